"""Distributed checkpoints of a ``ShardedOptimizer`` (``torch.distributed.checkpoint``, DCP):
``get_state_dict`` and ``set_state_dict``, spelled and laid out as torch's own
(``torch.distributed.checkpoint.state_dict``), where each rank saves and loads only its slices.

A rank's slices of a parameter are flat ranges of it (its segments, :mod:`.sharding`); every
rank knows every rank's ranges from the plan alone, so the backend can describe each state
tensor as one global tensor of the parameter's shape, keyed by the parameter's name, of which
this rank holds some pieces. DCP then writes each piece once and reads, at any world size,
the pieces that overlap what a rank asks for. The framework's part (the global tensors, the
names, the model's own state) is the backend's ``TensorOps.distributed_checkpoint()``.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Tuple

from ...registry import backend_for
from .optimizer_state import Layout
from .sharding import own_segments


class OwnSlice(NamedTuple):
    """One of this rank's segments of a parameter: its range and the tensor stepped for it."""

    start: int
    stop: int
    tensor: Any


class ParamSlices(NamedTuple):
    """One stepped parameter: its number in ``params``, its group, every rank's ranges of it
    (``(rank, start, stop)``) and this rank's own slices."""

    number: int
    group: int
    param: Any
    ranges: List[Tuple[int, int, int]]
    own: List[OwnSlice]


class Slices(NamedTuple):
    """What a distributed checkpoint needs of a ``ShardedOptimizer``."""

    ops: Any
    optimizer: Any  # the wrapped one, over this rank's segments
    params: List[ParamSlices]  # by index in ``params``
    param_groups: List[Dict[str, Any]]  # the unsharded optimizer's (the model's parameters)
    rank: int
    world: int


def param_slices(layout: Layout, group_of: List[int], rank: int,
                 world: int) -> List[ParamSlices]:
    """Every parameter of ``layout``'s plan with every rank's ranges of it (from the plan
    alone: no collective) and this rank's segments."""
    plan = layout.plan
    ranges: Dict[int, List[Tuple[int, int, int]]] = {}
    for r in range(world):
        for segment in own_segments(plan, r, world):
            ranges.setdefault(segment.position, []).append((r, segment.start, segment.stop))
    own: Dict[int, List[OwnSlice]] = {}
    for segment, tensor in zip(layout.segments, layout.tensors):
        own.setdefault(segment.position, []).append(OwnSlice(segment.start, segment.stop,
                                                             tensor))
    found = []
    for position in sorted(ranges, key=lambda p: layout.numbering[p]):
        index = layout.numbering[position]
        found.append(ParamSlices(index, group_of[index], plan.tensor(position),
                                 ranges[position], own.get(position, [])))
    return found


def get_state_dict(model: Any, optimizer: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The model's and a ``ShardedOptimizer``'s state, for ``torch.distributed.checkpoint``'s
    ``save`` and ``load`` (as ``torch.distributed.checkpoint.state_dict.get_state_dict``
    gives them for DDP or FSDP2): the model's by name, the optimizer's as
    ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``, each
    state tensor a global tensor of its parameter's shape of which this rank holds its
    slices (no gather). Every rank calls it (it communicates nothing).

    For ``dcp.load``, it is the template loaded into: a parameter whose slices have no state
    yet gets zeros of the wrapped optimizer's making (as torch's ``get_state_dict`` steps
    a fresh optimizer with zero gradients and no learning rate), so that every key is
    loaded; then :func:`set_state_dict`. Parameters never stepped here (frozen) are left
    out, on both sides.

    Example:
        Here a process group of one rank (docs/sharded.md saves on two, loads on any):

        >>> import tempfile
        >>> import torch
        >>> import torch.distributed as dist
        >>> import torch.distributed.checkpoint as dcp
        >>> from gradmgr.distributed import ShardedOptimizer, data_parallel, free_port
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> model = torch.nn.Linear(3, 2)
        >>> gm = data_parallel(model, shard=True)
        >>> opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=0.1)
        >>> with gm:
        ...     gm.backward(model(torch.ones(1, 3)).sum())
        >>> opt.step()
        >>> model_state, optim_state = get_state_dict(model, opt)
        >>> sorted(optim_state["state"]["weight"])  # by name, as torch's get_state_dict
        ['exp_avg', 'exp_avg_sq', 'step']
        >>> folder = tempfile.mkdtemp()
        >>> _ = dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
        >>> del opt, gm  # they hold the manager: before the group goes
        >>> dist.destroy_process_group()
    """
    whole = _fully_sharded(model, optimizer)
    if whole is not None:
        return whole.full_state(model, optimizer)
    view = _slices(optimizer)
    support = _support(view)
    return support.model_state(model), support.optimizer_state(model, view)


def set_state_dict(model: Any, optimizer: Any, *, model_state_dict: Dict[str, Any],
                   optim_state_dict: Dict[str, Any]) -> None:
    """Load what :func:`get_state_dict` gave, filled by ``dcp.load`` (from a checkpoint of
    any world size, or of DDP with the same optimizer class), into the model and the
    ``ShardedOptimizer``: each rank copies its slices; every group takes the saved options
    of the group its parameters were saved in. Raises ValueError, before changing the
    optimizer, where the dict names other parameters or holds state that is not one value
    per element or one value per parameter.

    Example:
        A checkpoint saved by :func:`get_state_dict`, loaded on a process group of one rank:

        >>> import tempfile
        >>> import torch
        >>> import torch.distributed as dist
        >>> import torch.distributed.checkpoint as dcp
        >>> from gradmgr.distributed import (ShardedOptimizer, data_parallel, free_port,
        ...                                  get_state_dict)
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> model = torch.nn.Linear(3, 2)
        >>> gm = data_parallel(model, shard=True)
        >>> opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=0.1)
        >>> with gm:
        ...     gm.backward(model(torch.ones(1, 3)).sum())
        >>> opt.step()
        >>> folder = tempfile.mkdtemp()
        >>> _ = dcp.save(dict(zip(["model", "optim"], get_state_dict(model, opt))),
        ...              checkpoint_id=folder)
        >>> fresh = ShardedOptimizer(gm, torch.optim.AdamW, lr=0.1)
        >>> model_state, optim_state = get_state_dict(model, fresh)  # the template
        >>> dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
        >>> set_state_dict(model, fresh, model_state_dict=model_state,
        ...                optim_state_dict=optim_state)
        >>> torch.equal(fresh.state_dict()["state"][0]["exp_avg"],
        ...             opt.state_dict()["state"][0]["exp_avg"])
        True
        >>> del opt, fresh, gm  # they hold the manager: before the group goes
        >>> dist.destroy_process_group()
    """
    whole = _fully_sharded(model, optimizer)
    if whole is not None:
        whole.load_full_state(model, optimizer, model_state_dict, optim_state_dict)
        return
    view = _slices(optimizer)
    support = _support(view)
    support.load_optimizer(model, view, optim_state_dict)
    support.load_model(model, model_state_dict)


def _fully_sharded(model: Any, optimizer: Any) -> Any:
    """The framework's checkpoints where ``model`` is fully sharded by the framework's own
    engine (``data_parallel(model, shard="full")``: FSDP2) and ``optimizer`` a plain one over
    its shards: the framework's own functions do all of it (torch's ``get_state_dict`` and
    ``set_state_dict``); else None."""
    if hasattr(optimizer, "checkpoint_slices"):
        return None
    params = getattr(model, "parameters", None)
    first = next(iter(params()), None) if callable(params) else None
    backend = None if first is None else backend_for(first)
    support = None if backend is None else backend.tensor_ops().distributed_checkpoint()
    if support is None or not support.is_fully_sharded(model):
        return None
    return support


def _slices(optimizer: Any) -> Slices:
    method = getattr(optimizer, "checkpoint_slices", None)
    if method is None:
        raise TypeError(
            f"gradmgr.distributed.get_state_dict/set_state_dict take a ShardedOptimizer, or a "
            f"plain optimizer over a model under data_parallel(model, shard='full'), not "
            f"{type(optimizer).__name__} over this model: for a plain optimizer (DDP), use "
            f"torch.distributed.checkpoint.state_dict.get_state_dict/set_state_dict")
    slices: Slices = method()
    return slices


def _support(view: Slices) -> Any:
    support = view.ops.distributed_checkpoint()
    if support is None:
        raise NotImplementedError("distributed checkpoints are torch.distributed.checkpoint's: "
                                  "this framework's ShardedOptimizer saves with state_dict()")
    return support


__all__ = ["get_state_dict", "set_state_dict"]
