"""What one backward delivers: each attached tensor's gradient after its callback chain (a
tensor, or a Future of one), checked, then accumulated into ``.grad`` all together."""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, List

from .backend import Backend
from .errors import CallbackResultError, CallbackReturnedNoneWarning
from .future import is_future


def source_name(source: Any) -> str:
    """A callback as "gradient callback <its name>"; a phrase as it is."""
    if isinstance(source, str):
        return source
    name = getattr(source, "__qualname__", None) or type(source).__qualname__
    return f"gradient callback {name}"


_warned_none: weakref.WeakSet[Any] = weakref.WeakSet()
_warned_none_ids: set = set()  # callables that take no weak reference (bound methods: by func)


def warn_none(source: Any, described: str) -> None:
    """A callback (or a Future's source) gave None: the tensor gets no gradient from this
    backward, as in MegEngine; say so once per callback."""
    target = getattr(source, "__func__", source)
    try:
        if target in _warned_none:
            return
        _warned_none.add(target)
    except TypeError:  # not weakly referenceable, or unhashable
        if id(target) in _warned_none_ids:
            return
        _warned_none_ids.add(id(target))
    warnings.warn(
        f"{source_name(source)} returned None for an attached tensor of {described}: the "
        f"tensor gets no gradient from this backward (MegEngine's rule; .grad keeps what it "
        f"held). If it should pass the gradient on, return it (warned once per callback)",
        CallbackReturnedNoneWarning,
        stacklevel=4,
    )


def note_callback(error: Exception, callback: Any, described: str) -> None:
    """Add to an error a callback raised which callback it was, on which tensor (the error
    keeps its type: a loop catches it as before). Library callbacks that bind to managers
    (the allreduce callback) raise errors that say so themselves."""
    if getattr(callback, "__gradmgr_bind__", None) is not None or getattr(
            error, "_gradmgr_noted", False):
        return
    note = f"(raised by {source_name(callback)} on an attached tensor of {described})"
    try:
        # once, also when it passes an outer manager (a mark on the user's error object)
        error._gradmgr_noted = True  # type: ignore[attr-defined]
    except AttributeError:
        return
    if error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} {note}",) + error.args[1:]
    elif hasattr(error, "add_note"):
        error.add_note(note)


class Delivery:
    """The gradients of one backward (or of one part of a split backward) by ``id(tensor)``,
    and who returned each pending Future; ``step`` is the recording the backward belongs to."""

    __slots__ = ("step", "gradients", "future_sources")

    def __init__(self, step: int) -> None:
        self.step = step
        self.gradients: Dict[int, Any] = {}
        self.future_sources: Dict[int, Any] = {}

    def run_chain(self, backend: Backend, callbacks: List[Any], key: int, tensor: Any,
                  grad: Any) -> Any:
        """``tensor``'s gradient through its callback chain, each result checked as it comes
        (a callback that raises has the error say which callback and tensor it was)."""
        is_tensor, grad_problem = backend.is_tensor, backend.grad_problem
        for cb in callbacks:
            try:
                given, grad = grad, cb(tensor, grad)
            except Exception as error:
                note_callback(error, cb, backend.describe(tensor))
                raise
            # what a callback passes on unchanged was checked before it
            if grad is not given and (not is_tensor(grad)
                                      or grad_problem(tensor, grad) is not None):
                if grad is None:
                    warn_none(cb, backend.describe(tensor))
                else:
                    self.check(backend, key, tensor, grad, cb)
        return grad

    def check(self, backend: Backend, key: int, tensor: Any, grad: Any, source: Any) -> None:
        """Raise :class:`CallbackResultError` unless ``grad`` can be ``tensor``'s gradient; a
        Future is checked once it resolves. ``source``: the callback that returned it, or a
        phrase ("add_gradient()")."""
        if backend.is_tensor(grad):
            problem = backend.grad_problem(tensor, grad)
            if problem is None:
                return
            raise CallbackResultError(
                f"{source_name(source)} returned a gradient that does not fit its tensor: "
                f"{problem}. A gradient must have its tensor's shape, dtype and device (or be a "
                f"Future of one)"
            )
        if grad is not None and is_future(grad):
            self.future_sources[key] = source
            return
        raise CallbackResultError(
            f"{source_name(source)} returned {type(grad).__qualname__} for an attached tensor "
            f"of {backend.describe(tensor)}: it must return the gradient (pass it on unchanged "
            f"if there is nothing to change), a Future of it, or None (no gradient)"
        )

    def accumulate(self, backend: Backend, attachments: Any) -> None:
        """Resolve Futures and check what they give, then accumulate every gradient (so a
        failure leaves every ``.grad`` as it was).

        The delivery lets go of each gradient before handing it to the backend, so that a
        backend can tell from reference counts whether anybody else still holds it (PyTorch's
        AccumulateGrad then stores it without a copy, and so does gradmgr)."""
        gradients, self.gradients = self.gradients, {}
        ready = self._resolve(backend, attachments, gradients)
        gradients.clear()
        accumulate, set_grad = backend.accumulate, backend.set_grad
        for i in range(len(ready)):
            tensor, grad, replace = ready[i]
            ready[i] = None
            if replace:
                set_grad(tensor, grad)
            else:
                accumulate(tensor, grad)
            grad = None

    def _resolve(self, backend: Backend, attachments: Any, gradients: Dict[int, Any]) -> List:
        is_tensor, grad_problem = backend.is_tensor, backend.grad_problem
        ready: List[Any] = []
        for key, delivered in gradients.items():
            spec = attachments.get(key)
            tensor = spec.tensor() if spec is not None else None
            if tensor is None:
                continue
            replace = False
            if delivered is None:
                continue  # a callback gave None: no gradient from this backward
            if not is_tensor(delivered):  # a Future: anything else was refused when delivered
                replace = getattr(delivered, "replaces_grad", False)
                source = self.future_sources.get(key)
                delivered = delivered.get()
                if delivered is None:
                    if not replace:  # (a data-parallel tensor unused everywhere says nothing)
                        warn_none(source, backend.describe(tensor))
                    continue
                if not is_tensor(delivered) or grad_problem(tensor, delivered) is not None:
                    self.check(backend, key, tensor, delivered,
                               f"the Future from {source_name(self.future_sources.get(key))}")
            ready.append((tensor, delivered, replace))
        return ready
