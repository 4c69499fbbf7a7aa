"""Distributed checkpoints of a ``ShardedOptimizer`` on ``torch.distributed.checkpoint`` (the
framework's part of :mod:`gradmgr.distributed.sharded.dcp_state`).

Each state tensor of a parameter becomes one ``ShardedTensor`` of the parameter's shape, keyed
``state.<parameter's name>.<key>`` as torch's ``get_state_dict`` keys a DDP or FSDP2
optimizer: a rank's flat slice of the parameter is cut into the few boxes (rectangular
pieces) it covers, views of the optimizer's own state (no copy on save), and every rank's boxes
are known from the plan, so DCP writes each piece once and reads, at another world size or
into another layout (DDP's whole tensors), the pieces that overlap. A state with one value per
parameter (Adam's step) is a plain tensor, as DDP's: DCP writes it once.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed.checkpoint import state_dict as torch_state
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

Box = Tuple[List[int], List[int]]  # offsets, sizes
_WHERE = "gradmgr.distributed.set_state_dict"


def boxes(shape: Sequence[int], start: int, stop: int) -> List[Box]:
    """The boxes that the flat range ``[start, stop)`` of a tensor of ``shape`` covers, in
    flat order (at most two partial rows per dimension and one block of whole rows)."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [([start], [stop - start])]
    inner = math.prod(shape[1:])
    row, column = divmod(start, inner)
    if column or stop - start < inner:  # a part of one row
        end = min(stop, (row + 1) * inner)
        head = [([row, *o], [1, *s]) for o, s in boxes(shape[1:], column, end - row * inner)]
        return head + boxes(shape, end, stop)
    rows = (stop - start) // inner
    block = ([row] + [0] * (len(shape) - 1), [rows, *shape[1:]])
    return [block] + boxes(shape, start + rows * inner, stop)


class TorchCheckpoints:
    """What :mod:`gradmgr.distributed.sharded.dcp_state` needs of torch."""

    def is_fully_sharded(self, model: Any) -> bool:
        """``model`` is wrapped with FSDP2's ``fully_shard`` (``shard="full"``)."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # torch before 2.6: no FSDP2
            return False
        return isinstance(model, FSDPModule)

    def full_state(self, model: Any, optimizer: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Full sharding's checkpoint: torch's own ``get_state_dict`` for FSDP2."""
        model_state, optim_state = torch_state.get_state_dict(model, optimizer)
        return model_state, optim_state

    def load_full_state(self, model: Any, optimizer: Any, model_state: Dict[str, Any],
                        optim_state: Dict[str, Any]) -> None:
        torch_state.set_state_dict(model, optimizer, model_state_dict=model_state,
                                   optim_state_dict=optim_state)

    def model_state(self, model: Any) -> Dict[str, Any]:
        return get_model_state_dict(model)  # whole on every rank: DCP writes each once

    def load_model(self, model: Any, state: Dict[str, Any]) -> None:
        set_model_state_dict(model, state)

    def optimizer_state(self, model: Any, view: Any) -> Dict[str, Any]:
        names = _names(model, view)
        held = _held(view)
        state: Dict[str, Dict[str, Any]] = {}
        for param in view.params:
            if param.own:
                state[names[id(param.param)]] = _param_state(param, held, view.rank)
        return {"state": state, "param_groups": _groups(view, names)}

    def load_optimizer(self, model: Any, view: Any, saved: Dict[str, Any]) -> None:
        names = _names(model, view)
        if not isinstance(saved, dict) or "state" not in saved or "param_groups" not in saved:
            raise ValueError(f"{_WHERE}: optim_state_dict must be the optimizer's dict of "
                             f"get_state_dict (keys 'state' and 'param_groups'), loaded by "
                             f"dcp.load")
        options = _saved_options(view, names, saved["param_groups"])
        loaded = {}  # checked entirely before anything changes
        for param in view.params:
            entry = saved["state"].get(names[id(param.param)])
            for piece in param.own:
                loaded[piece] = (None if entry is None else
                                 _slice_of(entry, piece, param, names[id(param.param)]))
        for group, found in zip(view.param_groups, options):
            group.update(found)  # the next step passes them to the wrapped optimizer
        for piece, state in loaded.items():
            if state is None:
                view.ops.reset_optimizer_state(view.optimizer, piece.tensor)
            else:
                view.ops.set_optimizer_state(view.optimizer, piece.tensor, state)


def refuse_sliced(value: Any) -> None:
    """Raise ValueError where ``value`` is one of :func:`get_state_dict`'s global tensors,
    handed to ``ShardedOptimizer.load_state_dict``, which takes whole tensors (cut as whole
    ones, they raised torch's ShardedTensor error half-way through the load, the groups'
    options already changed)."""
    if isinstance(value, ShardedTensor):
        raise ValueError(
            "ShardedOptimizer.load_state_dict: a loaded state is a ShardedTensor, of which "
            "this rank holds only its pieces: the dict of gradmgr.distributed.get_state_dict "
            "(torch.distributed.checkpoint's layout). Load that dict, filled by dcp.load, with "
            "gradmgr.distributed.set_state_dict(model, opt, model_state_dict=..., "
            "optim_state_dict=...); opt.load_state_dict takes whole tensors, as "
            "opt.state_dict() gives them")


def _names(model: Any, view: Any) -> Dict[int, str]:
    names = {id(p): name for name, p in model.named_parameters()}
    for group in view.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("gradmgr.distributed.get_state_dict/set_state_dict: a "
                                 "parameter of the optimizer is not one of the model's "
                                 "(named_parameters()): pass the model the optimizer trains")
    return names


def _held(view: Any) -> Dict[int, Dict[str, Any]]:
    """Each of this rank's slices' state: the optimizer's, or, where it has none yet, what
    its class makes on a step with zero gradients and no learning rate (torch's
    ``get_state_dict`` does the same to a fresh optimizer, in place; here on zeros)."""
    held, missing = {}, []
    for param in view.params:
        for piece in param.own:
            state = view.ops.optimizer_state(view.optimizer, piece.tensor)
            if state:
                held[id(piece.tensor)] = state
            else:
                missing.append((param.group, piece.tensor))
    if missing:
        held.update(_fresh(view.optimizer, missing))
    return held


def _fresh(optimizer: Any, missing: List[Tuple[int, Any]]) -> Dict[int, Dict[str, Any]]:
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
              for g in optimizer.param_groups]
    zeros = {}
    for number, tensor in missing:
        zero = torch.zeros_like(tensor)
        zero.grad = torch.zeros_like(tensor)
        groups[number]["params"].append(zero)
        zeros[id(tensor)] = zero
    for group in groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
    made = type(optimizer)([g for g in groups if g["params"]])
    made.step()
    return {key: dict(made.state.get(zero, {})) for key, zero in zeros.items()}


def _param_state(param: Any, held: Dict[int, Dict[str, Any]], rank: int) -> Dict[str, Any]:
    states = [held[id(piece.tensor)] for piece in param.own]
    out: Dict[str, Any] = {}
    for key, value in states[0].items():
        if torch.is_tensor(value) and value.shape == param.own[0].tensor.shape:
            out[key] = _global(param, [s[key] for s in states], rank)
        else:  # one value per parameter (a step count): every slice holds the same
            out[key] = value
    return out


def _global(param: Any, values: List[Any], rank: int) -> Any:
    """One state tensor of ``param`` as a ShardedTensor of its shape: this rank's boxes are
    views of ``values`` (one flat tensor per own slice)."""
    shape = list(param.param.shape)
    device = values[0].device
    if not shape:  # a 0-d parameter: one rank holds it, as a plain tensor
        return values[0].view(())
    everyone = [ShardMetadata(o, s, f"rank:{r}/{device}")
                for r, start, stop in param.ranges for o, s in boxes(shape, start, stop)]
    local = []
    for piece, value in zip(param.own, values):
        at = 0
        for o, s in boxes(shape, piece.start, piece.stop):
            n = math.prod(s)
            local.append(Shard(value[at:at + n].view(s),
                               ShardMetadata(o, s, f"rank:{rank}/{device}")))
            at += n
    properties = TensorProperties(dtype=values[0].dtype, requires_grad=False)
    meta = ShardedTensorMetadata(everyone, torch.Size(shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def _groups(view: Any, names: Dict[int, str]) -> List[Dict[str, Any]]:
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [names[id(p)] for p in g["params"]]} for g in view.param_groups]


def _saved_options(view: Any, names: Dict[int, str], saved: Any) -> List[Dict[str, Any]]:
    """Each of our groups' options: those of the saved group that holds its parameters."""
    found = []
    for index, group in enumerate(view.param_groups):
        ours = [names[id(p)] for p in group["params"]]
        match = [g for g in saved if ours and ours[0] in g.get("params", ())]
        if not match:
            raise ValueError(f"{_WHERE}: no parameter group of the loaded dict holds "
                             f"parameter {ours[0] if ours else None!r} (group {index}): the "
                             f"checkpoint was saved from another model")
        found.append({k: v for k, v in match[0].items() if k != "params"})
    return found


def _slice_of(entry: Dict[str, Any], piece: Any, param: Any, name: str) -> Dict[str, Any]:
    """This slice's part of one parameter's loaded state, as new tensors."""
    shape = tuple(param.param.shape)
    out = {}
    for key, value in entry.items():
        if isinstance(value, ShardedTensor):
            value = _own_boxes(value, piece, shape, f"{name}.{key}")
        elif torch.is_tensor(value) and tuple(value.shape) == shape and (shape or key != "step"):
            value = value.detach().reshape(-1)[piece.start:piece.stop].clone()
        elif torch.is_tensor(value) and value.numel() == 1:
            value = value.detach().clone()
        elif torch.is_tensor(value):
            raise ValueError(f"{_WHERE}: the loaded state {name}.{key} has shape "
                             f"{tuple(value.shape)}, the parameter {shape}: saved from "
                             f"another model")
        out[key] = value
    return out


def _own_boxes(value: Any, piece: Any, shape: tuple, what: str) -> Any:
    by_box = {(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)): s.tensor
              for s in value.local_shards()}
    parts = []
    for o, s in boxes(list(shape), piece.start, piece.stop):
        part = by_box.get((tuple(o), tuple(s)))
        if part is None:
            raise ValueError(f"{_WHERE}: the loaded {what} does not hold this rank's slice "
                             f"(offsets {o}): pass the dict get_state_dict made for this "
                             f"optimizer, filled by dcp.load")
        parts.append(part.reshape(-1))
    return torch.cat(parts)
