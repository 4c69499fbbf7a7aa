"""One data-parallel step of one manager on gradmgr's own buckets: gradients go into their
bucket's buffer as they arrive, each full bucket is launched at once (in plan order, the same on
every rank), and each tensor gets a Future of its reduced gradient."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, List, Optional, Protocol, Sequence, Set, Tuple

from ...future import Future
from ..contract import Handle, TensorOps, Transport
from ..errors import RankFailedError
from ..reducing import RANK_FAILED, CommHook
from .bucket import BucketPlan


class Launched(Protocol):
    """A launched bucket as a step holds it: a :class:`Reduction`, or on the sharded path a
    ``ShardReduction`` (whose per-tensor results are None)."""

    def drain(self) -> None: ...

    def result(self, slot: int) -> Any: ...

    def used_anywhere(self, slot: int) -> bool: ...


class Reduction:
    """One launched bucket; unpacks the reduced buffer on first use."""

    __slots__ = ("_ops", "_handle", "_bucket", "_compressed", "_parts", "_flags",
                 "_lock")

    def __init__(self, ops: TensorOps, handle: Handle, bucket: Any, compressed: bool) -> None:
        self._ops, self._handle, self._bucket = ops, handle, bucket
        self._compressed = compressed
        self._parts: Optional[List[Any]] = None
        self._flags: Any = None
        self._lock = threading.Lock()

    def _unpack(self) -> List[Any]:
        with self._lock:
            if self._parts is None:
                flat = self._handle.wait()
                if self._compressed:
                    flat = self._ops.cast(flat, self._bucket.key[0])
                parts, flags = self._ops.unpack(flat, self._bucket)
                # (every bucket's marker: a comm hook's failure marks its own bucket only)
                if self._ops.failed_somewhere(flags):
                    raise RankFailedError(RANK_FAILED)
                self._parts, self._flags = parts, flags
            return self._parts

    def drain(self) -> None:
        """Wait for the collective, for a rank whose backward failed: its error, not the
        transport's, is the one to report."""
        with contextlib.suppress(Exception):  # the backward's own error propagates
            self._handle.wait()

    def result(self, slot: int) -> Any:
        parts = self._parts
        if parts is None:
            parts = self._unpack()
        return parts[slot]

    def used_anywhere(self, slot: int) -> bool:
        if self._parts is None:
            self._unpack()
        return self._ops.flag(self._flags, slot) != 0


class PendingGradient(Future):
    """The reduced gradient of one bucket member: the tensor's complete new ``.grad``
    (``replaces_grad``), or None for a tensor that no rank used since the last sync."""

    __slots__ = ("_launched", "_bucket", "_slot", "_maybe_unused")

    replaces_grad = True

    def __init__(self, launched: List[Optional[Launched]], bucket: int, slot: int,
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


class Wire:
    """How a step's buckets travel: the transport, the ops, and what is done to a buffer
    (divided for a mean as it is filled, then cast for compression before it leaves)."""

    __slots__ = ("ops", "transport", "mean", "compression")

    def __init__(self, ops: TensorOps, transport: Transport, mean: bool,
                 compression: Optional[str]) -> None:
        self.ops, self.transport = ops, transport
        self.mean, self.compression = mean, compression

    def settle(self, step: Step) -> None:
        """After a synced step's last bucket went out (nothing to do: see HookWire)."""

    def lend(self, bucket: Any) -> None:
        """Before ``bucket``'s buffer is made: the allreduce path keeps each bucket's own
        (``.grad`` views it), so nothing to do."""

    def factor(self) -> Optional[float]:
        """What each bucket's buffer is multiplied by as it is filled (``TensorOps.new_buffer``):
        ``1/world`` for a mean, else None."""
        return 1.0 / self.transport.world_size() if self.mean else None

    def send(self, flat: Any, bucket: Any, last: bool, plan: Any = None) -> Launched:
        ops = self.ops  # flat is scaled already (factor()): compress the mean, as DDP does
        if self.compression is not None:
            flat = ops.compress(flat, self.compression)
        handle = self.transport.allreduce_async(flat)
        return Reduction(ops, handle, bucket, self.compression is not None)


class HookWire(Wire):
    """The wire of a communication hook (``comm_hook=``): each bucket goes to the hook
    undivided, as DDP hands it over; the hook reduces it (torch's hooks divide by the world
    size themselves), and the flags travel apart (see ``CommHook.launch``)."""

    __slots__ = ("hook",)

    def __init__(self, ops: TensorOps, transport: Transport, hook: CommHook) -> None:
        super().__init__(ops, transport, False, None)
        self.hook = hook

    def settle(self, step: Step) -> None:
        """Wait for every launched bucket in plan order: each sends its flags when its hook's
        future is done, and their allreduces must pair alike on every rank (an error is kept
        for the gradient's Future)."""
        step.drain()

    def send(self, flat: Any, bucket: Any, last: bool, plan: Any = None) -> Launched:
        def parameters() -> List[Any]:
            return [plan.tensor(m) for m in bucket.members]

        handle = self.hook.launch(flat, bucket, last, self.transport, parameters)
        return Reduction(self.ops, handle, bucket, False)


class Step:
    """What one backward of one manager has gathered so far (a synced one launches buckets;
    a ``no_sync`` one only notes which tensors got a gradient)."""

    __slots__ = ("plan", "sync", "buffers", "filled", "count", "launched", "next_launch",
                 "check", "mismatch", "grads_at_record", "finished_before", "finish_limit",
                 "after")

    def __init__(self, plan: BucketPlan, sync: bool) -> None:
        self.plan = plan
        self.sync = sync
        self.buffers: List[Any] = [None] * len(plan.buckets)  # BucketBuffer, once needed
        self.filled: List[List[bool]] = [[False] * len(b.members) for b in plan.buckets]
        self.count = [0] * len(plan.buckets)
        self.launched: List[Optional[Launched]] = [None] * len(plan.buckets)
        self.next_launch = 0
        self.check: Any = None  # the ranks' plans compared (PlanCheck), not yet read
        self.mismatch: Optional[BaseException] = None  # they differed: launch nothing
        self.grads_at_record: Any = None  # TensorOps.grad_snapshot of the planned tensors
        self.finished_before = 0  # Synchronizer.finished when the step was recorded
        # no_sync: the Synchronizer.finished its gradients may come at (synced steps recorded
        # before it may finish first: a split backward's finish() in the next window)
        self.finish_limit = 0
        self.after = False  # reduced after its backward (see post_backward.py)

    def put(self, wire: Wire, tensor: Any, grad: Any, b: int, slot: int) -> PendingGradient:
        """Member ``slot`` of bucket ``b`` got its gradient: into the buffer, and every bucket
        now complete (in plan order) goes out."""
        if self.filled[b][slot]:
            raise RuntimeError(
                "allreduce callback called twice for one tensor in one backward: attach "
                "each tensor with a given allreduce callback only once"
            )
        self.filled[b][slot] = True
        ops = wire.ops
        self._buffer(wire, b, tensor).put(slot, grad, ops.local_grad(tensor))
        self.count[b] += 1
        if self.count[b] == len(self.plan.buckets[b].members):
            self._launch_ready(wire)
        return PendingGradient(self.launched, b, slot, False)

    def _buffer(self, wire: Wire, b: int, like: Any) -> Any:
        buffer = self.buffers[b]
        if buffer is None:
            bucket = self.plan.buckets[b]
            wire.lend(bucket)
            buffer = self.buffers[b] = wire.ops.new_buffer(bucket, like, wire.factor())
        return buffer

    def _launch_ready(self, wire: Wire) -> None:
        buckets = self.plan.buckets
        while self.next_launch < len(buckets):
            b = self.next_launch
            if self.count[b] < len(buckets[b].members):
                return
            self.launch(wire, b, ())

    def launch(self, wire: Wire, b: int, unused: Sequence[int], failed: bool = False) -> None:
        bucket = self.plan.buckets[b]
        flat = self._buffer(wire, b, self.plan.tensor(bucket.members[0])).finish(unused, failed)
        self.buffers[b] = None
        self.launched[b] = wire.send(flat, bucket, b == len(self.plan.buckets) - 1, self.plan)
        self.next_launch = b + 1

    def launch_zeros(self, wire: Wire) -> None:
        """A joined rank's part of a synced step (uneven inputs): every bucket holds zeros,
        every member flagged unused, no failure."""
        for b, bucket in enumerate(self.plan.buckets):
            buffer = self._buffer(wire, b, self.plan.tensor(bucket.members[0]))
            for slot in range(len(bucket.members)):
                buffer.put(slot, None, None)
            self.launch(wire, b, range(len(bucket.members)))

    def launch_failed(self, wire: Wire) -> None:
        """This rank's backward raised: launch the remaining buckets with the failure marker
        set, so the other ranks' reductions of the step complete (instead of pairing with this
        rank's next step) and they raise RankFailedError rather than use incomplete sums."""
        for b in range(self.next_launch, len(self.plan.buckets)):
            self.launch(wire, b, (), failed=True)

    def all_launched(self) -> List[Launched]:
        """Every bucket's reduction, once the step launched them all (a step ends so)."""
        launched = [r for r in self.launched if r is not None]
        if len(launched) != len(self.launched):
            raise RuntimeError("gradmgr: a step ended with a bucket never launched (an internal "
                               "error: please report it with the output of `gradmgr env`)")
        return launched

    def drain(self) -> None:
        """Wait for every launched bucket (a failed rank's, whose own error is reported)."""
        for reduction in self.launched:
            if reduction is not None:
                reduction.drain()

    def launch_missing(self, wire: Wire, used: Set[int]) -> List[Tuple[Any, int, int]]:
        """Members with no gradient in this step on this rank contribute what their ``.grad``
        holds (or zeros), flagged unused unless they are in ``used`` (ids of the tensors with
        a gradient since the last synced step); then every bucket not yet launched goes out.
        Returns ``(tensor, bucket, slot)`` of those members."""
        missing = []
        tensors = self.plan.tensors()
        for b in range(self.next_launch, len(self.plan.buckets)):
            unused = []
            for slot, position in enumerate(self.plan.buckets[b].members):
                if self.filled[b][slot]:
                    continue
                tensor = tensors[position]
                if tensor is None:
                    raise RuntimeError("an attached tensor died during its allreduce step")
                self._buffer(wire, b, tensor).put(slot, None, wire.ops.local_grad(tensor))
                if id(tensor) not in used:
                    unused.append(slot)
                missing.append((tensor, b, slot))
            self.launch(wire, b, unused)
        return missing
