"""Find the backend that owns a tensor, without importing any framework.

Detection looks at the module that defines the tensor's type (and its base classes): a
``torch.Tensor`` can only exist once ``torch`` was imported, so the backend module is imported
lazily on the first tensor of that framework and the answer is cached per type. Third-party
backends register through the entry-point group ``gradmgr.backends`` or :func:`register_backend`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

from ._imports import call_after_import
from .backend import Backend
from .errors import BackendNotFoundError

ENTRY_POINT_GROUP = "gradmgr.backends"

# name -> "module:Class" (loaded on first use) or a Backend subclass
_specs: Dict[str, Union[str, Type[Backend]]] = {
    "torch": "gradmgr.backends.torch:TorchBackend",
    "megengine": "gradmgr.backends.megengine:MegEngineBackend",
    "paddle": "gradmgr.backends.paddle:PaddleBackend",
}
# top-level module name of a tensor type -> backend name
_owners: Dict[str, str] = {"torch": "torch", "megengine": "megengine", "paddle": "paddle"}
_instances: Dict[str, Backend] = {}
_by_type: Dict[type, Optional[Backend]] = {}
_entry_points_loaded = False
_lock = threading.RLock()


def register_backend(name: str, backend: Union[str, Type[Backend]],
                     tensor_modules: Sequence[str] = ()) -> None:
    """Register a backend class (or ``"module:Class"``) under ``name``.

    Example:
        >>> register_backend("mine", "my_pkg.gradmgr_backend:MyBackend", tensor_modules=["my_pkg"])
    """
    with _lock:
        _specs[name] = backend
        _instances.pop(name, None)
        modules = tensor_modules or getattr(backend, "tensor_modules", ())
        for module in modules:
            _owners[module] = name
        _by_type.clear()
        _outputs_by_type.clear()


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    eps: Any = entry_points()  # EntryPoints (3.10 on), or on 3.9 a dict of lists by group
    group = eps.select(group=ENTRY_POINT_GROUP) if hasattr(eps, "select") else eps.get(
        ENTRY_POINT_GROUP, []
    )
    for ep in group:
        if ep.name in _specs:
            continue
        try:
            cls = ep.load()
        except Exception as exc:  # a broken third-party plugin must not break detection
            import warnings

            warnings.warn(f"gradmgr: backend entry point {ep.name!r} failed to load: {exc}",
                          stacklevel=2)
            continue
        register_backend(ep.name, cls)


def get_backend(name: str) -> Backend:
    """The backend instance registered under ``name`` (``"torch"``, ``"megengine"``, ...).

    Example:
        >>> get_backend("torch").name
        'torch'
    """
    with _lock:
        if name in _instances:
            return _instances[name]
        if name not in _specs:
            _load_entry_points()
        if name not in _specs:
            raise BackendNotFoundError(
                f"no gradmgr backend named {name!r}; known: {sorted(_specs)}"
            )
        spec = _specs[name]
        if isinstance(spec, str):
            module_name, _, attr = spec.partition(":")
            try:
                spec = getattr(importlib.import_module(module_name), attr)
            except ImportError as error:
                raise BackendNotFoundError(_cannot_import(name, error)) from error
        instance = spec()
        _instances[name] = instance
        return instance


def _python() -> Tuple[int, ...]:
    return tuple(sys.version_info[:3])


def _megengine_hint() -> str:
    # MegEngine 1.13, its newest release, has wheels for CPython 3.8-3.10 only: on those the
    # fix is an install; on a newer Python there is nothing to install.
    if _python()[:2] <= (3, 10):
        return "install MegEngine 1.13 (pip install 'gradmgr[megengine]'), which supports it"
    return ("MegEngine publishes no wheels for Python 3.11 or newer (1.13 supports CPython "
            "3.8-3.10): use a Python 3.10 environment and pip install 'gradmgr[megengine]' "
            "there")


_INSTALL_HINTS: Dict[str, Union[str, Callable[[], str]]] = {
    "torch": "install PyTorch (pip install 'gradmgr[torch]')",
    "megengine": _megengine_hint,
    "paddle": "install PaddlePaddle (pip install 'gradmgr[paddle]')",
}


def _cannot_import(name: str, error: ImportError) -> str:
    hint = _INSTALL_HINTS.get(name, "install its framework")
    python = ".".join(map(str, _python()))
    return (f"the {name!r} backend cannot be used here: importing it failed ({error}); "
            f"{hint() if callable(hint) else hint}. This is Python {python}")


def backend_for(obj: Any) -> Optional[Backend]:
    """The backend owning ``obj``'s type, or None if ``obj`` is no known tensor.

    Example:
        >>> import torch
        >>> backend_for(torch.ones(1)).name, backend_for([1.0])
        ('torch', None)
    """
    cls = type(obj)
    try:
        return _by_type[cls]
    except KeyError:
        pass
    with _lock:
        found = _detect(cls, obj)
        if found is None and not _entry_points_loaded:
            _load_entry_points()
            found = _detect(cls, obj)
        _by_type[cls] = found
        return found


def backend_of_output(obj: Any) -> Optional[Backend]:
    """The backend for which ``obj`` can be a ``y`` of a backward (a tensor, or what else the
    backend takes: :meth:`Backend.is_output`), or None."""
    found = backend_for(obj)
    if found is not None:
        return found
    cls = type(obj)
    try:
        return _outputs_by_type[cls]
    except KeyError:
        pass
    with _lock:
        found = _outputs_by_type[cls] = _detect(cls, obj, outputs=True)
        return found


_outputs_by_type: Dict[type, Optional[Backend]] = {}


def _detect(cls: type, obj: Any, outputs: bool = False) -> Optional[Backend]:
    for klass in cls.__mro__:
        top = (klass.__module__ or "").partition(".")[0]
        name = _owners.get(top)
        if name is not None and top in sys.modules:
            backend = get_backend(name)
            if backend.is_output(obj) if outputs else backend.is_tensor(obj):
                return backend
    return None


def known_backends() -> List[str]:
    """The names of the registered backends, built in and from entry points, imported or not.

    Example:
        >>> {"torch", "megengine"} <= set(known_backends())
        True
    """
    with _lock:
        _load_entry_points()
        return sorted(_specs)


def imported_backends() -> List[Backend]:
    """The backends of the registered frameworks imported so far, by name.

    Lets ``record()`` on a manager with nothing attached yet start its tape at once (or one
    per candidate framework), so that its place in the recording order (which manager records
    which backward) is the right one.
    """
    names = sorted({name for module, name in _owners.items() if module in sys.modules})
    return [get_backend(name) for name in names]


def prepare_ranks(rank: int, world: int) -> None:
    """Tell every registered backend, once its framework is imported (now, or whenever it is),
    that this process is rank ``rank`` of ``world`` (:meth:`Backend.prepare_rank`)."""
    with _lock:
        if not _entry_points_loaded:
            _load_entry_points()
        owners = dict(_owners)
    for module, name in owners.items():
        call_after_import(module, functools.partial(_prepare_rank, name, rank, world))


def _prepare_rank(name: str, rank: int, world: int) -> None:
    get_backend(name).prepare_rank(rank, world)


def hold_rendezvous(world: int) -> Optional[Tuple[Any, int, Dict[str, str]]]:
    """The first installed backend's rendezvous server for ``world`` ranks
    (:meth:`Backend.hold_rendezvous`), or None where none has one. A backend whose framework
    is not installed is passed over; one that is gets imported (torch, whose
    ``torch.distributed`` every gradmgr rank rendezvouses through, comes first)."""
    for name in list(_specs):
        module = next((m for m, owner in _owners.items() if owner == name), None)
        if module is not None and importlib.util.find_spec(module) is None:
            continue
        try:
            backend = get_backend(name)
        except BackendNotFoundError:
            continue
        held = backend.hold_rendezvous(world)
        if held is not None:
            return held
    return None


def resolve_backend(backend: Union[str, Backend, None]) -> Optional[Backend]:
    if backend is None or isinstance(backend, Backend):
        return backend
    if isinstance(backend, str):
        return get_backend(backend)
    raise TypeError(f"backend must be a name or a Backend instance, not {type(backend).__name__}")
