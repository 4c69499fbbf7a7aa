"""Before a :class:`~gradmgr.distributed.ShardedOptimizer` gathers its state: the steps of
split backwards this rank dropped unfinished are failed first, as its next ``record()`` would
fail them, so that the gather does not pair with what those steps still owe the other ranks;
then the ranks meet, so that a rank that calls it alone raises instead of waiting in a
collective forever."""

from __future__ import annotations

from typing import Any

from ...hooks import fail_dropped_splits

# In the framework's words ({idioms.save}: TensorOps.idioms)
_ALONE = (
    "ShardedOptimizer.state_dict() gathers every rank's slices of the optimizer state, so every "
    "rank calls it, and rank {rank} called it while not every rank did within half the "
    "process group's timeout (the `if rank == 0: {idioms.save}(opt.state_dict(), path)` habit "
    "of data-parallel scripts?). Write `state = opt.state_dict()` on every rank, then `if rank "
    "== 0: {idioms.save}(state, path)`. Nothing was communicated: the process group is as it was"
)
_WAITING = (  # {{seconds}}: the transport's, once it knows how long it waits
    "ShardedOptimizer.state_dict() on rank {rank} waits for the other ranks: it gathers every "
    "rank's slices of the optimizer state, so every rank calls it. Where the others do not "
    "(the `if rank == 0: {idioms.save}(opt.state_dict(), path)` habit of data-parallel "
    "scripts?), this rank raises RuntimeError in {{seconds:.0f}} s, having communicated "
    "nothing. Write `state = opt.state_dict()` on every rank, then `if rank == 0: "
    "{idioms.save}(state, path)`"
)
_NOT_TO = (
    "ShardedOptimizer.state_dict() on rank {rank} after consolidate_state_dict(to={to}): as "
    "with ZeroRedundancyOptimizer, only rank {to} holds the consolidated state, until the next "
    "step. Write `if rank == {to}: {idioms.save}(opt.state_dict(), path)`, or, without "
    "consolidate_state_dict, `state = opt.state_dict()` on every rank"
)


def every_rank_here(gm: Any, transport: Any, ops: Any, key: str, rank: int) -> bool:
    """Before the state's gather: fail ``gm``'s dropped splits' steps, then meet the other
    ranks under ``key`` (a new one for each meeting that succeeded); raise RuntimeError,
    before any collective, where not every rank came. False where there was no meeting to hold (one
    rank, or a transport without one): the caller keeps its key."""
    fail_dropped_splits(gm)
    arrive = getattr(transport, "arrive", None)
    if arrive is None or transport.world_size() < 2:
        return False
    idioms = ops.idioms()
    if arrive(key, _WAITING.format(rank=rank, idioms=idioms)) is False:
        raise RuntimeError(_ALONE.format(rank=rank, idioms=idioms))
    return True


def not_to(rank: int, to: int, ops: Any) -> RuntimeError:
    """The error of ``state_dict()`` on a rank other than ``to`` after
    ``consolidate_state_dict(to)``."""
    return RuntimeError(_NOT_TO.format(rank=rank, to=to, idioms=ops.idioms()))
