"""Using gradmgr from trainers: one module per trainer, each importing its trainer (and the
framework under it) only when first used, so that ``import gradmgr.integrations`` needs
nothing installed.

- :mod:`gradmgr.integrations.lightning`: a Lightning Fabric strategy (``pip install
  "gradmgr[lightning]"``).
"""
