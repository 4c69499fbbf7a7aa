"""Bucket planning: which gradients are reduced together, identically on every rank.

The plan depends only on the attached tensors (their first-attach order, dtype, device and
size), never on the order in which gradients arrive, so every rank builds the same buckets and
launches them in the same order; collectives issued in different orders would deadlock or mix
buffers.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..contract import TensorOps

LARGE_BYTES = 2**18
"""Members of at least this size are copied into the bucket's buffer as soon as their gradient
arrives (so the gradient is freed at once, as DDP does); smaller ones are packed together when
the bucket is launched (one copy for all of them, cheaper than one per member)."""


class Bucket:
    """Members (positions in the plan) reduced as one flat buffer of one dtype and device.

    The buffer holds the small members first, then the large ones (each region in member
    order), then one "used" flag per member, then a "this rank failed" marker (see
    ``TensorOps.new_buffer``): ``offsets[slot]`` is where member ``slot`` starts,
    ``small`` lists the small members' slots, ``numel`` the elements before the flags.

    Example:
        >>> import torch
        >>> from gradmgr import get_backend
        >>> ops = get_backend("torch").tensor_ops()
        >>> bucket = BucketPlan([torch.zeros(3), torch.zeros(2)], ops, 2**20).buckets[0]
        >>> bucket.members, bucket.sizes, bucket.numel
        ([1, 0], [2, 3], 5)
    """

    __slots__ = ("index", "key", "members", "shapes", "sizes", "large", "nbytes", "offsets",
                 "small", "layout", "small_numel", "numel", "spare")

    def __init__(self, index: int, key: Tuple[str, str]) -> None:
        self.index = index
        self.key = key
        self.members: List[int] = []
        self.shapes: List[Tuple[int, ...]] = []
        self.sizes: List[int] = []
        self.large: List[bool] = []
        self.nbytes = 0
        self.offsets: List[int] = []
        self.small: List[int] = []
        self.layout: List[int] = []  # slots in buffer order
        self.small_numel = 0
        self.numel = 0
        self.spare: Any = None  # the last buffer (sharded: a pool's), reused once free

    def _lay_out(self) -> None:
        self.small = [slot for slot, large in enumerate(self.large) if not large]
        self.layout = self.small + [slot for slot, large in enumerate(self.large) if large]
        self.offsets = [0] * len(self.members)
        offset = 0
        for slot in self.layout:
            self.offsets[slot] = offset
            offset += self.sizes[slot]
        self.small_numel = sum(self.sizes[slot] for slot in self.small)
        self.numel = offset

    @property
    def buffer_numel(self) -> int:
        """The length of the bucket's flat buffer: the values, a flag per member, the failure
        marker."""
        return self.numel + len(self.members) + 1

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {self.key}, members={self.members}, {self.nbytes} B)"


class BucketPlan:
    """Buckets over ``tensors`` filled in reverse attach order (late layers first, as their
    gradients are ready first), one open bucket per (dtype, device), each closed once it holds
    at least ``bucket_bytes``; the very first bucket closes at ``first_bucket_bytes`` already
    (as in DDP), so that communication starts early in the backward.

    Example:
        >>> import torch
        >>> from gradmgr import get_backend
        >>> ts = [torch.zeros(4), torch.zeros(4), torch.zeros(4)]
        >>> ops = get_backend("torch").tensor_ops()
        >>> [b.members for b in BucketPlan(ts, ops, bucket_bytes=32).buckets]
        [[2, 1], [0]]
    """

    def __init__(self, tensors: Sequence[Any], ops: TensorOps, bucket_bytes: int,
                 first_bucket_bytes: Optional[int] = None) -> None:
        first = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
        self._refs = [weakref.ref(t) for t in tensors]
        self.dtypes = ops.dtypes(tensors)  # compared at every recording (see TensorOps.dtypes)
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
            shape = ops.shape(tensor)
            bucket.shapes.append(shape)
            bucket.sizes.append(_numel(shape))
            nbytes = ops.nbytes(tensor)
            bucket.large.append(nbytes >= LARGE_BYTES)
            bucket.nbytes += nbytes
            if bucket.nbytes >= (first if bucket.index == 0 else bucket_bytes):
                del open_by_key[key]
        for bucket in self.buckets:
            bucket._lay_out()

    def tensors(self) -> List[Any]:
        """The planned tensors (None for one that died since)."""
        return [ref() for ref in self._refs]

    def tensor(self, position: int) -> Any:
        """The planned tensor at ``position`` (None if it died since)."""
        return self._refs[position]()

    def matches(self, tensors: Sequence[Any], ops: Optional[TensorOps] = None) -> bool:
        """True while ``tensors`` are exactly the planned ones, in the same order (and, given
        the ``ops``, with the same dtypes)."""
        return len(tensors) == len(self._refs) and all(
            ref() is t for ref, t in zip(self._refs, tensors)
        ) and (ops is None or ops.dtypes(tensors) == self.dtypes)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
