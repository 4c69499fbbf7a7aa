"""GradManager and GradManagerGroup: MegEngine's gradient-manager semantics on any backend."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

from . import _state
from .backend import Backend, Tape
from .errors import AttachError, CallbackResultError, GradMgrWarning, UnsupportedGraphError
from .future import is_future
from .registry import backend_for, imported_backends, resolve_backend
from .split import DeferredBackward

Callback = Callable[[Any, Any], Any]
"""``cb(tensor, grad) -> grad`` (or a Future of a grad)."""


class AttachSpec:
    """One attached tensor: a weak reference to it and its callback chain."""

    __slots__ = ("tensor", "callbacks", "sink", "__weakref__")

    def __init__(self, tensor: weakref.ref, callbacks: List[Callback]) -> None:
        self.tensor = tensor
        self.callbacks = callbacks
        self.sink: Callable[[Any], Any] = _no_sink


def _no_sink(grad: Any) -> Any:
    return None


def _source(source: Any) -> str:
    """A callback as "gradient callback <its name>"; a phrase as it is."""
    if isinstance(source, str):
        return source
    name = getattr(source, "__qualname__", None) or type(source).__qualname__
    return f"gradient callback {name}"


def _as_list(value: Any) -> List[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


class GradManager:
    """Computes gradients of attached tensors by reverse-mode autodiff, MegEngine-style.

    Attach tensors once; each recording (``with gm:`` or ``record()``) tracks the operations on
    them, and ``backward(y, dy)`` accumulates ``dy``-weighted gradients into ``tensor.grad`` of
    the attached tensors only, running each tensor's callbacks as its gradient becomes ready.

    Example (PyTorch; MegEngine tensors work the same way):
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
            tape for each and keeps the right one once the framework is known.
    """

    def __init__(self, backend: Union[str, Backend, None] = None) -> None:
        self._backend: Optional[Backend] = resolve_backend(backend)
        self._specs: Dict[int, AttachSpec] = {}
        self._attach_epoch = 0
        self._tape: Optional[Tape] = None
        self._recording = False
        self._taping = False  # the tape has started (the backend may be unknown at record())
        # Backend unknown at record() and several frameworks imported: one started tape per
        # candidate, so that whichever it turns out to be has its place in the recording order.
        self._provisional: Dict[Backend, Tape] = {}
        self._record_order = -1
        self._backward_step: Optional[int] = None  # a split backward's recording, in finish()
        self._group: Optional[GradManagerGroup] = None
        # The recording thread's list of recording managers (not the thread-local object: a
        # backward or release() may run in another thread).
        self._recording_list: Optional[List[GradManager]] = None
        self._gradients: Dict[int, Any] = {}
        self._future_sources: Dict[int, Any] = {}  # who returned each pending Future
        self._backwarding = False
        self._after_backward_callbacks: List[Callable[[], None]] = []
        self._error_callbacks: List[Callable[[], None]] = []
        self._record_callbacks: List[Callable[[], None]] = []
        self._backward_delegate: Optional[Callable[[], Any]] = None

    # ----------------------------------------------------------------- attaching
    @property
    def backend(self) -> Optional[Backend]:
        """The backend in use, or None until the first tensor is attached."""
        return self._backend

    def attached_tensors(self, with_callback: Optional[Callback] = None) -> List[Any]:
        """Live attached tensors, in first-attach order.

        With ``with_callback``, only the tensors whose chain contains that callback (an
        allreduce callback uses this to plan buckets the same way on every rank).
        """
        specs = self._specs.values()
        if with_callback is not None:
            specs = [s for s in specs if any(cb == with_callback for cb in s.callbacks)]
        alive = (spec.tensor() for spec in specs)
        return [t for t in alive if t is not None]

    @property
    def attach_epoch(self) -> int:
        """Changes whenever a tensor is attached, gets more callbacks, or dies: for caches
        derived from :meth:`attached_tensors` (the data-parallel bucket plan)."""
        return self._attach_epoch

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
        if not self._backwarding:
            raise RuntimeError("add_gradient() is only valid while this manager is backwarding")
        spec = self._specs.get(id(tensor))
        if spec is None or spec.tensor() is not tensor:
            raise ValueError("add_gradient(): the tensor is not attached to this manager")
        self._check_result(id(tensor), tensor, grad, "add_gradient()")
        self._gradients[id(tensor)] = grad

    def attach(
        self,
        tensors: Union[Any, Iterable[Any]],
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
        callback_list = self._check_callbacks(callbacks)
        tensor_list = self._check_tensors(tensors)
        for cb in callback_list:
            bind = getattr(cb, "__gradmgr_bind__", None)
            if bind is not None:
                bind(self)
        if self._provisional and self._backend is not None:
            self._settle_backend()
        for tensor in tensor_list:
            key = id(tensor)
            spec = self._specs.get(key)
            if spec is None:
                spec = AttachSpec(self._weak(tensor, key), list(callback_list))
                spec.sink = self._make_sink(spec, key)
                self._specs[key] = spec
                self._attach_epoch += 1
                self._watch_new(spec, tensor)
            else:
                had_callbacks = bool(spec.callbacks)
                spec.callbacks.extend(callback_list)
                if callback_list:
                    self._attach_epoch += 1
                if callback_list and not had_callbacks and (
                    self._taping or self._get_tape().persistent_watch
                ):
                    # now eager: callbacks must run while the backward runs
                    self._tape.watch(tensor, spec.sink, True)
        return self

    def _weak(self, tensor: Any, key: int) -> weakref.ref:
        manager = weakref.ref(self)

        def forget(ref: weakref.ref) -> None:
            owner = manager()
            if owner is not None:
                spec = owner._specs.get(key)
                if spec is not None and spec.tensor is ref:
                    del owner._specs[key]
                    owner._attach_epoch += 1

        return weakref.ref(tensor, forget)

    @staticmethod
    def _check_callbacks(callbacks: Any) -> List[Callback]:
        if callbacks is None:
            return []
        if callable(callbacks):
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
        return callback_list

    def _check_tensors(self, tensors: Any) -> List[Any]:
        """Validate everything before changing anything, so a bad call leaves no trace."""
        if backend_for(tensors) is not None:
            tensor_list = [tensors]
        else:
            try:
                tensor_list = list(tensors)
            except TypeError:
                raise AttachError(
                    f"attach() expects a tensor or an iterable of tensors, "
                    f"got {type(tensors).__module__}.{type(tensors).__qualname__}"
                ) from None
        backend = self._backend
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
        self._backend = backend
        return tensor_list

    # ----------------------------------------------------------------- recording
    def record(self) -> None:
        """Start recording operations; ``backward()`` is legal until ``release()``.

        Raises:
            RuntimeError: already recording.
        """
        self._begin_record(group=None)

    def _begin_record(self, group: Optional[GradManagerGroup]) -> None:
        if self._recording:
            raise RuntimeError(
                "already recording: call backward() or release() before record() again"
            )
        self._recording = True
        self._group = group
        self._record_order = next(_state.record_counter)
        recording = self._recording_list = _state.state.recording
        recording.append(self)
        try:
            for callback in self._record_callbacks:  # before the tape snapshots anything
                callback()
            if self._backend is None:
                candidates = imported_backends()
                if len(candidates) == 1:
                    self._backend = candidates[0]
                elif group is None:  # a group's members start together in one backend context
                    self._start_provisional(candidates)
            if self._backend is not None:
                self._ensure_tape()
        except BaseException:
            self.release()
            raise

    @property
    def step(self) -> int:
        """Identifies the current (or latest) recording; increases with every ``record()``.

        The numbers are global, not per manager, so they are not consecutive; -1 before the
        first recording. A callback that batches work per backward (an allreduce bucket) can
        use it to tell one step from the next. While a split backward finishes
        (:meth:`DeferredBackward.finish`), it is that backward's recording.
        """
        return self._record_order if self._backward_step is None else self._backward_step

    def _start_provisional(self, candidates: List[Backend]) -> None:
        for backend in candidates:
            tape = backend.new_tape()
            try:
                tape.start()
            except Exception:
                # This framework cannot record here (MegEngine outside the main thread). If the
                # manager turns out to be of it, _ensure_tape() raises the real error then.
                continue
            self._provisional[backend] = tape

    def _settle_backend(self) -> None:
        """The backend just became known: keep its provisional tape, stop the others."""
        provisional, self._provisional = self._provisional, {}
        tape = provisional.pop(self._backend, None)
        for other in provisional.values():
            other.stop()
        if tape is not None:
            self._tape, self._taping = tape, True

    def _get_tape(self) -> Tape:
        if self._tape is None:
            self._tape = self._backend.new_tape()
        return self._tape

    def _ensure_tape(self) -> None:
        if self._taping:
            return
        tape = self._get_tape()
        tape.start()
        self._taping = True
        if not tape.persistent_watch:
            items = []
            for spec in self._specs.values():
                tensor = spec.tensor()
                if tensor is not None:
                    items.append((tensor, spec.sink, bool(spec.callbacks)))
            tape.watch_all(items)

    def _watch_new(self, spec: AttachSpec, tensor: Any) -> None:
        tape = self._get_tape()
        if self._recording and not self._taping:
            self._warn_if_started_late()
            self._ensure_tape()  # recording began before the backend was known
            if not tape.persistent_watch:
                return  # _ensure_tape watched it
        if tape.persistent_watch or self._taping:
            tape.watch(tensor, spec.sink, bool(spec.callbacks))

    def _warn_if_started_late(self) -> None:
        later = [m for m in self._recording_list
                 if m is not self and m._record_order > self._record_order and m._taping]
        if later:
            warnings.warn(
                "gradmgr: this manager started recording before its framework was known "
                "(nothing was attached before record(), and it recorded as part of a group or "
                "its framework was imported only after record()), and a manager that started "
                "later is already recording: it may not record that manager's backward. Pass "
                "GradManager(backend=...) to fix the order.",
                GradMgrWarning,
                stacklevel=4,
            )

    def _make_sink(self, spec: AttachSpec, key: int) -> Callable[[Any], Any]:
        manager = weakref.ref(self)  # tapes keep sinks: no reference cycle through them

        def sink(grad: Any) -> Any:
            owner = manager()
            tensor = spec.tensor()
            if owner is None or tensor is None:
                return None
            if spec.callbacks:
                # The engine may call this from one of its worker threads: make the manager
                # the backwarding one there too, so callbacks can find it.
                stack = _state.state.backwarding
                pushed = not stack or stack[-1] is not owner
                if pushed:
                    stack.append(owner)
                try:
                    backend = owner._backend
                    is_tensor, grad_problem = backend.is_tensor, backend.grad_problem
                    for cb in spec.callbacks:
                        given, grad = grad, cb(tensor, grad)
                        # what a callback passes on unchanged was checked before it
                        if grad is not given and (not is_tensor(grad)
                                                  or grad_problem(tensor, grad) is not None):
                            owner._check_result(key, tensor, grad, cb)
                finally:
                    if pushed:
                        stack.pop()
            owner._gradients[key] = grad
            return grad

        return sink

    def _check_result(self, key: int, tensor: Any, grad: Any, source: Any) -> None:
        """Raise :class:`CallbackResultError` unless ``grad`` can be ``tensor``'s gradient;
        a Future is checked once it resolves. ``source``: the callback that returned it, or a
        phrase ("add_gradient()")."""
        backend = self._backend
        if backend.is_tensor(grad):
            problem = backend.grad_problem(tensor, grad)
            if problem is None:
                return
            raise CallbackResultError(
                f"{_source(source)} returned a gradient that does not fit its tensor: {problem}. "
                f"A gradient must have its tensor's shape, dtype and device (or be a Future of one)"
            )
        if grad is not None and is_future(grad):
            self._future_sources[key] = source
            return
        raise CallbackResultError(
            f"{_source(source)} returned {'None' if grad is None else type(grad).__qualname__} "
            f"for an attached tensor of {backend.describe(tensor)}: it must return the gradient "
            f"(pass it on unchanged if there is nothing to change) or a Future of it"
        )

    def release(self) -> None:
        """Stop recording and free what was kept for differentiation. Idempotent."""
        self._recording = False
        self._group = None
        if self._gradients:
            self._gradients = {}
        if self._future_sources:
            self._future_sources = {}
        recording = self._recording_list
        if recording is not None:
            self._recording_list = None
            if recording and recording[-1] is self:
                recording.pop()
            elif self in recording:
                recording.remove(self)
        if self._taping:
            self._taping = False
            self._tape.stop()
        if self._provisional:
            provisional, self._provisional = self._provisional, {}
            for tape in provisional.values():
                tape.stop()

    def __enter__(self) -> GradManager:
        self.record()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.release()

    # ----------------------------------------------------------------- backward
    def register_after_backward_callback(self, callback: Callable[[], None]) -> GradManager:
        """Call ``callback()`` after every backward's gradients are computed, before Futures
        resolve and before anything is accumulated into ``.grad``. Registrations persist."""
        if not callable(callback):
            raise TypeError(f"after-backward callback must be callable, not {type(callback)}")
        self._after_backward_callbacks.append(callback)
        return self

    _register_after_backward_callback = register_after_backward_callback  # MegEngine's name

    @property
    def after_backward_callbacks(self) -> tuple:
        """The registered after-backward callbacks, in order."""
        return tuple(self._after_backward_callbacks)

    def register_backward_error_callback(self, callback: Callable[[], None]) -> GradManager:
        """Call ``callback()`` when a backward (or a split backward's first part or
        ``finish()``) raises, before the error propagates; ``step`` is still that backward's.
        For work the after-backward callbacks would have finished: an allreduce callback
        launches the step's remaining collectives there, so other ranks do not wait on them.
        An error the callback raises is chained to the backward's. Registrations persist."""
        if not callable(callback):
            raise TypeError(f"backward error callback must be callable, not {type(callback)}")
        self._error_callbacks.append(callback)
        return self

    def _backward_failed(self, error: BaseException) -> None:
        for callback in self._error_callbacks:
            try:
                callback()
            except BaseException as raised:  # keep the backward's error; note this one
                raised.__context__ = error.__context__
                error.__context__ = raised

    def register_record_callback(self, callback: Callable[[], None]) -> GradManager:
        """Call ``callback()`` at the start of every recording (``record()`` / ``with``),
        before anything is recorded; an exception ends that recording. Registrations persist.

        Example:
            >>> gm = GradManager().register_record_callback(lambda: print("step starts"))
            >>> with gm:
            ...     pass
            step starts
        """
        if not callable(callback):
            raise TypeError(f"record callback must be callable, not {type(callback)}")
        self._record_callbacks.append(callback)
        return self

    def set_backward_delegate(self, delegate: Optional[Callable[[], Any]]) -> GradManager:
        """Let ``delegate`` take over whole backwards (None: stop): the data-parallel callback
        uses it to hand a step to PyTorch's C++ reducer.

        At the start of every :meth:`backward` (not :meth:`backward_split`), ``delegate()``
        returns None (this backward runs as usual) or an object with ``finish()`` and
        ``abort()``. Then the engine accumulates every attached tensor's gradient straight
        into ``.grad`` (no callback and no after-backward callback runs), after which
        ``finish()`` is called, or ``abort()`` if the backward raised. Only a backend whose
        tape has ``backward_accumulating`` (PyTorch) can be delegated to.

        Example:
            >>> class Count:
            ...     calls = 0
            ...     def finish(self): Count.calls += 1
            ...     def abort(self): pass
            >>> import torch
            >>> w = torch.ones(2, requires_grad=True)
            >>> gm = GradManager().attach(w).set_backward_delegate(Count)
            >>> with gm:
            ...     gm.backward((w * 3).sum())
            >>> w.grad, Count.calls
            (tensor([3., 3.]), 1)
        """
        if delegate is not None and not callable(delegate):
            raise TypeError(f"backward delegate must be callable, not {type(delegate)}")
        self._backward_delegate = delegate
        return self

    def callback_chains(self) -> List[tuple]:
        """``(tensor, callbacks)`` for every live attached tensor, in first-attach order."""
        chains = ((spec.tensor(), tuple(spec.callbacks)) for spec in self._specs.values())
        return [(t, callbacks) for t, callbacks in chains if t is not None]

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
        if not self._recording:
            raise RuntimeError(
                "no computation history to differentiate: call record() (or use `with gm:`) "
                "before computing y, then backward(y) inside the recording"
            )
        stack = _state.state.backwarding  # this thread's: callbacks run here look it up
        stack.append(self)
        self._backwarding = True
        scope = None
        try:
            ys, dys = self._check_outputs(y, dy)
            if self._provisional and self._backend is not None:
                self._settle_backend()
            if self._backend is not None and self._backend.tracks_backwarding:
                scope = (self._backend, self._backend.enter_backward(self))
            if self._backward_delegate is not None:
                delegated = self._backward_delegate()
                if delegated is not None:
                    self._delegated_backward(ys, dys, delegated)
                    return
            if ys and self._taping:
                create_graph, retain_graph = self._nesting(self._recording_list)
                self._tape.backward(ys, dys, create_graph=create_graph, retain_graph=retain_graph,
                                    may_accumulate=not self._after_backward_callbacks)
            for callback in self._after_backward_callbacks:
                callback()
            if self._gradients:
                self._accumulate_gradients()
        except BaseException as error:
            self._backward_failed(error)
            raise
        finally:
            self._backwarding = False
            if scope is not None:
                scope[0].exit_backward(scope[1])
            self.release()
            stack.pop()

    def _delegated_backward(self, ys: List[Any], dys: List[Any], delegated: Any) -> None:
        """The engine accumulates into ``.grad``; ``delegated`` does the rest (see
        :meth:`set_backward_delegate`)."""
        try:
            if ys and self._taping:
                create_graph, retain_graph = self._nesting(self._recording_list)
                self._tape.backward_accumulating(ys, dys, create_graph=create_graph,
                                                 retain_graph=retain_graph)
            delegated.finish()
        except BaseException:
            delegated.abort()
            raise

    def _nesting(self, recording: List[GradManager]) -> tuple:
        """``(create_graph, retain_graph)`` for this manager's backward while ``recording``
        (this thread's recording managers) holds others too."""
        if len(recording) == 1:  # only this manager: nobody records this backward
            return False, False
        # A manager whose own backward is running (this one runs inside its callback) can no
        # longer differentiate anything recorded now.
        others = [m for m in recording if m is not self and not m._backwarding]
        create_graph = any(
            m._record_order < self._record_order
            and (self._group is None or m._group is not self._group)
            for m in others
        )
        return create_graph, bool(others)

    def backward_split(self, y: Any = None, dy: Any = None, *,
                       first: Union[Any, Iterable[Any]]) -> DeferredBackward:
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
        if not self._recording:
            raise RuntimeError(
                "no computation history to differentiate: call record() (or use `with gm:`) "
                "before computing y, then backward_split(y, first=...) inside the recording"
            )
        stack = _state.state.backwarding
        stack.append(self)
        self._backwarding = True
        scope = rest = None
        step = self._record_order
        try:
            ys, dys = self._check_outputs(y, dy)
            if self._provisional and self._backend is not None:
                self._settle_backend()
            first_list = self._check_first(first)
            backend = self._backend
            if backend is not None and not backend.capabilities.split_backward:
                raise UnsupportedGraphError(
                    f"the {backend.name} backend cannot split a backward (its engine has no way "
                    f"to compute some gradients now and the others later); use backward()"
                )
            if backend is not None and backend.tracks_backwarding:
                scope = (backend, backend.enter_backward(self))
            if ys and self._taping:
                create_graph, retain_graph = self._nesting(self._recording_list)
                if create_graph:
                    raise UnsupportedGraphError(
                        "a manager that started recording earlier records this backward "
                        "(higher-order derivatives), and a split backward cannot be "
                        "differentiated; use backward() there"
                    )
                rest = self._tape.backward_split(ys, dys, first_list, retain_graph=retain_graph)
            self._accumulate_gradients()
        except BaseException as error:
            self._backward_failed(error)
            raise
        finally:
            self._backwarding = False
            if scope is not None:
                scope[0].exit_backward(scope[1])
            self.release()
            stack.pop()
        return DeferredBackward(self, rest, step)

    def _check_first(self, first: Any) -> List[Any]:
        items = [first] if backend_for(first) is not None else list(first)
        for i, t in enumerate(items):
            spec = self._specs.get(id(t))
            if spec is None or spec.tensor() is not t:
                what = (f"a tensor of {self._backend.describe(t)}"
                        if self._backend is not None and backend_for(t) is self._backend
                        else type(t).__name__)
                raise ValueError(
                    f"backward_split(first=...): item {i} ({what}) is not attached to this "
                    f"manager; attach it first (an activation: attach it while recording, "
                    f"right after computing it)"
                )
        return items

    def _check_can_finish(self) -> None:
        if self._backwarding:
            raise RuntimeError(
                "cannot finish a split backward while a backward of the same manager runs; "
                "finish it before or after"
            )

    def _finish_split(self, rest: Any, step: int) -> None:
        """:meth:`DeferredBackward.finish` (after :meth:`_check_can_finish`): the rest of a
        split backward, in its own scope."""
        stack = _state.state.backwarding
        stack.append(self)
        self._backwarding = True
        self._backward_step = step
        backend = self._backend
        scope = None
        try:
            if backend is not None and backend.tracks_backwarding:
                scope = (backend, backend.enter_backward(self))
            if rest is not None:
                rest.run(may_accumulate=not self._after_backward_callbacks)
            for callback in self._after_backward_callbacks:
                callback()
            self._accumulate_gradients()
        except BaseException as error:
            self._backward_failed(error)
            raise
        finally:
            self._gradients = {}
            self._future_sources = {}
            self._backwarding = False
            self._backward_step = None
            if scope is not None:
                scope[0].exit_backward(scope[1])
            stack.pop()

    def _accumulate_gradients(self) -> None:
        """Resolve Futures and check what they give, then accumulate every gradient (so a
        failure leaves every ``.grad`` as it was).

        The manager lets go of each gradient before handing it to the backend, so that a
        backend can tell from reference counts whether anybody else still holds it (PyTorch's
        AccumulateGrad then stores it without a copy, and so does gradmgr)."""
        backend, specs = self._backend, self._specs
        is_tensor, grad_problem = backend.is_tensor, backend.grad_problem
        gradients, self._gradients = self._gradients, {}
        ready: List[Any] = []
        for key, delivered in gradients.items():
            spec = specs.get(key)
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
                    self._check_result(key, tensor, delivered,
                                       f"the Future from {_source(self._future_sources.get(key))}")
            ready.append((tensor, delivered, replace))
        delivered = None
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

    def _check_outputs(self, y: Any, dy: Any) -> tuple:
        backend = self._backend
        if dy is None and backend is not None and backend_for(y) is backend:
            return [y], [backend.ones_like(y)]  # the common call: backward(loss)
        ys = _as_list(y)
        if not ys:
            if dy is not None and _as_list(dy):
                raise ValueError("dy was given but y is empty")
            return [], []
        for t in ys:
            found = backend_for(t)
            if found is None:
                raise TypeError(f"backward() expects tensors as y, got {type(t).__name__}")
            if backend is not None and found is not backend:
                raise TypeError(
                    f"y is a {found.name} tensor but this manager holds {backend.name} tensors"
                )
            backend = found
        if self._backend is None:
            self._backend = backend
        if dy is None:
            return ys, [backend.ones_like(t) for t in ys]
        dys = _as_list(dy)
        if len(dys) != len(ys):
            raise ValueError(f"got {len(ys)} tensors as y but {len(dys)} as dy; give one dy per y")
        for i, (t, d) in enumerate(zip(ys, dys)):
            if backend_for(d) is not backend:
                raise TypeError(f"dy[{i}] must be a {backend.name} tensor, got {type(d).__name__}")
            problem = backend.seed_problem(t, d)
            if problem is not None:
                raise ValueError(f"dy[{i}] {problem} (y[{i}]); each dy must match its y")
        return ys, dys

    # ----------------------------------------------------------------- graph helper
    def reachable(self, y: Any) -> List[Any]:
        """Attached tensors that ``backward(y)`` would give a gradient, in attach order."""
        ys = _as_list(y)
        if not ys or self._backend is None:
            return []
        return self._backend.reachable(ys, self.attached_tensors())

    # ----------------------------------------------------------------- groups
    def __or__(self, other: Any) -> GradManagerGroup:
        if isinstance(other, GradManager):
            return GradManagerGroup([self, other])
        if isinstance(other, GradManagerGroup):
            return GradManagerGroup([self, *other._gms])
        return NotImplemented

    __ror__ = __or__

    def __repr__(self) -> str:
        name = self._backend.name if self._backend else "no backend yet"
        state = "recording" if self._recording else "idle"
        return f"<GradManager {name}, {len(self._specs)} attached, {state}>"


class GradManagerGroup:
    """Managers that record together and do not see each other's backward.

    Example:
        >>> gm1, gm2 = GradManager(), GradManager()
        >>> group = gm1 | gm2
        >>> with group:
        ...     pass  # both record; gm1.backward(...) is not recorded by gm2, nor vice versa
    """

    def __init__(self, gms: Iterable[GradManager]) -> None:
        self._gms = list(gms)
        for gm in self._gms:
            if not isinstance(gm, GradManager):
                raise TypeError(f"a group holds GradManagers, not {type(gm).__name__}")

    def merge_with(self, other: Any) -> GradManagerGroup:
        if isinstance(other, GradManager):
            return GradManagerGroup([*self._gms, other])
        if isinstance(other, GradManagerGroup):
            return GradManagerGroup([*self._gms, *other._gms])
        return NotImplemented

    __or__ = merge_with
    __ror__ = merge_with

    def record(self) -> None:
        backends = {gm._backend for gm in self._gms if gm._backend is not None}
        if len(backends) > 1:
            names = sorted(b.name for b in backends)
            raise TypeError(f"a group cannot mix frameworks: its managers use {names}")
        backend = next(iter(backends), None)
        context = backend.recording_group() if backend is not None else contextlib.nullcontext()
        started: List[GradManager] = []
        try:
            with context:
                for gm in self._gms:
                    gm._begin_record(group=self)
                    started.append(gm)
        except BaseException:
            for gm in reversed(started):
                gm.release()
            raise

    def release(self) -> None:
        for gm in reversed(self._gms):
            gm.release()

    def __enter__(self) -> GradManagerGroup:
        self.record()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.release()

