"""GradManager: MegEngine's gradient-manager semantics on any backend.

A manager holds its attached tensors (:mod:`.attachments`), a tape from its backend that records
between ``record()`` and ``release()`` (while the framework is still unknown, a provisional one:
:mod:`.provisional`), and, while a backward runs, what the backward delivers
(:mod:`.delivery`). Every form of backward (``backward``, the first part of ``backward_split``
and ``DeferredBackward.finish``) runs in one scope, :class:`_Backwarding` (``backward`` enters
it through the scope's functions; see there).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, List, NoReturn, Optional, Sequence, Union

from . import _state
from .attachments import (
    Attachments,
    AttachSpec,
    Callback,
    Tensors,
    check_callbacks,
    check_tensors,
)
from .backend import Backend, Tape
from .delivery import Delivery
from .errors import GradMgrWarning, UnsupportedGraphError
from .group import GradManagerGroup
from .hooks import StepHooks
from .outputs import as_list, check_outputs
from .provisional import ProvisionalTape
from .registry import backend_for, imported_backends, resolve_backend
from .split import DeferredBackward, FinishRefused, check_can_split, check_first

__all__ = ["AttachSpec", "Callback", "GradManager"]


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
        self._backend: Optional[Backend] = resolve_backend(backend)
        # The backend was only guessed (a recording or a backward with nothing attached took
        # the only imported framework, or its group's): the first attached tensor decides.
        self._guessed = False
        self._attached = Attachments()
        self._tape: Optional[Tape] = None  # the backend's, for the manager's whole life
        # The recording (record() to release()), in the manager itself rather than an object
        # of its own, which would cost every step time (bench/bench_torch.py): the list of the
        # recording thread's recording managers it joined (None: not recording; a backward may
        # run in another thread), its group, and its started tape (the manager's, or a
        # provisional one; None until the backend is known).
        self._managers: Optional[List[weakref.ref]] = None
        # What the thread's list holds while this manager records: a weak reference, so that
        # a manager dropped while recording is freed (as MegEngine's is) and its recording
        # ended by _Leftover instead of changing every later backward in the thread.
        self._leftover = _Leftover()
        self._ref = weakref.ref(self, self._leftover.collected)
        self._recording_group: Optional[object] = None
        self._recording_tape: Optional[Tape] = None
        self._step = -1  # the latest recording's number
        self._backward_ran = False  # in the latest recording
        self._leaving_on_error = False  # a `with` block is left by an exception
        self._delivery: Optional[Delivery] = None  # while a backward of this manager runs
        self._spare_delivery: Optional[Delivery] = None  # an empty one, for the next backward

    # ----------------------------------------------------------------- attaching
    @property
    def backend(self) -> Optional[Backend]:
        """The backend in use, or None until the first tensor is attached."""
        return None if self._guessed else self._backend

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
        if self._guessed and backend is not None:
            self._replace_guess(backend)
        self._use_backend(backend)
        for cb in callback_list:
            bind = getattr(cb, "__gradmgr_bind__", None)
            if bind is not None:
                bind(self)
        for tensor in tensor_list:
            spec, new = self._attached.add(tensor, callback_list)
            if new:
                spec.sink = self._sink_for(spec, id(tensor))
                self._watch_new(spec, tensor)
            elif self._taping() or self._own_tape().persistent_watch:
                # Watched again: callbacks may now run during backward, and a backend may
                # judge the tensor again (PyTorch: the user may have frozen it since).
                self._own_tape().watch(tensor, spec.sink, bool(spec.callbacks))
        return self

    def attached_tensors(self, with_callback: Optional[Callback] = None) -> List[Any]:
        """Live attached tensors, in first-attach order.

        With ``with_callback``, only the tensors whose chain contains that callback (an
        allreduce callback uses this to plan buckets the same way on every rank).
        """
        return self._attached.tensors(with_callback)

    def _watch_new(self, spec: AttachSpec, tensor: Any) -> None:
        tape = self._own_tape()
        eager = bool(spec.callbacks)
        if self._managers is not None and not self._taping():
            self._warn_if_started_late()
            self._start_tape()  # recording began before the backend was known
            if not tape.persistent_watch:
                return  # _start_tape watched it
        if tape.persistent_watch or self._taping():
            tape.watch(tensor, spec.sink, eager)

    def _sink_for(self, spec: AttachSpec, key: int) -> Callable[[Any], Any]:
        # Tapes keep sinks, and a tape's finalizer may keep what it holds until the tape dies:
        # no strong reference to the manager, nor to its callbacks (one that holds the
        # manager would keep it alive for ever).
        manager, spec_ref = weakref.ref(self), weakref.ref(spec)

        def sink(grad: Any) -> Any:
            owner, spec = manager(), spec_ref()
            tensor = None if spec is None else spec.tensor()
            if owner is None or spec is None or tensor is None:
                return None
            if spec.callbacks:
                grad = owner._run_chain(spec.callbacks, key, tensor, grad)
            delivery = owner._delivery
            if delivery is None:
                _outside_backward()
            delivery.gradients[key] = grad
            return grad

        return sink

    def _run_chain(self, callbacks: List[Callback], key: int, tensor: Any, grad: Any) -> Any:
        # The engine may call this from one of its worker threads: make the manager the
        # backwarding one there too, so callbacks can find it.
        stack = _state.state.backwarding
        pushed = not stack or stack[-1] is not self
        if pushed:
            stack.append(self)
        try:
            delivery, backend = self._delivery, self._backend
            if delivery is None or backend is None:
                _outside_backward()
            return delivery.run_chain(backend, callbacks, key, tensor, grad)
        finally:
            if pushed:
                stack.pop()

    # ----------------------------------------------------------------- recording
    def record(self) -> None:
        """Start recording operations; ``backward()`` is legal until ``release()``.

        Raises:
            RuntimeError: already recording.
        """
        state = _state.state
        starting = state.starting_group  # set while a group starts its members
        if self._managers is not None:
            raise RuntimeError(
                "already recording: call backward() or release() before record() again"
            )
        self._step = next(_state.record_counter)
        self._backward_ran = False
        self._recording_group = None if starting is None else starting.group
        managers = self._managers = self._leftover.managers = state.recording
        managers.append(self._ref)
        try:
            if self._record_callbacks:
                self._run_record_callbacks()  # before the tape snapshots anything
            tape = self._tape
            if tape is not None and tape.persistent_watch and self._recording_tape is None:
                tape.start()  # the usual recording: the tape watches every attached tensor
                self._recording_tape = tape
                return
            if self._backend is None:
                self._start_without_backend(None if starting is None else starting.backend)
            if self._backend is not None:
                self._start_tape()
        except BaseException:
            self.release()
            raise

    def __enter__(self) -> GradManager:
        self.record()  # (a subclass's record() too, as MegEngine's __enter__ calls it)
        return self

    def _start_without_backend(self, group_backend: Optional[Backend]) -> None:
        """Nothing attached tells the framework yet. A group's member takes the group's (a
        group cannot mix frameworks); otherwise the only one imported, or with several, a
        provisional tape in each until a tensor settles it (for a group's members inside
        each framework's group context, so whichever it turns out to be, its tape started
        with the group's: on MegEngine, one started later would not join the native group)."""
        candidates = [group_backend] if group_backend is not None else imported_backends()
        if len(candidates) == 1:
            self._backend, self._guessed = candidates[0], True
        else:
            provisional = ProvisionalTape(candidates)
            provisional.start()
            self._recording_tape = self._leftover.provisional = provisional

    @property
    def is_recording(self) -> bool:
        """Between ``record()`` and ``release()`` (or the end of ``backward()``)."""
        return self._managers is not None

    @property
    def step(self) -> int:
        """Identifies the current (or latest) recording; increases with every ``record()``.

        The numbers are global, not per manager, so they are not consecutive; -1 before the
        first recording. A callback that batches work per backward (an allreduce bucket) can
        use it to tell one step from the next. While a split backward finishes
        (:meth:`DeferredBackward.finish`), it is that backward's recording.
        """
        delivery = self._delivery
        return self._step if delivery is None else delivery.step

    def _replace_guess(self, backend: Backend, still_guessed: bool = False) -> None:
        """A tensor of ``backend`` is given to a manager whose backend was only guessed (or
        is unknown): keep the guess if it is the tensor's framework; otherwise forget it (and
        its tape, restarted in the tensor's framework if recording). An attached tensor
        settles the backend; a ``y`` (``still_guessed``) is only the next guess."""
        self._guessed = still_guessed
        if backend is self._backend or self._backend is None:
            return
        recording = self._managers is not None
        if recording and self._recording_tape is not None:
            tape, self._recording_tape = self._recording_tape, None
            tape.stop()
        self._backend, self._tape = backend, None
        if recording:
            self._warn_if_started_late()
            self._start_tape()

    def _use_backend(self, backend: Optional[Backend]) -> None:
        """The backend just became known (from a tensor): settle a provisional tape."""
        if backend is None or backend is self._backend:
            return
        self._backend = backend
        provisional = self._recording_tape
        if self._managers is not None and isinstance(provisional, ProvisionalTape):
            tape = provisional.settle(backend)
            self._recording_tape = None
            if tape is not None:
                self._tape = self._recording_tape = self._leftover.tape = tape

    def _own_tape(self) -> Tape:
        if self._tape is None:
            if self._backend is None:  # callers come with a tensor, or from _use_backend
                raise RuntimeError("gradmgr: a tape was asked for before the manager's "
                                   "framework is known (an internal error: please report it "
                                   "with the output of `python -m gradmgr env`)")
            self._tape = self._leftover.tape = self._backend.new_tape()
        return self._tape

    def _taping(self) -> bool:
        return self._managers is not None and self._recording_tape is not None

    def _start_tape(self) -> None:
        if self._recording_tape is not None:
            return
        tape = self._own_tape()
        tape.start()
        self._recording_tape = tape
        if not tape.persistent_watch:
            tape.watch_all([(t, spec.sink, bool(spec.callbacks))
                            for t, spec in self._attached.live()])

    def _warn_if_started_late(self) -> None:
        later = [m for m in _live(self._managers)
                 if m is not self and m._step > self._step and m._taping()]
        if later:
            warnings.warn(
                "gradmgr: this manager started recording before its framework was known "
                "(nothing was attached before record(), and it recorded as part of a group or "
                "its framework was imported only after record()), and a manager that started "
                "later is already recording: it may not record that manager's backward. Pass "
                "GradManager(backend=...) to fix the order.",
                GradMgrWarning,
                stacklevel=5,
            )

    def release(self) -> None:
        """Stop recording and free what was kept for differentiation. Idempotent.

        Raises:
            RuntimeError: the recording ended without ``backward()``, but PyTorch's own
                ``loss.backward()`` wrote attached tensors' ``.grad`` in it, skipping their
                callbacks (seen where a tensor has callbacks).
        """
        managers, self._managers = self._managers, None
        if managers is None:
            return
        ref = self._ref
        if managers and managers[-1] is ref:
            managers.pop()
        elif ref in managers:
            managers.remove(ref)
        tape, self._recording_tape = self._recording_tape, None
        bypassed = None
        if tape is not None:
            tape.stop()
            bypassed = tape.bypassed
            if bypassed is not None:
                tape.bypassed = None
        if self._release_callbacks:
            self._run_release_callbacks(self._backward_ran)
        if bypassed is not None and not self._backward_ran and not self._leaving_on_error:
            raise RuntimeError(bypassed)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # (nothing to do where a backward released it already; a subclass's release() too)
        if exc_type is None:
            self.release()
            return
        tape = self._recording_tape
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
        managers = self._managers
        if managers is None:
            self._require_recording("backward(y)")
        self._backward_ran = True
        # The scope by its functions, not a _Backwarding and a `with` (the object would cost
        # the usual step time: see _Backwarding).
        stack, tracked = _open_scope(self, self._step), None
        try:
            ys, dys = self._outputs(y, dy)
            backend = self._backend
            # (the calls of _track and _end_backward only where they have work: each call
            # costs the usual step time, as bench/ab_plain_step.py shows)
            if backend is not None and backend.tracks_backwarding:
                tracked = _track(self, backend)
            delegated = None if self._backward_delegate is None else self._backward_delegate()
            tape = self._recording_tape
            if delegated is not None:
                self._run_delegated(ys, dys, delegated)
            else:
                if ys and tape is not None:
                    create_graph, retain_graph = (
                        (False, False) if len(managers) == 1 else self._nesting())
                    tape.backward(ys, dys, create_graph=create_graph, retain_graph=retain_graph,
                                  may_accumulate=not self._after_backward_callbacks)
                if self._after_backward_callbacks or _delivering(self).gradients:
                    self._end_backward()
        except BaseException as error:
            _close_scope(self, stack, tracked, error)
            raise
        else:
            _close_scope(self, stack, tracked, None)
        finally:
            self.release()

    def _require_recording(self, call: str) -> NoReturn:
        if self._managers is None and self._backward_ran:
            raise RuntimeError(
                f"not recording: the first backward() ended the recording, as every backward "
                f"does (MegEngine's rule), so {call} has nothing to differentiate. For another "
                f"backward, compute y again in a new recording (`with gm:` or record()); for "
                f"several outputs at once, pass them together: backward([y1, y2])"
            )
        raise RuntimeError(
            f"no computation history to differentiate: call record() (or use `with gm:`) "
            f"before computing y, then {call} inside the recording"
        )

    def _outputs(self, y: Any, dy: Any) -> tuple:
        backend = self._backend
        if dy is None and backend is not None and backend_for(y) is backend:
            return [y], [backend.ones_like(y)]  # the common call: backward(loss)
        ys, dys, backend = check_outputs(y, dy, self.backend)
        if backend is not None and not len(self._attached) and (
                self._guessed or self._backend is None):
            self._replace_guess(backend, still_guessed=True)  # y's framework: not attached
        self._use_backend(backend)
        return ys, dys

    def _end_backward(self) -> None:
        """After the engine: after-backward callbacks, then Futures and ``.grad``."""
        if self._after_backward_callbacks:
            self._run_after_backward_callbacks()
        delivery = _delivering(self)
        if delivery.gradients:
            delivery.accumulate(_delivering_backend(self), self._attached)

    def _run_delegated(self, ys: List[Any], dys: List[Any], delegated: Any) -> None:
        """The engine accumulates into ``.grad``; ``delegated`` does the rest (see
        :func:`gradmgr.hooks.set_backward_delegate`)."""
        try:
            tape = self._recording_tape
            if ys and tape is not None:
                create_graph, retain_graph = self._nesting()
                tape.backward_accumulating(ys, dys, create_graph=create_graph,
                                           retain_graph=retain_graph)
            delegated.finish()
        except BaseException:
            delegated.abort()
            raise

    def _nesting(self) -> tuple:
        """``(create_graph, retain_graph)`` for this manager's backward while this thread's
        recording managers hold others too (alone, it is ``(False, False)``)."""
        # A manager whose own backward is running (this one runs inside its callback) can no
        # longer differentiate anything recorded now.
        others = [m for m in _live(self._managers) if m is not self and m._delivery is None]
        group = self._recording_group
        create_graph = any(
            m._step < self._step and (group is None or m._recording_group is not group)
            for m in others
        )
        return create_graph, bool(others)

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
        delivery = self._delivery
        if delivery is None:
            raise RuntimeError("add_gradient() is only valid while this manager is backwarding")
        if self._attached.spec_of(tensor) is None:
            raise ValueError("add_gradient(): the tensor is not attached to this manager")
        delivery.check(_delivering_backend(self), id(tensor), tensor, grad, "add_gradient()")
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
        if self._managers is None:
            self._require_recording("backward_split(y, first=...)")
        self._backward_ran = True
        step, rest = self._step, None
        try:
            with _Backwarding(self, step) as scope:
                ys, dys = self._outputs(y, dy)
                first_list = check_first(first, self._attached, self._backend)
                check_can_split(self._backend)
                scope.track(self._backend)
                tape = self._recording_tape
                if ys and tape is not None:
                    create_graph, retain_graph = self._nesting()
                    if create_graph:
                        raise UnsupportedGraphError(
                            "a manager that started recording earlier records this backward "
                            "(higher-order derivatives), and a split backward cannot be "
                            "differentiated; use backward() there"
                        )
                    rest = tape.backward_split(ys, dys, first_list, retain_graph=retain_graph)
                _delivering(self).accumulate(_delivering_backend(self), self._attached)
        except BaseException:
            if rest is not None:
                rest.release()
            raise
        finally:
            self.release()
        return DeferredBackward(self._finish_split, rest, step)

    def _finish_split(self, rest: Any, step: int, retain_graph: bool) -> None:
        """:meth:`DeferredBackward.finish`: the rest of a split backward, in its own scope."""
        if self._delivery is not None:
            raise FinishRefused(
                "cannot finish a split backward while a backward of the same manager runs; "
                "finish it before or after"
            )
        with _Backwarding(self, step) as scope:
            scope.track(self._backend)
            if rest is not None:
                rest.run(may_accumulate=not self._after_backward_callbacks,
                         retain_graph=retain_graph)
            self._end_backward()

    # ----------------------------------------------------------------- the rest
    def reachable(self, y: Any) -> List[Any]:
        """Attached tensors that ``backward(y)`` would give a gradient, in attach order."""
        ys = as_list(y)
        if not ys or self._backend is None:
            return []
        return self._backend.reachable(ys, self.attached_tensors())

    def __or__(self, other: Any) -> GradManagerGroup:
        """``gm1 | gm2``: the managers as a group (see :class:`GradManagerGroup`)."""
        if isinstance(other, (GradManager, GradManagerGroup)):
            return GradManagerGroup([self]).merge_with(other)
        return NotImplemented

    __ror__ = __or__

    def __getattr__(self, name: str) -> Any:
        # Called only for a name the manager lacks: torch's Join asks every joinable for these
        # first, and a manager built by hand is none (see _NOT_JOINABLE).
        if name in _JOINABLE:
            raise TypeError(_NOT_JOINABLE)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __repr__(self) -> str:
        name = self._backend.name if self._backend else "no backend yet"
        state = "recording" if self._managers is not None else "idle"
        return f"<GradManager {name}, {len(self._attached)} attached, {state}>"


_JOINABLE = frozenset({"join_hook", "join_device", "join_process_group"})
_NOT_JOINABLE = (
    "this GradManager is not a joinable of torch's Join (uneven inputs): only the manager "
    "gradmgr.distributed.data_parallel(model) returns takes part in it, as a DDP model does "
    "(a manager built by hand with make_allreduce_cb() has no join hook). Make it with "
    "gm = data_parallel(model), or give every rank the same number of batches"
)


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


def _live(refs: Optional[List[weakref.ref]]) -> List[GradManager]:
    """The live managers of a thread's list of recording ones (see GradManager._ref); none
    for a manager that is not recording."""
    return [] if refs is None else [m for m in (ref() for ref in refs) if m is not None]


def _outside_backward() -> NoReturn:
    raise RuntimeError("gradmgr: a gradient arrived while its manager is not backwarding, or "
                       "before its framework is known (an internal error: please report it "
                       "with the output of `python -m gradmgr env`)")


def _delivering(manager: GradManager) -> Delivery:
    """The delivery of ``manager``'s running backward."""
    if manager._delivery is None:
        _outside_backward()
    return manager._delivery


def _delivering_backend(manager: GradManager) -> Backend:
    """The backend of ``manager``'s running backward (a gradient came: it is known)."""
    if manager._backend is None:
        _outside_backward()
    return manager._backend


class _Leftover:
    """What a manager's recording leaves to end if the manager is collected while recording
    (``def h(): gm.record()``): its place in the thread's list of recording managers and its
    tapes. Holds no reference to the manager; the manager sets these as they change."""

    __slots__ = ("managers", "tape", "provisional")

    def __init__(self) -> None:
        self.managers: Optional[List[weakref.ref]] = None  # the list of the latest record()
        self.tape: Optional[Tape] = None  # the manager's own tape
        self.provisional: Optional[Tape] = None  # its latest provisional one

    def collected(self, ref: weakref.ref) -> None:
        """The manager died: if it was recording, end the recording (a tape's stop() undoes
        what it changed: PyTorch inputs' ``requires_grad``, grad mode, MegEngine's ``Grad``),
        so that it no longer records (higher order) later backwards of its thread."""
        managers = self.managers
        if managers is None or ref not in managers:
            return  # not recording
        managers.remove(ref)
        for tape in (self.provisional, self.tape):
            if tape is not None:
                tape.stop()


class _Backwarding:
    """The scope of every form of backward: the manager is the backwarding one in this thread
    (callbacks look it up there), collects what the backward delivers, is announced to its
    backend once known (``track``), and runs its error callbacks if the backward raises.

    ``backward()`` calls the functions below itself instead: creating this object and
    entering it costs a training step time (instantiating a class, setting attributes and a
    ``with`` look names up on types, and the forward pushed those caches out), a visible part
    of what the plain step may cost on a small model (bench/bench_torch.py's mlp-64;
    bench/ab_plain_step.py compares two versions side by side)."""

    __slots__ = ("_manager", "_step", "_stack", "_tracked")

    def __init__(self, manager: GradManager, step: int) -> None:
        self._manager, self._step = manager, step
        self._stack: List[GradManager] = []  # (this thread's, set on entering)
        self._tracked: Optional[tuple] = None

    def __enter__(self) -> _Backwarding:
        self._stack = _open_scope(self._manager, self._step)
        return self

    def track(self, backend: Optional[Backend]) -> None:
        self._tracked = _track(self._manager, backend)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        _close_scope(self._manager, self._stack, self._tracked, exc)


def _open_scope(manager: GradManager, step: int) -> List[GradManager]:
    """Enter the scope; returns this thread's stack of backwarding managers, for leaving."""
    stack = _state.state.backwarding
    stack.append(manager)
    delivery = manager._spare_delivery
    if delivery is None:
        delivery = Delivery(step)
    else:  # the last backward's, left empty: a new object would cost the usual step time
        # (bench/bench_torch.py)
        manager._spare_delivery = None
        delivery.step = step
    manager._delivery = delivery
    return stack


def _track(manager: GradManager, backend: Optional[Backend]) -> Optional[tuple]:
    """Announce the backward to ``backend`` (MegEngine's helpers look the manager up there);
    returns what :func:`_close_scope` needs to take it back."""
    if backend is not None and backend.tracks_backwarding:
        return backend, backend.enter_backward(manager)
    return None


def _close_scope(manager: GradManager, stack: List[GradManager], tracked: Optional[tuple],
                 error: Optional[BaseException]) -> None:
    """Leave the scope; ``error``: what the backward raised (its error callbacks run)."""
    try:
        if error is not None:
            manager._run_error_callbacks(error)
    finally:
        delivery, manager._delivery = manager._delivery, None
        if delivery is not None and not delivery.gradients and not delivery.future_sources:
            manager._spare_delivery = delivery  # nothing refers to it: the next scope's
        if tracked is not None:
            backend, token = tracked
            backend.exit_backward(token)
        stack.pop()
