"""MegEngine backend: gradmgr on MegEngine's own autodiff engine.

The native ``megengine.autodiff.GradManager`` is a thin layer over
``megengine.core.autodiff.grad.Grad``; this backend drives the same engine the same way (one
``Grad`` per recording, ``wrt(tensor, callback=...)`` per attached tensor, ``grad(ys, dys)`` to
run reverse mode), so gradients are bit-identical to the native manager's.

Example:
    >>> import megengine as mge
    >>> from gradmgr import GradManager
    >>> w = mge.Parameter([1.0, 2.0])
    >>> gm = GradManager().attach(w)
    >>> with gm:
    ...     gm.backward((w * w).sum())
    >>> w.grad.numpy().tolist()
    [2.0, 4.0]
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import megengine
import megengine.autodiff.grad_manager as native_grad_manager
import megengine.functional as F
import numpy as np
from megengine.core._imperative_rt.core2 import pop_scope, push_scope, set_option
from megengine.core.autodiff.grad import Grad
from megengine.core.tensor.dtype import is_differentible_dtype
from megengine.jit.tracing import is_tracing

from gradmgr.backend import Backend, Capabilities, GradSink, Tape
from gradmgr.errors import AttachError

# How many MegEngine backwards are running (MegEngine runs only in the main thread, so one
# counter is enough). Its engine cannot start or extend a recording from inside a gradient
# callback, so that is refused with a clear error instead of an opaque one from the engine.
_backward_depth = 0
_MAIN_THREAD_ID = threading.main_thread().ident
_ONE_ELEMENT = ((), (1,))


def _check_can_record(action: str) -> None:
    if _backward_depth == 0 and threading.get_ident() == _MAIN_THREAD_ID:
        return  # the usual case, checked cheaply: it runs every step
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"cannot {action} in thread {threading.current_thread().name!r}: MegEngine's "
            f"autodiff (and MegEngine 1.13 tensors in general) only work in the main thread; "
            f"run MegEngine GradManagers in the main thread or in separate processes"
        )
    if _backward_depth:
        raise RuntimeError(
            f"cannot {action} inside a gradient callback: MegEngine cannot start or extend a "
            f"recording while a backward is running; do that work after backward() returns, "
            f"for example in an after-backward callback"
        )


class _Slot:
    """The current sink of one watched tensor; re-watching swaps the sink, not the snapshot."""

    __slots__ = ("tensor", "sink")

    def __init__(self, tensor: Any, sink: GradSink) -> None:
        self.tensor = weakref.ref(tensor)
        self.sink: Optional[GradSink] = sink

    def __call__(self, grad: Any) -> None:
        sink = self.sink
        if sink is not None:
            sink(grad)


class MegEngineTape(Tape):
    """One ``Grad`` per recording, exactly as the native manager's ``record()`` makes it."""

    def __init__(self) -> None:
        self._grad: Optional[Grad] = None
        self._slots: Dict[int, _Slot] = {}

    def start(self) -> None:
        _check_can_record("start recording a MegEngine GradManager")
        grad = Grad()
        grad.__enter__()
        self._grad = grad
        self._slots = {}

    def watch(self, tensor: Any, sink: GradSink, eager: bool) -> None:
        # MegEngine calls wrt callbacks as each gradient becomes ready, so ``eager`` needs
        # nothing extra.
        if self._grad is None:
            raise RuntimeError("MegEngineTape.watch() called while the tape is not started")
        key = id(tensor)
        slot = self._slots.get(key)
        if slot is not None and slot.tensor() is tensor:
            slot.sink = sink  # a second wrt() would add a second snapshot; keep the first
            return
        _check_can_record("attach a MegEngine tensor to a recording manager")
        if slot is not None:
            slot.sink = None  # a dead tensor's id was reused: silence its old attachment
        slot = _Slot(tensor, sink)
        self._slots[key] = slot
        self._grad.wrt(tensor, callback=slot)

    def watch_all(self, items: Sequence[Tuple[Any, GradSink, bool]]) -> None:
        if self._slots or self._grad is None:
            super().watch_all(items)
            return
        # A fresh recording in the main thread (start() checked): what watch() does, minus
        # the checks that cannot fail here; this runs for every attached tensor every step.
        slots, wrt = self._slots, self._grad.wrt
        for tensor, sink, _ in items:
            slot = slots[id(tensor)] = _Slot(tensor, sink)
            wrt(tensor, callback=slot)

    def backward(
        self, ys: Sequence[Any], dys: Sequence[Any], *, create_graph: bool, retain_graph: bool,
        may_accumulate: bool = False,
    ) -> None:
        # ``create_graph`` and ``retain_graph`` are not needed: MegEngine's Grad stack records
        # a backward in every Grad entered earlier (higher order), suppresses the other members
        # of this Grad's group, and keeps each Grad's tape until that Grad exits. Every
        # gradient goes through its sink (``may_accumulate`` is not used).
        grad = self._grad
        if grad is None:
            raise RuntimeError("MegEngineTape.backward() called while the tape is not started")
        # As the native backward does: a profiler scope, and no computing-path recording.
        global _backward_depth
        push_scope("backward")
        set_option("record_computing_path", 0)
        _backward_depth += 1
        try:
            try:
                grad(list(ys), list(dys))
            except BaseException:
                # Grad.__call__ suppresses the other group members around the engine call and
                # resumes them only on success; resume them here so an exception (say, in a
                # callback) leaves them recording. resume() on an active key would break it,
                # so only the ones that are currently suppressed by this call are touched.
                _resume_group_after_failure(grad)
                raise
        finally:
            _backward_depth -= 1
            set_option("record_computing_path", 1)
            pop_scope("backward")

    def stop(self) -> None:
        grad, self._grad = self._grad, None
        for slot in self._slots.values():
            slot.sink = None
        self._slots = {}
        if grad is not None:
            grad.__exit__(None, None, None)


def _resume_group_after_failure(grad: Grad) -> None:
    # The engine call is the only step of Grad.__call__ that can raise once suppression has
    # started, so after a failure every other live member is suppressed.
    for ref in list(grad._group):
        member = ref()
        if member is not None and member is not grad:
            member.resume()


class _NativeView(native_grad_manager.GradManager):
    """What ``megengine.autodiff.grad_manager.get_backwarding_grad_manager()`` returns while a
    gradmgr manager backwards, so that MegEngine's own helpers work with gradmgr managers:
    ``megengine.distributed.make_allreduce_cb`` checks ``isinstance`` against MegEngine's class
    and registers its flush with ``_register_after_backward_callback``."""

    def __init__(self, manager: Any) -> None:  # not MegEngine's __init__: it holds no state
        self._gradmgr = weakref.ref(manager)

    def _register_after_backward_callback(self, callback: Any) -> _NativeView:
        self._gradmgr().register_after_backward_callback(callback)
        return self


def _forward_to_gradmgr(name: str) -> Any:
    def method(self: _NativeView, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._gradmgr(), name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in ("attached_tensors", "attach", "backward", "record", "release", "__enter__",
              "__exit__", "__or__"):  # the rest of the native API: the gradmgr manager's
    setattr(_NativeView, _name, _forward_to_gradmgr(_name))


_native_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class MegEngineBackend(Backend):
    """Adapter for ``megengine.Tensor`` (``megengine.Parameter`` included)."""

    name = "megengine"
    tensor_modules = ("megengine",)
    capabilities = Capabilities(
        higher_order=True,
        cuda=True,
        exact_pre_record_semantics=True,
        requires_grad_flag=False,
        threads=False,  # MegEngine 1.13 works only in the main thread
        backward_in_callback=False,  # its engine cannot record while a backward runs
    )

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, megengine.Tensor)

    def check_attachable(self, tensor: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            _check_can_record("attach a MegEngine tensor")  # raises: not the main thread
        if not is_differentible_dtype(tensor.dtype):
            raise AttachError(
                f"only floating-point tensors can be attached to get gradients; got a "
                f"megengine tensor of dtype {tensor.dtype} and shape {tuple(tensor.shape)} "
                f"(cast it with .astype('float32') first)"
            )

    def shape(self, tensor: Any) -> tuple:
        return tuple(int(d) for d in tensor.shape)

    def ones_like(self, tensor: Any) -> Any:
        return F.ones_like(tensor)

    def seed_problem(self, y: Any, dy: Any) -> Optional[str]:
        # F.ones_like of a 0-d tensor has shape (1,) in MegEngine, and the native manager takes
        # that as the seed of a 0-d loss, so () and (1,) match each other. Other differences
        # would be broadcast by MegEngine's engine, which gives a silently scaled gradient.
        y_shape, dy_shape = self.shape(y), self.shape(dy)
        if y_shape == dy_shape or (y_shape in _ONE_ELEMENT and dy_shape in _ONE_ELEMENT):
            return None
        return f"has shape {dy_shape} but y has shape {y_shape}"

    def accumulate(self, tensor: Any, grad: Any) -> None:
        # As the native manager does. MegEngine tensors are values: ``+=`` rebinds .grad to a
        # new tensor, so a gradient shared with a callback or another tensor is never changed.
        if tensor.grad is None:
            tensor.grad = grad
        else:
            tensor.grad += grad

    def grad_problem(self, tensor: Any, grad: Any) -> Optional[str]:
        # MegEngine's += would broadcast a wrong shape and promote a wrong dtype silently. Its
        # engine gives a 0-d tensor a gradient of shape (1,) (and the native manager stores
        # it), so () and (1,) match each other, as for seeds.
        if grad.dtype != tensor.dtype or grad.device != tensor.device:
            return f"got {self.describe(grad)}, but the tensor has {self.describe(tensor)}"
        if is_tracing():
            return None  # shapes are symbolic under jit.trace; the traced program checks them
        grad_shape, shape = self.shape(grad), self.shape(tensor)
        if grad_shape == shape or (grad_shape in _ONE_ELEMENT and shape in _ONE_ELEMENT):
            return None
        return f"got {self.describe(grad)}, but the tensor has {self.describe(tensor)}"

    def describe(self, tensor: Any) -> str:
        return (f"shape {self.shape(tensor)}, dtype {np.dtype(tensor.dtype).name}, "
                f"device {tensor.device}")

    def new_tape(self) -> Tape:
        return MegEngineTape()

    tracks_backwarding = True

    def enter_backward(self, manager: Any) -> Any:
        # One view per manager: MegEngine's helpers remember the managers they registered with.
        view = _native_views.get(manager)
        if view is None:
            view = _native_views[manager] = _NativeView(manager)
        previous = native_grad_manager.backwarding_grad_manager
        native_grad_manager.backwarding_grad_manager = view
        return previous

    def exit_backward(self, token: Any) -> None:
        native_grad_manager.backwarding_grad_manager = token

    @contextlib.contextmanager
    def recording_group(self) -> Iterator[None]:
        """Grad objects started inside join one group, as ``GradManagerGroup.__enter__`` does.

        If a member fails to start, the group is closed and, when nobody joined it, removed
        from ``Grad.stack``, so MegEngine's global state is as before.
        """
        if Grad.grouping:
            raise RuntimeError("a MegEngine GradManager group is already being formed")
        group: list = []
        Grad.stack.append(group)
        Grad.begin_group()
        try:
            yield
        finally:
            Grad.grouping = False  # Grad.end_group(), minus its bare asserts
            if not group:  # nobody joined: remove exactly this list (Grad uses ==)
                for i in range(len(Grad.stack) - 1, -1, -1):
                    if Grad.stack[i] is group:
                        del Grad.stack[i]
                        break

    def device_of(self, tensor: Any) -> Optional[str]:
        return str(tensor.device)
