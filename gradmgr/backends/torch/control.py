"""The plan check's own process group, and how long a rank waits in it.

The plan check is the first collective of every synced step (``gradmgr.distributed.
consistency``). On the user's process group it would pair with whatever another rank does
there: a rank that skipped a batch (``continue``) without ``Join`` has left its loop when the
others start their last step, and its next collective (an evaluation's allreduce, a barrier)
met their check; gloo then aborted the process on the size mismatch. So the checks run in a
gloo group of their own, one per user group, made by ``data_parallel()`` or at the first
check, and kept while that group lives: there a check meets only checks.

A rank whose check nobody joins gives up before the user group's timeout, while the ranks
that left their loop still wait in their next collective there (the whole timeout): it
raises :class:`RanksOutOfStepError`, and that collective then meets the next one this rank
makes, so a program that catches the error still has a working group. Giving up destroys the
check group: the abandoned check would otherwise meet another rank's next check. This rank's
later checks raise at once, and another rank's fail as soon as they start; a new process group
(``destroy_process_group``, ``init_process_group``) makes a new check group. A check that
completes costs what it cost on the user's group.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
import weakref
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from gradmgr.distributed.consistency import STEPS, CheckTerms
from gradmgr.distributed.errors import RanksOutOfStepError

from .arrival import group_store

_log = logging.getLogger(__name__)
_LATEST_S = 60.0  # give up at most this long before the user group's timeout

_OUT_OF_STEP = (
    "data parallel: not every rank started this {terms.checked}: this rank waited {waited:.0f} "
    "s (of the process group's {timeout:.0f} s timeout) for the others' plan check{why}. The "
    "ranks ran different numbers of steps: a rank skipped a batch (`continue`) or ran out of "
    "data while the others trained on, and its {terms.unit}s have been paired with the "
    "others' next ones since. {terms.even_out}. Or another rank waits in a collective that "
    "this one never called, such as `if rank == 0: dcp.save(...)`: "
    "torch.distributed.checkpoint's save and load are collectives, every rank calls them. "
    "Then start a new process group (this one's plan checks were given up on)"
)
_LEFT = (", and another rank left the checks meanwhile (its process ended, or it gave up on "
         "an earlier step's check: see its RanksOutOfStepError)")
_NO_GLOO = (
    "data parallel: gradmgr runs its plan check (one small collective per synced step) in a "
    "gloo process group beside yours, and making it failed: {error}. Gloo must reach every "
    "rank over TCP (GLOO_SOCKET_IFNAME names the network interface), also where the "
    "gradients go over nccl"
)
_EARLIER = (
    "data parallel: this rank gave up on an earlier {terms.checked}'s plan check (the "
    "RanksOutOfStepError raised then), so its checks in this process group would pair with "
    "the wrong steps. Start a new process group (dist.destroy_process_group(), then "
    "init_process_group) before training again. The earlier error: {cause}"
)


class CheckGroup:
    """The gloo group the checks of one user group run in (made by :meth:`make`), and whether
    this rank can use it no more (``broken``: the error to raise at every later check).

    Its timeout is the patience: half the user group's timeout, or a minute short of it where
    that is more, so that the ranks waiting in their next collective of the user group are
    still there when this rank gives up."""

    def __init__(self, parent: Any) -> None:
        store = group_store(parent)
        timeout = store.timeout if store is not None else datetime.timedelta(minutes=30)
        self.timeout_s = timeout.total_seconds()
        self.patience_s = max(self.timeout_s / 2, self.timeout_s - _LATEST_S)
        self.group: Any = None
        self.broken: Optional[Tuple[type, str]] = None

    def make(self, parent: Any, terms: CheckTerms) -> None:
        started = time.monotonic()
        try:
            ranks = dist.get_process_group_ranks(parent)
            self.group = dist.new_group(
                ranks, backend="gloo", timeout=datetime.timedelta(seconds=self.patience_s),
                use_local_synchronization=True)  # (a barrier of its ranks only)
            _log.info("plan check group: a gloo group of its own over ranks %s, patience %.0f s "
                      "(gloo on torch 2.8 prints its '[Gloo] ... connected' lines for it too)",
                      ranks, self.patience_s)
        except RuntimeError as error:
            if _timed_out(error):  # a rank never came: its first step is the one missing
                self.give_up(error, started, terms)
            message = _NO_GLOO.format(error=error)
            self.broken = (RuntimeError, message)
            raise RuntimeError(message) from error

    def start_sum(self, flat: Any, terms: CheckTerms = STEPS) -> CheckWork:
        if self.broken is not None:
            kind, message = self.broken
            raise kind(message)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return CheckWork(work, flat, self, time.monotonic(), terms)

    def give_up(self, error: BaseException, started: float, terms: CheckTerms) -> None:
        """Raise :class:`RanksOutOfStepError` for ``error`` (the transport's timeout, or a peer
        gone), worded in the checking path's ``terms``, now and at every later check; the
        group is destroyed, so that a rank that comes late, or whose next check would have met
        the abandoned one, is told at once."""
        message = _OUT_OF_STEP.format(waited=time.monotonic() - started,
                                      timeout=self.timeout_s, terms=terms,
                                      why="" if _timed_out(error) else _LEFT)
        self.broken = (RanksOutOfStepError, _EARLIER.format(cause=message, terms=terms))
        if self.group is not None:
            dist.destroy_process_group(self.group)
        raise RanksOutOfStepError(message) from error


def _timed_out(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text  # gloo's; the store's


_GROUPS: weakref.WeakKeyDictionary[Any, CheckGroup] = weakref.WeakKeyDictionary()
_MAKING = threading.Lock()  # one check group per user group, whichever thread asks first
# Not the last reference at shutdown: a gloo group freed while the interpreter comes apart
# may abort the process (see .teardown); c10d's own references go as its groups do.
atexit.register(_GROUPS.clear)


def check_group(group: Any, terms: CheckTerms = STEPS) -> CheckGroup:
    """The check group of ``group`` (None: the default group), made where there is none yet
    (a collective of ``group``'s ranks). One given up on stays: a new one would be made on
    this rank alone; a new user group (``init_process_group`` again) gets a new one."""
    parent = group if group is not None else dist.distributed_c10d._get_default_group()
    with _MAKING:
        found = _GROUPS.get(parent)
        if found is None or parent not in dist.distributed_c10d._world.pg_map:  # (private)
            found = _GROUPS[parent] = CheckGroup(parent)
            found.make(parent, terms)
    return found


class CheckWork:
    """A check in flight: ``wait()`` returns the summed buffer, or gives up after the
    check group's timeout (:meth:`CheckGroup.give_up`, in ``terms``)."""

    __slots__ = ("_work", "_flat", "_group", "_started", "_terms")

    def __init__(self, work: Any, flat: Any, group: CheckGroup, started: float,
                 terms: CheckTerms) -> None:
        self._work, self._flat, self._group, self._started = work, flat, group, started
        self._terms = terms

    def wait(self) -> Any:
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as error:  # timed out, or a peer closed its connection
                self._group.give_up(error, self._started, self._terms)
            self._work = None
        return self._flat


class CheckTransport:
    """The plan check's transport over ``group`` (None: the default group): sums host
    buffers in :func:`check_group`'s group, made by :meth:`open` or at the first check. Its
    buffers are on the host (``on_host``), so a check of CUDA tensors waits for no stream.
    ``terms``: how its errors speak of the checking path's steps (``RanksOutOfStepError``)."""

    on_host = True

    def __init__(self, group: Any = None, terms: CheckTerms = STEPS) -> None:
        self._group, self._terms = group, terms

    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    def rank(self) -> int:
        return dist.get_rank(self._group)

    def open(self) -> None:
        """Make the check group now, where every rank is (``data_parallel()``): a rank with no
        batch at all never reaches a first check."""
        if self.world_size() > 1:
            check_group(self._group, self._terms)

    def start_sum(self, flat: torch.Tensor) -> CheckWork:
        """Start summing ``flat``, a host buffer (PlanCheck builds its vector there, asked by
        ``on_host``; MegEngine's transport copies its own there)."""
        return check_group(self._group, self._terms).start_sum(flat, self._terms)

    allreduce_async = start_sum
