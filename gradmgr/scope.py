"""The scope every form of backward runs in (``backward``, the first part of
``backward_split``, ``DeferredBackward.finish``), and what flows into it: while a backward runs,
its manager is the backwarding one in this thread (callbacks look it up there), collects what
the backward delivers (each attached tensor's sink runs its callback chain and hands the result
to the :class:`~gradmgr.delivery.Delivery`), is announced to its backend once known (``track``),
and runs its error callbacks if the backward raises.

A manager's :class:`Scope` is made once, with the manager, and holds it by a weak reference:
tapes keep sinks, so nothing a sink reaches may keep the manager alive. The usual step enters
and leaves the scope with two calls and reuses the last backward's empty delivery (an object
made per step, or a ``with``, costs it measurably: bench/ab_plain_step.py).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, NoReturn, Optional

from . import _state
from .attachments import AttachSpec
from .backend import Backend
from .delivery import Delivery
from .hooks import StepHooks, run_error_callbacks
from .recording import Recording


class Scope:
    """One manager's backward scope; ``delivery`` is the running backward's, else None."""

    __slots__ = ("manager", "recording", "delivery", "spare", "dropped", "__weakref__")

    def __init__(self, manager: StepHooks, recording: Recording) -> None:
        self.manager = weakref.ref(manager)
        self.recording = recording
        self.delivery: Optional[Delivery] = None
        self.spare: Optional[Delivery] = None  # the last backward's, left empty: the next one's
        # Steps of split backwards collected before their finish() (any thread may add one)
        self.dropped: List[int] = []

    def fail_dropped(self) -> None:
        """Run the error callbacks once for each split backward collected unfinished, at its
        step, as if its ``finish()`` had raised: a data-parallel callback then completes that
        step's collectives as a failed one, so that the other ranks' ``finish()`` raises
        instead of pairing that step with this rank's next one. Not inside a backward."""
        while self.dropped and self.delivery is None:
            step = self.dropped.pop(0)
            self.close(self.open(step), None, RuntimeError(
                f"the split backward of recording {step} was collected before its finish()"))

    def open(self, step: int) -> List[Any]:
        """Enter; returns this thread's stack of backwarding managers, for :meth:`close`."""
        stack = _state.state.backwarding
        stack.append(self.manager())
        delivery = self.spare
        if delivery is None:
            delivery = Delivery(step)
        else:
            self.spare = None
            delivery.step = step
        self.delivery = delivery
        return stack

    def track(self, backend: Optional[Backend]) -> Optional[tuple]:
        """Announce the backward to ``backend`` (MegEngine's helpers look the manager up
        there); returns what :meth:`close` needs to take it back."""
        if backend is not None and backend.tracks_backwarding:
            return backend, backend.enter_backward(self.manager())
        return None

    def close(self, stack: List[Any], tracked: Optional[tuple],
              error: Optional[BaseException]) -> None:
        """Leave; ``error``: what the backward raised (the manager's error callbacks run)."""
        try:
            manager = self.manager()
            if error is not None and manager is not None:
                run_error_callbacks(manager, error)
        finally:
            delivery, self.delivery = self.delivery, None
            if delivery is not None and not delivery.gradients and not delivery.future_sources:
                self.spare = delivery  # nothing refers to it
            if tracked is not None:
                backend, token = tracked
                backend.exit_backward(token)
            stack.pop()

    def gradients_came(self) -> bool:
        """Whether the running backward delivered a gradient (or a Future) yet."""
        if self.delivery is None:
            outside_backward()
        return bool(self.delivery.gradients)

    def delivering(self) -> tuple:
        """``(delivery, backend)`` of the running backward (a gradient came: both are
        known)."""
        delivery, backend = self.delivery, self.recording.backend
        if delivery is None or backend is None:
            outside_backward()
        return delivery, backend

    def sink_for(self, spec: AttachSpec, key: int) -> Callable[[Any], Any]:
        """What the tape calls with an attached tensor's gradient. No strong reference to the
        manager nor to the tensor's callbacks (one that holds the manager would keep it alive
        for ever): a tape's finalizer may keep what it holds until the tape dies."""
        scope_ref, spec_ref = weakref.ref(self), weakref.ref(spec)

        def sink(grad: Any) -> Any:
            scope, spec = scope_ref(), spec_ref()
            tensor = None if spec is None else spec.tensor()
            if scope is None or spec is None or tensor is None or scope.manager() is None:
                return None
            if spec.callbacks:
                grad = scope.run_chain(spec.callbacks, key, tensor, grad)
            delivery = scope.delivery
            if delivery is None:
                outside_backward()
            delivery.gradients[key] = grad
            return grad

        return sink

    def run_chain(self, callbacks: List[Any], key: int, tensor: Any, grad: Any) -> Any:
        # The engine may call this from one of its worker threads: make the manager the
        # backwarding one there too, so callbacks can find it.
        manager = self.manager()
        stack = _state.state.backwarding
        pushed = not stack or stack[-1] is not manager
        if pushed:
            stack.append(manager)
        try:
            delivery, backend = self.delivering()
            return delivery.run_chain(backend, callbacks, key, tensor, grad)
        finally:
            if pushed:
                stack.pop()


def outside_backward() -> NoReturn:
    raise RuntimeError("gradmgr: a gradient arrived while its manager is not backwarding, or "
                       "before its framework is known (an internal error: please report it "
                       "with the output of `python -m gradmgr env`)")
