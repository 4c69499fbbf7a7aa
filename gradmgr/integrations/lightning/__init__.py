"""Lightning Fabric's strategy for gradmgr (the ``lightning`` extra: ``lightning-fabric``):

    from gradmgr.integrations.lightning import GradmgrStrategy
    fabric = Fabric(accelerator="cpu", devices=2, strategy=GradmgrStrategy())

Importing this package imports neither Lightning nor PyTorch: the strategy lives in its module
:mod:`.strategy`, imported, with Lightning Fabric and PyTorch, when ``GradmgrStrategy`` or
``GradmgrModule`` is first asked for. Where Lightning Fabric is not installed, that raises
``ImportError`` saying what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:  # for type checkers only: importing it would import Lightning
    from .strategy import GradmgrModule, GradmgrStrategy

_IMPLEMENTATION = f"{__name__}.strategy"
__all__: List[str] = ["GradmgrModule", "GradmgrStrategy"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        implementation = importlib.import_module(_IMPLEMENTATION)
    except ImportError as error:
        if error.name is None or error.name.partition(".")[0] not in ("lightning_fabric", "torch"):
            raise
        raise ImportError(
            f"gradmgr.integrations.lightning.{name} needs Lightning Fabric and PyTorch "
            f"({error.name} is missing): pip install \"gradmgr[lightning]\""
        ) from error
    return getattr(implementation, name)


def __dir__() -> List[str]:
    return sorted(__all__)
