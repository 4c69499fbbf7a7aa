"""Uneven inputs on the sharded path: a :class:`~gradmgr.distributed.ShardedOptimizer` is a
joinable too (``with Join([gm, opt]):``, as torch's ``ZeroRedundancyOptimizer``).

A joined rank still owns its slice of the parameters, so at every synced step the others
take, after the manager's hook has taken its part of the step's reduce-scatter (zeros in, this
rank's slice of the others' summed gradient out), this rank steps its slice with that
gradient and takes part in the all-gather: every rank's parameters are then those of DDP +
Join with the unsharded optimizer. (``ZeroRedundancyOptimizer``'s join hook steps the joined
rank's slice with whatever ``.grad`` it still holds instead, none after ``zero_grad()``.)

Before their step (and before :meth:`ShardedOptimizer.clip_grad_norm_`) the ranks inside an
enabled context exchange what they are about to do (one small collective): a joined rank
cannot take part in the clipping's collective, so where one has joined, every rank raises.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List

STEP, CLIP, JOINED = 0, 1, 2  # what a rank announces (a slot of the exchange)
_NO_CLIP = (
    "ShardedOptimizer.clip_grad_norm_ (or torch's clip_grad_norm_, or a GradScaler's check, "
    "on the sharded gradients) inside Join after a rank ran out of batches: the joined rank "
    "cannot take part in the norm's collective (it does not know the others clip). "
    "Clip only while every rank has batches (Join(..., throw_on_early_termination=True) "
    "stops all ranks when one runs out), or give every rank the same number of batches"
)
_FIRST = (
    "Join([gm, opt]): the ShardedOptimizer's manager comes first in the Join context, the "
    "optimizer after it (a joined rank steps its slice after its manager's hook took its part "
    "of the step)"
)


def active(optimizer: Any) -> bool:
    config = getattr(optimizer, "_join_config", None)
    return config is not None and config.enable


def announce(optimizer: Any, what: int) -> None:
    """A rank that has not joined, before its step or its clipping, inside the context."""
    summed = _exchange(optimizer, what)
    if summed[JOINED] and summed[CLIP]:
        raise RuntimeError(_NO_CLIP)


def guard(optimizer: Any) -> Callable[[], None]:
    """What the gradient shards' stand-ins call before their collectives (torch's
    ``clip_grad_norm_`` through them, a GradScaler's check): as :meth:`ShardedOptimizer.
    clip_grad_norm_`, announced inside the context. Holds the optimizer weakly."""
    ref = weakref.ref(optimizer)

    def before_collective() -> None:
        found = ref()
        if found is not None and active(found):
            announce(found, CLIP)

    return before_collective


def _exchange(optimizer: Any, what: int) -> List[float]:
    ops, transport = optimizer._ops, optimizer._transport
    row = [0.0, 0.0, 0.0]
    row[what] = 1.0
    like = optimizer._plan.tensor(0)
    return ops.values(transport.allreduce_async(ops.vector(row, like)).wait())


class OptimizerJoinHook:
    """The optimizer's part for a joined rank (torch's ``JoinHook``)."""

    def __init__(self, optimizer: Any, synchronizer: Any, support: Any) -> None:
        self._optimizer, self._synchronizer, self._support = optimizer, synchronizer, support
        self._seen = synchronizer.shadowed

    def main_hook(self) -> None:
        optimizer = self._optimizer
        if optimizer._join_config.is_first_joinable:
            raise ValueError(_FIRST)
        if self._synchronizer.shadowed == self._seen:
            return  # the others' step was inside no_sync: no optimizer step follows it
        self._seen = self._synchronizer.shadowed
        summed = _exchange(optimizer, JOINED)
        if summed[CLIP]:
            raise RuntimeError(_NO_CLIP)
        optimizer.step_slice()

    def post_hook(self, is_last_joiner: bool) -> None:
        self._optimizer._join_config = self._support.disabled_config()


__all__: List[str] = ["CLIP", "JOINED", "STEP", "OptimizerJoinHook", "active", "announce",
                      "guard"]
