"""Sharded gradients (ZeRO-2): each bucket is reduce-scattered instead of allreduced, so a rank
keeps only its slice of every reduced gradient, and the full-size gradients are freed as soon as
their bucket has gone out.

A bucket's flat buffer is cut into ``world`` equal chunks (padded at the end); rank ``r`` keeps
chunk ``r``, summed over the ranks. Where a member crosses a chunk boundary, each rank holds the
part of it that falls in its chunk: a *segment*, the unit the sharded optimizer steps. The
per-member "used" flags and the failure markers, which the allreduce path carries at the end of
each bucket, travel here in one small allreduce at the end of the step (a reduce-scatter would
hand them to one rank only): every rank then knows which tensors some rank used, and whether a
rank failed, before any shard is kept.
"""

from __future__ import annotations

import contextlib
from typing import Any, List, NamedTuple, Optional, Sequence

from ..contract import Done, Handle, TensorOps, Transport
from ..errors import RankFailedError
from ..reduce.bucket import BucketPlan
from ..reduce.steps import Wire
from ..reducing import RANK_FAILED


class BufferPool:
    """The sharded path's bucket buffers, shared by all buckets within one backward: a bucket
    takes a free one big enough (else allocates), and gives it back once its chunk has
    arrived; after the backward none is kept. (The allreduce path keeps one buffer per bucket,
    which ``.grad`` views; here the reduced gradients live in the shards, so a step needs only
    the buffers in flight: memory is what sharding is for.)"""

    __slots__ = ("ops", "free", "open")

    def __init__(self, ops: TensorOps) -> None:
        self.ops, self.open = ops, False
        self.free: List[Any] = []

    def lend(self, bucket: Any) -> None:
        """Offer ``bucket`` a free buffer as its ``spare``, or none (``TensorOps.new_buffer``
        takes the start of a spare that is big enough and that nothing else holds)."""
        self.open = True
        need = bucket.buffer_numel
        for i, flat in enumerate(self.free):
            if self.ops.key(flat) == bucket.key and self.ops.numel(flat) >= need:
                del self.free[i]
                bucket.spare = flat
                return
        bucket.spare = None

    def fits(self, bucket: Any) -> bool:
        """Whether a free buffer could serve ``bucket``."""
        need = bucket.buffer_numel
        return any(self.ops.key(flat) == bucket.key and self.ops.numel(flat) >= need
                   for flat in self.free)

    def give_back(self, bucket: Any) -> None:
        """``bucket``'s collective is done with its buffer."""
        if self.open and bucket.spare is not None:
            self.free.append(bucket.spare)
        bucket.spare = None

    def close(self) -> None:
        """The backward launched its last bucket: buffers given back from now on are freed."""
        self.free.clear()
        self.open = False


class ShardReduction:
    """One bucket's reduce-scatter in flight, and the bucket's flags (reduced later, with the
    other buckets' flags). The per-tensor Futures of a sharded step resolve to None: the
    gradients go to the shards, not to ``.grad``."""

    __slots__ = ("_ops", "_handle", "_bucket", "_compressed", "flags", "_chunk", "_pool")

    def __init__(self, ops: TensorOps, handle: Handle, bucket: Any, compressed: bool,
                 flags: Any, pool: BufferPool) -> None:
        self._ops, self._handle, self._bucket = ops, handle, bucket
        self._compressed, self.flags, self._pool = compressed, flags, pool
        self._chunk: Any = None

    def chunk(self) -> Any:
        """This rank's chunk of the summed bucket (waits for the collective)."""
        if self._chunk is None:
            chunk = self._handle.wait()
            self._chunk = (self._ops.cast(chunk, self._bucket.key[0]) if self._compressed
                           else chunk)
            # The collective held its input, the bucket's buffer: the next bucket takes it.
            self._handle = Done(chunk)
            self._pool.give_back(self._bucket)
        return self._chunk

    def drain(self) -> None:
        with contextlib.suppress(Exception):  # a failed rank reports its own error
            self._handle.wait()

    def result(self, slot: int) -> Any:
        return None

    def used_anywhere(self, slot: int) -> bool:
        return False


class ShardWire(Wire):
    """The sharded path's wire: data reduce-scattered, flags kept for :meth:`end_step`, at most
    one bucket in flight, whose buffer the next bucket with a large member takes once the
    reduction is done (so that one buffer serves a backward of equal buckets: with more in
    flight, each would hold a bucket's worth of memory)."""

    __slots__ = ("pool", "in_flight")

    def __init__(self, ops: TensorOps, transport: Transport, mean: bool,
                 compression: Optional[str]) -> None:
        super().__init__(ops, transport, mean, compression)
        self.pool = BufferPool(ops)
        self.in_flight: Optional[ShardReduction] = None

    def lend(self, bucket: Any) -> None:
        if self.in_flight is not None and any(bucket.large) and not self.pool.fits(bucket):
            # The bucket in flight gives its buffer to this one: without this wait, its
            # buffer, this one's and the engine's newest gradient (a large member's, not yet
            # copied in) are alive together, a buffer more than the step needs. send() waited
            # for it a copy later anyway, so the overlap lost is that copy.
            with contextlib.suppress(Exception):  # the error is raised where it is used
                self.in_flight.chunk()
            self.in_flight = None
        self.pool.lend(bucket)

    def send(self, flat: Any, bucket: Any, last: bool, plan: Any = None) -> ShardReduction:
        ops, transport = self.ops, self.transport
        if self.in_flight is not None:
            with contextlib.suppress(Exception):  # the error is raised where it is used
                self.in_flight.chunk()
        if self.compression is not None:  # the mean's division was done as flat was filled
            flat = ops.compress(flat, self.compression)
        world = transport.world_size()
        data = ops.padded(ops.part(flat, 0, bucket.numel), chunk_numel(bucket, world) * world)
        flags = ops.copy(ops.part(flat, bucket.numel, None))  # the buffer is reused
        reduction = ShardReduction(ops, reduce_scatter(transport, data), bucket,
                                   self.compression is not None, flags, self.pool)
        self.in_flight = None if last else reduction
        return reduction

    def end_step(self, launched: Sequence[Optional[ShardReduction]], failed: bool,
                 like: Any) -> Handle:
        """Every bucket's flags and this rank's failure marker, summed over the ranks (one
        small collective, after the step's last bucket)."""
        self.in_flight = None
        self.pool.close()
        ops = self.ops
        parts = [ops.cast(r.flags, "float32") for r in launched if r is not None]
        parts.append(ops.vector([1.0 if failed else 0.0], like))
        return self.transport.allreduce_async(ops.flatten(parts))


def reduce_scatter(transport: Transport, data: Any) -> Handle:
    start = getattr(transport, "reduce_scatter_async", None)
    if start is None:
        raise TypeError(
            f"sharded data parallelism needs a transport with reduce_scatter_async(flat) and "
            f"all_gather_async(chunk); {type(transport).__name__} has none: use the backend's "
            f"own transport, or add them (see gradmgr.distributed.contract.Transport)"
        )
    return start(data)


def chunk_numel(bucket: Any, world: int) -> int:
    """The length of each rank's chunk of ``bucket`` (its buffer padded to ``world`` chunks)."""
    return -(-bucket.numel // world)


class Segment(NamedTuple):
    """The part of one bucket member that falls in this rank's chunk."""

    bucket: int
    slot: int
    position: int  # of the member in the plan (its tensor: plan.tensor(position))
    start: int  # where the part begins and ends in the member (flattened)
    stop: int
    offset: int  # where it begins in this rank's chunk


def own_segments(plan: BucketPlan, rank: int, world: int) -> List[Segment]:
    """Every segment this rank holds, bucket by bucket, in chunk order."""
    segments = []
    for b, bucket in enumerate(plan.buckets):
        size = chunk_numel(bucket, world)
        low, high = rank * size, min((rank + 1) * size, bucket.numel)
        for slot in bucket.layout:
            begin = bucket.offsets[slot]
            end = begin + bucket.sizes[slot]
            lo, hi = max(low, begin), min(high, end)
            if lo < hi:
                segments.append(Segment(b, slot, bucket.members[slot], lo - begin, hi - begin,
                                        lo - low))
    return segments


class GradientShards:
    """One manager's reduced gradient shards: this rank's chunk of every bucket, summed over
    the steps since :meth:`zero` (as ``.grad`` accumulates), and which members have a
    gradient in it (some rank used them)."""

    def __init__(self, ops: TensorOps, stand_ins: Any) -> None:
        self.ops = ops
        self.plan: Optional[BucketPlan] = None
        self.chunks: List[Any] = []
        self.present: List[List[bool]] = []
        self.kept_zeros: List[bool] = []  # a chunk of zeros that the next step replaces
        self.version = 0  # changes whenever the chunks' values do
        # The planned tensors' .grad after a synced step: stand_ins is shard_grads.StandIns
        # (passed in: that module builds on this one).
        self.stand_ins = stand_ins(self)

    def planned(self, plan: BucketPlan) -> None:
        """A new plan: the shards of the old one are dropped."""
        if plan is not self.plan:
            self.plan = plan
            self.stand_ins.planned()
            self.zero()

    def zero(self) -> None:
        buckets = self.plan.buckets if self.plan is not None else []
        self.chunks = [None] * len(buckets)
        self.present = [[False] * len(b.members) for b in buckets]
        self.kept_zeros = [False] * len(buckets)
        self.changed()
        self.stand_ins.drop()

    def keep_zeros(self) -> None:
        """Zero the chunks, keeping which members have a gradient (``zero_grad(set_to_none=
        False)``): as a zeroed ``.grad`` under DDP, a member that gets no gradient in the next
        step still has one, zeros, which the optimizer steps (momentum, weight decay)."""
        ops, chunks = self.ops, self.chunks
        for b, chunk in enumerate(chunks):  # one at a time: each old chunk freed as replaced
            if chunk is not None:
                chunks[b] = ops.zeros(ops.numel(chunk), chunk)
        self.kept_zeros = [c is not None for c in chunks]
        self.changed()
        self.stand_ins.drop()

    def release(self, transport: Transport) -> None:
        """After a synced step kept its chunks: the local gradients they summed are freed
        (``.grad`` None, or a stand-in where some rank used the tensor: see
        :mod:`.shard_grads`)."""
        self.stand_ins.give(transport)

    def recording(self) -> None:
        """A recording begins: no stand-in ``.grad`` for autograd to accumulate into; the
        gradients whose stand-in the program set None itself (``model.zero_grad()``) are
        zeroed, as that would have zeroed them under DDP."""
        given = self.stand_ins.count()
        taken = self.stand_ins.drop()
        if taken and len(taken) == given:
            self.zero()
        else:
            for position in taken:
                self.stand_ins.zero(position)
            if taken:
                self.changed()

    def accept(self, launched: Sequence[ShardReduction], summed_flags: List[float],
               failed_here: bool) -> None:
        """Keep a finished step's chunks, or raise RankFailedError (every rank not failing
        itself) where some rank failed; nothing is kept then."""
        plan = self.plan
        if plan is None:  # the synchronizer plans (planned()) before any step launches
            raise RuntimeError("gradmgr: gradient shards given a step before a plan (an "
                               "internal error: please report it with `gradmgr env`)")
        if summed_flags[-1] != 0 or _any_bucket_failed(plan, summed_flags):
            if failed_here:
                return
            raise RankFailedError(RANK_FAILED)
        start = 0
        for b, (bucket, reduction) in enumerate(zip(plan.buckets, launched)):
            flags = summed_flags[start:start + len(bucket.members)]
            start += len(bucket.members) + 1
            chunk = reduction.chunk()
            if self.chunks[b] is None or self.kept_zeros[b]:
                self.chunks[b] = chunk  # (as DDP copies a bucket into a zeroed .grad)
                self.kept_zeros[b] = False
            else:
                self.chunks[b] = self.ops.add(self.chunks[b], chunk)
            self.present[b] = [was or used != 0 for was, used in zip(self.present[b], flags)]
        self.changed()

    def scale(self, coef: float) -> None:
        """Multiply every chunk by ``coef`` (clipping)."""
        self.chunks = [None if c is None else self.ops.scale(c, coef) for c in self.chunks]
        self.changed()

    def changed(self) -> None:
        """The chunks' values changed (written in place, or replaced): what was computed from
        them (the stand-ins' norms) is computed again."""
        self.version += 1

    def grad_of(self, segment: Segment) -> Any:
        """The reduced gradient of a segment (a view where the framework has them), or None
        where no rank used its tensor."""
        chunk = self.chunks[segment.bucket]
        if chunk is None or not self.present[segment.bucket][segment.slot]:
            return None
        return self.ops.part(chunk, segment.offset, segment.offset + segment.stop - segment.start)

    def nbytes(self) -> int:
        return sum(self.ops.nbytes(c) for c in self.chunks if c is not None)


def _any_bucket_failed(plan: BucketPlan, summed: List[float]) -> bool:
    start = 0
    for bucket in plan.buckets:
        start += len(bucket.members)
        if summed[start] != 0:
            return True
        start += 1
    return False
