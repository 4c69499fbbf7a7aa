"""A joined rank's part of the others' steps (uneven inputs, see :mod:`.joining`).

Once a rank has run out of batches inside the framework's Join context, it still takes part in
every step the other ranks take, as DDP's join hook does: the same collectives, in the same
order (the plan check, the gradient buckets or torch's reducer, the reduce-scatter), with
nothing of its own in them (zero gradients, no tensor used). These functions do that for one
:class:`~gradmgr.distributed.reduce.synchronizer.Synchronizer`.
"""

from __future__ import annotations

from typing import Any, List

from ..errors import RankFailedError
from ..reduce.bucket import BucketPlan
from ..reduce.no_sync import is_paused
from ..reduce.paths import check_step, open_step
from ..reduce.steps import Step


def upcoming(synchronizer: Any, gm: Any) -> List[float]:
    """What a joined rank needs to know of the step a recording of ``gm`` starts now, before
    it starts: synced, the first, and the recordings inside no_sync before it."""
    with synchronizer.lock:
        sync = synchronizer.options.syncing and not is_paused(gm)
        return [float(sync), float(not synchronizer.started), float(synchronizer.unsynced)]


def shadow(synchronizer: Any, gm: Any, theirs: List[float]) -> bool:
    """A joined rank's part of the step the others start (``theirs``: their
    :func:`upcoming`). Returns whether the step is synced."""
    sync, first, unsynced = bool(theirs[0]), bool(theirs[1]), int(theirs[2])
    with synchronizer.lock:
        step = open_step(synchronizer, gm, sync, unsynced, own=False)
        plan = step.plan
        if sync or first:  # the others' plan check (builds torch's reducer where asked)
            check_step(synchronizer, step, unsynced if sync else None, settle=True)
        synchronizer.started = True
        if not sync or not plan.buckets:
            return sync
        if synchronizer.on_reducer:
            synchronizer.used.update(synchronizer.reducer.used_since_window())
            completed = synchronizer.reducer.shadow()
        else:
            completed = _shadow_buckets(synchronizer, plan)
        synchronizer.used.clear()
        if completed:  # (a failed step is skipped: no optimizer step to shadow)
            synchronizer.shadowed += 1
        return True


def _shadow_buckets(synchronizer: Any, plan: BucketPlan) -> bool:
    """A synced step's reductions on gradmgr's buckets: zeros. Returns whether the step
    completed (a rank that failed makes the others skip it; the joined rank goes on
    shadowing, it does not raise)."""
    step = Step(plan, True)
    step.launch_zeros(synchronizer.wire)
    try:
        if synchronizer.shards is not None:
            synchronizer.shards.zero()  # its slice is the others' step's gradient, alone
            synchronizer.keep_shards(step)
        else:
            for reduction in step.all_launched():  # the sums are dropped; the last bucket's
                reduction.result(0)          # flags say whether a rank failed
    except RankFailedError:
        step.drain()
        return False
    return True


__all__: List[str] = ["shadow", "upcoming"]
