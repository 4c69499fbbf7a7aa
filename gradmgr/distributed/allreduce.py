"""The data-parallel allreduce callback: bucketed, launched during backward, overlapping it.

The callback is a state machine per manager it serves: at every recording it plans (again, if
the trainable attached tensors changed), compares the plan across ranks and starts the step;
during the backward each gradient goes into its bucket (:mod:`.steps`) or, where the backend's
own reducer can take the whole backward over, the step is handed to it; after the backward the
remaining buckets go out. Everything framework-specific comes from the backend's adapters
(:mod:`gradmgr.distributed.contract`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Set, Union

from .._state import get_backwarding_grad_manager
from .bucket import BucketPlan
from .consistency import PlanCheck, plan_fingerprint
from .contract import NativePath, NativeReducer, TensorOps, Transport
from .errors import RankMismatchError, SparseGradientError, sparse_message
from .steps import PendingGradient, Step, Wire
from .sync import broadcast, is_paused
from .transport import TransportSpec, check_transport, resolve_transport

_REDUCE = ("mean", "sum")
_VERIFY = {True: "step", "step": "step", "plan": "plan", False: None}
_COMPRESSION = (None, "fp16", "bf16")
_FIRST_BUCKET_BYTES = 2**20  # as DDP: start communicating early, then use bigger buckets
_MAX_OPEN_STEPS = 1024  # steps begun but not flushed (split backwards pending, or no backward)


class _ManagerState:
    """What the callback keeps per manager it serves."""

    __slots__ = ("backend", "ops", "transport", "wire", "plan", "excluded", "epoch", "steps",
                 "used", "native_path", "native", "reducer", "fingerprint", "started",
                 "flush")

    def __init__(self, backend: Any, ops: TensorOps) -> None:
        self.backend = backend
        self.ops = ops
        self.transport: Optional[Transport] = None
        self.wire: Optional[Wire] = None
        self.plan: Optional[BucketPlan] = None
        self.excluded: List[Any] = []  # attached with this callback but frozen at planning
        self.epoch = -1  # the manager's attach_epoch the plan was made for
        # Steps by recording: a split backward finishes its step after the next recording
        # has started its own (GradManager.backward_split).
        self.steps: Dict[int, Step] = {}
        self.used: Set[int] = set()  # ids with a local gradient since the last synced step
        self.native_path: Optional[NativePath] = None  # the backend's reducer, if any
        self.native = False  # plain backwards go to it (see _native_possible)
        self.reducer: Optional[NativeReducer] = None
        self.fingerprint: List[int] = []  # of plan and path, for PlanCheck (see _set_native)
        self.started = False  # the first recording's check and broadcast are done
        self.flush: Any = None  # the after-backward callback registered for this manager


class AllreduceCallback:
    """Averages (or sums) gradients over all processes, data-parallel style, like PyTorch's
    ``DistributedDataParallel``.

    Use one instance for all parameters of a model: ``gm.attach(params, callbacks=[cb])``.
    Attaching binds it to the manager; from then on, at the start of every recording of that
    manager, it:

    * plans buckets from the attached tensors that are trainable (on PyTorch: that require
      grad; a frozen parameter is left out and keeps ``.grad`` as it is, as with DDP), in
      reverse attach order, by dtype and device, about ``bucket_bytes`` each (the first at most
      1 MiB, as in DDP, so communication starts early);
    * at every synced step (and the first), launches one small collective that compares
      every rank's plan (count, order, shapes, dtypes, and how they are reduced); the step
      reads it before launching anything else, so it overlaps the forward. Where the plans
      differ (one rank alone attached, froze or unfroze a tensor, say), every rank raises
      :class:`gradmgr.distributed.RankMismatchError` naming the first differing tensor,
      rather than reducing mismatched buffers;
    * on the first plan, with ``broadcast=True`` (default), overwrites the planned tensors on
      every rank with rank ``src``'s values, as DDP does when it wraps a model (buffers: see
      :func:`gradmgr.distributed.broadcast` and :func:`gradmgr.distributed.data_parallel`);
    * reads whether this step synchronises (see :meth:`no_sync`).

    During the backward, ``cb(tensor, grad)`` puts the gradient into its bucket and returns a
    :class:`gradmgr.Future`; each bucket is reduced as soon as all its members are in, in the
    same order on every rank, so communication overlaps the rest of the backward. An
    after-backward callback launches the remaining buckets. Where ``native`` allows, a plain
    ``gm.backward`` skips all of that and the framework's own reducer does the same work
    (torch's C++ ``Reducer``, DDP's: see :mod:`gradmgr.backends.torch.reducer`).

    What ``.grad`` holds afterwards is exactly what DDP's gives: every rank's ``.grad`` (from
    earlier ``no_sync`` steps, or kept from before) plus its new gradient, averaged over the
    ranks; it replaces ``.grad`` and is bit-identical on every rank. The new ``.grad`` tensors
    are views into the reduced bucket buffers (DDP's ``gradient_as_bucket_view``): nothing is
    copied, and two ``.grad`` tensors share a buffer without overlapping.

    Unused tensors: an attached, trainable tensor that gets no gradient on a rank in a step is
    reduced as zeros there, and the result reaches it through ``gm.add_gradient``; one that no
    rank used since the last synced step keeps its ``.grad`` (``None`` stays ``None``), as with
    DDP's ``find_unused_parameters=True``. Every backward of a manager that ``cb`` serves is a
    collective step that all ranks must take, and so is every ``record()`` of a synced step.

    Example:
        >>> # torch.distributed.init_process_group("gloo", ...) in every process
        >>> # cb = make_allreduce_cb("mean")
        >>> # gm = GradManager().attach(model.parameters(), callbacks=[cb])
        >>> # with gm:
        >>> #     gm.backward(loss_fn(model(x), y))   # .grad is now the mean over ranks

    Args:
        reduce: ``"mean"`` or ``"sum"`` over processes.
        group: the process group (torch ``ProcessGroup`` / megengine ``Group``); None: all.
        bucket_bytes: target bucket size in bytes (a bucket closes once it reaches it).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the dtype sent over the wire (a mean
            is divided by the world size before the cast, so fp16 rarely overflows).
        transport: None (the tensors' backend picks: torch.distributed for PyTorch; for
            MegEngine its own collectives when initialised, else torch.distributed through
            host memory), a name the backend knows (``"torch"``, ``"megengine"``,
            ``"megengine-via-torch"``) or any object with ``world_size()`` and
            ``allreduce_async(flat) -> handle`` (``handle.wait()`` returns the summed buffer;
            see :class:`gradmgr.distributed.contract.Transport`).
        broadcast: broadcast the planned tensors from ``src`` at the first recording.
        src: the rank whose values the broadcast spreads.
        verify: compare the ranks' plans: ``True`` or ``"step"``, at every synced step (one
            small collective each, overlapping the forward; catches a change made on one
            rank alone); ``"plan"``, only at steps where this rank re-planned (no per-step
            cost, but a rank that alone attaches, freezes or unfreezes a tensor then takes a
            collective the others do not: gloo aborts, or gradients are wrong); ``False``:
            never.
        native: let plain backwards go to the framework's own reducer (on PyTorch, torch's
            C++ ``Reducer``, DDP's) where nothing else needs the per-tensor callbacks:
            ``"mean"`` without compression over the backend's default transport, every
            attached tensor's chain this callback alone (or empty), no other after-backward
            callback, and what the backend asks (PyTorch: leaves, dense, no
            post-accumulate-grad hook). Same results, DDP's cost; it holds the planned tensors
            while bound. None: on unless the environment sets ``GRADMGR_NATIVE_REDUCER=0``.
    """

    def __init__(
        self,
        reduce: str = "mean",
        group: Any = None,
        bucket_bytes: int = 25 * 2**20,
        compression: Optional[str] = None,
        transport: TransportSpec = None,
        *,
        broadcast: bool = True,
        src: int = 0,
        verify: Union[bool, str] = True,
        native: Optional[bool] = None,
    ) -> None:
        if reduce not in _REDUCE:
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        if compression not in _COMPRESSION:
            raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if not isinstance(verify, (bool, str)) or verify not in _VERIFY:
            raise ValueError(f"verify must be True, 'step', 'plan' or False, got {verify!r}")
        check_transport(transport)
        self.reduce = reduce
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.compression = compression
        self.broadcast = broadcast
        self.src = src
        self.verify: Optional[str] = _VERIFY[verify]
        self.native = (os.environ.get("GRADMGR_NATIVE_REDUCER", "1") != "0"
                       if native is None else native)
        self._transport_spec = transport
        self._sync = True
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.RLock()  # CUDA backwards call from engine worker threads

    # ------------------------------------------------------------------ public
    def __call__(self, tensor: Any, grad: Any) -> Any:
        gm = get_backwarding_grad_manager()
        if gm is None:
            raise RuntimeError(
                "an allreduce callback must be called by a GradManager during backward "
                "(attach it: gm.attach(params, callbacks=[cb]))"
            )
        with self._lock:
            state = self._states.get(gm)
            if state is None:
                self.bind(gm)
                state = self._states[gm]
            step = state.steps.get(gm.step)
            if step is None:
                step = self._prepare(gm, state, at_record=False)
            if step.check is not None or step.mismatch is not None:
                self._settle(state, step)
            where = step.plan.where.get(id(tensor))
            if where is None:
                raise RuntimeError(
                    "allreduce callback: got a gradient for a tensor that was not planned when "
                    "this recording started: the callback plans its buckets then, alike on "
                    "every rank, so attach and unfreeze tensors between recordings, not during "
                    "one. An intermediate (an activation attached while recording) cannot be "
                    "reduced by it: reduce it with a callback of your own"
                )
            if state.ops.is_sparse(grad):
                raise SparseGradientError(sparse_message(state.ops.shape(tensor)))
            if not step.sync:
                state.used.add(id(tensor))  # for the next synced step (see Step.launch_missing)
                return grad
            return step.put(state.wire, tensor, grad, *where)

    def bind(self, gm: Any) -> None:
        """Register this callback's record and after-backward work with ``gm``; attaching
        does it (again calls are no-ops)."""
        with self._lock:
            if gm in self._states:
                return
            if gm.backend is None:
                raise RuntimeError("allreduce callback: bind a manager once it has tensors")
            state = self._states[gm] = _ManagerState(gm.backend, gm.backend.tensor_ops())
            hooks = _Hooks(self, gm)
            state.flush = hooks.flush
            gm.register_record_callback(hooks.record)
            gm.register_after_backward_callback(hooks.flush)
            gm.register_backward_error_callback(hooks.abort)
            if self.native:
                gm.set_backward_delegate(hooks.delegate)

    __gradmgr_bind__ = bind

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Recordings that start inside only accumulate gradients locally (no communication),
        for every manager this callback serves; :func:`gradmgr.distributed.no_sync` does it for
        one manager without a handle on the callback. Read when a recording starts.

        Example:
            >>> # with cb.no_sync():
            >>> #     with gm: gm.backward(loss(micro_batch_1))
            >>> # with gm: gm.backward(loss(micro_batch_2))   # reduces both micro-batches
        """
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def buckets(self, gm: Any) -> List[Any]:
        """The current bucket plan for ``gm`` (for inspection), or [] before the first step.
        On the reducer's path, torch's reducer re-forms the buckets in the order gradients
        became ready after the first synced step, as DDP does; this stays the plan."""
        state = self._states.get(gm)
        return list(state.plan.buckets) if state is not None and state.plan is not None else []

    def path(self, gm: Any) -> Optional[str]:
        """How ``gm``'s plain backwards are reduced now: ``"reducer"`` (the framework's own,
        see ``native``), ``"buckets"`` (gradmgr's), or None before the first recording."""
        state = self._states.get(gm)
        if state is None or state.plan is None:
            return None
        return "reducer" if state.native else "buckets"

    def transport_of(self, gm: Any) -> Optional[Transport]:
        """The transport reducing ``gm``'s gradients, or None before the first recording."""
        state = self._states.get(gm)
        return None if state is None else state.transport

    # ------------------------------------------------------------------ a step begins
    def _prepare(self, gm: Any, state: _ManagerState, at_record: bool) -> Step:
        """Plan (again) if the trainable attached tensors changed, then start this step; a
        synced step (and the first) launches the comparison of the ranks' plans."""
        fingerprint = state.fingerprint
        first = not state.started
        self._replan_if_needed(gm, state)
        sync = self._sync and not is_paused(gm)
        steps = state.steps
        if len(steps) >= _MAX_OPEN_STEPS:  # recordings released without a backward
            del steps[min(steps)]
        plan = state.plan
        step = steps[gm.step] = Step(plan, sync)
        # A tensor to put the check on (its device): planned, else attached but frozen.
        like = plan.tensor(0) if plan.buckets else next(iter(state.excluded), None)
        request = state.native and state.reducer is None
        if self.verify == "step":
            # Every synced step, not only where this rank re-planned: a rank that alone
            # attached, froze or unfroze a tensor would otherwise take a collective that the
            # others do not (and meet their gradient buckets). Read before this step launches
            # anything else (see _settle), so it overlaps the forward.
            wanted = sync or first
        else:  # "plan": only where this rank re-planned, trusting all ranks to do so alike
            wanted = self.verify == "plan" and (
                first or request or state.fingerprint is not fingerprint)
        if wanted and like is not None and state.transport.world_size() > 1:
            step.check = PlanCheck(state.transport, state.ops, state.fingerprint, like,
                                   request=request)
            if first or not at_record:
                try:
                    self._settle(state, step)
                except RankMismatchError:
                    if at_record:  # the recording ends; no backward will come for this step
                        del steps[gm.step]
                    raise
        if first and at_record:
            if self.broadcast and plan.buckets:
                broadcast(plan.tensors(), self.src, transport=state.transport)
            state.started = True
        return step

    def _replan_if_needed(self, gm: Any, state: _ManagerState) -> None:
        plan = state.plan
        if (plan is None or state.epoch != gm.attach_epoch
                or not state.ops.all_trainable(self._planned(state))
                or state.ops.any_trainable(state.excluded)):
            self._plan(gm, state)
        reducer = state.reducer
        if state.native and reducer is not None:
            if not self._native_still_possible(gm, state, reducer.tensors):
                self._set_native(state, False)
            elif reducer.broken:
                # A backward raised midway, or building the reducer raised (a broken process
                # group): build it again, so that this step raises the transport's error again.
                self._set_native(state, True)

    @staticmethod
    def _planned(state: _ManagerState) -> List[Any]:
        # The reducer holds the planned tensors: no weak references to follow.
        return state.plan.tensors() if state.reducer is None else state.reducer.tensors

    def _settle(self, state: _ManagerState, step: Step) -> None:
        """Read the step's comparison of plans, once; where they differ, every rank raises
        (now and whenever this step is touched again) and launches nothing for it."""
        check = step.check
        if check is not None:
            step.check = None
            if not check.agreed():
                step.mismatch = check.error(step.plan.tensors(), self._mode(state.native),
                                            "with the allreduce callback, trainable")
            elif check.requested and state.native and step.sync:
                # A rank needs a new reducer: all build one, at a step every rank settles (a
                # no_sync step with no gradient on some rank might never settle its check).
                self._build_reducer(state)
        if step.mismatch is not None:
            raise step.mismatch

    def _plan(self, gm: Any, state: _ManagerState) -> None:
        ops = state.ops
        attached = gm.attached_tensors(with_callback=self)
        tensors = [t for t in attached if ops.trainable(t)]
        if state.transport is None:
            state.transport = resolve_transport(self._transport_spec, state.backend, self.group)
            state.wire = Wire(ops, state.transport, self.reduce == "mean", self.compression)
            state.native_path = ops.native_path(state.transport) if self.native else None
        native = self._native_possible(gm, state, tensors)
        new_plan = state.plan is None or not state.plan.matches(tensors)
        if new_plan:
            first_bytes = min(self.bucket_bytes, _FIRST_BUCKET_BYTES)
            state.plan = BucketPlan(tensors, ops, self.bucket_bytes, first_bytes)
            state.used &= {id(t) for t in tensors}
        if new_plan or native != state.native:
            self._set_native(state, native)  # drops the old plan's reducer
        state.excluded = [t for t in attached if not ops.trainable(t)]
        state.epoch = gm.attach_epoch

    def _mode(self, native: bool) -> str:
        """How this rank reduces, compared across ranks with the planned tensors: ranks that
        differ here would sum mismatched buffers (gradients silently wrong, or a crash in
        the transport when the sizes differ)."""
        path = "the framework's own reducer" if native else "gradmgr's buckets"
        return (f"{path}, reduce={self.reduce!r}, compression={self.compression!r}, "
                f"bucket_bytes={self.bucket_bytes}")

    # ------------------------------------------------------------------ the reducer's path
    def _native_possible(self, gm: Any, state: _ManagerState, tensors: List[Any]) -> bool:
        """Whether plain backwards can go to the backend's own reducer, which reduces exactly
        what the buckets would: ``"mean"`` without compression, nothing else needing the
        per-tensor callbacks (every attached tensor's chain this callback alone, or empty; no
        other after-backward callback), and what the backend's path asks of the tensors."""
        path = state.native_path
        if not (path is not None and tensors and self.reduce == "mean"
                and self.compression is None):
            return False
        chains = gm.callback_chains()
        if any(callbacks and callbacks != (self,) for _, callbacks in chains):
            return False
        return (gm.after_backward_callbacks == (state.flush,)
                and path.accepts([t for t, _ in chains], tensors))

    def _native_still_possible(self, gm: Any, state: _ManagerState, tensors: List[Any]) -> bool:
        """What can change between recordings without a new plan: the manager's after-backward
        callbacks, and what the backend's path checks at every recording."""
        return (gm.after_backward_callbacks == (state.flush,)
                and state.native_path.still_accepts(tensors))

    def _set_native(self, state: _ManagerState, native: bool) -> None:
        """Choose the path; a reducer for it is built at the next synced step (see
        :meth:`_build_reducer`)."""
        _drop_reducer(state)
        state.native = native
        state.fingerprint = plan_fingerprint(state.ops, state.plan.tensors(), self._mode(native))

    def _build_reducer(self, state: _ManagerState) -> None:
        """Building one broadcasts, so all ranks do it at the same synced step: when any rank
        asks in the step's plan check, or, with no check, where this rank needs one."""
        _drop_reducer(state)
        state.reducer = state.native_path.build(state.plan, self.bucket_bytes,
                                                min(self.bucket_bytes, _FIRST_BUCKET_BYTES))

    def _native_step(self, gm: Any) -> Optional[_NativeStep]:
        """The backward delegate: this step goes to the reducer when the plan says so and
        nothing was attached since the recording started."""
        with self._lock:
            state = self._states.get(gm)
            if state is None or not state.native or state.epoch != gm.attach_epoch:
                return None
            step = state.steps.get(gm.step)
            if step is None:
                return None
            if step.sync:
                self._settle(state, step)  # where it raises, _abort drops the step
                if state.reducer is None:  # no plan check to agree on building it
                    self._build_reducer(state)
            elif state.reducer is None:
                return None  # not built yet: the per-tensor path accumulates locally
            del state.steps[gm.step]
            try:
                state.reducer.begin(step.sync)
            except BaseException:
                state.reducer.abort()
                raise
            return _NativeStep(state, step.sync)

    # ------------------------------------------------------------------ a step ends
    def _abort(self, gm: Any) -> None:
        """``gm``'s backward raised: this rank still takes part in the step's collectives,
        with the failure marker set (see :meth:`Step.launch_failed`)."""
        with self._lock:
            state = self._states.get(gm)
            step = state.steps.pop(gm.step, None) if state is not None else None
            if step is None or not step.sync or step.mismatch is not None:
                return  # nothing launched, or the ranks' plans differ: launch nothing
            self._settle(state, step)
            step.launch_failed(state.wire)
        step.drain()

    def _flush(self, gm: Any) -> None:
        with self._lock:
            state = self._states.get(gm)
            if state is None:
                return
            step = state.steps.pop(gm.step, None)
            if step is None:
                step = self._prepare(gm, state, at_record=False)
                del state.steps[gm.step]
            if not step.sync:
                return
            self._settle(state, step)
            if state.reducer is not None:  # earlier steps went to the reducer
                state.used.update(state.reducer.used_since_window())
            missing = step.launch_missing(state.wire, state.used)
            state.used.clear()
        for tensor, b, slot in missing:
            gm.add_gradient(tensor, PendingGradient(step.launched, b, slot, True))


class _Hooks:
    """The callback's work registered with one manager; holds both weakly (the manager holds
    these functions)."""

    __slots__ = ("_cb", "_gm")

    def __init__(self, cb: AllreduceCallback, gm: Any) -> None:
        self._cb, self._gm = weakref.ref(cb), weakref.ref(gm)

    def _both(self) -> tuple:
        return self._cb(), self._gm()

    def record(self) -> None:
        cb, gm = self._both()
        if cb is not None and gm is not None:
            with cb._lock:
                cb._prepare(gm, cb._states[gm], at_record=True)

    def flush(self) -> None:
        cb, gm = self._both()
        if cb is not None and gm is not None:
            cb._flush(gm)

    def abort(self) -> None:
        cb, gm = self._both()
        if cb is not None and gm is not None:
            cb._abort(gm)

    def delegate(self) -> Any:
        cb, gm = self._both()
        return None if cb is None or gm is None else cb._native_step(gm)


def _drop_reducer(state: _ManagerState) -> None:
    if state.reducer is not None:  # a no_sync window may be open: keep what it saw used
        state.used.update(state.reducer.used_since_window())
    state.reducer = None  # its hooks go with it


class _NativeStep:
    """A backward handed to the reducer (see GradManager.set_backward_delegate)."""

    __slots__ = ("_state", "_sync")

    def __init__(self, state: _ManagerState, sync: bool) -> None:
        self._state, self._sync = state, sync

    def finish(self) -> None:
        state = self._state
        state.reducer.finish(self._sync, state.used)
        if self._sync:
            state.used.clear()

    def abort(self) -> None:
        self._state.reducer.abort()


def make_allreduce_cb(
    reduce: str = "mean",
    group: Any = None,
    bucket_bytes: int = 25 * 2**20,
    compression: Optional[str] = None,
    transport: TransportSpec = None,
    **options: Any,
) -> AllreduceCallback:
    """A data-parallel allreduce callback; see :class:`AllreduceCallback` (``options``:
    ``broadcast``, ``src``, ``verify``, ``native``).

    Example:
        >>> cb = make_allreduce_cb("mean", bucket_bytes=4 * 2**20)
        >>> cb.reduce, cb.bucket_bytes
        ('mean', 4194304)
    """
    return AllreduceCallback(reduce, group, bucket_bytes, compression, transport, **options)


__all__: List[str] = ["AllreduceCallback", "make_allreduce_cb"]
