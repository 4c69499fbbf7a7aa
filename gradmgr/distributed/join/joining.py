"""Uneven inputs: the manager ``data_parallel`` returns takes part in the framework's context
for them (on PyTorch, torch's ``torch.distributed.algorithms.Join``), as a DDP model does.

Inside ``with Join([gm]):`` a rank that has run out of batches leaves its loop and waits in
the context's exit, which calls :meth:`JoinHook.main_hook` once for each step the other
ranks still take: it takes part in exactly the collectives of their step (the plan check,
the gradient buckets or torch's reducer, the sharded path's closing collective, the buffer
broadcast) with zero gradients and no tensor marked used, and drops the sums, as DDP's join
hook does. The others' gradients are their sum divided by the initial world size (DDP's
``divide_by_initial_world_size=True``). When every rank has joined,
:meth:`JoinHook.post_hook` broadcasts the parameters (and buffers) of the last rank to join,
so that every rank ends with the same model, DDP's.

Per step, a rank that has not joined tells the context so at the start of its recording (the
context's own collective, as DDP's forward does), then (with ``broadcast_buffers``, after a
synced step) broadcasts the buffers from the highest rank that has not joined, where DDP's
forward does (inside the context the buffer broadcast moves from the end of a synced
recording to the start of the next, DDP's schedule), then tells the joined ranks what its
step is (synced or inside no_sync, the first or not, how many recordings inside no_sync
came before: one small collective, as DDP's ``_check_global_requires_backward_grad_sync``).
"""

from __future__ import annotations

import weakref
from typing import Any, List

from ..broadcasting import broadcast
from .shadowing import shadow, upcoming

NOT_FIRST = (
    "the manager data_parallel returns must be the first joinable of the Join context "
    "(`with Join([gm, opt]):`): its step's collectives come first, and a joined rank "
    "shadows them before the optimizer's"
)


class Joining:
    """One manager's part in the context: what a rank that has not joined adds to each step
    (:meth:`record`), and the buffers a synced step leaves to broadcast."""

    def __init__(self, gm: Any, module: Any, callback: Any, support: Any,
                 buffers: bool) -> None:
        self._gm = weakref.ref(gm)
        self.module, self.callback, self.support = module, callback, support
        self.buffers = buffers  # broadcast_buffers
        self.pending = False  # a synced step ended: its buffers go out at the next step
        gm._join_config = support.disabled_config()

    def device(self) -> Any:
        return self.support.device(self._like())

    def process_group(self) -> Any:
        return self.support.process_group(self.callback.group)

    def _like(self) -> Any:
        return next(iter(self.module.parameters()))

    def active(self, gm: Any) -> bool:
        """Inside an enabled context (until its end: see :meth:`JoinHook.post_hook`)."""
        config = gm._join_config
        return config is not None and config.enable

    def defer_buffers(self, gm: Any) -> bool:
        """At the end of a synced recording: inside the context, the buffers go out at the
        start of the next step instead (DDP's schedule: its authoritative rank is the highest
        one that has not joined then)."""
        if not self.active(gm):
            return False
        self.pending = True
        return True

    def record(self) -> None:
        """The start of a recording, before the step's own collectives: tell the context
        this rank has not joined, broadcast pending buffers, tell joined ranks the step."""
        gm = self._gm()
        if gm is None or not self.active(gm):
            return
        self.support.notify(gm)
        if not gm._join_config.is_first_joinable:
            raise ValueError(NOT_FIRST)
        synchronizer = self.callback.synchronizer(gm)
        synchronizer.plan_now(gm)
        self.broadcast_pending(synchronizer, candidate=True)
        _exchange(synchronizer, self._like(), [1.0, *upcoming(synchronizer, gm)])

    def broadcast_pending(self, synchronizer: Any, candidate: bool) -> None:
        if not self.pending:
            return
        self.pending = False
        buffers = list(self.module.buffers())
        if buffers:
            src = common_rank(synchronizer, self._like(), candidate)
            broadcast(buffers, src, transport=synchronizer.transport)


class JoinHook:
    """A joined rank's part (torch's ``JoinHook``): :meth:`main_hook` once per step the others
    take, :meth:`post_hook` when every rank has joined."""

    def __init__(self, joining: Joining, gm: Any) -> None:
        self._joining, self._gm = joining, weakref.ref(gm)

    def _manager(self) -> Any:
        gm = self._gm()
        if gm is None:  # the other ranks would wait for this one's collectives for ever
            raise RuntimeError("gradmgr: the DataParallelManager was garbage-collected while "
                               "torch's Join context still holds its hook: keep a reference "
                               "to it until the context ends")
        return gm

    def main_hook(self) -> None:
        joining, gm = self._joining, self._manager()
        if not gm._join_config.is_first_joinable:
            raise ValueError(NOT_FIRST)
        synchronizer = joining.callback.synchronizer(gm)
        synchronizer.plan_now(gm)
        joining.broadcast_pending(synchronizer, candidate=False)
        rows = _exchange(synchronizer, joining._like(), [0.0, 0.0, 0.0, 0.0])
        theirs = next(row for row in rows if row[0])
        if shadow(synchronizer, gm, theirs[1:]) and joining.buffers:
            joining.pending = True

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the (highest) last rank to join, as DDP's
        ``_sync_final_model``; then steps are as outside the context again."""
        joining, gm = self._joining, self._manager()
        synchronizer = joining.callback.synchronizer(gm)
        synchronizer.plan_now(gm)
        module = joining.module
        tensors = list(module.parameters()) + (list(module.buffers()) if joining.buffers
                                               else [])
        src = common_rank(synchronizer, joining._like(), is_last_joiner)
        broadcast(tensors, src, transport=synchronizer.transport)
        joining.pending = False
        gm._join_config = joining.support.disabled_config()


def _exchange(synchronizer: Any, like: Any, row: List[float]) -> List[List[float]]:
    """Every rank's ``row`` (a sum over zeros elsewhere): joined ranks' rows are zeros."""
    transport, ops = synchronizer.transport, synchronizer.ops
    world, rank = transport.world_size(), transport.rank()
    flat = [0.0] * (world * len(row))
    flat[rank * len(row):(rank + 1) * len(row)] = row
    summed = ops.values(transport.allreduce_async(ops.vector(flat, like)).wait())
    return [summed[r * len(row):(r + 1) * len(row)] for r in range(world)]


def common_rank(synchronizer: Any, like: Any, candidate: bool) -> int:
    """The highest rank among the candidates (DDP's ``_find_common_rank``)."""
    rows = _exchange(synchronizer, like, [1.0 if candidate else 0.0])
    chosen = [r for r, row in enumerate(rows) if row[0]]
    if not chosen:
        raise RuntimeError("uneven inputs: no rank is a candidate for the common model")
    return chosen[-1]


__all__: List[str] = ["JoinHook", "Joining", "common_rank"]
