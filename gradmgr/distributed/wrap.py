"""``data_parallel(module)``: a GradManager set up as ``DistributedDataParallel(module)`` is."""

from __future__ import annotations

import weakref
from typing import Any, List

from ..manager import GradManager
from .allreduce import AllreduceCallback
from .sync import broadcast, is_paused
from .transport import TransportSpec


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


__all__: List[str] = ["data_parallel"]
