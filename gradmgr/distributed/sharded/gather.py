"""The sharded optimizer's all-gather: after each rank stepped its segments, every rank's
parameters take every segment's new values from the rank that stepped it.

Two ways, same values. A bucket cut into few, large segments goes by broadcasts where the
transport has ``broadcast_async``: each segment from its owner straight into the parameters,
all started before the first wait, with no buffer and no copy. A bucket of many small segments
(one collective each would cost more than copying them) is all-gathered into a flat buffer and
copied into its members. The choice depends on the plan and the transport only, so every rank
issues the same collectives.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from ..contract import TensorOps
from ..reduce.bucket import LARGE_BYTES, BucketPlan
from .sharding import Segment, chunk_numel, own_segments

BROADCAST_BYTES = LARGE_BYTES
"""A bucket whose segments (every rank's) hold at least this much on average goes by
broadcasts."""


class ParameterGather:
    """Gathers one plan's parameters on a rank holding ``segments`` (stepped as ``tensors``)."""

    def __init__(self, ops: TensorOps, transport: Any, plan: BucketPlan, world: int,
                 segments: Sequence[Segment], tensors: Sequence[Any]) -> None:
        self.ops, self.transport, self.plan, self.world = ops, transport, plan, world
        self.segments, self.tensors = segments, tensors
        self._own = dict(zip(segments, tensors))
        everyone = [(r, s) for r in range(world) for s in own_segments(plan, r, world)]
        count = [0] * len(plan.buckets)
        for _, segment in everyone:
            count[segment.bucket] += 1
        can = getattr(transport, "broadcast_async", None) is not None
        self.direct = [can and bucket.nbytes >= BROADCAST_BYTES * n
                       for bucket, n in zip(plan.buckets, count)]
        self.broadcast = [(r, s) for r, s in everyone if self.direct[s.bucket]]

    def __call__(self) -> None:
        self.start().wait_all()

    def start(self) -> PendingGather:
        """Start the gather; the many-small-segment buckets are gathered before it returns,
        the broadcasts are left in flight (what :class:`PendingGather` waits for)."""
        ops = self.ops
        for segment, tensor in zip(self.segments, self.tensors):
            if self.direct[segment.bucket]:
                target = self._slice(segment)
                if target is not None:
                    ops.write_segment(tensor, target)
        started = [self._start(owner, segment) for owner, segment in self.broadcast]
        self._through_buckets()
        return PendingGather(ops, self.plan, started)

    def _start(self, owner: int, segment: Segment) -> tuple:
        """Start one segment's broadcast into its parameter (or, for a parameter without a
        writable view, into a temporary written into it after the wait)."""
        target = self._slice(segment)
        if target is not None:
            return segment, None, self.transport.broadcast_async(target, owner)
        like = self.plan.tensor(segment.position)
        temporary = self.ops.zeros(segment.stop - segment.start, like)
        if segment in self._own:  # this rank's: what it stepped
            self.ops.write(temporary, 0, self._own[segment])
        return segment, temporary, self.transport.broadcast_async(temporary, owner)

    def _slice(self, segment: Segment) -> Any:
        param = self.plan.tensor(segment.position)
        return None if param is None else self.ops.param_slice(param, segment.start,
                                                               segment.stop)

    def _through_buckets(self) -> None:
        ops, plan = self.ops, self.plan
        by_bucket: Dict[int, List[Any]] = {}
        for segment, tensor in zip(self.segments, self.tensors):
            by_bucket.setdefault(segment.bucket, []).append(tensor)
        for b, bucket in enumerate(plan.buckets):
            if self.direct[b]:
                continue
            size = chunk_numel(bucket, self.world)
            like = plan.tensor(bucket.members[0])
            own = [ops.cast(t, bucket.key[0]) for t in by_bucket.get(b, [])]
            chunk = ops.padded(ops.flatten(own) if own else ops.zeros(0, like), size)
            full = self.transport.all_gather_async(chunk).wait()
            members = [plan.tensor(bucket.members[slot]) for slot in bucket.layout]
            ops.assign(members, ops.part(full, 0, bucket.numel))


class PendingGather:
    """The broadcasts of one gather still in flight, by the position of their parameter.

    Every rank started the same broadcasts in the same order, so waiting for any of them
    needs nothing more from the other ranks: a wait never starts a collective, and a rank that
    waits where the others do not (a checkpoint on rank 0 alone) cannot hang on them."""

    def __init__(self, ops: TensorOps, plan: BucketPlan, started: List[tuple]) -> None:
        self.ops, self.plan = ops, plan
        self._by_position: Dict[int, List[tuple]] = {}
        for entry in started:
            self._by_position.setdefault(entry[0].position, []).append(entry)

    @property
    def pending(self) -> bool:
        return bool(self._by_position)

    def wait_for(self, positions: Sequence[int]) -> None:
        """Wait for the broadcasts into the parameters at ``positions`` of the plan."""
        for position in positions:
            entries = self._by_position.pop(position, None)
            if entries:
                self._finish(entries)

    def wait_all(self) -> None:
        # popped one parameter at a time: an error leaves the others to the next wait
        while self._by_position:
            self._finish(self._by_position.pop(next(iter(self._by_position))))

    def _finish(self, entries: List[tuple]) -> None:
        for segment, target, work in entries:
            work.wait()
            param = self.plan.tensor(segment.position)
            if target is not None and param is not None:  # the parameter has no such view
                self.ops.write_part(param, segment.start, target)
