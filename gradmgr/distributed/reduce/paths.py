"""Which path a step takes, and opening a step on it.

Three paths reduce the same sums: gradmgr's buckets (a hook per tensor fills them during the
backward), the backend's own reducer (torch's C++ ``Reducer`` takes whole plain backwards),
and gradmgr's buckets after the backward (compiled autograd, where a hook per tensor would
break the compiled graph: :mod:`.post_backward`). The choice is made at planning
(:func:`choose_path`), checked again at every recording, and compared across ranks in the
plan check through the path's fingerprint. :func:`open_step` opens every step, a rank's own
and, on a rank that has joined (uneven inputs), the others' (:mod:`..join.shadowing`).

The functions work on one :class:`~gradmgr.distributed.reduce.synchronizer.Synchronizer`.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Set, Tuple

from ...hooks import after_backward_callbacks
from ...manager import attach_epoch, callback_chains
from ..consistency import plan_fingerprint
from .post_backward import PostBackwardStep
from .steps import Step

# The synchronizer's logger: the name users filter on (docs/data-parallel.md), from before
# the path choice had a module of its own.
_log = logging.getLogger("gradmgr.distributed.synchronizer")

_LATE_COMPILED = (
    "data parallel: this backward runs under compiled autograd, but compiled autograd was off "
    "when its recording began (`with gm:`), so the step was planned for torch's C++ reducer, "
    "which compiled autograd refuses. Turn compiled autograd on before `with gm:` (set "
    "torch._dynamo.config.compiled_autograd = True before torch.compile of the whole step "
    "function, or enter its context around the recording): the step is then reduced after "
    "its backward, with no hook in the compiled graph"
)


# ---------------------------------------------------------------------- opening a step
def open_step(synchronizer: Any, gm: Any, sync: bool, unsynced: int, own: bool) -> Step:
    """Open a step: ``gm``'s recording's (``own``) or, on a rank that has joined, the step
    the other ranks open (``unsynced``: the recordings inside no_sync before it, theirs). The
    plan is made again where outdated, the shards are told, the count of recordings inside
    no_sync moves on, and the step chooses its path: after the backward where compiled
    autograd asks it of this recording (a joined rank records nothing: never)."""
    plan = synchronizer.replan_if_needed(gm)
    if synchronizer.shards is not None:
        synchronizer.shards.recording()
    synchronizer.unsynced = 0 if sync else unsynced + 1
    step = Step(plan, sync)
    if own:
        post_path = synchronizer.post_path
        # (post_ok first: the usual step asks nothing more; post_ok says there is a path)
        step.after = (synchronizer.post_ok and post_path is not None and post_path.wanted()
                      and still_delegable(synchronizer, gm, synchronizer.planned(), post_path))
    return step


def check_step(synchronizer: Any, step: Step, accumulated: Optional[int], settle: bool) -> bool:
    """Launch ``step``'s plan check on its path (asking for a reducer where it goes to the
    reducer and none is built yet); read it at once where ``settle``. Returns whether a check
    was launched."""
    on_reducer, request = step_path(synchronizer, step)
    if not synchronizer.check_plan(step, on_reducer, request, accumulated):
        return False
    if settle:
        synchronizer.settle(step)
    return True


def step_path(synchronizer: Any, step: Step) -> Tuple[bool, bool]:
    """Whether ``step`` goes to the reducer, and whether it asks for one (none built yet)."""
    on_reducer = synchronizer.on_reducer and not step.after
    return on_reducer, on_reducer and synchronizer.reducer is None


# ---------------------------------------------------------------------- choosing the path
def choose_path(synchronizer: Any, on_reducer: bool) -> None:
    """Choose the path; a reducer for it is built at the next synced step (see
    :meth:`Synchronizer.build_reducer`)."""
    synchronizer.drop_reducer()
    synchronizer.on_reducer = on_reducer
    mode = path_mode(synchronizer, on_reducer)
    _log.info("the steps' path: %s", mode)
    tensors = synchronizer.the_plan().tensors()
    synchronizer.fingerprint = plan_fingerprint(synchronizer.ops, tensors, mode)
    synchronizer.bucket_fingerprint = None if on_reducer else synchronizer.fingerprint


def path_mode(synchronizer: Any, on_reducer: bool) -> str:
    """How this rank reduces, compared across ranks with the planned tensors: ranks that
    differ here would sum mismatched buffers (gradients silently wrong, or a crash in the
    transport when the sizes differ)."""
    options, comm_hook = synchronizer.options, synchronizer.comm_hook
    path = ("the framework's own reducer" if on_reducer else "gradmgr's buckets"
            if synchronizer.shards is None else "gradmgr's buckets, reduce-scattered")
    hook = "" if comm_hook is None else f", comm_hook={comm_hook.describe()}"
    return (f"{path}, reduce={options.reduce!r}, compression={options.compression!r}, "
            f"bucket_bytes={options.bucket_bytes}{hook}")


def step_mode(synchronizer: Any, step: Step) -> str:
    """How this rank reduces ``step``, for an error: a step reduced after its backward says
    why (ranks that differ in it differ in whether compiled autograd is on)."""
    if not step.after:
        return path_mode(synchronizer, synchronizer.on_reducer)
    return path_mode(synchronizer, False).replace(
        "gradmgr's buckets", "gradmgr's buckets after the backward (compiled autograd is on)", 1)


def fingerprint(synchronizer: Any, on_reducer: bool) -> List[int]:
    """The plan's fingerprint for a step on the reducer or the buckets (the per-tensor path
    and the post-backward one reduce alike: ranks may mix them)."""
    if on_reducer:
        return synchronizer.fingerprint
    if synchronizer.bucket_fingerprint is None:
        synchronizer.bucket_fingerprint = plan_fingerprint(
            synchronizer.ops, synchronizer.the_plan().tensors(), path_mode(synchronizer, False))
    return synchronizer.bucket_fingerprint


def reducer_possible(synchronizer: Any, gm: Any, tensors: List[Any]) -> bool:
    """Whether plain backwards can go to the backend's own reducer, which reduces exactly
    what the buckets would: ``"mean"`` without compression, and whole backwards can be
    delegated to it (:func:`delegable`)."""
    options = synchronizer.options
    return (options.reduce == "mean" and options.compression is None
            and delegable(synchronizer, gm, tensors, synchronizer.reducer_path))


def delegable(synchronizer: Any, gm: Any, tensors: List[Any], path: Any) -> bool:
    """Whether whole backwards can go to ``path`` (the engine accumulating into ``.grad``):
    nothing else needing the per-tensor callbacks (every reduced tensor's chain the callback
    alone; every other one's empty, or delivered by the path's tape: ``delivers_others``;
    no other after-backward callback), and what the backend's path asks of the tensors."""
    if path is None or not tensors:
        return False
    options = synchronizer.options
    chains = callback_chains(gm)
    if any(callbacks and callbacks != (options,)
           and (options in callbacks or not path.delivers_others) for _, callbacks in chains):
        return False
    return (after_backward_callbacks(gm) == (synchronizer.flush_hook,)
            and path.accepts([t for t, _ in chains], tensors))


def own_callbacks(synchronizer: Any, gm: Any) -> bool:
    """Some attached tensor has callbacks and not this one (the reducer path's tape delivers
    it: its step says what the reducer takes)."""
    options = synchronizer.options
    return any(callbacks and options not in callbacks for _, callbacks in callback_chains(gm))


def still_delegable(synchronizer: Any, gm: Any, tensors: List[Any], path: Any) -> bool:
    """What can change between recordings without a new plan: the manager's after-backward
    callbacks, and what the backend's path checks at every recording."""
    return (after_backward_callbacks(gm) == (synchronizer.flush_hook,)
            and path.still_accepts(tensors))


# ---------------------------------------------------------------------- the backward delegate
def delegate(synchronizer: Any, gm: Any) -> Any:
    """The backward delegate: this step is reduced after the backward where its recording
    chose that (:mod:`.post_backward`), else goes to the reducer when the plan says so;
    neither where what was attached since the recording started changes the plan or the path
    (an input or an activation attached for its own gradient does not: the other ranks take
    the delegate)."""
    with synchronizer.lock:
        step = synchronizer.steps.get(gm.step)
        if step is None or not synchronizer.plan_holds(gm, step.after):
            return None
        if step.after:
            return _post_backward_step(synchronizer, gm, step)
        if not synchronizer.on_reducer:
            return None
        if synchronizer.post_path is not None and synchronizer.post_path.wanted():
            del synchronizer.steps[gm.step]  # (no collective: every rank raises this alike)
            raise RuntimeError(_LATE_COMPILED)
        if step.sync:
            reducer = synchronizer.reducer_for(step)
        elif synchronizer.reducer is None:
            return None  # not built yet: the per-tensor path accumulates locally
        else:
            reducer = synchronizer.reducer
        del synchronizer.steps[gm.step]
        try:
            reducer.begin(step.sync)
        except BaseException:
            reducer.abort()
            raise
        delivered = synchronizer.others or synchronizer.epoch != attach_epoch(gm)
        return ReducerStep(synchronizer, step.sync,
                           {id(t) for t in reducer.tensors} if delivered else None)


def _post_backward_step(synchronizer: Any, gm: Any, step: Step) -> Optional[PostBackwardStep]:
    tensors = synchronizer.planned()
    if any(t is None for t in tensors):
        return None  # a planned tensor died: the per-tensor path says so
    if step.sync:
        synchronizer.settle(step)
    del synchronizer.steps[gm.step]
    deferred = PostBackwardStep(synchronizer, step, tensors)
    deferred.begin()
    return deferred


class ReducerStep:
    """A backward handed to the reducer (see ``gradmgr.hooks.set_backward_delegate``).
    ``taken``: the ids of the tensors the reducer takes, where something else attached has
    callbacks of its own or was attached since planning (None: nothing else to deliver but
    non-leaves)."""

    __slots__ = ("_sync", "_synchronizer", "taken")

    def __init__(self, synchronizer: Any, sync: bool, taken: Optional[Set[int]] = None) -> None:
        self._synchronizer, self._sync, self.taken = synchronizer, sync, taken

    def finish(self) -> None:
        synchronizer = self._synchronizer
        synchronizer.the_reducer().finish(self._sync, synchronizer.used)
        if self._sync:
            synchronizer.used.clear()
            synchronizer.finished += 1

    def abort(self) -> None:
        self._synchronizer.the_reducer().abort()


__all__: List[str] = ["ReducerStep", "check_step", "choose_path", "delegate", "fingerprint",
                      "open_step", "own_callbacks", "path_mode", "reducer_possible", "step_mode",
                      "still_delegable"]
