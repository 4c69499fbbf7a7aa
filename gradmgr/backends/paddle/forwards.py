"""What ``data_parallel(model)`` watches on a ``paddle.nn.Layer``: its forwards.

A forward with gradients enabled outside a recording arms a hook on every trainable parameter
(``Tensor.register_hook``) that raises the manager's refusal: Paddle runs a leaf's hooks only
in a backward that accumulates into ``.grad`` (``loss.backward()``), before it writes any,
and never in ``paddle.grad`` (which gradmgr's own backward is, and a gradient penalty's), so
only the forgotten ``with gm:`` is refused. Paddle hands the hook's error back wrapped, as
``OSError: (External) RuntimeError: <the refusal>`` (Paddle 3.3, measured): the nearest to
PyTorch's ``RuntimeError`` that a hook can raise.

A forward through a ``paddle.DataParallel`` kept around the layer, or one put around a sublayer
of it, raises at once (wrappers.py): it readies Paddle's own reducer for a backward that
gradmgr runs instead.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import paddle

from gradmgr.distributed.contract import ArmedHooks

from . import registrations
from .wrappers import forward_problem


def _refuse(message: str, grad: Any) -> None:
    raise RuntimeError(message)


class ForwardWatch(ArmedHooks):
    """One forward post-hook on the layer, and the parameter hooks a forward arms (see the
    module's docstring; ``TensorOps.watch_forwards``). The manager disarms them when a
    recording starts."""

    def __init__(self, layer: Any, refusal: Callable[[], Optional[str]]) -> None:
        super().__init__()  # the parameter hooks' handles, once armed
        self._refusal: Callable[[], Any] = weakref.WeakMethod(refusal)
        # The sublayers are walked for a wrapper until a walk finds none: a walk costs about
        # 3.5 % of a 100-block model's forward, so later wrappers are left to Paddle's error
        self._walk = True
        self._layer: Callable[[], Any] = weakref.ref(layer)
        self._params = [weakref.ref(p) for p in layer.parameters()]
        self._seen = registrations.count_changes(layer)
        self._handle = layer.register_forward_post_hook(self._after)

    def _after(self, layer: Any, inputs: Any, output: Any) -> None:
        if not paddle.is_grad_enabled():
            return  # an evaluation under no_grad (through a paddle.DataParallel too): no backward
        if self._handle is None:
            return  # a copy's (see _unwatched): data_parallel reduces nothing of it
        problem = forward_problem(layer, self._walk)
        if problem is not None:
            raise RuntimeError(problem)
        self._walk = False
        if self._armed:
            return
        refusal = self._refusal()
        message = None if refusal is None else refusal()
        if message is not None:
            refuse = functools.partial(_refuse, message)
            self._armed = [p.register_hook(refuse) for p in layer.parameters()
                           if not p.stop_gradient]

    def changed(self) -> Optional[str]:
        """The name of the first parameter of the layer that it did not have when watched (a
        layer replaced or added since); None: none. The parameters are looked at only after
        a sublayer or parameter was assigned in a watched layer (registrations.py)."""
        layer = self._layer()
        if layer is None or self._seen == registrations.changes():
            return None
        seen = registrations.count_changes(layer)  # a new sublayer's assignments count too
        known = {id(ref()) for ref in self._params}
        for name, param in layer.named_parameters():
            if id(param) not in known:
                return name
        self._seen = seen
        return None

    def remove(self) -> None:
        self.disarm()
        self._handle.remove()

    # ``copy.deepcopy(model)`` and pickling copy the layer's hooks, this one's bound method
    # too: the copy, which no manager watches, gets a watch of nothing.
    def __deepcopy__(self, memo: Any) -> ForwardWatch:
        return _unwatched()

    def __reduce__(self) -> Any:
        return _unwatched, ()


def _nothing() -> None:
    return None


def _unwatched() -> ForwardWatch:
    """A watch whose forwards arm nothing (no manager: no refusal), on no layer."""
    watch = ForwardWatch.__new__(ForwardWatch)
    ArmedHooks.__init__(watch)
    watch._refusal, watch._handle, watch._walk = _nothing, None, False
    watch._layer, watch._params, watch._seen = _nothing, [], 0
    return watch


def watch_forwards(layer: Any, refusal: Callable[[], Optional[str]]) -> Optional[ForwardWatch]:
    """Hooks on ``layer``'s forward; None: not a ``paddle.nn.Layer``."""
    if not isinstance(layer, paddle.nn.Layer):
        return None
    return ForwardWatch(layer, refusal)
