"""What one backward delivers: each attached tensor's gradient after its callback chain (a
tensor, or a Future of one), checked, then accumulated into ``.grad`` all together."""

from __future__ import annotations

from typing import Any, Dict, List

from .backend import Backend
from .errors import CallbackResultError
from .future import is_future


def source_name(source: Any) -> str:
    """A callback as "gradient callback <its name>"; a phrase as it is."""
    if isinstance(source, str):
        return source
    name = getattr(source, "__qualname__", None) or type(source).__qualname__
    return f"gradient callback {name}"


class Delivery:
    """The gradients of one backward (or of one part of a split backward) by ``id(tensor)``,
    and who returned each pending Future; ``step`` is the recording the backward belongs to."""

    __slots__ = ("step", "gradients", "future_sources")

    def __init__(self, step: int) -> None:
        self.step = step
        self.gradients: Dict[int, Any] = {}
        self.future_sources: Dict[int, Any] = {}

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
            f"{source_name(source)} returned {'None' if grad is None else type(grad).__qualname__}"
            f" for an attached tensor of {backend.describe(tensor)}: it must return the "
            f"gradient (pass it on unchanged if there is nothing to change) or a Future of it"
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
            if not is_tensor(delivered):  # a Future: anything else was refused when delivered
                replace = getattr(delivered, "replaces_grad", False)
                delivered = delivered.get()
                if replace and delivered is None:
                    continue  # nothing to deliver (a data-parallel tensor unused everywhere)
                if not is_tensor(delivered) or grad_problem(tensor, delivered) is not None:
                    self.check(backend, key, tensor, delivered,
                               f"the Future from {source_name(self.future_sources.get(key))}")
            ready.append((tensor, delivered, replace))
        return ready
