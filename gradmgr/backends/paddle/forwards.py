"""What ``data_parallel(model)`` watches on a ``paddle.nn.Layer``: its forwards.

A forward with gradients enabled outside a recording arms a hook on every trainable parameter
(``Tensor.register_hook``) that raises the manager's refusal: Paddle runs a leaf's hooks only
in a backward that accumulates into ``.grad`` (``loss.backward()``), before it writes any,
and never in ``paddle.grad`` (which gradmgr's own backward is, and a gradient penalty's), so
only the forgotten ``with gm:`` is refused. Paddle hands the hook's error back wrapped, as
``OSError: (External) RuntimeError: <the refusal>`` (Paddle 3.3, measured): the nearest to
PyTorch's ``RuntimeError`` that a hook can raise.

A forward through a ``paddle.DataParallel`` kept around the layer raises at once
(:data:`DATA_PARALLEL_AROUND`): it readies Paddle's own reducer for a backward that gradmgr
runs instead.
"""

from __future__ import annotations

import functools
import sys
import weakref
from types import FrameType
from typing import Any, Callable, Optional

import paddle

from gradmgr.distributed.contract import ArmedHooks

DATA_PARALLEL_AROUND = (
    "data_parallel(): this layer's forward runs inside a paddle.DataParallel's forward, which "
    "readies Paddle's own reducer for the backward while gradmgr's data-parallel manager "
    "reduces the gradients itself: with a register_hook on a parameter, Paddle's reducer is "
    "left waiting and the next forward fails in it (PreconditionNotMet). Drop the "
    "paddle.DataParallel wrapper: data_parallel(model) does what it did (broadcast, gradient "
    "averaging, no_sync); call model(x) itself and gm.backward(loss) inside `with gm:`"
)

_DATA_PARALLEL_FORWARD = paddle.DataParallel.forward.__code__


def _inside_data_parallel(layer: Any) -> bool:
    """A ``paddle.DataParallel`` around ``layer`` (or around a layer holding it) is running its
    forward. Paddle marks no running wrapper (torch's DDP does), so its frame on the stack
    tells; looked for once per forward of the watched layer, a walk of the stack's frames."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _DATA_PARALLEL_FORWARD:
            inner = getattr(frame.f_locals.get("self"), "_layers", None)
            if inner is not None and any(s is layer for s in inner.sublayers(include_self=True)):
                return True
        frame = frame.f_back
    return False


def _refuse(message: str, grad: Any) -> None:
    raise RuntimeError(message)


class ForwardWatch(ArmedHooks):
    """One forward post-hook on the layer, and the parameter hooks a forward arms (see the
    module's docstring; ``TensorOps.watch_forwards``). The manager disarms them when a
    recording starts."""

    def __init__(self, layer: Any, refusal: Callable[[], Optional[str]]) -> None:
        super().__init__()  # the parameter hooks' handles, once armed
        self._refusal: Callable[[], Any] = weakref.WeakMethod(refusal)
        self._handle = layer.register_forward_post_hook(self._after)

    def _after(self, layer: Any, inputs: Any, output: Any) -> None:
        if not paddle.is_grad_enabled():
            return  # an evaluation under no_grad (through a paddle.DataParallel too): no backward
        if _inside_data_parallel(layer):
            raise RuntimeError(DATA_PARALLEL_AROUND)
        if self._armed:
            return
        refusal = self._refusal()
        message = None if refusal is None else refusal()
        if message is not None:
            refuse = functools.partial(_refuse, message)
            self._armed = [p.register_hook(refuse) for p in layer.parameters()
                           if not p.stop_gradient]

    def changed(self) -> Optional[str]:
        """None: a layer replaced after ``data_parallel`` is not looked for on Paddle."""
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
    watch._refusal, watch._handle = _nothing, None
    return watch


def watch_forwards(layer: Any, refusal: Callable[[], Optional[str]]) -> Optional[ForwardWatch]:
    """Hooks on ``layer``'s forward; None: not a ``paddle.nn.Layer``."""
    if not isinstance(layer, paddle.nn.Layer):
        return None
    return ForwardWatch(layer, refusal)
