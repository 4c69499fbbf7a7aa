"""Whether every rank of a process group reached the same point, asked of the group's key-value
store (c10d's, which ``init_process_group`` rendezvoused through) instead of a collective.

A collective that one rank enters alone cannot be left: the others are in their next
collective, or in a ``dist.barrier()``, and a rank that gives up leaves the group's collectives
paired wrongly from then on. Asking the store first can be given up on: a rank that arrives
alone waits half the store's timeout (``init_process_group``'s ``timeout``, the time a
collective would have waited), takes its arrival back, and raises; the group's collectives
are untouched, so a program that catches the error goes on. ``ShardedOptimizer.state_dict()``
asks it before its collectives, for the ``if rank == 0: torch.save(opt.state_dict(), ...)`` habit.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import torch.distributed as dist

# A rank still alone after this long is told why it waits (the error itself comes at patience's
# end, which is 15 minutes with torch's default timeout): a rank that others reach later than
# this is rare, and it costs them a warning, not an error.
NUDGE = datetime.timedelta(seconds=20)


def group_store(group: Any) -> Optional[Any]:
    """The store of ``group`` (None: the default group), or None where this torch keeps it
    elsewhere (``ShardedOptimizer`` then checks nothing, as before)."""
    c10d = dist.distributed_c10d
    try:  # private: in torch 2.8 and 2.13 alike
        return c10d._get_process_group_store(group or c10d._get_default_group())
    except (AttributeError, KeyError, RuntimeError, ValueError):
        return None


def patience(store: Any) -> Any:
    """How long a rank waits for the others: half the store's timeout (the group's). The
    ranks already inside their next collective wait the whole of it there, so a rank that
    gives up at half still meets them in it, and the group stays in step."""
    return store.timeout / 2


def arrived(store: Any, key: str, world: int,
            waiting: Optional[Callable[[Any], None]] = None) -> bool:
    """Count this rank in at ``key`` (each rank once, and a key used for one meeting only) and
    wait until all ``world`` ranks have: True; or, where :func:`patience` runs out first,
    take this arrival back and return False (unless the last rank came meanwhile).
    ``waiting(left)`` is called once where the others have not come within
    ``min(NUDGE, patience / 2)`` (``left``: the patience that remains), so that a rank left
    alone says so long before it gives up."""
    done = f"{key}/all"
    if store.add(key, 1) == world:
        store.set(done, "1")
        return True
    whole = patience(store)
    nudge = min(NUDGE, whole / 2)
    try:
        if waiting is not None and not _came(store, done, nudge):
            waiting(whole - nudge)
            store.wait([done], whole - nudge)
        elif waiting is None:
            store.wait([done], whole)
        return True
    except RuntimeError:  # DistStoreError: the wait's timeout passed
        store.add(key, -1)
        # A rank that counted itself in before our -1 saw all ranks here and went on: so do we.
        return store.check([done])


def _came(store: Any, done: str, within: Any) -> bool:
    try:
        store.wait([done], within)
        return True
    except RuntimeError:
        return False
