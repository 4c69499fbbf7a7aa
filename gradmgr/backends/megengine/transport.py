"""Collectives for MegEngine tensors: MegEngine's own (nccl/rccl, GPU only), or, on a machine
without them, ``torch.distributed`` (gloo) reached through host memory."""

from __future__ import annotations

import sys
from typing import Any, Optional

import megengine
import megengine.distributed as mdist
import numpy as np

from gradmgr.distributed.consistency import STEPS, CheckTerms
from gradmgr.distributed.contract import Done

from .world import is_gloo_world


def make(group: Any, name: Optional[str], backend: Any) -> Any:
    """The transport called ``name``, or the default: MegEngine's own collectives when
    initialised (by MegEngine, not by gradmgr's launcher: see :mod:`.world`), else
    torch.distributed gloo through host memory when that is."""
    own = mdist.is_distributed() and not is_gloo_world()
    if name == "megengine" or (name is None and own):
        return MegEngineTransport(group)
    if name == "megengine-via-torch" or (name is None and _torch_dist_initialised()):
        return MegEngineViaTorchTransport(group)
    if name is not None:
        raise backend.unknown_transport(name)
    raise RuntimeError(
        "no collective engine for MegEngine tensors: initialise megengine.distributed "
        "(GPU) or torch.distributed with gloo (CPU) before the first backward"
    )


def _torch_dist_initialised() -> bool:
    dist = sys.modules.get("torch.distributed")  # torch.distributed is initialised only if imported
    return dist is not None and dist.is_available() and dist.is_initialized()


class MegEngineTransport:
    """``megengine.distributed.functional.all_reduce_sum`` (nccl/rccl, GPU only).

    MegEngine dispatches the collective asynchronously on the device; the handle holds the
    result tensor, which later operations wait for on the device, not on the host.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def _group(self) -> Any:
        if not mdist.is_distributed():
            raise RuntimeError(
                "megengine.distributed is not initialised: call "
                "megengine.distributed.init_process_group(...) first (GPU only); on a CPU, "
                "initialise torch.distributed with gloo instead"
            )
        return self.group if self.group is not None else mdist.WORLD

    def world_size(self) -> int:
        group = self._group()
        return mdist.get_world_size() if group is mdist.WORLD else group.size

    def rank(self) -> int:
        group = self._group()
        return mdist.get_rank() if group is mdist.WORLD else group.rank

    def allreduce_async(self, flat: Any) -> Done:
        from megengine.distributed.functional import all_reduce_sum

        return Done(all_reduce_sum(flat, group=self._group()))

    def reduce_scatter_async(self, flat: Any) -> Done:
        from megengine.distributed.functional import reduce_scatter_sum

        return Done(reduce_scatter_sum(flat, group=self._group()))

    def all_gather_async(self, chunk: Any) -> Done:
        from megengine.distributed.functional import all_gather

        return Done(all_gather(chunk, group=self._group()))

    def broadcast(self, flat: Any, src: int) -> Any:
        from megengine.distributed.functional import broadcast

        if src != 0:
            raise ValueError("megengine.distributed broadcasts from the group's rank 0 only; "
                             "use src=0")
        return broadcast(flat, group=self._group())


def _host_copy(flat: Any) -> Any:
    """A torch CPU tensor holding a copy of a MegEngine tensor's values."""
    import torch

    return torch.from_numpy(np.array(flat.numpy(), copy=True))


def _from_host(buffer: Any, device: Any) -> Any:
    """The values of a torch CPU tensor as a MegEngine tensor on ``device``."""
    return megengine.Tensor(buffer.numpy(), device=device)


class _HostWork:
    """A torch collective on a host copy; ``buffer`` None: the work's own result."""

    __slots__ = ("_work", "_buffer", "_device")

    def __init__(self, work: Any, buffer: Any, device: Any) -> None:
        self._work, self._buffer, self._device = work, buffer, device

    def wait(self) -> Any:
        result = self._work.wait()
        return _from_host(result if self._buffer is None else self._buffer, self._device)


def _torch_collective(group: Any) -> Any:
    from gradmgr.backends.torch.transport import TorchTransport

    return TorchTransport(group)


class MegEngineViaTorchTransport:
    """MegEngine tensors reduced by ``torch.distributed`` (gloo) through host memory.

    MegEngine's own collectives need a GPU; this lets CPU-only machines train MegEngine
    models data-parallel: tensor -> numpy -> torch -> allreduce -> back, on the tensor's device.
    """

    def __init__(self, group: Any = None, collective: Any = None) -> None:
        self.group = group
        self._torch = _torch_collective(group) if collective is None else collective

    def world_size(self) -> int:
        return self._torch.world_size()

    def rank(self) -> int:
        return self._torch.rank()

    def arrive(self, key: str, waiting: Optional[str] = None) -> Any:
        return self._torch.arrive(key, waiting)

    def control(self, terms: CheckTerms = STEPS) -> MegEngineViaTorchTransport:
        """The plan checks' transport: torch's, in a gloo group of their own (its errors in
        the checking path's ``terms``)."""
        return MegEngineViaTorchTransport(self.group, self._torch.control(terms))

    def allreduce_async(self, flat: Any) -> _HostWork:
        buffer = _host_copy(flat)
        return _HostWork(self._torch.start_sum(buffer), buffer, flat.device)

    def broadcast(self, flat: Any, src: int) -> Any:
        buffer = _host_copy(flat)
        self._torch.broadcast_in_place(buffer, src)
        return _from_host(buffer, flat.device)

    def reduce_scatter_async(self, flat: Any) -> _HostWork:
        work = self._torch.reduce_scatter_async(_host_copy(flat))
        return _HostWork(work, None, flat.device)

    def all_gather_async(self, chunk: Any) -> _HostWork:
        work = self._torch.all_gather_async(_host_copy(chunk))
        return _HostWork(work, None, chunk.device)
