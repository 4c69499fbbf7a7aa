"""The ``parity`` extra (``pip install "gradmgr[parity]"``: numpy, matplotlib, tqdm): what
gradmgr.parity needs beyond gradmgr, checked where it is first needed so that a missing one
is named with the install line, not as a bare ``No module named ...``.

Imported first by gradmgr.parity, so that numpy's absence is said before any module of it
imports numpy.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = 'pip install "gradmgr[parity]"'


def require(module: str, user: str) -> ModuleType:
    """``module`` imported, or ImportError naming ``user`` (what needs it) and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if error.name is None or error.name.partition(".")[0] != module.partition(".")[0]:
            raise  # the module is there but broken: its own error says more than ours
        raise ImportError(
            f"{user} needs {module.partition('.')[0]}, which is not installed in this "
            f"environment: {INSTALL} (numpy, matplotlib and tqdm)") from error


require("numpy", "gradmgr.parity")
