"""MegEngine backend: gradmgr on MegEngine's own autodiff engine.

The native ``megengine.autodiff.GradManager`` is a thin layer over
``megengine.core.autodiff.grad.Grad``; this backend drives the same engine the same way (one
``Grad`` per recording, ``wrt(tensor, callback=...)`` per attached tensor, ``grad(ys, dys)`` to
run reverse mode), so gradients are bit-identical to the native manager's.

The modules: :mod:`.backend` (:class:`MegEngineBackend`, what the core talks to), :mod:`.tape`
(:class:`MegEngineTape`), :mod:`.compat` (what MegEngine's own helpers see of gradmgr managers);
for data parallelism :mod:`.ops` (bucket buffers) and :mod:`.transport` (MegEngine's collectives,
or torch.distributed through host memory).

Example:
    >>> import megengine as mge
    >>> from gradmgr import GradManager
    >>> w = mge.Parameter([1.0, 2.0])
    >>> gm = GradManager().attach(w)
    >>> with gm:
    ...     gm.backward((w * w).sum())
    >>> w.grad.numpy().tolist()
    [2.0, 4.0]
"""

from __future__ import annotations

from .backend import MegEngineBackend
from .tape import MegEngineTape

__all__ = ["MegEngineBackend", "MegEngineTape"]
