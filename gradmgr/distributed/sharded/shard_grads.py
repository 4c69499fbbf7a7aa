"""The ``.grad`` of a tensor whose reduced gradient a synced sharded backward left in the
gradient shards (each rank its slice, see :mod:`.sharding`).

``.grad`` None there would make torch's own ``clip_grad_norm_(model.parameters(), max_norm)``,
the habit of every DDP script, return 0 and clip nothing, silently. So where the backend makes
them (``ops.stand_in_grad(tensor, member)``; PyTorch does), each tensor with a gradient in the
shards gets a stand-in ``.grad`` that holds no memory and answers what clipping asks: the norm
of the tensor's whole gradient (every rank's slices: one small allreduce for all the tensors,
the first time one is asked after the shards changed, so every rank must ask, as every rank
clips under DDP) and its slices, to change in place elementwise (scale, zero, clamp, add the
same noise on every rank: each rank its own slices). Anything else
done with it raises an error that says where the gradient is. The stand-ins go at
``opt.zero_grad()`` and when the next recording begins, before autograd could accumulate into
one; where the program took them away itself (``model.zero_grad()`` sets ``.grad`` None, the
habit of many scripts), that tensor's slices are zeroed then, as its ``.grad`` would have been
(before, the shards kept them, and the next step added the old gradient to the new one).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

from .sharding import Segment, own_segments


class MemberGrad:
    """What the stand-in ``.grad`` of the planned tensor at ``position`` asks of the shards."""

    __slots__ = ("_stand_ins", "position")

    def __init__(self, stand_ins: StandIns, position: int) -> None:
        self._stand_ins, self.position = stand_ins, position

    def norm(self) -> float:
        """The 2-norm of the tensor's whole reduced gradient (a collective the first time
        any tensor's is asked after the shards changed: every rank asks)."""
        return self._stand_ins.norms()[self.position]

    def parts(self) -> List[Any]:
        """This rank's slices of the tensor's gradient: views into the shards, which the
        backend scales or zeroes in place (then :meth:`changed`)."""
        return self._stand_ins.parts(self.position)

    def pieces(self) -> List[tuple]:
        """``(start, stop, slice)`` for each of :meth:`parts`: the slice holds the elements
        ``start`` to ``stop`` of the tensor's flattened gradient."""
        return self._stand_ins.pieces(self.position)

    def span(self) -> tuple:
        """``(start, stop)`` of this rank's part of the tensor's flattened gradient (start ==
        stop where it holds none)."""
        segment = self._stand_ins.segment(self.position)
        return (0, 0) if segment is None else (segment.start, segment.stop)

    def local(self) -> Any:
        """This rank's part of the tensor's reduced gradient (a view into the shards; empty
        where it holds none), or None where the shards hold no gradient of it now."""
        return self._stand_ins.local(self.position)

    def changed(self) -> None:
        """The slices were written in place: norms asked from now on are computed again."""
        self._stand_ins.shards.changed()

    def on_some_rank(self, found: bool) -> bool:
        """Whether ``found`` is true on some rank (a small allreduce: every rank asks, for
        the same tensors), so that every rank decides alike (a gradient scaler's skip)."""
        return self._stand_ins.on_some_rank(found)


class StandIns:
    """The stand-in ``.grad`` of one manager's shards (a :class:`GradientShards`)."""

    def __init__(self, shards: Any) -> None:
        self.shards = shards
        self.transport: Any = None
        self.made: Dict[int, Any] = {}  # by plan position, for the current plan
        self._position: Dict[int, int] = {}  # id(tensor) -> its plan position, where made
        self.given: List[tuple] = []  # (tensor, its stand-in) given at the last synced step
        self._segments: Optional[List[Segment]] = None
        self._norms: Optional[tuple] = None  # (shards version, norms by position)
        # Called before each of their collectives: a ShardedOptimizer inside torch's Join
        # sets it, so that a joined rank, which cannot take part, stops every rank instead.
        self.before_collective: Optional[Callable[[], None]] = None

    def planned(self) -> None:
        """A new plan: stand-ins and segments are made again."""
        self.drop()
        self.made, self._position, self._segments, self._norms = {}, {}, None, None

    def give(self, transport: Any) -> None:
        """After a synced step: ``.grad`` is a stand-in for each planned tensor some rank used
        (where the backend makes them), None for the others (their local gradients are
        summed into the shards, and freed)."""
        shards, made, self.transport = self.shards, self.made, transport
        make = getattr(shards.ops, "stand_in_grad", None)
        tensors, given = shards.plan.tensors(), []
        for bucket, present in zip(shards.plan.buckets, shards.present):
            for position, used in zip(bucket.members, present):
                tensor = tensors[position]
                if tensor is None:
                    continue
                grad = None
                if used and make is not None:
                    grad = made.get(position)
                    if grad is None:
                        grad = made[position] = make(tensor, MemberGrad(self, position))
                    given.append((tensor, grad))
                tensor.grad = grad
        self.given = given
        if len(self._position) != len(made):
            self._position = {id(tensors[p]): p for p in made}

    def drop(self) -> List[int]:
        """The stand-ins go (``.grad`` None), where ``.grad`` still holds one; the positions
        of those the program had taken away itself (``model.zero_grad()`` sets ``.grad``
        None), in order."""
        taken = []
        if self.given:
            for tensor, grad in self.given:
                if tensor.grad is grad:
                    tensor.grad = None
                else:
                    taken.append(self._position[id(tensor)])
            self.given = []
        return taken

    def count(self) -> int:
        """How many stand-ins the last synced step gave."""
        return len(self.given)

    def zero(self, position: int) -> None:
        """Zero this rank's slices of one tensor's gradient (its ``.grad`` was set None)."""
        ops = self.shards.ops
        for part in self.parts(position):
            ops.write(part, 0, ops.zeros(ops.numel(part), part))

    def _own(self) -> List[Segment]:
        if self._segments is None:
            transport = self.transport
            self._segments = own_segments(self.shards.plan, transport.rank(),
                                          transport.world_size())
        return self._segments

    def on_some_rank(self, found: bool) -> bool:
        if self.before_collective is not None:
            self.before_collective()
        ops = self.shards.ops
        like = next(t for t in self.shards.plan.tensors() if t is not None)
        summed = ops.values(self.transport.allreduce_async(
            ops.vector([1.0 if found else 0.0], like)).wait())
        return summed[0] > 0

    def norms(self) -> List[float]:
        shards = self.shards
        if self._norms is not None and self._norms[0] == shards.version:
            return self._norms[1]
        if self.before_collective is not None:
            self.before_collective()
        ops, tensors = shards.ops, shards.plan.tensors()
        # per tensor: the sum of squares of split ones; the framework's own norm of those
        # one rank holds whole (then torch's clip_grad_norm_ is DDP's bit for bit), and a 1
        n = len(tensors)
        sums = [0.0] * (3 * n)
        for segment in self._own():
            grad = shards.grad_of(segment)
            if grad is None:
                continue
            p = segment.position
            whole = tensors[p] is not None and segment.stop - segment.start == ops.numel(tensors[p])
            if whole:
                sums[n + p], sums[2 * n + p] = ops.norm(grad), 1.0
            else:
                sums[p] += ops.sum_squares([grad])
        like = next(t for t in tensors if t is not None)
        summed = ops.values(self.transport.allreduce_async(ops.vector(sums, like)).wait())
        norms = [summed[n + p] if summed[2 * n + p] else math.sqrt(max(summed[p], 0.0))
                 for p in range(n)]
        self._norms = (shards.version, norms)
        return norms

    def segment(self, position: int) -> Optional[Segment]:
        return next((s for s in self._own() if s.position == position), None)

    def local(self, position: int) -> Any:
        shards = self.shards
        segment = self.segment(position)
        if segment is not None:
            return shards.grad_of(segment)
        # This rank holds none of the tensor: an empty part of its bucket's chunk, while the
        # shards hold a gradient of it.
        bucket, slot = shards.plan.where[id(shards.plan.tensor(position))]
        chunk = shards.chunks[bucket]
        if chunk is None or not shards.present[bucket][slot]:
            return None
        return shards.ops.part(chunk, 0, 0)

    def parts(self, position: int) -> List[Any]:
        return [part for _, _, part in self.pieces(position)]

    def pieces(self, position: int) -> List[tuple]:
        shards = self.shards
        found = [(s.start, s.stop, shards.grad_of(s)) for s in self._own()
                 if s.position == position]
        return [piece for piece in found if piece[2] is not None]
