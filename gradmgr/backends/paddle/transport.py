"""Collectives for Paddle tensors: Paddle's own (``paddle.distributed``: gloo on CPU, nccl on
GPU), on the tensors themselves.

Chosen by measurement (docs/paddle.md): on this project's 2-core CPU machine, 2 ranks, the
allreduce of a 10 MB float32 tensor took a median 15 ms over Paddle's gloo, as long as
torch.distributed's gloo on a torch tensor, while torch's gloo on a Paddle tensor, copied
through numpy (as MegEngine's tensors go) or dlpack, took 105 ms or 36 ms.
"""

from __future__ import annotations

from typing import Any, Optional

import paddle.distributed as pdist

from gradmgr.distributed.consistency import STEPS, CheckTerms

from .ops import NO_SHARDING

NOT_INITIALISED = (
    "paddle.distributed is not initialised: call paddle.distributed.init_parallel_env() on "
    "every rank first (ranks started by `python -m paddle.distributed.launch`, "
    "paddle.distributed.spawn or gradmgr.distributed.spawn_local; on a CPU, with "
    "PADDLE_DISTRI_BACKEND=gloo, which spawn_local sets). With one process it initialises "
    "nothing: data parallelism on Paddle needs 2 ranks or more"
)


def make(group: Any, name: Optional[str], backend: Any) -> PaddleTransport:
    """The transport called ``name`` (``"paddle"``, the only one), or the default."""
    if name is not None and name != "paddle":
        raise backend.unknown_transport(name)
    return PaddleTransport(group)


class _Task:
    """A started collective; ``wait()`` gives the tensor it reduced in place."""

    __slots__ = ("_task", "_flat")

    def __init__(self, task: Any, flat: Any) -> None:
        self._task, self._flat = task, flat

    def wait(self) -> Any:
        self._task.wait()
        return self._flat


class PaddleTransport:
    """``paddle.distributed.all_reduce`` / ``broadcast`` over ``group`` (None: every rank)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def _check(self) -> None:
        if not pdist.is_initialized():
            raise RuntimeError(NOT_INITIALISED)

    def world_size(self) -> int:
        self._check()
        return pdist.get_world_size(self.group)

    def rank(self) -> int:
        self._check()
        return pdist.get_rank(self.group)

    def allreduce_async(self, flat: Any) -> _Task:
        self._check()
        return _Task(pdist.all_reduce(flat, group=self.group, sync_op=False), flat)

    def control(self, terms: CheckTerms = STEPS) -> Any:
        """The plan checks' transport: a gloo group of their own, with a patience
        (:mod:`.checks`)."""
        from .checks import CheckTransport

        return CheckTransport(self.group, terms)

    def broadcast(self, flat: Any, src: int) -> Any:
        self._check()
        pdist.broadcast(flat, src, group=self.group)
        return flat

    def reduce_scatter_async(self, flat: Any) -> Any:
        raise NotImplementedError(NO_SHARDING)

    def all_gather_async(self, chunk: Any) -> Any:
        raise NotImplementedError(NO_SHARDING)
