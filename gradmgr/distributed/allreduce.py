"""The data-parallel allreduce callback: bucketed, launched during backward, overlapping it."""

from __future__ import annotations

import contextlib
import operator
import os
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Union

from .._state import get_backwarding_grad_manager
from ..future import Future
from .bucket import Bucket, BucketPlan
from .consistency import (
    PlanCheck,
    RankFailedError,
    RankMismatchError,
    SparseGradientError,
    plan_fingerprint,
    sparse_message,
)
from .ops import TensorOps, ops_for
from .sync import broadcast, is_paused
from .transport import (
    Handle,
    TorchTransport,
    Transport,
    TransportSpec,
    check_transport,
    resolve_transport,
)

_REDUCE = ("mean", "sum")
_VERIFY = {True: "step", "step": "step", "plan": "plan", False: None}
_COMPRESSION = (None, "fp16", "bf16")
_FIRST_BUCKET_BYTES = 2**20  # as DDP: start communicating early, then use bigger buckets
_MAX_OPEN_STEPS = 1024  # steps begun but not flushed (split backwards pending, or no backward)


class _Reduction:
    """One launched bucket; unpacks the reduced buffer on first use."""

    __slots__ = ("_ops", "_handle", "_bucket", "_compressed", "_last", "_parts", "_flags",
                 "_lock")

    def __init__(self, ops: TensorOps, handle: Handle, bucket: Bucket, compressed: bool,
                 last: bool) -> None:
        self._ops, self._handle, self._bucket = ops, handle, bucket
        self._compressed = compressed
        self._last = last  # the step's last bucket: it tells whether a rank failed
        self._parts: Optional[List[Any]] = None
        self._flags: Any = None
        self._lock = threading.Lock()

    def _unpack(self) -> None:
        with self._lock:
            if self._parts is None:
                flat = self._handle.wait()
                if self._compressed:
                    flat = self._ops.cast(flat, self._bucket.key[0])
                parts, flags = self._ops.unpack(flat, self._bucket)
                if self._last and self._ops.failed_somewhere(flags):
                    raise RankFailedError(_RANK_FAILED)
                self._parts, self._flags = parts, flags

    def drain(self) -> None:
        """Wait for the collective, for a rank whose backward failed: its error, not the
        transport's, is the one to report."""
        with contextlib.suppress(Exception):  # the backward's own error propagates
            self._handle.wait()

    def result(self, slot: int) -> Any:
        if self._parts is None:
            self._unpack()
        return self._parts[slot]

    def used_anywhere(self, slot: int) -> bool:
        if self._parts is None:
            self._unpack()
        return self._ops.flag(self._flags, slot) != 0


class _Step:
    """What one synced backward of one manager has gathered so far."""

    __slots__ = ("record_id", "plan", "sync", "buffers", "filled", "count", "launched",
                 "next_launch", "check", "mismatch")

    def __init__(self, record_id: int, plan: BucketPlan, sync: bool) -> None:
        self.record_id = record_id
        self.plan = plan
        self.sync = sync
        self.buffers: List[Any] = [None] * len(plan.buckets)  # see TensorOps.new_buffer
        self.filled: List[List[bool]] = [[False] * len(b.members) for b in plan.buckets]
        self.count = [0] * len(plan.buckets)
        self.launched: List[Optional[_Reduction]] = [None] * len(plan.buckets)
        self.next_launch = 0
        self.check: Optional[PlanCheck] = None  # the ranks' plans compared, not yet read
        self.mismatch: Optional[BaseException] = None  # they differed: launch nothing


class _ManagerState:
    __slots__ = ("plan", "excluded", "epoch", "ops", "transport", "steps", "used", "native",
                 "reducer", "fingerprint", "started")

    def __init__(self, ops: TensorOps) -> None:
        self.plan: Optional[BucketPlan] = None
        self.excluded: List[Any] = []  # attached with this callback but frozen at planning
        self.epoch = -1  # the manager's attach_epoch the plan was made for
        self.ops = ops
        self.transport: Optional[Transport] = None
        # Steps by recording: a split backward finishes its step after the next recording
        # has started its own (GradManager.backward_split).
        self.steps: Dict[int, _Step] = {}
        self.used: Set[int] = set()  # ids with a local gradient since the last synced step
        # Whether plain backwards go to torch's C++ reducer (see _native_possible), and it.
        self.native = False
        self.reducer: Any = None
        self.fingerprint: List[int] = []  # of plan and path, for PlanCheck (see _set_native)
        self.started = False  # the first recording's check and broadcast are done


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
    ``gm.backward`` skips all of that and torch's C++ reducer does the same work (see
    :mod:`gradmgr.distributed.reducer`).

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
        transport: None (pick from the tensors' framework: torch.distributed; for MegEngine its
            own collectives when initialised, else torch.distributed through numpy), a name
            (``"torch"``, ``"megengine"``, ``"megengine-via-torch"``) or any object with
            ``world_size()`` and ``allreduce_async(flat) -> handle`` (``handle.wait()`` returns
            the summed buffer).
        broadcast: broadcast the planned tensors from ``src`` at the first recording.
        src: the rank whose values the broadcast spreads.
        verify: compare the ranks' plans: ``True`` or ``"step"``, at every synced step (one
            small collective each, overlapping the forward; catches a change made on one
            rank alone); ``"plan"``, only at steps where this rank re-planned (no per-step
            cost, but a rank that alone attaches, freezes or unfreezes a tensor then takes a
            collective the others do not: gloo aborts, or gradients are wrong); ``False``:
            never.
        native: let plain backwards go to torch's C++ ``Reducer`` (DDP's) where nothing else
            needs the per-tensor callbacks: PyTorch tensors, ``"mean"`` without compression
            over the default transport, every attached tensor a leaf whose chain is this
            callback alone (or empty), no other after-backward callback. Same results, DDP's
            cost; it holds the planned tensors while bound. None: on unless the environment
            sets ``GRADMGR_NATIVE_REDUCER=0``.
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
            if getattr(grad, "is_sparse", False):
                raise SparseGradientError(sparse_message(tensor.shape))
            if not step.sync:
                state.used.add(id(tensor))  # for the next synced step (see _fill_missing)
                return grad
            b, slot = where
            if step.filled[b][slot]:
                raise RuntimeError(
                    "allreduce callback called twice for one tensor in one backward: attach "
                    "each tensor with a given allreduce callback only once"
                )
            step.filled[b][slot] = True
            buffer = step.buffers[b]
            if buffer is None:
                buffer = step.buffers[b] = state.ops.new_buffer(step.plan.buckets[b], tensor)
            buffer.put(slot, grad, state.ops.local_grad(tensor))
            step.count[b] += 1
            if step.count[b] == len(step.plan.buckets[b].members):
                self._launch_ready(state, step)
            return _Pending(step.launched, b, slot, False)

    def bind(self, gm: Any) -> None:
        """Register this callback's record and after-backward work with ``gm``; attaching
        does it (again calls are no-ops)."""
        with self._lock:
            if gm in self._states:
                return
            if gm.backend is None:
                raise RuntimeError("allreduce callback: bind a manager once it has tensors")
            self._states[gm] = _ManagerState(ops_for(gm.backend.name))
            gm_ref, me = weakref.ref(gm), weakref.ref(self)

            def on_record() -> None:
                cb, manager = me(), gm_ref()
                if cb is not None and manager is not None:
                    with cb._lock:
                        cb._prepare(manager, cb._states[manager], at_record=True)

            def flush() -> None:
                cb, manager = me(), gm_ref()
                if cb is not None and manager is not None:
                    cb._flush(manager)

            def abort() -> None:
                cb, manager = me(), gm_ref()
                if cb is not None and manager is not None:
                    cb._abort(manager)

            def delegate() -> Any:
                cb, manager = me(), gm_ref()
                if cb is None or manager is None:
                    return None
                return cb._native_step(manager)

            gm.register_record_callback(on_record)
            gm.register_after_backward_callback(flush)
            gm.register_backward_error_callback(abort)
            if self.native:
                gm.set_backward_delegate(delegate)

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

    # ------------------------------------------------------------------ internals
    def _prepare(self, gm: Any, state: _ManagerState, at_record: bool) -> _Step:
        """Plan (again) if the trainable attached tensors changed, then start this step; a
        synced step (and the first) launches the comparison of the ranks' plans."""
        plan, fingerprint = state.plan, state.fingerprint
        first = not state.started
        if plan is None or state.epoch != gm.attach_epoch or not _still_planned(state, plan):
            self._plan(gm, state)
        reducer = state.reducer
        if state.native and reducer is not None and not _native_still_possible(gm,
                                                                               reducer.tensors):
            self._set_native(state, False)
        elif state.native and reducer is not None and reducer.broken:
            # A backward raised midway, or building the reducer raised (a broken process
            # group): build it again, so that this step raises the transport's error again.
            self._set_native(state, True)
        sync = self._sync and not is_paused(gm)
        steps = state.steps
        if len(steps) >= _MAX_OPEN_STEPS:  # recordings released without a backward
            del steps[min(steps)]
        step = steps[gm.step] = _Step(gm.step, state.plan, sync)
        plan = state.plan
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

    def _settle(self, state: _ManagerState, step: _Step) -> None:
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
            state.transport = resolve_transport(self._transport_spec, ops.name, self.group)
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
        path = "torch's C++ Reducer" if native else "gradmgr's buckets"
        return (f"{path}, reduce={self.reduce!r}, compression={self.compression!r}, "
                f"bucket_bytes={self.bucket_bytes}")

    def _native_possible(self, gm: Any, state: _ManagerState, tensors: List[Any]) -> bool:
        """Whether plain backwards can go to torch's C++ reducer (DDP's), which reduces exactly
        what the Python buckets would, at DDP's cost: PyTorch's own transport, ``"mean"``
        without compression, and nothing else needing the per-tensor callbacks (every attached
        tensor a leaf whose chain is this callback alone, or empty; no other after-backward
        callback, checked at each recording)."""
        if not (self.native and tensors and state.ops.name == "torch" and self.reduce == "mean"
                and self.compression is None and type(state.transport) is TorchTransport):
            return False
        from .reducer import available  # imports torch: only for torch tensors

        if not available():
            return False
        for tensor, callbacks in gm.callback_chains():
            if not tensor.is_leaf or (callbacks and callbacks != (self,)):
                return False
        return _native_still_possible(gm, tensors) and all(
            t.requires_grad and str(t.layout) == "torch.strided" for t in tensors)

    def _set_native(self, state: _ManagerState, native: bool) -> None:
        """Choose the path; a reducer for it is built at the next synced step (see
        :meth:`_build_reducer`)."""
        _drop_reducer(state)
        state.native = native
        state.fingerprint = plan_fingerprint(state.ops, state.plan.tensors(), self._mode(native))

    def _build_reducer(self, state: _ManagerState) -> None:
        """Building one broadcasts, so all ranks do it at the same synced step: when any rank
        asks in the step's plan check, or, with no check, where this rank needs one."""
        from .reducer import TorchReducer  # imports torch: only for torch tensors

        _drop_reducer(state)
        state.reducer = TorchReducer(state.plan, self.group, self.bucket_bytes,
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

    def _launch_ready(self, state: _ManagerState, step: _Step) -> None:
        buckets = step.plan.buckets
        while step.next_launch < len(buckets):
            b = step.next_launch
            if step.count[b] < len(buckets[b].members):
                return
            self._launch(state, step, b, ())

    def _launch(self, state: _ManagerState, step: _Step, b: int, unused: Sequence[int],
                failed: bool = False) -> None:
        ops, bucket = state.ops, step.plan.buckets[b]
        buffer = step.buffers[b]
        if buffer is None:
            buffer = ops.new_buffer(bucket, step.plan.tensor(bucket.members[0]))
        flat = buffer.finish(unused, failed)
        step.buffers[b] = None
        if self.reduce == "mean":
            flat = ops.scale(flat, 1.0 / state.transport.world_size())
        if self.compression is not None:
            flat = ops.compress(flat, self.compression)
        handle = state.transport.allreduce_async(flat)
        step.launched[b] = _Reduction(ops, handle, bucket, self.compression is not None,
                                      b == len(step.plan.buckets) - 1)
        step.next_launch = b + 1

    def _abort(self, gm: Any) -> None:
        """``gm``'s backward raised: launch this step's remaining buckets with the failure
        marker set, so the other ranks' reductions of the step complete (instead of pairing
        with this rank's next step) and they raise :class:`RankFailedError` rather than use
        incomplete sums; then wait for all of them."""
        with self._lock:
            state = self._states.get(gm)
            step = state.steps.pop(gm.step, None) if state is not None else None
            if step is None or not step.sync or step.mismatch is not None:
                return  # nothing launched, or the ranks' plans differ: launch nothing
            self._settle(state, step)
            for b in range(step.next_launch, len(step.plan.buckets)):
                self._launch(state, step, b, (), failed=True)
        for reduction in step.launched:
            if reduction is not None:
                reduction.drain()

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
            missing = self._fill_missing(state, step)
            state.used.clear()
        for tensor, b, slot in missing:
            gm.add_gradient(tensor, _Pending(step.launched, b, slot, True))

    def _fill_missing(self, state: _ManagerState, step: _Step) -> List[tuple]:
        """Members with no gradient this step on this rank contribute what their ``.grad``
        holds (or zeros), flagged unused unless they had a gradient since the last sync; then
        every bucket not yet launched goes out."""
        missing = []
        tensors = step.plan.tensors()
        for b in range(step.next_launch, len(step.plan.buckets)):
            bucket = step.plan.buckets[b]
            unused = []
            for slot, position in enumerate(bucket.members):
                if step.filled[b][slot]:
                    continue
                tensor = tensors[position]
                if tensor is None:
                    raise RuntimeError("an attached tensor died during its allreduce step")
                buffer = step.buffers[b]
                if buffer is None:
                    buffer = step.buffers[b] = state.ops.new_buffer(bucket, tensor)
                buffer.put(slot, None, state.ops.local_grad(tensor))
                if id(tensor) not in state.used:
                    unused.append(slot)
                missing.append((tensor, b, slot))
            self._launch(state, step, b, unused)
        return missing


def _drop_reducer(state: _ManagerState) -> None:
    if state.reducer is not None:  # a no_sync window may be open: keep what it saw used
        state.used.update(state.reducer.used_since_window())
    state.reducer = None  # its hooks go with it


def _native_still_possible(gm: Any, tensors: List[Any]) -> bool:
    """What can change between recordings without a new plan: the manager's one after-backward
    callback is the flush an allreduce callback registered (bind() registers exactly one per
    manager), and no planned tensor has a post-accumulate-grad hook (the reducer would run
    after it, so it would see the local gradient instead of the reduced one)."""
    return len(gm._after_backward_callbacks) == 1 and not any(map(_POST_HOOKS, tensors))


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


def _still_planned(state: _ManagerState, plan: BucketPlan) -> bool:
    """The planned tensors are alive and trainable, the frozen ones still frozen."""
    ops = state.ops
    if ops.name != "torch":
        return True  # only PyTorch tensors can be frozen
    # The reducer holds the planned tensors: no weak references to follow.
    tensors = plan.tensors() if state.reducer is None else state.reducer.tensors
    try:
        if not all(map(_REQUIRES_GRAD, tensors)):
            return False
    except AttributeError:  # None: a planned tensor died
        return False
    return not any(t.requires_grad for t in state.excluded)


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_POST_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


_RANK_FAILED = (
    "another rank's backward raised during this data-parallel step (its own error says why), "
    "so the step's reduced gradients are incomplete; no rank uses them, and .grad keeps what "
    "it held before the step. Skip the step on every rank (catch this error where that rank "
    "catches its own), or stop all ranks"
)


class _Pending(Future):
    """The reduced gradient of one bucket member: the tensor's complete new ``.grad``
    (``replaces_grad``), or None for a tensor that no rank used since the last sync."""

    __slots__ = ("_launched", "_bucket", "_slot", "_maybe_unused")

    replaces_grad = True

    def __init__(self, launched: List[Optional[_Reduction]], bucket: int, slot: int,
                 maybe_unused: bool) -> None:
        self._launched, self._bucket, self._slot = launched, bucket, slot
        self._maybe_unused = maybe_unused

    def get(self, timeout: Optional[float] = None) -> Any:
        reduction = self._launched[self._bucket]  # filled in place when the bucket launches
        if reduction is None:
            raise RuntimeError(
                "allreduce bucket never launched: the manager's after-backward flush did not run"
            )
        if self._maybe_unused and not reduction.used_anywhere(self._slot):
            return None
        return reduction.result(self._slot)

    def done(self) -> bool:
        return self._launched[self._bucket] is not None

    def set(self, value: Any) -> None:
        raise TypeError("an allreduce result is set by its collective, not by set()")


def make_allreduce_cb(
    reduce: str = "mean",
    group: Any = None,
    bucket_bytes: int = 25 * 2**20,
    compression: Optional[str] = None,
    transport: TransportSpec = None,
    **options: Any,
) -> AllreduceCallback:
    """A data-parallel allreduce callback; see :class:`AllreduceCallback` (``options``:
    ``broadcast``, ``src``, ``verify``).

    Example:
        >>> cb = make_allreduce_cb("mean", bucket_bytes=4 * 2**20)
        >>> cb.reduce, cb.bucket_bytes
        ('mean', 4194304)
    """
    return AllreduceCallback(reduce, group, bucket_bytes, compression, transport, **options)


__all__: List[str] = ["AllreduceCallback", "make_allreduce_cb"]
