"""The plan checks' transport on Paddle ranks: a gloo group of their own, and a patience.

The plan check is the first collective of every synced step (``gradmgr.distributed.
consistency``). On the user's group, a rank with a step more (another skipped a batch with
``continue``) met, with its check, whatever the others did after their loop: gloo then aborted
a process (``op.preamble.length <= op.nbytes``). So, as on PyTorch ranks, the checks run in a
gloo group of their own (``paddle.distributed.new_group``), made by ``data_parallel()`` where
every rank is: there a check meets only checks.

Paddle 3.3 makes a gloo group with gloo's fixed 30 s timeout (``ProcessGroupGloo.create`` takes
none), and a collective cannot be left before it ends; its TCP store answered each ``add`` in
about 44 ms (measured, 2 local ranks), too slow to count arrivals at every step. So each check
runs in a thread of its group, and the step waits for it at most the patience, half the
30 s: a rank whose check nobody joins raises :class:`RanksOutOfStepError` while the ranks
that left their loop still wait in their next collective of the user's group, which then
meets this rank's next one. The abandoned check ends in its thread when gloo's timeout
passes (the process waits for it at exit: a process that exits while a gloo collective runs
may abort).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from typing import Any, Dict, Optional, Tuple

import paddle.distributed as pdist

from gradmgr.distributed.consistency import STEPS, CheckTerms
from gradmgr.distributed.errors import RanksOutOfStepError

GLOO_TIMEOUT_S = 30.0
"""How long a Paddle gloo collective waits for its peers (gloo's default, which Paddle 3.3's
``ProcessGroupGloo.create`` keeps: measured 30.0 s)."""

_OUT_OF_STEP = (
    "data parallel: not every rank started this {terms.checked}: this rank waited {waited:.0f} "
    "s (of the {timeout:.0f} s that a Paddle collective waits) for the others' plan "
    "check{why}. The ranks ran different numbers of steps: a rank skipped a batch (`continue`) "
    "or ran out of data while the others trained on, and its {terms.unit}s have been paired "
    "with the others' next ones since. Take every step on every rank: a rank with nothing to "
    "contribute records an empty step, `with gm: gm.backward()` (gradmgr has no Join on "
    "Paddle). This rank's later steps on this process group raise at once"
)
_FAILED = ", and the check failed: {error}"
_EARLIER = (
    "data parallel: this rank gave up on an earlier {terms.checked}'s plan check (the "
    "RanksOutOfStepError raised then), so its checks in this process group would pair with "
    "the wrong steps: start the ranks again. The earlier error: {cause}"
)


def group_timeout_s(group: Any) -> float:
    """How long a collective of ``group`` waits: gloo's 30 s; otherwise ``PADDLE_PG_TIMEOUT``
    (milliseconds), as ``init_parallel_env()`` reads it (not tried: nccl)."""
    if pdist.get_backend(group).lower() == "gloo":
        return GLOO_TIMEOUT_S
    return int(os.getenv("PADDLE_PG_TIMEOUT", "1800000")) / 1000


class CheckWork:
    """A check handed to its group's thread; ``wait()`` gives the summed buffer, or gives up
    after the patience (:meth:`CheckGroup.give_up`)."""

    __slots__ = ("flat", "error", "done", "_group", "_terms", "_started")

    def __init__(self, flat: Any, group: CheckGroup, terms: CheckTerms) -> None:
        self.flat, self._group, self._terms = flat, group, terms
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self._started = time.monotonic()

    def wait(self) -> Any:
        group = self._group
        left = group.patience_s - (time.monotonic() - self._started)
        if not self.done.wait(max(left, 0.0)) or self.error is not None:
            group.give_up(self.error, self._terms, time.monotonic() - self._started)
        return self.flat


class CheckGroup:
    """The gloo group the checks of one user group run in, the thread that runs them one at
    a time, and whether this rank gave up (``broken``: the error to raise at every later
    check)."""

    def __init__(self, parent: Any) -> None:
        self.timeout_s = group_timeout_s(parent)
        self.patience_s = max(self.timeout_s / 2, self.timeout_s - 60.0)
        ranks = list(range(pdist.get_world_size())) if parent is None else parent.ranks
        self.group = pdist.new_group(ranks, backend="gloo")
        self.broken: Optional[Tuple[type, str]] = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Optional[CheckWork] = None
        threading.Thread(target=self._run, name="gradmgr plan checks", daemon=True).start()

    def start_sum(self, flat: Any, terms: CheckTerms) -> CheckWork:
        if self.broken is not None:
            kind, message = self.broken
            raise kind(message)
        work = self._last = CheckWork(flat, self, terms)
        self._jobs.put(work)
        return work

    def _run(self) -> None:
        while True:
            work = self._jobs.get()
            try:
                pdist.all_reduce(work.flat, group=self.group)
            except Exception as error:  # noqa: BLE001 (gloo's timeout: the waiter raises it)
                work.error = error
            work.done.set()

    def give_up(self, error: Optional[BaseException], terms: CheckTerms, waited: float) -> None:
        """Raise :class:`RanksOutOfStepError` (``error``: the check's own, or None: the
        patience ran out), now and at every later check."""
        message = _OUT_OF_STEP.format(waited=waited, timeout=self.timeout_s,
                                      terms=terms,
                                      why="" if error is None else _FAILED.format(error=error))
        self.broken = (RanksOutOfStepError, _EARLIER.format(cause=message, terms=terms))
        raise RanksOutOfStepError(message) from error

    def finish(self) -> None:
        """Let the last check end (gloo's timeout ends an abandoned one) before the process
        exits."""
        last = self._last
        if last is not None:
            last.done.wait(self.timeout_s)


_GROUPS: Dict[int, CheckGroup] = {}  # by the user group's id (0: the default group)
_MAKING = threading.Lock()


def check_group(group: Any) -> CheckGroup:
    """The check group of ``group`` (None: the default group), made where there is none yet
    (``new_group``: every rank of ``group`` must call it)."""
    gid = 0 if group is None else group.id
    with _MAKING:
        found = _GROUPS.get(gid)
        if found is None:
            found = _GROUPS[gid] = CheckGroup(group)
    return found


@atexit.register
def _finish_checks() -> None:
    for found in list(_GROUPS.values()):
        found.finish()


class CheckTransport:
    """The plan checks' transport over ``group`` (None: every rank): sums host buffers in
    :func:`check_group`'s group, made by :meth:`open` (``data_parallel()``) or at the first
    check."""

    on_host = True

    def __init__(self, group: Any = None, terms: CheckTerms = STEPS) -> None:
        self._group, self._terms = group, terms

    def world_size(self) -> int:
        return int(pdist.get_world_size(self._group))

    def rank(self) -> int:
        return int(pdist.get_rank(self._group))

    def open(self) -> None:
        """Make the check group now, where every rank is: a rank with no batch at all never
        reaches a first check."""
        if self.world_size() > 1:
            check_group(self._group)

    def allreduce_async(self, flat: Any) -> CheckWork:
        return check_group(self._group).start_sum(flat, self._terms)
