"""The tensors attached to one manager: a weak reference and a callback chain each, in
first-attach order, and the checks ``attach()`` makes before it changes anything."""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Tuple, Union

from .backend import Backend
from .errors import AttachError
from .registry import backend_for
from .weak_keys import forgetting_ref

Callback = Callable[[Any, Any], Any]
"""``cb(tensor, grad) -> grad`` (or a Future of a grad)."""


class TensorLike(Protocol):
    """A framework's tensor, as a type checker sees it (torch's and MegEngine's have
    ``detach``). A module is not one: ``torch.nn.Module`` finds its attributes with
    ``__getattr__``, which gives no method, so a user's type checker rejects
    ``attach(model)`` where ``attach(model.parameters())`` was meant."""

    def detach(self) -> Any: ...


Tensors = Union[TensorLike, Iterable[TensorLike]]
"""One tensor, or any iterable of them (a list, ``model.parameters()``)."""


class AttachSpec:
    """One attached tensor: a weak reference to it, its callback chain, and the sink its tape
    delivers its gradient to (what a manager keeps per attached tensor).

    Example:
        >>> import weakref, torch
        >>> w = torch.ones(2)
        >>> spec = AttachSpec(weakref.ref(w), [])
        >>> spec.tensor() is w, spec.callbacks
        (True, [])
    """

    __slots__ = ("tensor", "callbacks", "sink", "__weakref__")

    def __init__(self, tensor: weakref.ref, callbacks: List[Callback]) -> None:
        self.tensor = tensor
        self.callbacks = callbacks
        self.sink: Callable[[Any], Any] = _no_sink


def _no_sink(grad: Any) -> Any:
    return None


class Attachments:
    """Specs by ``id(tensor)``; a spec disappears when its tensor dies (contract point 3).
    ``epoch`` changes whenever a tensor is attached, gets more callbacks, or dies."""

    __slots__ = ("_specs", "epoch", "__weakref__")

    def __init__(self) -> None:
        self._specs: Dict[int, AttachSpec] = {}
        self.epoch = 0

    def __len__(self) -> int:
        return len(self._specs)

    def spec_of(self, tensor: Any) -> Optional[AttachSpec]:
        """The spec of ``tensor`` if it is attached (not merely a dead tensor's id)."""
        spec = self._specs.get(id(tensor))
        return spec if spec is not None and spec.tensor() is tensor else None

    def get(self, key: int) -> Optional[AttachSpec]:
        return self._specs.get(key)

    def add(self, tensor: Any, callbacks: List[Callback]) -> Tuple[AttachSpec, bool]:
        """Attach ``tensor`` or append to its chain; returns ``(spec, new)``."""
        key = id(tensor)
        spec = self._specs.get(key)
        if spec is None:
            spec = AttachSpec(forgetting_ref(tensor, self, Attachments._forget), list(callbacks))
            self._specs[key] = spec
            self.epoch += 1
            return spec, True
        spec.callbacks.extend(callbacks)
        if callbacks:
            self.epoch += 1
        return spec, False

    def _forget(self, key: int, dead: weakref.ref) -> None:
        spec = self._specs.get(key)
        if spec is not None and spec.tensor is dead:  # not a tensor that reused the id
            del self._specs[key]
            self.epoch += 1

    def live(self) -> List[Tuple[Any, AttachSpec]]:
        """``(tensor, spec)`` of every live attached tensor, in first-attach order (a list:
        MegEngine's tape takes it at every recording, where a generator's resumption per
        tensor cost more than the list)."""
        pairs = []
        for spec in list(self._specs.values()):
            tensor = spec.tensor()
            if tensor is not None:
                pairs.append((tensor, spec))
        return pairs

    def tensors(self, with_callback: Optional[Callback] = None) -> List[Any]:
        return [t for t, spec in self.live()
                if with_callback is None or any(cb == with_callback for cb in spec.callbacks)]


def check_callbacks(callbacks: Any) -> List[Callback]:
    if callbacks is None:
        return []
    if callable(callbacks):
        _check_signature(callbacks)
        return [callbacks]
    try:
        callback_list = list(callbacks)
    except TypeError:
        raise TypeError(
            f"callbacks must be a callable or a list of callables, "
            f"not {type(callbacks).__name__}"
        ) from None
    for cb in callback_list:
        if not callable(cb):
            raise TypeError(
                f"each callback must be callable as cb(tensor, grad) -> grad; "
                f"got {type(cb).__name__}"
            )
        _check_signature(cb)
    return callback_list


def _check_signature(cb: Any) -> None:
    """Refuse a callback that cannot take ``(tensor, grad)`` (a tensor hook's ``hook(grad)``,
    by habit) now, rather than with a bare TypeError in the middle of a backward."""
    try:
        signature = inspect.signature(cb)
    except (TypeError, ValueError):  # a builtin or extension callable: trust it
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(cb, "__qualname__", None) or type(cb).__qualname__
        raise TypeError(
            f"gradient callback {name}{signature} cannot be called as cb(tensor, grad) -> grad: "
            f"gradmgr passes the attached tensor and its gradient (a tensor hook takes only "
            f"the gradient: wrap it, lambda tensor, grad: hook(grad))"
        ) from None


def check_tensors(tensors: Any,
                  backend: Optional[Backend]) -> Tuple[List[Any], Optional[Backend]]:
    """The tensors to attach and their backend, after checking every one of them (so a bad
    call leaves no trace); ``backend``: the manager's, if known."""
    if backend_for(tensors) is not None:
        tensor_list = [tensors]
    elif callable(getattr(tensors, "parameters", None)):
        raise AttachError(
            f"attach() expects tensors, got a module ({type(tensors).__qualname__}): attach its "
            f"parameters, gm.attach(model.parameters())"
        )
    elif hasattr(tensors, "__array__") and hasattr(tensors, "dtype"):
        raise AttachError(
            f"attach() expects a tensor of a framework with a gradmgr backend, got a "
            f"{type(tensors).__module__}.{type(tensors).__qualname__} (an array, which has no "
            f"gradients): convert it to a tensor first (torch.from_numpy(a), "
            f"megengine.tensor(a), paddle.to_tensor(a))"
        )
    else:
        try:
            tensor_list = list(tensors)
        except TypeError:
            raise AttachError(
                f"attach() expects a tensor or an iterable of tensors, "
                f"got {type(tensors).__module__}.{type(tensors).__qualname__}"
            ) from None
    for tensor in tensor_list:
        found = backend_for(tensor)
        if found is None:
            raise AttachError(
                f"only tensors can be attached; got {type(tensor).__module__}."
                f"{type(tensor).__qualname__} (is its framework's backend installed?)"
            )
        if backend is not None and found is not backend:
            raise TypeError(
                f"one GradManager cannot mix frameworks: it holds {backend.name} tensors "
                f"and was given a {found.name} tensor; use one manager per framework"
            )
        found.check_attachable(tensor)
        backend = found
    return tensor_list, backend
