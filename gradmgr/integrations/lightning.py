"""Lightning Fabric's strategy for gradmgr (the ``lightning`` extra: ``lightning-fabric``):

    from gradmgr.integrations.lightning import GradmgrStrategy
    fabric = Fabric(accelerator="cpu", devices=2, strategy=GradmgrStrategy())

Importing this module imports neither Lightning nor PyTorch: the strategy lives with the
PyTorch backend (``gradmgr.backends.torch.lightning``) and is imported, with Lightning Fabric,
when ``GradmgrStrategy`` or ``GradmgrModule`` is first asked for. Where Lightning Fabric is not
installed, that raises ``ImportError`` saying what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:  # for type checkers only: importing it would import Lightning
    from gradmgr.backends.torch.lightning import GradmgrModule, GradmgrStrategy

_IMPLEMENTATION = "gradmgr.backends.torch.lightning"
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
