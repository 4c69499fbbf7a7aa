"""Broadcasting parameters and buffers from one rank: the initial sync DDP does when it
wraps a model, and the buffers' broadcast of its forward."""

from __future__ import annotations

from typing import Any, Dict, List

from ..registry import backend_for
from .transport import TransportSpec, resolve_transport


def _tensors_of(tensors: Any) -> List[Any]:
    if hasattr(tensors, "parameters") and hasattr(tensors, "buffers"):  # a module
        return [*tensors.parameters(), *tensors.buffers()]
    if backend_for(tensors) is not None:
        return [tensors]
    return list(tensors)


def broadcast(tensors: Any, src: int = 0, *, group: Any = None,
              transport: TransportSpec = None) -> None:
    """Overwrite ``tensors`` (a module: its parameters and buffers) on every rank with rank
    ``src``'s values, in place: the initial sync DDP does when it wraps a model.

    Every rank must call it with the same tensors in the same order. Tensors are grouped by
    dtype and device into one collective each.

    Example:
        Ranks that start from different weights all hold rank 0's afterwards (here a process
        group of one rank):

        >>> import torch
        >>> import torch.distributed as dist
        >>> from gradmgr.distributed import free_port
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> broadcast(model)
        >>> dist.destroy_process_group()
    """
    items = _tensors_of(tensors)
    if items:
        broadcast_tensors(items, backend_for(items[0]), src, group, transport)


def broadcast_tensors(items: List[Any], backend: Any, src: int, group: Any,
                      transport: TransportSpec) -> None:
    """:func:`broadcast` of a non-empty list of tensors whose backend (that of the first,
    None: not a framework's tensors) the caller has looked up already."""
    if backend is None:
        raise TypeError(f"broadcast() expects tensors or a module, got {type(items[0]).__name__}")
    ops = backend.tensor_ops()
    chosen = resolve_transport(transport, backend, group)
    groups: Dict[Any, List[Any]] = {}
    for t in items:
        groups.setdefault(ops.key(t), []).append(t)
    for key in sorted(groups):
        members = groups[key]
        flat = ops.flatten(members)
        if hasattr(chosen, "broadcast"):
            flat = chosen.broadcast(flat, src)
        elif hasattr(chosen, "rank"):  # a sum with zeros from every other rank
            rank = chosen.rank()
            flat = chosen.allreduce_async(flat if rank == src else ops.scale(flat, 0.0)).wait()
        else:
            raise TypeError(
                f"cannot broadcast through {type(chosen).__name__}: it has neither broadcast(flat, "
                f"src) nor rank(); add one, or pass broadcast=False to make_allreduce_cb and "
                f"broadcast the parameters yourself"
            )
        ops.assign(members, flat)


__all__: List[str] = ["broadcast", "broadcast_tensors"]
