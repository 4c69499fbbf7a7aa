"""gradmgr: one gradient-manager API (MegEngine's GradManager semantics) across frameworks.

Example:
    >>> from gradmgr import GradManager
    >>> # gm = GradManager().attach(model.parameters())
    >>> # with gm:
    >>> #     gm.backward(loss_fn(model(x), y))

Importing gradmgr imports no framework; a backend is loaded on the first tensor of its kind.
"""

from . import _log
from .backend import Backend, Capabilities, Tape
from .errors import (
    AttachError,
    BackendNotFoundError,
    CallbackResultError,
    CallbackReturnedNoneWarning,
    GradMgrWarning,
    UnsupportedBackendError,
    UnsupportedGraphError,
)
from .future import Future, is_future
from .group import GradManagerGroup
from .manager import AttachSpec, GradManager, get_backwarding_grad_manager
from .registry import backend_for, get_backend, register_backend
from .split import DeferredBackward, UnfinishedBackwardWarning

__version__ = "0.1.0"

_log.configure_from_env()  # GRADMGR_LOG=info: the library's decisions on stderr

__all__ = [
    "AttachError",
    "AttachSpec",
    "Backend",
    "BackendNotFoundError",
    "CallbackResultError",
    "CallbackReturnedNoneWarning",
    "Capabilities",
    "DeferredBackward",
    "Future",
    "GradManager",
    "GradManagerGroup",
    "GradMgrWarning",
    "Tape",
    "UnfinishedBackwardWarning",
    "UnsupportedBackendError",
    "UnsupportedGraphError",
    "backend_for",
    "get_backend",
    "get_backwarding_grad_manager",
    "is_future",
    "register_backend",
]
