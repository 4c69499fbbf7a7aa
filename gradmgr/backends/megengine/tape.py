"""MegEngineTape: one ``megengine.core.autodiff.grad.Grad`` per recording, as the native
manager's ``record()`` makes it."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

from megengine.core._imperative_rt.core2 import pop_scope, push_scope, set_option
from megengine.core.autodiff.grad import Grad

from gradmgr.backend import GradSink, Tape

# How many MegEngine backwards are running (MegEngine runs only in the main thread, so one
# counter is enough). Its engine cannot start or extend a recording from inside a gradient
# callback, so that is refused with a clear error instead of an opaque one from the engine.
_backward_depth = 0
_MAIN_THREAD_ID = threading.main_thread().ident


def check_can_record(action: str) -> None:
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
        check_can_record("start recording a MegEngine GradManager")
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
        check_can_record("attach a MegEngine tensor to a recording manager")
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
