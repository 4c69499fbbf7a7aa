"""``megengine.distributed`` on ranks that gradmgr's launcher started and torch.distributed
(gloo) connects: MegEngine's training scripts run data-parallel on a CPU machine unchanged.

MegEngine's own collectives need a GPU (nccl/rccl), and its rank queries read a module global
that only its own ``init_process_group`` sets: on such ranks ``get_world_size()`` reads 1 and a
script written for MegEngine (``if dist.get_world_size() > 1: ...``) silently trains each rank
alone. Here the queries tell the truth, and the collectives those scripts use
(``bcast_list_``, ``make_allreduce_cb``, ``functional.all_reduce_sum`` for metrics and
``SyncBatchNorm``, ``group_barrier``) run over torch.distributed; any other MegEngine collective
raises.

A script imports those names at its top, which under ``spawn_local`` runs before this module
is installed, so the names it holds are MegEngine's own functions: they are made to work where
they lead rather than only replaced by name. Every MegEngine collective calls
``megengine.distributed.functional.collective_comm`` (looked up when called), which is replaced
here; ``make_allreduce_cb`` is MegEngine's ``AllreduceCallback`` class, whose construction gives
gradmgr's callback here. ``SyncBatchNorm``'s function is replaced too (:mod:`.sync_bn`).
"""

from __future__ import annotations

from typing import Any, Callable, cast

import megengine
import megengine.distributed as mdist
import megengine.functional.distributed as fdist
import numpy as np
from megengine.core.autodiff.grad import Function
from megengine.distributed import functional as dfunc
from megengine.distributed import group as mgroup
from megengine.distributed import helper

from . import sync_bn

GLOO_WORLD = "gradmgr-gloo"
"""What ``megengine.distributed.get_backend()`` reports on such ranks."""

_REFUSED = ("all_reduce_max", "all_reduce_min", "all_gather", "reduce_scatter_sum",
            "reduce_sum", "broadcast", "gather", "scatter", "all_to_all", "remote_send",
            "remote_recv")


def install(rank: int, world: int) -> None:
    """Make ``megengine.distributed`` see this process as ``rank`` of ``world``. Does nothing
    where MegEngine's own group is initialised for the same world."""
    sd = mgroup._sd
    if sd is not None:
        if sd.backend == GLOO_WORLD and (sd.proc_rank, sd.world_size) != (rank, world):
            raise RuntimeError(f"megengine.distributed already sees rank {sd.proc_rank} of "
                               f"{sd.world_size}, not {rank} of {world}")
        return  # MegEngine's own group (GPU), or installed before
    sd = mgroup.StaticData()
    sd.world_size, sd.proc_rank, sd.backend = world, rank, GLOO_WORLD
    sd.device, sd.device_type, sd.client = 0, "cpu", _Client()
    sd.machine_ranks = list(range(world))  # one machine
    mgroup._sd = sd
    mgroup.WORLD.reset(list(range(world)))
    for module in (mdist, helper):
        module.bcast_list_, module.make_allreduce_cb = _bcast_list_, _make_allreduce_cb
    helper.AllreduceCallback.__new__ = _new_allreduce_cb  # (the class a script may hold)
    dfunc.collective_comm = _collective_comm  # what every MegEngine collective calls
    sync_bn.install()  # MegEngine's own goes wrong now and then on a CPU (see there)
    for module in (dfunc, fdist):
        module.all_reduce_sum = _all_reduce_sum
        for name in _REFUSED:
            if hasattr(module, name):
                setattr(module, name, _unsupported(name))


def is_gloo_world() -> bool:
    """This process's megengine.distributed is the one :func:`install` made."""
    return mdist.is_distributed() and mdist.get_backend() == GLOO_WORLD


def _torch_dist() -> Any:
    import torch.distributed as tdist

    if not tdist.is_initialized():
        raise RuntimeError(
            "megengine.distributed on ranks started by gradmgr runs its collectives over "
            "torch.distributed: call torch.distributed.init_process_group('gloo', ...) first "
            "(megengine.distributed.init_process_group needs a GPU)"
        )
    return tdist


class _Client:
    """What ``megengine.distributed.group_barrier`` calls (MegEngine's RPC server is not run)."""

    def group_barrier(self, key: str, size: int) -> None:
        _torch_dist().barrier()

    def bcast_val(self, *args: Any) -> Any:  # what the refused collectives call first
        raise NotImplementedError(_UNSUPPORTED.format(
            name="collective that exchanges values through MegEngine's server (broadcast, "
                 "scatter, remote_send, remote_recv)"))


def _world_only(group: Any) -> None:
    if group is not None and group is not mdist.WORLD:
        raise NotImplementedError("on ranks over gloo, gradmgr serves megengine.distributed.WORLD "
                                  "only")


def _bcast_list_(tensors: Any, group: Any = None) -> None:
    from gradmgr.distributed import broadcast

    _world_only(group)
    tensors = list(tensors)
    if tensors:
        broadcast(tensors, 0)  # gradmgr's: MegEngine tensors through host memory over gloo


def _make_allreduce_cb(reduce_method: str, group: Any = None, backend: Any = None) -> Any:
    from gradmgr.distributed import make_allreduce_cb
    from gradmgr.distributed.reduce.allreduce import Reduce

    _world_only(group)
    # MegEngine's names in any case; make_allreduce_cb refuses others, naming the choices
    return make_allreduce_cb(cast(Reduce, reduce_method.lower()))  # for gradmgr's GradManager


def _new_allreduce_cb(cls: type, reduce_method: str, group: Any = None,
                      backend: Any = None) -> Any:
    """``megengine.distributed.make_allreduce_cb(...)`` (the class ``AllreduceCallback``,
    imported before or after the ranks started): gradmgr's callback, which is not an instance
    of the class, so its ``__init__`` does not run."""
    return _make_allreduce_cb(reduce_method, group, backend)


def _all_reduce_sum(inp: Any, group: Any = None, device: Any = None) -> Any:
    """``all_reduce_sum``, differentiable as MegEngine's: its gradient is the
    ``all_reduce_sum`` of the output's gradient (every rank must backward through it)."""
    _world_only(group)
    return _AllReduceSum()(inp)


def _collective_comm(inp: Any, mode: Any, group: Any, device: Any) -> Any:
    """``megengine.distributed.functional.collective_comm``, which MegEngine's collectives
    call: the sum (``all_reduce_sum``, ``SyncBatchNorm``'s statistics, ``make_allreduce_cb``)
    and the broadcast (``bcast_list_``) over torch.distributed; the others refused."""
    from megengine.core.ops.builtin import CollectiveComm

    _world_only(group)
    if mode == CollectiveComm.Mode.ALL_REDUCE_SUM:
        return _AllReduceSum()(inp)
    if mode == CollectiveComm.Mode.BROADCAST:
        return _host_broadcast(inp)
    raise NotImplementedError(_UNSUPPORTED.format(name=f"collective {mode}"))


def _host_all_reduce(inp: Any) -> Any:
    import torch

    buffer = torch.from_numpy(np.array(inp.numpy(), copy=True))
    _torch_dist().all_reduce(buffer)
    return megengine.Tensor(buffer.numpy(), device=inp.device)


def _host_broadcast(inp: Any) -> Any:
    import torch

    buffer = torch.from_numpy(np.array(inp.numpy(), copy=True))
    _torch_dist().broadcast(buffer, 0)
    return megengine.Tensor(buffer.numpy(), device=inp.device)


class _AllReduceSum(Function):
    """The sum over ranks through host memory; backward: the sum of the output gradients."""

    def forward(self, inp: Any) -> Any:
        return _host_all_reduce(inp)

    def backward(self, grad: Any) -> Any:
        # None: no gradient reached the output (MegEngine still calls a Function's backward
        # then); the program is the same on every rank, so no rank reduces it.
        return None if grad is None else _host_all_reduce(grad)


_UNSUPPORTED = ("megengine.distributed's {name} has no gloo counterpart in gradmgr (MegEngine's "
                "own needs a GPU); compute it on host copies with torch.distributed")


def _unsupported(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(_UNSUPPORTED.format(name=f"functional.{name}"))

    return refuse
