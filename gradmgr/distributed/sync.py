"""What DistributedDataParallel does besides reducing gradients: broadcasting parameters and
buffers, and skipping communication for gradient accumulation (``no_sync``)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Iterator, List

from ..manager import GradManager
from ..registry import backend_for
from .ops import ops_for
from .transport import TransportSpec, resolve_transport

_paused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def no_sync(gm: GradManager) -> Iterator[None]:
    """Recordings of ``gm`` that start inside only accumulate gradients locally: no allreduce
    callback attached to ``gm`` communicates (``DistributedDataParallel.no_sync()``).

    The flag is read when a recording starts (``record()`` / ``with gm``), as DDP reads it at
    the forward: put the whole ``with gm:`` block inside. The next synced backward reduces
    what ``.grad`` holds plus its own gradient, so every rank ends with bit-identical
    gradients, equal to DDP's.

    Example:
        >>> # for micro in range(k):
        >>> #     with (no_sync(gm) if micro < k - 1 else contextlib.nullcontext()):
        >>> #         with gm:
        >>> #             gm.backward(loss_fn(model(x[micro]), y[micro]))
    """
    _paused[gm] = _paused.get(gm, 0) + 1
    try:
        yield
    finally:
        _paused[gm] -= 1
        if not _paused[gm]:
            del _paused[gm]


def is_paused(gm: GradManager) -> bool:
    """True inside :func:`no_sync` for ``gm``."""
    return gm in _paused


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
        >>> # torch.manual_seed(rank)          # ranks start from different weights...
        >>> # model = make_model()
        >>> # broadcast(model)                 # ...and now all hold rank 0's
    """
    items = _tensors_of(tensors)
    if not items:
        return
    backend = backend_for(items[0])
    if backend is None:
        raise TypeError(f"broadcast() expects tensors or a module, got {type(items[0]).__name__}")
    ops = ops_for(backend.name)
    chosen = resolve_transport(transport, ops.name, group)
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


def data_parallel(
    module: Any,
    reduce: str = "mean",
    *,
    broadcast_buffers: bool = True,
    src: int = 0,
    group: Any = None,
    bucket_bytes: int = 25 * 2**20,
    compression: Any = None,
    transport: TransportSpec = None,
) -> GradManager:
    """A GradManager that trains ``module`` data-parallel, set up as
    ``DistributedDataParallel(module)`` is: rank ``src``'s parameters and buffers are broadcast
    now (the buffers only with ``broadcast_buffers``), the trainable parameters are attached
    with an allreduce callback, and (with ``broadcast_buffers``) the buffers are broadcast
    again when a recording starts, as DDP does at the forward: at the first recording after a
    synchronised one (not inside a :func:`no_sync` accumulation window).

    Example:
        >>> # gm = data_parallel(model)
        >>> # with gm:
        >>> #     gm.backward(loss_fn(model(x), y))   # .grad: the mean over ranks
        >>> # with no_sync(gm): ...                    # gradient accumulation
    """
    from .allreduce import AllreduceCallback

    cb = AllreduceCallback(reduce, group, bucket_bytes, compression, transport,
                           broadcast=False, src=src)
    buffers = list(module.buffers())
    broadcast(list(module.parameters()) + (buffers if broadcast_buffers else []), src,
              group=group, transport=transport)
    gm = GradManager().attach(list(module.parameters()), callbacks=[cb])
    if broadcast_buffers and buffers:
        gm.register_record_callback(_BufferSync(gm, buffers, src, group, transport))
    return gm


class _BufferSync:
    """Broadcast buffers when a recording starts, as DDP does at the forward: at the first
    recording after a synced one, not again inside a ``no_sync`` accumulation window."""

    def __init__(self, gm: GradManager, buffers: List[Any], src: int, group: Any,
                 transport: TransportSpec) -> None:
        self._gm = weakref.ref(gm)
        self._buffers, self._src, self._group, self._transport = buffers, src, group, transport
        self._after_sync = True

    def __call__(self) -> None:
        gm = self._gm()
        if gm is None:
            return
        if self._after_sync:
            broadcast(self._buffers, self._src, group=self._group, transport=self._transport)
        self._after_sync = not is_paused(gm)


__all__: List[str] = ["broadcast", "data_parallel", "no_sync"]


