"""What one allreduce callback does for one manager: a state machine over its steps.

At every recording it plans (again, if the trainable attached tensors changed), compares the
plan across ranks and starts the step; during the backward each gradient goes into its bucket
(:mod:`.steps`), or the backend's own reducer takes the whole backward over (which path a
step takes, and opening a step, are :mod:`.paths`'); after it, the remaining buckets go out.
A backward that raises, or a recording released without a backward (a rank that skips a bad
batch), still takes part in the step's collectives, with the failure marker set, so the ranks
stay paired and the others raise :class:`RankFailedError`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Set, cast

from ...manager import attach_epoch
from ..broadcasting import broadcast
from ..consistency import NameOf, PlanCheck, step_terms
from ..contract import TensorOps, Transport
from ..errors import RankMismatchError, RanksOutOfStepError, sparse_error
from ..reducing import CommHook, PostBackwardPath, Reducer, ReducerPath
from ..sharded.sharding import GradientShards, ShardReduction, ShardWire
from ..transport import control_transport, resolve_transport
from .bucket import BucketPlan
from .no_sync import OVERTAKEN, is_paused
from .paths import (
    check_step,
    choose_path,
    delegable,
    fingerprint,
    open_step,
    own_callbacks,
    reducer_possible,
    step_mode,
    step_path,
    still_delegable,
)
from .steps import HookWire, PendingGradient, Step, Wire

# The name users filter on (docs/data-parallel.md), from before distributed/ had rooms.
_log = logging.getLogger("gradmgr.distributed.synchronizer")

FIRST_BUCKET_BYTES = 2**20  # as DDP: start communicating early, then use bigger buckets
_MAX_OPEN_STEPS = 1024  # steps begun but not flushed (split backwards pending)

_HABIT = (
    "a data-parallel recording ended without gm.backward(), but the attached tensors' .grad "
    "changed during it: loss.backward() (typed by habit?) computes this rank's gradients "
    "only, so the ranks' gradients, and then their parameters, would differ. Call "
    "gm.backward(loss) inside `with gm:` instead; this step's collectives were completed "
    "without reducing anything, and .grad holds this rank's local gradients"
)

class Synchronizer:
    """The allreduce callback's work for one manager (the callback keeps one per manager and
    forwards to it; ``options`` is the callback, read for its settings)."""

    def __init__(self, options: Any, backend: Any, name_of: NameOf = None,
                 shards: Optional[GradientShards] = None) -> None:
        self.options = options
        self.shards = shards  # the sharded path (reduce-scatter): this rank's gradient shards
        self.backend = backend
        self.ops: TensorOps = backend.tensor_ops()
        # A communication hook as the backend runs it (refused there by one that has none).
        self.comm_hook: Optional[CommHook] = (
            None if options.comm_hook is None
            else self.ops.comm_hook(options.comm_hook, options.comm_state))
        self.name_of = name_of
        self.lock = threading.RLock()  # CUDA backwards call from engine worker threads
        self.transport: Optional[Transport] = None
        self.checks: Optional[Transport] = None  # the plan checks' (see check_plan)
        self.wire: Optional[Wire] = None
        self.plan: Optional[BucketPlan] = None
        self.excluded: List[Any] = []  # attached with the callback but frozen at planning
        self.epoch = -1  # the manager's attach_epoch the plan was made for
        # Steps by recording: a split backward finishes its step after the next recording
        # has started its own (GradManager.backward_split).
        self.steps: Dict[int, Step] = {}
        self.used: Set[int] = set()  # ids with a local gradient since the last synced step
        self.reducer_path: Optional[ReducerPath] = None  # the backend's reducer, if any
        # Steps whose backward wants no per-tensor hook (compiled autograd) are reduced after
        # it (see post_backward.py) where the plan allows (post_ok, like reducer_possible).
        self.post_path: Optional[PostBackwardPath] = self.ops.post_backward_path()
        self.post_ok = False
        self.others = False  # a tensor attached with callbacks of its own (paths.own_callbacks)
        # ids of planned tensors frozen inside the open no_sync window: still planned until its
        # synced step reduces what they accumulated there (as DDP with find_unused_parameters)
        self.held: Set[int] = set()
        self.on_reducer = False  # plain backwards go to it (see paths.reducer_possible)
        self.reducer: Optional[Reducer] = None
        self.fingerprint: List[int] = []  # of plan and path, for PlanCheck (paths.choose_path)
        self.bucket_fingerprint: Optional[List[int]] = None  # the same on the buckets
        self.started = False  # the first recording's check and broadcast are done
        self.unsynced = 0  # recordings inside no_sync since the last synced one (PlanCheck)
        self.flush_hook: Any = None  # the after-backward callback registered for the manager
        # Synced steps finished so far: one finishing while another recording is open (a
        # split backward's finish()) writes .grad during that recording.
        self.finished = 0
        # Work for when a synced step still open closes (data_parallel's buffer broadcast
        # after a split backward's finish()), by step
        self.closing: Dict[int, Callable[[], None]] = {}
        self.shadowed = 0  # synced steps taken as a joined rank (uneven inputs: .joining)

    # ------------------------------------------------------------------ a step begins
    def prepare(self, gm: Any, at_record: bool) -> Step:
        """Plan (again) if the trainable attached tensors changed, then start this step; a
        synced step (and the first) launches the comparison of the ranks' plans. A step that
        could not start (no process group, the ranks' plans differ at a recording) is not
        kept: no backward will come for it. (Started by a callback, a refused step stays, so
        that the rest of the backward raises the same error without another collective.)"""
        try:
            return self._start_step(gm, at_record)
        except BaseException as error:
            if at_record or not isinstance(error, RankMismatchError):
                self.steps.pop(gm.step, None)
            raise

    def _start_step(self, gm: Any, at_record: bool) -> Step:
        options = self.options
        planned_for = self.fingerprint  # replaced where this step plans again
        first = not self.started
        sync = options.syncing and not is_paused(gm)
        accumulated = self.unsynced if sync else None
        step = open_step(self, gm, sync, self.unsynced, own=True)
        steps = self.steps
        if not sync:
            step.finish_limit = self.finished + sum(s.sync for s in steps.values())
        if len(steps) >= _MAX_OPEN_STEPS:
            del steps[min(steps)]
        steps[gm.step] = step
        if step.after and self.reducer is not None:
            # Its hooks on the tensors' accumulators would run in the backward (torch's
            # reducer then raises under compiled autograd); the next reducer step builds one.
            self.drop_reducer()
        if sync and at_record:
            step.grads_at_record = self.ops.grad_snapshot(self.planned())
            step.finished_before = self.finished
        if options.verify == "step":
            # Every synced step, not only where this rank re-planned: a rank that alone
            # attached, froze or unfroze a tensor would otherwise take a collective that the
            # others do not (and meet their gradient buckets). Read before this step launches
            # anything else (see settle), so it overlaps the forward.
            wanted = sync or first
        else:  # "plan": only where this rank re-planned, trusting all ranks to do so alike
            wanted = options.verify == "plan" and (
                first or step_path(self, step)[1] or self.fingerprint is not planned_for)
        if wanted:  # (launched here; read at once only where nothing else comes to read it)
            check_step(self, step, accumulated, settle=first or not at_record)
        if first and at_record:
            if options.broadcast and step.plan.buckets:
                broadcast(step.plan.tensors(), options.src, transport=self._transport())
            self.started = True
        return step

    def replan_if_needed(self, gm: Any) -> BucketPlan:
        """The plan for ``gm``'s next recording, made again where it is outdated."""
        if self.plan is None or self._plan_outdated(gm):
            self._plan(gm)
        reducer = self.reducer
        if self.on_reducer and reducer is not None:
            if not still_delegable(self, gm, reducer.tensors, self.reducer_path):
                choose_path(self, False)
            elif reducer.broken:
                # A backward raised midway, or building the reducer raised (a broken process
                # group): build it again, so that this step raises the transport's error again.
                choose_path(self, True)
        return self.the_plan()

    def _plan_outdated(self, gm: Any) -> bool:
        """Whether the trainable attached tensors changed since planning: attached, frozen,
        unfrozen, died, or (``model.double()`` after planning) of another dtype now."""
        ops, planned = self.ops, self.planned()
        return (self.epoch != attach_epoch(gm)
                or not (ops.all_trainable(planned) or self._held_until_synced(planned))
                or ops.dtypes(planned) != self.the_plan().dtypes
                or ops.any_trainable(self.excluded))

    def _held_until_synced(self, planned: List[Any]) -> bool:
        """Every frozen planned tensor is held for the open no_sync window (see ``held``)."""
        held = self.held
        return bool(self.unsynced and held) and all(
            id(t) in held or self.ops.trainable(t) for t in planned)

    def plan_holds(self, gm: Any, after: bool) -> bool:
        """Whether this step's plan, and the path it was opened on (``after``: reduced after
        the backward), hold for what is attached now: true where nothing was attached since
        planning, or only what this callback does not reduce (an input or an activation
        attached inside the recording for its own gradient, on one rank alone)."""
        if self.epoch == attach_epoch(gm):
            return True
        ops = self.ops
        tensors = self._trainable(gm.attached_tensors(with_callback=self.options))
        if not self.the_plan().matches(tensors, ops):
            return False
        if after:  # (else the per-tensor path, which reduces alike: ranks may mix them)
            return delegable(self, gm, tensors, self.post_path)
        return reducer_possible(self, gm, tensors) == self.on_reducer

    def plan_now(self, gm: Any) -> BucketPlan:
        """The plan the next recording will use, made now where there is none yet (the sharded
        optimizer lays its segments out on it)."""
        with self.lock:
            return self.replan_if_needed(gm)

    def planned(self) -> List[Any]:
        """The planned tensors (the reducer holds them, in plan order: no weak references to
        follow)."""
        return self.the_plan().tensors() if self.reducer is None else self.reducer.tensors

    def check_plan(self, step: Step, on_reducer: bool, request: bool,
                   accumulated: Optional[int]) -> bool:
        """Launch ``step``'s plan check (see :class:`PlanCheck`) for a step on the reducer
        (``on_reducer``) or the buckets, where there are ranks to compare with and a tensor to
        put it on (its device): planned, else attached but frozen. It runs on the checks'
        own transport (``control()``), where it meets only the other ranks' checks."""
        plan = step.plan
        like = plan.tensor(0) if plan.buckets else next(iter(self.excluded), None)
        if like is None or self._transport().world_size() < 2:
            return False
        step.check = PlanCheck(self.checks, self.ops, fingerprint(self, on_reducer), like,
                               request=request, accumulated=accumulated)
        return True

    def settle(self, step: Step) -> None:
        """Read the step's comparison of plans, once; where they differ, every rank raises
        (now and whenever this step is touched again) and launches nothing for it."""
        check = step.check
        if check is not None:
            step.check = None
            try:
                agreed = check.agreed()
            except RanksOutOfStepError as error:  # launch nothing more for this step
                step.mismatch = error
                raise
            if not agreed:
                self.unsynced = 0  # every rank starts counting afresh (see PlanCheck)
                step.mismatch = check.error(step.plan.tensors(), step_mode(self, step),
                                            "with the allreduce callback, trainable",
                                            self.name_of)
            elif check.requested and self.on_reducer and step.sync:
                # A rank needs a new reducer: all build one, at a step every rank settles (a
                # no_sync step with no gradient on some rank might never settle its check).
                self.build_reducer()
        if step.mismatch is not None:
            raise step.mismatch

    def _plan(self, gm: Any) -> None:
        options, ops = self.options, self.ops
        if not self.unsynced:
            self.held = set()
        elif self.plan is not None:  # frozen inside the window: held until it is reduced
            self.held |= {id(t) for t in self.planned() if t is not None and not ops.trainable(t)}
        attached = gm.attached_tensors(with_callback=options)
        tensors = self._trainable(attached)
        if self.transport is None:
            self.transport = resolve_transport(options.transport_spec, self.backend,
                                               options.group)
            # The remedy for ranks out of step names Join only to a manager Join takes.
            joinable = hasattr(type(gm), "join_hook")
            self.checks = control_transport(self.transport, step_terms(ops, joinable))
            if self.comm_hook is not None:
                self.wire = HookWire(ops, self.transport, self.comm_hook)
            else:
                kind = Wire if self.shards is None else ShardWire
                self.wire = kind(ops, self.transport, options.reduce == "mean",
                                 options.compression)
            wants_reducer = options.native and self.shards is None
            self.reducer_path = ops.reducer_path(self.transport) if wants_reducer else None
        on_reducer = reducer_possible(self, gm, tensors)
        self.post_ok = delegable(self, gm, tensors, self.post_path)
        self.others = own_callbacks(self, gm)
        new_plan = self.plan is None or not self.plan.matches(tensors, ops)
        if new_plan:
            first_bytes = min(options.bucket_bytes, FIRST_BUCKET_BYTES)
            self.plan = BucketPlan(tensors, ops, options.bucket_bytes, first_bytes)
            _log.info("bucket plan: %d trainable tensors in %d buckets of %s bytes (the first "
                      "bucket up to %d, the others %d)", len(tensors), len(self.plan.buckets),
                      [b.nbytes for b in self.plan.buckets], first_bytes, options.bucket_bytes)
            self.used &= {id(t) for t in tensors}
            if self.shards is not None:
                self.shards.planned(self.plan)
        if new_plan or on_reducer != self.on_reducer:
            choose_path(self, on_reducer)  # drops the old plan's reducer
        self.excluded = [t for t in attached if not ops.trainable(t)]
        self.epoch = attach_epoch(gm)

    def _trainable(self, attached: List[Any]) -> List[Any]:
        """What a plan holds of the tensors attached with this callback, in attach order: the
        trainable ones, and those held for the open no_sync window."""
        held, trainable = self.held, self.ops.trainable
        return [t for t in attached if trainable(t) or id(t) in held]

    # What the first recording sets up (see _plan), for the steps after it
    def the_plan(self) -> BucketPlan:
        if self.plan is None:
            _unprepared("a bucket plan")
        return self.plan

    def _transport(self) -> Transport:
        if self.transport is None:
            _unprepared("a transport")
        return self.transport

    def _wire(self) -> Wire:
        if self.wire is None:
            _unprepared("a wire")
        return self.wire

    def the_reducer(self) -> Reducer:
        if self.reducer is None:
            _unprepared("the backend's reducer")
        return self.reducer

    # ------------------------------------------------------------------ the reducer's path
    def build_reducer(self) -> None:
        """Building one broadcasts, so all ranks do it at the same synced step: when any rank
        asks in the step's plan check, or, with no check, where this rank needs one."""
        self.drop_reducer()
        bucket_bytes = self.options.bucket_bytes
        if self.reducer_path is None:
            _unprepared("the backend's reducer path")
        self.reducer = self.reducer_path.build(self.the_plan(), bucket_bytes,
                                              min(bucket_bytes, FIRST_BUCKET_BYTES),
                                              self.comm_hook)

    def drop_reducer(self) -> None:
        if self.reducer is not None:  # a no_sync window may be open: keep what it saw used
            self.used.update(self.reducer.used_since_window())
        self.reducer = None  # its hooks go with it

    def reducer_for(self, step: Step) -> Reducer:
        """Settle a synced step bound for the reducer, building the reducer if no plan check
        agreed on it (where it raises, the step is dropped by the caller); the reducer."""
        self.settle(step)
        if self.reducer is None:
            self.build_reducer()
        return self.the_reducer()

    # ------------------------------------------------------------------ during the backward
    def on_gradient(self, gm: Any, tensor: Any, grad: Any) -> Any:
        with self.lock:
            step = self.steps.get(gm.step)
            if step is None:
                step = self.prepare(gm, at_record=False)
            if step.check is not None or step.mismatch is not None:
                self.settle(step)
            where = step.plan.where.get(id(tensor))
            if where is None:
                raise RuntimeError(
                    "allreduce callback: got a gradient for a tensor that was not planned when "
                    "this recording started: the callback plans its buckets then, alike on "
                    "every rank, so attach and unfreeze tensors between recordings, not during "
                    "one. An intermediate (an activation attached while recording) cannot be "
                    "reduced by it: reduce it with a callback of your own"
                )
            if self.ops.is_sparse(grad):
                raise sparse_error(self.ops, tensor)
            if not step.sync:
                self._check_not_overtaken(step)
                self.used.add(id(tensor))  # for the next synced step (see Step.launch_missing)
                return grad
            return step.put(self._wire(), tensor, grad, *where)

    # ------------------------------------------------------------------ a step ends
    def flush(self, gm: Any) -> None:
        """After the backward: the buckets not launched yet go out."""
        with self.lock:
            step = self.steps.pop(gm.step, None)
            if step is None:
                step = self.prepare(gm, at_record=False)
                del self.steps[gm.step]
            if not step.sync:
                self._check_not_overtaken(step)
                return
            missing = self.close(step)
        self._wire().settle(step)
        for tensor, b, slot in missing:
            gm.add_gradient(tensor, PendingGradient(step.launched, b, slot, True))
        then = self.closing.pop(gm.step, None)
        if then is not None:
            then()

    def step_open(self, step: int) -> bool:
        """Whether synced step ``step`` (a recording's ``gm.step``) has not closed yet: a split
        backward's, until its ``finish()``."""
        with self.lock:
            open_step = self.steps.get(step)
            return open_step is not None and open_step.sync

    def when_closed(self, step: int, then: Callable[[], None]) -> None:
        """Call ``then()`` once the open synced step ``step`` has closed (not if it fails)."""
        with self.lock:
            self.closing[step] = then

    def _check_not_overtaken(self, step: Step) -> None:
        """Refuse a no_sync step's gradients after a synced step recorded later has reduced
        (split backwards finished out of order): they would stay on this rank alone."""
        if self.finished > step.finish_limit:
            raise RuntimeError(OVERTAKEN)

    def close(self, step: Step) -> List[tuple]:
        """A synced step's gradients are all in its buckets: the others go out (what
        ``.grad`` holds, flagged unused unless used since the last synced step); returns
        their ``(tensor, bucket, slot)`` (none on the sharded path, whose shards keep the
        step's chunks)."""
        self.settle(step)
        if self.reducer is not None:  # earlier steps went to the reducer
            self.used.update(self.reducer.used_since_window())
        missing = step.launch_missing(self._wire(), self.used)
        if self.shards is not None:
            self.keep_shards(step)
            missing = []  # (their gradients went to the shards too)
        self.used.clear()
        self.finished += 1
        return missing

    def _end_sharded(self, step: Step, failed: bool) -> List[float]:
        """The sharded step's closing collective: every bucket's flags, summed."""
        like = step.plan.tensor(0)
        wire = self.wire
        if not isinstance(wire, ShardWire):
            _unprepared("the sharded path's wire")
        # ShardWire.send launched them: ShardReductions (None: not launched, as a failed step)
        launched = cast(Sequence[Optional[ShardReduction]], step.launched)
        return self.ops.values(wire.end_step(launched, failed, like).wait())

    def keep_shards(self, step: Step) -> None:
        """The step's chunks join the shards (or RankFailedError), and the local gradients
        they summed are freed: ``.grad`` is None after a synced sharded step, or a stand-in
        (see :mod:`..sharded.shard_grads`)."""
        shards = self.shards
        if shards is None:
            _unprepared("the gradient shards")
        # A ShardWire launched every bucket of a step on the sharded path
        launched = cast(Sequence[ShardReduction], step.all_launched())
        shards.accept(launched, self._end_sharded(step, False), False)
        shards.release(self._transport())

    def abort(self, gm: Any) -> None:
        """``gm``'s backward raised: this rank still takes part in the step's collectives,
        with the failure marker set (see :meth:`Step.launch_failed`)."""
        with self.lock:
            self.closing.pop(gm.step, None)
            step = self.steps.pop(gm.step, None)
            if step is None or not step.sync or step.mismatch is not None:
                return  # nothing launched, or the ranks' plans differ: launch nothing
        self.fail(step)

    def fail(self, step: Step) -> None:
        """A synced step's backward raised here: launch the rest of its buckets with the
        failure marker set (see :meth:`Step.launch_failed`)."""
        with self.lock:
            self.settle(step)
            step.launch_failed(self._wire())
            if self.shards is not None:
                self._end_sharded(step, True)
        step.drain()

    def abandon(self, gm: Any) -> None:
        """``gm``'s recording ended without a backward (its forward raised and the loop skips
        the batch; or ``loss.backward()`` was typed instead of ``gm.backward(loss)``): complete
        the step's collectives as a failed one, so the other ranks raise RankFailedError
        instead of pairing this step with the next; then refuse ``.grad`` that changed."""
        with self.lock:
            step = self.steps.pop(gm.step, None)
            if step is None or not step.sync or step.mismatch is not None:
                return
            try:
                self.settle(step)
            except RankMismatchError:
                return  # the others raise it too and launch nothing
            # Before the failed step: torch's reducer replaces a kept .grad that is a view
            # into its bucket by a copy, which is no change of the user's.
            changed = (step.finished_before == self.finished  # .grad written by gradmgr
                       and self.ops.grads_changed(self.planned(), step.grads_at_record))
            if self.on_reducer and not step.after:
                self.reducer_for(step).fail_step(self.used)
            else:
                step.launch_failed(self._wire())
                if self.shards is not None:
                    self._end_sharded(step, True)
        step.drain()
        if changed:
            raise RuntimeError(_HABIT)


def _unprepared(what: str) -> NoReturn:
    raise RuntimeError(f"gradmgr: the data-parallel step has no {what} yet (an internal error: "
                       f"please report it with the output of `python -m gradmgr env`)")
