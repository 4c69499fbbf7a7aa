"""Full sharding (``data_parallel(model, shard="full")``) on torch's own engine for it,
FSDP2 (``torch.distributed.fsdp.fully_shard``), as the default path is on DDP's reducer.

FSDP2 gathers each block's parameters before its forward and reduce-scatters its gradients
from hooks in the autograd graph, writing each parameter's reduced shard into ``.grad`` (a
``DTensor``) at the end of the backward. Those hooks fire only in a backward that accumulates
into the unsharded parameters' ``.grad``: a plain ``loss.backward()``, which is what a step
runs here (:meth:`FullShardPath.run_engine`)."""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence

import torch
from torch.utils._pytree import tree_map

_BLOCKS = (
    "data_parallel(shard='full'): blocks= takes a list or tuple of module classes to wrap "
    "with fully_shard each (FSDP2 users' per-block wrapping, e.g. blocks=[TransformerBlock]); "
    "got {got}"
)
_NOTHING = (
    "data_parallel(shard='full'): blocks={names} names no submodule of the model: nothing "
    "would be wrapped but the root, so every parameter would be gathered at once (no memory "
    "saved in the forward). Name classes the model uses (its submodules' classes: {seen}), "
    "or pass blocks=() to wrap the root only"
)
_POLICY = (
    "data_parallel(shard='full'): mp_policy= takes a "
    "torch.distributed.fsdp.MixedPrecisionPolicy (or None), got {got}"
)
_SHARED = (
    "data_parallel(shard='full'): the parameter {names} is held by {units}, which fully_shard "
    "wraps separately: each would get its own shard of it (FSDP2 alone on torch 2.8 trains "
    "the copies apart, the tie silently broken; torch 2.13's refuses it at the first "
    "forward). Choose blocks= so that every module holding it is wrapped in the same unit: "
    "leave those modules' classes out of blocks= (the root then holds the parameter), or "
    "name a class that holds them all"
)
_HIGHER = (
    "data_parallel(shard='full'): a backward recorded by an earlier manager (second "
    "derivatives) is not supported under full sharding: FSDP2 frees each block's gathered "
    "parameters during the backward. Use data_parallel(model) (DDP's path) for higher-order "
    "gradients"
)

_GRAPH_KEPT = (
    "data_parallel(shard='full'): a backward that keeps its graph (create_graph=True: "
    "torch.autograd.grad(..., create_graph=True) for a gradient penalty, second derivatives) "
    "reached the model's output: FSDP2 frees each block's gathered parameters during a "
    "backward, so a backward through this one's graph cannot be right (torch then fails "
    "inside it, or leaves gradients missing). Use data_parallel(model) or shard=True, which "
    "give DDP's gradients with a gradient penalty"
)


_WRAPPED: weakref.WeakSet[Any] = weakref.WeakSet()  # the roots wrap() wrapped


def wrapped_here(module: Any) -> bool:
    """``module`` is a root that full sharding's :meth:`FullShardPath.wrap` wrapped."""
    return module in _WRAPPED


def available() -> bool:
    """This torch has FSDP2 (``torch.distributed.fsdp.fully_shard``, torch 2.6 and later)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


class FullShardPath:
    """What full sharding needs of torch: wrapping, the sync switch, and the engine call."""

    def wrap(self, module: Any, blocks: Sequence[Any], reshard_after_forward: bool,
             mp_policy: Any) -> List[Any]:
        """``fully_shard`` each submodule whose class is in ``blocks``, inner ones first (as
        FSDP2 users write it), then the root; the modules wrapped, in that order."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        classes = _classes(blocks)
        if mp_policy is None:
            mp_policy = MixedPrecisionPolicy()
        elif not isinstance(mp_policy, MixedPrecisionPolicy):
            raise TypeError(_POLICY.format(got=type(mp_policy).__name__))
        chosen = [m for m in module.modules() if m is not module and isinstance(m, classes)]
        if classes and not chosen:
            seen = sorted({type(m).__name__ for m in module.modules() if m is not module})
            raise ValueError(_NOTHING.format(names=[c.__name__ for c in classes],
                                             seen=", ".join(seen) or "none"))
        _refuse_shared(module, chosen)
        for block in reversed(chosen):  # modules() lists outer blocks first
            fully_shard(block, reshard_after_forward=reshard_after_forward,
                        mp_policy=mp_policy)
        fully_shard(module, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
        module.register_forward_hook(_watch_outputs)
        _WRAPPED.add(module)
        units = [*reversed(chosen), module]
        if _gloo():
            # FSDP2 asks gloo's reduce_scatter_tensor for an average, and on torch 2.8 gloo
            # returns the sum: every gradient N times too large, silently. A sum divided by
            # N afterwards is the mean on every version (tests/test_full_shard.py, DDP's).
            for wrapped in units:
                wrapped.set_force_sum_reduction_for_comms(True)
        return units

    def reshard(self, units: Sequence[Any]) -> None:
        """FSDP2's ``reshard()`` of each wrapped module: the sharded parameters on the modules
        again where a forward gathered them and no backward followed (with
        ``reshard_after_forward=False`` they stay gathered for the backward); nothing where
        they are sharded."""
        for unit in units:
            unit.reshard()

    def watch_optimizers(self, replaced: Any) -> None:
        """Refuse, at its step, an optimizer holding a parameter ``replaced`` lists (one made
        before the wrapping: it would step nothing)."""
        from .stale_optimizers import refuse_stale_optimizers

        refuse_stale_optimizers(replaced)

    def set_sync(self, module: Any, sync: bool) -> None:
        """FSDP2's ``set_requires_gradient_sync``: off inside ``no_sync`` (each rank
        accumulates its unsharded gradients; the next synced backward reduce-scatters them)."""
        module.set_requires_gradient_sync(sync)

    def run_engine(self, ys: Sequence[Any], dys: Sequence[Any], create_graph: bool,
                   retain_graph: bool, attached: Sequence[Any] = ()) -> None:
        """``loss.backward()``: FSDP2's hooks reduce-scatter into the shards' ``.grad``; the
        ``attached`` tensors that are not leaves (activations) get theirs in ``.grad`` too,
        after their hooks, as the manager's own backward gives it them (the engine writes
        only the leaves': ``retain_grad()`` has it write theirs)."""
        if create_graph:
            raise RuntimeError(_HIGHER)
        for tensor in attached:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad and not tensor.is_leaf:
                tensor.retain_grad()
        outputs = [y for y in ys if y.requires_grad]
        if outputs:
            seeds = [dy for y, dy in zip(ys, dys) if y.requires_grad]
            torch.autograd.backward(outputs, seeds, retain_graph=retain_graph)

    def is_sharded(self, tensor: Any) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(tensor, DTensor)


def _refuse_shared(root: Any, chosen: List[Any]) -> None:
    """A parameter that two of the units fully_shard makes (each chosen block, and the root
    for the rest) would both hold: FSDP2 gives each its own shard of it, without a word."""
    owner: dict = {}
    for unit in [*chosen, root]:
        for param in _unit_parameters(unit, chosen):
            first = owner.setdefault(id(param), (unit, param))[0]
            if first is not unit:
                raise ValueError(_shared_message(root, param, first, unit))


def _unit_parameters(unit: Any, chosen: List[Any]) -> List[Any]:
    """The parameters ``fully_shard(unit)`` takes: its modules' own, where no chosen block
    nested inside it (wrapped before it) took them."""
    inner = {id(m) for m in chosen if m is not unit}
    seen, stack, found = set(), [unit], []
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found += list(module.parameters(recurse=False))
        stack += [c for c in module.children() if id(c) not in inner]
    return found


def _shared_message(root: Any, param: Any, first: Any, second: Any) -> str:
    names = [n for n, p in root.named_parameters(remove_duplicate=False) if p is param]
    where = {id(m): repr(n) for n, m in root.named_modules(remove_duplicate=False) if n}
    units = " and ".join(where.get(id(u), "the root") for u in (first, second))
    return _SHARED.format(names=" = ".join(names), units=units)


def _gloo() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "gloo"


def _classes(blocks: Any) -> tuple:
    if not isinstance(blocks, (list, tuple)) or not all(
            isinstance(c, type) and issubclass(c, torch.nn.Module) for c in blocks):
        got = blocks if not isinstance(blocks, (list, tuple)) else [
            c for c in blocks if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
        raise TypeError(_BLOCKS.format(got=repr(got)))
    return tuple(blocks)


def full_shard_path() -> Optional[FullShardPath]:
    return FullShardPath() if available() else None


def _watch_outputs(module: Any, inputs: Any, output: Any) -> Any:
    """A forward hook on the wrapped root: the model's outputs that require grad are handed
    on as views of themselves, each refusing a backward that keeps its graph (a gradient
    penalty by ``torch.autograd.grad``; a manager's is refused before its engine runs, see
    ``hooks.refuse_higher_order``). A view's hook runs before any hook on the output itself,
    so before FSDP2's, which would gather parameters for a backward that then stops. (A
    module-level function: ``copy.deepcopy`` of the model copies the hook.)"""
    if not torch.is_grad_enabled():
        return None
    return tree_map(_refusing_view, output)


def _refusing_view(value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or not value.requires_grad:
        return value
    view = value.view_as(value)
    view.register_hook(_refuse_kept_graph)
    return view


def _refuse_kept_graph(grad: torch.Tensor) -> None:
    if torch.is_grad_enabled():  # (the engine's grad mode in a backward: its create_graph)
        raise RuntimeError(_GRAPH_KEPT)


__all__: List[str] = ["FullShardPath", "available", "full_shard_path", "wrapped_here"]
