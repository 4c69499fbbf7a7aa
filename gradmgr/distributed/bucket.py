"""Bucket planning: which gradients are reduced together, identically on every rank.

The plan depends only on the attached tensors (their first-attach order, dtype, device and
size), never on the order in which gradients arrive, so every rank builds the same buckets and
launches them in the same order; collectives issued in different orders would deadlock or mix
buffers.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .ops import TensorOps


class Bucket:
    """Members (positions in the plan) reduced as one flat buffer of one dtype and device."""

    __slots__ = ("index", "key", "members", "shapes", "nbytes")

    def __init__(self, index: int, key: Tuple[str, str]) -> None:
        self.index = index
        self.key = key
        self.members: List[int] = []
        self.shapes: List[Tuple[int, ...]] = []
        self.nbytes = 0

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {self.key}, members={self.members}, {self.nbytes} B)"


class BucketPlan:
    """Buckets over ``tensors`` filled in reverse attach order (late layers first, as their
    gradients are ready first), one open bucket per (dtype, device), each closed once it holds
    at least ``bucket_bytes``; the very first bucket closes at ``first_bucket_bytes`` already
    (as in DDP), so that communication starts early in the backward.

    Example:
        >>> import torch
        >>> from gradmgr.distributed.ops import ops_for
        >>> ts = [torch.zeros(4), torch.zeros(4), torch.zeros(4)]
        >>> [b.members for b in BucketPlan(ts, ops_for("torch"), bucket_bytes=32).buckets]
        [[2, 1], [0]]
    """

    def __init__(self, tensors: Sequence[Any], ops: TensorOps, bucket_bytes: int,
                 first_bucket_bytes: Optional[int] = None) -> None:
        first = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
        self._refs = [weakref.ref(t) for t in tensors]
        self.buckets: List[Bucket] = []
        self.where: Dict[int, Tuple[int, int]] = {}  # id(tensor) -> (bucket, slot)
        open_by_key: Dict[Tuple[str, str], Bucket] = {}
        for position in reversed(range(len(tensors))):
            tensor = tensors[position]
            key = ops.key(tensor)
            bucket = open_by_key.get(key)
            if bucket is None:
                bucket = Bucket(len(self.buckets), key)
                self.buckets.append(bucket)
                open_by_key[key] = bucket
            self.where[id(tensor)] = (bucket.index, len(bucket.members))
            bucket.members.append(position)
            bucket.shapes.append(ops.shape(tensor))
            bucket.nbytes += ops.nbytes(tensor)
            if bucket.nbytes >= (first if bucket.index == 0 else bucket_bytes):
                del open_by_key[key]

    def tensors(self) -> List[Any]:
        """The planned tensors (None for one that died since)."""
        return [ref() for ref in self._refs]

    def matches(self, tensors: Sequence[Any]) -> bool:
        """True while ``tensors`` are exactly the planned ones, in the same order."""
        return len(tensors) == len(self._refs) and all(
            ref() is t for ref, t in zip(self._refs, tensors)
        )
