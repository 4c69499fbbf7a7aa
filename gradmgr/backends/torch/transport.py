"""Collectives over ``torch.distributed`` (gloo on CPU, nccl on CUDA, ...)."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch.distributed as dist

from gradmgr.distributed.consistency import STEPS, CheckTerms
from gradmgr.errors import GradMgrWarning

from .arrival import arrived, group_store
from .control import CheckTransport
from .teardown import collect_cycles_at_exit


def initialised_dist() -> Any:
    """``torch.distributed``, after checking that a process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: data parallelism runs one process per rank "
            "in a process group. Start the script with `torchrun --nproc_per_node 2 "
            "train.py` (or gradmgr.distributed.spawn_local) and call "
            "torch.distributed.init_process_group('gloo' or 'nccl') in every process before "
            "data_parallel() or the first backward (or pass transport= to make_allreduce_cb)"
        )
    return dist


class TorchWork:
    """A collective in flight; ``wait()`` returns the buffer it reduces in place."""

    __slots__ = ("_work", "_flat")

    def __init__(self, work: Any, flat: Any) -> None:
        self._work, self._flat = work, flat

    def wait(self) -> Any:
        self._work.wait()
        return self._flat


class TorchCollective:
    """What transports over ``torch.distributed`` share: the process group, rank and size,
    starting a sum and broadcasting a host or device buffer."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        collect_cycles_at_exit()  # a group held by a cycle must not be freed at shutdown

    def world_size(self) -> int:
        return initialised_dist().get_world_size(self.group)

    def rank(self) -> int:
        return initialised_dist().get_rank(self.group)

    def start_sum(self, buffer: Any) -> Any:
        d = initialised_dist()
        return d.all_reduce(buffer, op=d.ReduceOp.SUM, group=self.group, async_op=True)

    def arrive(self, key: str, waiting: Optional[str] = None) -> Optional[bool]:
        """Whether every rank reached ``key`` within the group's timeout, asked of the group's
        store without a collective (see :mod:`.arrival`); None where there is no store.
        ``waiting`` (formatted with ``seconds``, the patience that remains) is warned where the
        others are late (``arrival.NUDGE``)."""
        store = group_store(self.group)
        if store is None:
            return None

        def warn(left: Any) -> None:
            if waiting is not None:
                warnings.warn(waiting.format(seconds=left.total_seconds()),
                              GradMgrWarning, stacklevel=2)

        return arrived(store, f"gradmgr/{key}", self.world_size(), warn)

    def broadcast_in_place(self, buffer: Any, src: int, async_op: bool = False) -> Any:
        """Broadcast from the group's rank ``src``; the work in flight where ``async_op``."""
        d = initialised_dist()
        root = src if self.group is None else d.get_global_rank(self.group, src)
        return d.broadcast(buffer, src=root, group=self.group, async_op=async_op)


class TorchTransport(TorchCollective):
    """``torch.distributed.all_reduce(async_op=True)`` on torch tensors (gloo, nccl, ...).

    Example:
        >>> # torch.distributed.init_process_group("gloo", ...)
        >>> # cb = make_allreduce_cb("mean", transport=TorchTransport())
    """

    def allreduce_async(self, flat: Any) -> TorchWork:
        return TorchWork(self.start_sum(flat), flat)

    def broadcast(self, flat: Any, src: int) -> Any:
        self.broadcast_in_place(flat, src)
        return flat

    def control(self, terms: CheckTerms = STEPS) -> Any:
        """The transport of the plan checks: a gloo group of their own (:mod:`.control`),
        whose errors speak of the checking path's ``terms``."""
        return CheckTransport(self.group, terms) if dist.is_gloo_available() else self

    def reduce_scatter_async(self, flat: Any) -> Any:
        d = initialised_dist()
        world, rank = d.get_world_size(self.group), d.get_rank(self.group)
        if flat.device.type == "cpu":
            # On CPU the collective is gloo's, whose reduce_scatter_tensor allreduces a clone
            # of its whole input: summing gradmgr's own buffer in place and keeping this rank's
            # chunk costs the same traffic without the clone (a bucket's size, per bucket).
            return ChunkOfSum(self.start_sum(flat), flat, rank, world)
        chunk = flat.new_empty(flat.numel() // world)
        work = _reduce_scatter_single(d)(chunk, flat, op=d.ReduceOp.SUM, group=self.group,
                                         async_op=True)  # never AVG: gloo in torch 2.8 ignores it
        return TorchWork(work, chunk)

    def all_gather_async(self, chunk: Any) -> TorchWork:
        d = initialised_dist()
        full = chunk.new_empty(chunk.numel() * d.get_world_size(self.group))
        work = _all_gather_single(d)(full, chunk.contiguous(), group=self.group,
                                     async_op=True)
        return TorchWork(work, full)

    def broadcast_async(self, tensor: Any, src: int) -> TorchWork:
        return TorchWork(self.broadcast_in_place(tensor, src, async_op=True), tensor)


def _all_gather_single(d: Any) -> Any:
    """``all_gather_single`` where torch has it (2.13 does, and deprecates
    ``all_gather_into_tensor`` with a FutureWarning at every call); else the latter, the same
    collective, not deprecated there (2.8)."""
    return getattr(d, "all_gather_single", None) or d.all_gather_into_tensor


def _reduce_scatter_single(d: Any) -> Any:
    """``reduce_scatter_single`` where torch has it, else ``reduce_scatter_tensor`` (as
    :func:`_all_gather_single`)."""
    return getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor


class ChunkOfSum:
    """A sum over the ranks in flight in ``flat`` itself; ``wait()`` returns a copy of this
    rank's chunk of it (a copy, so that ``flat``, a bucket's buffer, can be reused at once)."""

    __slots__ = ("_work", "_flat", "_rank", "_world", "_chunk")

    def __init__(self, work: Any, flat: Any, rank: int, world: int) -> None:
        self._work, self._flat, self._rank, self._world = work, flat, rank, world
        self._chunk: Any = None

    def wait(self) -> Any:
        if self._chunk is None:
            self._work.wait()  # raises the transport's error, every time it is asked
            n = self._flat.numel() // self._world
            self._chunk = self._flat[self._rank * n:(self._rank + 1) * n].clone()
            self._flat = self._work = None
        return self._chunk
