"""``data_parallel(module)``: a GradManager set up as ``DistributedDataParallel(module)`` is."""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Union

from ..manager import GradManager
from ..registry import backend_for
from .allreduce import AllreduceCallback, ReduceScatterCallback
from .consistency import PlanCheck, names_from, plan_fingerprint
from .sync import broadcast, is_paused
from .transport import TransportSpec, resolve_transport


def data_parallel(
    module: Any,
    reduce: str = "mean",
    *,
    broadcast_buffers: bool = True,
    src: int = 0,
    group: Any = None,
    bucket_bytes: Optional[int] = None,
    compression: Any = None,
    transport: TransportSpec = None,
    verify: Union[bool, str] = True,
    native: Optional[bool] = None,
    shard: bool = False,
) -> GradManager:
    """A GradManager that trains ``module`` data-parallel, set up as
    ``DistributedDataParallel(module)`` is: rank ``src``'s parameters and buffers are broadcast
    now (the buffers only with ``broadcast_buffers``), the trainable parameters are attached
    with an allreduce callback, and (with ``broadcast_buffers``) the buffers are broadcast
    again when a recording starts, as DDP does at the forward: at the first recording after a
    synchronised one (not inside a :func:`no_sync` accumulation window).

    Before broadcasting, the ranks compare their modules (every parameter and buffer, in
    order, with its shape and dtype): where they differ, every rank raises
    :class:`RankMismatchError` naming the first differing one (``fc2.weight``), as DDP refuses
    to wrap at once. The other options are :class:`AllreduceCallback`'s; ``verify=False``
    also skips this first comparison. ``shard=True`` reduce-scatters the gradients instead
    (:class:`ReduceScatterCallback`: each rank keeps its slice, for a
    :class:`ShardedOptimizer`; ``native`` does not apply).

    Example:
        >>> # gm = data_parallel(model)
        >>> # with gm:
        >>> #     gm.backward(loss_fn(model(x), y))   # .grad: the mean over ranks
        >>> # with no_sync(gm): ...                    # gradient accumulation
    """
    kind = ReduceScatterCallback if shard else AllreduceCallback
    cb = kind(reduce, group, bucket_bytes, compression, transport, broadcast=False, src=src,
              verify=verify, native=False if shard else native, names=module)
    params, buffers = list(module.parameters()), list(module.buffers())
    if verify:
        _refuse_modules_that_differ(module, params + buffers, group, transport)
    broadcast(params + (buffers if broadcast_buffers else []), src, group=group,
              transport=transport)
    gm = GradManager()
    if broadcast_buffers and buffers:
        # Before attaching (which registers the callback's own record hook): a recording's
        # first collective is then this broadcast, taken by every rank alike, and the plan
        # check comes after it, so that ranks that disagree about no_sync pair check with
        # check, which tells them so (see gradmgr.distributed.consistency).
        gm.register_record_callback(_BufferSync(gm, buffers, src, group, transport))
    return gm.attach(params, callbacks=[cb])


def _refuse_modules_that_differ(module: Any, tensors: List[Any], group: Any,
                                transport: TransportSpec) -> None:
    """One collective compares every rank's parameters and buffers; where they differ, a few
    more find the first difference and every rank raises RankMismatchError naming it."""
    if not tensors:
        return
    backend = backend_for(tensors[0])
    if backend is None:
        raise TypeError(f"data_parallel() expects a module of tensors, got "
                        f"{type(tensors[0]).__name__} parameters")
    ops, chosen = backend.tensor_ops(), resolve_transport(transport, backend, group)
    if chosen.world_size() < 2:
        return
    mode = "the module's parameters and buffers, in order"
    check = PlanCheck(chosen, ops, plan_fingerprint(ops, tensors, mode), tensors[0])
    if not check.agreed():
        raise check.error(tensors, mode, "their modules' parameters and buffers",
                          names_from(module))


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
