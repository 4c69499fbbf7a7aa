"""GradManager: MegEngine's gradient-manager semantics on any backend.

A manager holds its attached tensors (:mod:`.attachments`), its recording (:mod:`.recording`:
the framework, the tape that records between ``record()`` and ``release()``, the recording in
progress) and, while a backward runs, what the backward delivers (:mod:`.delivery`). Every form
of backward (``backward``, the first part of ``backward_split`` and ``DeferredBackward.finish``)
runs in one scope (:mod:`.scope`).
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence, Union

from . import _state
from .attachments import Attachments, AttachSpec, Callback, Tensors, check_callbacks, check_tensors
from .backend import Backend
from .errors import JOIN_HOOK_NAMES, NOT_JOINABLE
from .group import GradManagerGroup
from .hooks import StepHooks, refuse_if_differentiated
from .outputs import as_list, check_outputs
from .recording import Recording, live
from .registry import backend_for, resolve_backend
from .scope import Scope
from .split import DeferredBackward, FinishRefused, check_can_split, check_first, check_not_nested

__all__ = ["AttachSpec", "Callback", "GradManager", "get_backwarding_grad_manager"]


class GradManager(StepHooks):
    """Computes gradients of attached tensors by reverse-mode autodiff, MegEngine-style.

    Attach tensors once; each recording (``with gm:`` or ``record()``) tracks the operations on
    them, and ``backward(y, dy)`` accumulates ``dy``-weighted gradients into ``tensor.grad`` of
    the attached tensors only, running each tensor's callbacks as its gradient becomes ready.

    Example:
        On PyTorch tensors (MegEngine's work the same way):

        >>> import torch
        >>> w = torch.ones(3, requires_grad=True)
        >>> gm = GradManager().attach(w)
        >>> with gm:
        ...     loss = (w * torch.tensor([1.0, 2.0, 3.0])).sum()
        ...     gm.backward(loss)
        >>> w.grad
        tensor([1., 2., 3.])

    Args:
        backend: ``"torch"``, ``"megengine"``, a registered name or a Backend instance. By
            default the backend is detected from the first attached tensor (or from ``y``).
            A recording that starts before that, with several frameworks imported, starts a
            tape for each and keeps the right one once the framework is known; in a group,
            a member with nothing attached takes the framework of the others.
    """

    def __init__(self, backend: Union[str, Backend, None] = None) -> None:
        super().__init__()  # the registrations (StepHooks)
        self._attached = Attachments()
        self._recording = Recording(resolve_backend(backend))
        # What the thread's list of recording managers holds while this one records: a weak
        # reference, so that a manager dropped while recording is freed (as MegEngine's is)
        # and its recording ended instead of changing every later backward in the thread.
        self._ref = weakref.ref(self, self._recording.collected)
        self._scope = Scope(self, self._recording)  # every backward's
        self._fail_dropped = self._scope.fail_dropped  # (hooks.fail_dropped_splits)
        self._leaving_on_error = False  # a `with` block is left by an exception

    # ----------------------------------------------------------------- attaching
    @property
    def backend(self) -> Optional[Backend]:
        """The backend in use, or None until the first tensor is attached."""
        recording = self._recording
        return None if recording.guessed else recording.backend

    def attach(
        self,
        tensors: Tensors,
        callbacks: Union[Callback, Sequence[Callback], None] = None,
    ) -> GradManager:
        """Track ``tensors`` so that later backwards compute their gradients.

        ``callbacks`` (a callable or a list) are appended to each tensor's chain and called as
        ``grad = cb(tensor, grad)`` during backward. Attaching while recording snapshots the
        tensor: only operations after this call are differentiated. A callback object with a
        ``__gradmgr_bind__(manager)`` method has it called on every attach (the data-parallel
        callback registers its record and after-backward work there).

        Example:
            >>> import torch
            >>> x = torch.tensor([2.0])
            >>> gm = GradManager().attach(x, callbacks=lambda t, g: g * 10)
            >>> with gm:
            ...     gm.backward(x * x)
            >>> x.grad
            tensor([40.])

        Raises:
            AttachError: an object is not a tensor, or a tensor's dtype is not floating point
                (a TypeError, and an AssertionError as MegEngine raises there).
            TypeError: a callback is not callable, or tensors of two frameworks meet in one
                manager.
        """
        callback_list = check_callbacks(callbacks)
        tensor_list, backend = check_tensors(tensors, self.backend)
        recording = self._recording
        if recording.guessed and backend is not None:
            self._replace_guess(backend)
        recording.settle(backend)
        for cb in callback_list:
            bind = getattr(cb, "__gradmgr_bind__", None)
            if bind is not None:
                bind(self)
        for tensor in tensor_list:
            spec, new = self._attached.add(tensor, callback_list)
            if new:
                spec.sink = self._scope.sink_for(spec, id(tensor))
                self._watch_new(spec, tensor)
            elif recording.taping or recording.own_tape().persistent_watch:
                # Watched again: callbacks may now run during backward, and a backend may
                # judge the tensor again (PyTorch: the user may have frozen it since).
                recording.own_tape().watch(tensor, spec.sink, bool(spec.callbacks))
        return self

    def attached_tensors(self, with_callback: Optional[Callback] = None) -> List[Any]:
        """Live attached tensors, in first-attach order.

        With ``with_callback``, only the tensors whose chain contains that callback (an
        allreduce callback uses this to plan buckets the same way on every rank).
        """
        return self._attached.tensors(with_callback)

    def _watch_new(self, spec: AttachSpec, tensor: Any) -> None:
        recording = self._recording
        tape = recording.own_tape()
        eager = bool(spec.callbacks)
        if recording.managers is not None and not recording.taping:
            self._start_late()
            if not tape.persistent_watch:
                return  # start_tape watched it
        if tape.persistent_watch or recording.taping:
            tape.watch(tensor, spec.sink, eager)

    # ----------------------------------------------------------------- recording
    def record(self) -> None:
        """Start recording operations; ``backward()`` is legal until ``release()``.

        Raises:
            RuntimeError: already recording.
        """
        recording = self._recording
        if recording.managers is not None:
            raise RuntimeError(
                "already recording: call backward() or release() before record() again"
            )
        self._fail_dropped()  # a split backward collected unfinished fails its step
        starting = _state.state.starting_group  # set while a group starts its members
        recording.begin(self._ref, None if starting is None else starting.group)
        try:
            if self._record_callbacks:
                self._run_record_callbacks()  # before the tape snapshots anything
            if recording.backend is None:
                recording.start_without_backend(None if starting is None else starting.backend)
            if recording.backend is not None:
                recording.start_tape(self._attached)
        except BaseException:
            self.release()
            raise

    def __enter__(self) -> GradManager:
        self.record()  # (a subclass's record() too, as MegEngine's __enter__ calls it)
        return self

    @property
    def is_recording(self) -> bool:
        """Between ``record()`` and ``release()`` (or the end of ``backward()``)."""
        return self._recording.managers is not None

    @property
    def step(self) -> int:
        """Identifies the current (or latest) recording; increases with every ``record()``.

        The numbers are global, not per manager, so they are not consecutive; -1 before the
        first recording. A callback that batches work per backward (an allreduce bucket) can
        use it to tell one step from the next. While a split backward finishes
        (:meth:`DeferredBackward.finish`), it is that backward's recording.
        """
        delivery = self._scope.delivery
        return self._recording.step if delivery is None else delivery.step

    def _replace_guess(self, backend: Backend, still_guessed: bool = False) -> None:
        """See :meth:`Recording.replace_guess`; a recording goes on in ``backend``."""
        if self._recording.replace_guess(backend, still_guessed):
            self._start_late()

    def _start_late(self) -> None:
        """Start the tape now, in a recording that began before the backend was known."""
        mine = self._recording
        mine.warn_if_started_late([m._recording for m in live(mine.managers) if m is not self])
        mine.start_tape(self._attached)

    def release(self) -> None:
        """Stop recording and free what was kept for differentiation. Idempotent.

        Raises:
            RuntimeError: the recording ended without ``backward()``, but PyTorch's own
                ``loss.backward()`` wrote attached tensors' ``.grad`` in it, skipping their
                callbacks (seen where a tensor has callbacks).
        """
        recording = self._recording
        if not recording.leave(self._ref):
            return
        tape, recording.started = recording.started, None
        bypassed = None
        if tape is not None:
            tape.stop()
            bypassed, tape.bypassed = tape.bypassed, None
        backward_ran = recording.backward_ran
        if self._release_callbacks:
            self._run_release_callbacks(backward_ran)
        if bypassed is not None and not backward_ran and not self._leaving_on_error:
            raise RuntimeError(bypassed)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # (nothing to do where a backward released it already; a subclass's release() too)
        if exc_type is None:
            self.release()
            return
        tape = self._recording.started
        explained = None if tape is None else tape.explain(exc)
        self._leaving_on_error = True  # the block's own error wins
        try:
            self.release()
        finally:
            self._leaving_on_error = False
        if explained is not None:
            raise explained from exc

    # ----------------------------------------------------------------- backward
    def backward(self, y: Any = None, dy: Any = None) -> None:
        """Accumulate the vector-Jacobian product ``dy · ∂y/∂x`` into ``x.grad`` for every
        attached ``x``, then release the recording (also when an error is raised).

        Args:
            y: a tensor, a list/tuple of tensors, or None (nothing to differentiate: a rank
                that only takes part through communication callbacks).
            dy: like ``y``; defaults to ones shaped like each ``y``.

        Raises:
            RuntimeError: not recording.
            ValueError: ``y`` and ``dy`` differ in length or in a shape.
        """
        recording = self._recording
        managers = recording.managers
        if managers is None:
            recording.refuse("backward(y)")
        recording.backward_ran = True
        scope = self._scope
        stack, tracked = scope.open(recording.step), None
        try:
            ys, dys = self._outputs(y, dy)
            tracked = scope.track(recording.backend)
            delegated = None if self._backward_delegate is None else self._backward_delegate()
            if delegated is not None:
                self._run_delegated(ys, dys, delegated)
            else:
                tape = recording.started
                if ys and tape is not None:
                    create_graph, retain_graph = (
                        (False, False) if len(managers) == 1 else self._nesting())
                    tape.backward(ys, dys, create_graph=create_graph, retain_graph=retain_graph,
                                  may_accumulate=not self._after_backward_callbacks)
                self._end_backward()
        except BaseException as error:
            scope.close(stack, tracked, error)
            raise
        else:
            scope.close(stack, tracked, None)
        finally:
            self.release()

    def _outputs(self, y: Any, dy: Any) -> tuple:
        recording = self._recording
        backend = recording.backend
        if dy is None and backend is not None and backend_for(y) is backend:
            return [y], [backend.ones_like(y)]  # the common call: backward(loss)
        ys, dys, backend = check_outputs(y, dy, self.backend)
        if backend is not None and not len(self._attached) and (
                recording.guessed or recording.backend is None):
            self._replace_guess(backend, still_guessed=True)  # y's framework: not attached
        recording.settle(backend)
        return ys, dys

    def _end_backward(self, delegated: bool = False) -> None:
        """After the engine: after-backward callbacks (not where a delegate took the
        backward), then Futures and ``.grad`` of what the sinks got."""
        if self._after_backward_callbacks and not delegated:
            self._run_after_backward_callbacks()
        if self._scope.gradients_came():
            delivery, backend = self._scope.delivering()
            delivery.accumulate(backend, self._attached)

    def _run_delegated(self, ys: List[Any], dys: List[Any], delegated: Any) -> None:
        """The engine accumulates into ``.grad``; ``delegated`` does the rest (see
        :func:`gradmgr.hooks.set_backward_delegate`), and the sinks' delivery what the tape
        gave them (what the delegate does not take)."""
        try:
            tape = self._recording.started
            own_engine = getattr(delegated, "run_engine", None)
            if ys and own_engine is not None:
                own_engine(ys, dys, *self._nesting())
            elif ys and tape is not None:
                create_graph, retain_graph = self._nesting()
                tape.backward_accumulating(ys, dys, create_graph=create_graph,
                                           retain_graph=retain_graph,
                                           taken=getattr(delegated, "taken", None))
            delegated.finish()
        except BaseException:
            delegated.abort()
            raise
        self._end_backward(delegated=True)

    def _nesting(self) -> tuple:
        """``(create_graph, retain_graph)`` for this manager's backward while this thread's
        recording managers hold others too (alone, it is ``(False, False)``)."""
        # A manager whose own backward is running (this one runs inside its callback) can no
        # longer differentiate anything recorded now.
        mine = self._recording
        others = [m for m in live(mine.managers) if m is not self and m._scope.delivery is None]
        earlier = [m for m in others if m._recording.step < mine.step
                   and (mine.group is None or m._recording.group is not mine.group)]
        refuse_if_differentiated(earlier)
        return bool(earlier), bool(others)

    def add_gradient(self, tensor: Any, grad: Any) -> None:
        """Deliver ``grad`` (a tensor or a Future) for attached ``tensor`` during a backward.

        For callbacks and after-backward callbacks that produce a gradient the engine did not:
        an allreduce gives a tensor that no local output reached the other ranks' gradient.
        It is accumulated into ``tensor.grad`` with the others; a gradient already delivered
        for the tensor in this backward is replaced.

        Raises:
            RuntimeError: no backward of this manager is running.
            ValueError: ``tensor`` is not attached.
        """
        if self._scope.delivery is None:
            raise RuntimeError("add_gradient() is only valid while this manager is backwarding")
        if self._attached.spec_of(tensor) is None:
            raise ValueError("add_gradient(): the tensor is not attached to this manager")
        delivery, backend = self._scope.delivering()
        delivery.check(backend, id(tensor), tensor, grad, "add_gradient()")
        delivery.gradients[id(tensor)] = grad

    # ----------------------------------------------------------------- split backward
    def backward_split(self, y: Any = None, dy: Any = None, *,
                       first: Tensors) -> DeferredBackward:
        """A backward in two parts: the gradients of the attached tensors in ``first`` now, the
        others when the returned object's ``finish()`` is called.

        Made for pipeline schedules: ``first`` holds a stage's input activations (attached
        while recording), whose gradients the previous stage waits for; the weights'
        gradients can wait to fill idle time. This call runs the callbacks of the ``first``
        tensors, resolves their Futures and accumulates their ``.grad``, then ends the
        recording as :meth:`backward` does, so the next one can start. ``finish()`` computes
        the other gradients (running their callbacks as they become ready, so a data-parallel
        allreduce still overlaps), then runs the after-backward callbacks once, resolves
        Futures and accumulates. Both parts together give what ``backward(y, dy)`` gives, bit
        for bit where each weight's gradient arrives by one path. Attached tensors on a path to
        a ``first`` tensor (an attached activation below it) are computed in the first part,
        and so are those below a ``first`` intermediate with no ``first`` tensor below it
        (the first part stops there).

        Example:
            >>> import torch
            >>> w = torch.full((3,), 2.0, requires_grad=True)
            >>> gm = GradManager().attach(w)
            >>> x = torch.ones(3)
            >>> with gm:
            ...     _ = gm.attach(x)                   # a stage input, attached while recording
            ...     rest = gm.backward_split((w * x).sum(), first=[x])
            >>> x.grad, w.grad
            (tensor([2., 2., 2.]), None)
            >>> rest.finish()
            >>> w.grad
            tensor([1., 1., 1.])

        Raises:
            ValueError: a ``first`` tensor is not attached.
            UnsupportedGraphError: the backend cannot split a backward
                (``capabilities.split_backward``), or an outer manager records this backward.
        """
        recording = self._recording
        if recording.managers is None:
            recording.refuse("backward_split(y, first=...)")
        recording.backward_ran = True
        step, rest, tracked, scope = recording.step, None, None, self._scope
        stack = scope.open(step)
        try:
            ys, dys = self._outputs(y, dy)
            first_list = check_first(first, self._attached, recording.backend)
            check_can_split(recording.backend, self._split_refusal)
            tracked = scope.track(recording.backend)
            tape = recording.started
            if ys and tape is not None:
                create_graph, retain_graph = self._nesting()
                check_not_nested(create_graph)
                rest = tape.backward_split(ys, dys, first_list, retain_graph=retain_graph)
            delivery, backend = scope.delivering()
            delivery.accumulate(backend, self._attached)
        except BaseException as error:
            scope.close(stack, tracked, error)
            if rest is not None:
                rest.release()
            raise
        else:
            scope.close(stack, tracked, None)
        finally:
            self.release()
        return DeferredBackward(self._finish_split, rest, step, self._scope.dropped.append)

    def _finish_split(self, rest: Any, step: int, retain_graph: bool) -> None:
        """:meth:`DeferredBackward.finish`: the rest of a split backward, in its own scope."""
        scope = self._scope
        if scope.delivery is not None:
            raise FinishRefused(
                "cannot finish a split backward while a backward of the same manager runs; "
                "finish it before or after"
            )
        stack, tracked = scope.open(step), None
        try:
            tracked = scope.track(self._recording.backend)
            if rest is not None:
                rest.run(may_accumulate=not self._after_backward_callbacks,
                         retain_graph=retain_graph)
            self._end_backward()
        except BaseException as error:
            scope.close(stack, tracked, error)
            raise
        else:
            scope.close(stack, tracked, None)

    # ----------------------------------------------------------------- the rest
    def reachable(self, y: Any) -> List[Any]:
        """Attached tensors that ``backward(y)`` would give a gradient, in attach order."""
        ys = as_list(y)
        backend = self._recording.backend
        if not ys or backend is None:
            return []
        return backend.reachable(ys, self.attached_tensors())

    def __or__(self, other: Any) -> GradManagerGroup:
        """``gm1 | gm2``: the managers as a group (see :class:`GradManagerGroup`)."""
        if isinstance(other, (GradManager, GradManagerGroup)):
            return GradManagerGroup([self]).merge_with(other)
        return NotImplemented

    __ror__ = __or__

    def __getattr__(self, name: str) -> Any:
        # Called only for a name the manager lacks: torch's Join asks every joinable for these
        # first, and a manager built by hand is none.
        if name in JOIN_HOOK_NAMES:
            raise TypeError(NOT_JOINABLE)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __repr__(self) -> str:
        backend = self._recording.backend
        name = backend.name if backend else "no backend yet"
        state = "recording" if self.is_recording else "idle"
        return f"<GradManager {name}, {len(self._attached)} attached, {state}>"


def get_backwarding_grad_manager() -> Optional[GradManager]:
    """The manager whose ``backward()`` is running in this thread, else None.

    Inside a gradient callback it is the manager that called the callback; after the backward
    it is whatever it was before (an outer manager's backward, or None).

    Example:
        >>> get_backwarding_grad_manager() is None
        True
    """
    stack = _state.state.backwarding
    return stack[-1] if stack else None


# ------------------------------------------------------ for libraries built on a manager
# (kept out of the manager's help(): a user never needs them)
def callback_chains(gm: GradManager) -> List[tuple]:
    """``(tensor, callbacks)`` for every live attached tensor of ``gm``, in first-attach
    order."""
    return [(t, tuple(spec.callbacks)) for t, spec in gm._attached.live()]


def attach_epoch(gm: GradManager) -> int:
    """Changes whenever a tensor is attached to ``gm``, gets more callbacks, or dies: for
    caches derived from :meth:`GradManager.attached_tensors` (the data-parallel bucket
    plan)."""
    return gm._attached.epoch
