"""The plan checks' transport on Paddle ranks: every rank counts itself in at Paddle's TCP
store before the check's collective, and a rank that the others do not join gives up.

The plan check is the first collective of every synced step (``gradmgr.distributed.
consistency``). A rank with a step more (another skipped a batch with ``continue``) would
meet, with its check, whatever the others do after their loop: gloo then aborted a process
(``op.preamble.length <= op.nbytes``). PyTorch ranks run the checks in a gloo group of their
own whose timeout is the patience; Paddle 3.3 makes a gloo group with gloo's fixed 30 s
timeout (``ProcessGroupGloo.create`` takes none, measured), past which a collective waiting
in it fails on both sides, and a collective cannot be left before that. So a check first
counts this rank in, in the store that ``init_parallel_env()`` made (one counter per group,
only ever added to: no key per step): the check's collective starts only once every rank
counted itself in for this check, so it always meets the others' checks; it starts when the
check is read (before the step's first bucket), the forward running meanwhile. A rank whose count
is not matched within the patience (half the group's timeout) poisons the counter and raises
:class:`RanksOutOfStepError`, while the others still wait in their next collective: that
collective then meets this rank's next one. Its later checks, and the others' next ones,
raise at once. A check that completes costs one store round trip more than before.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional, Tuple

import paddle.distributed as pdist
from paddle.base import core

from gradmgr.distributed.consistency import STEPS, CheckTerms
from gradmgr.distributed.errors import RanksOutOfStepError

GLOO_TIMEOUT_S = 30.0
"""How long a Paddle gloo collective waits for its peers (gloo's default, which Paddle 3.3's
``ProcessGroupGloo.create`` keeps: measured 30.0 s)."""

_POISON = 2**40  # taken off the counter by a rank that gave up: the others see it below zero
_FIRST_POLL_S, _LAST_POLL_S = 5e-5, 2e-3  # between reads of the counter, doubling

_OUT_OF_STEP = (
    "data parallel: not every rank started this {terms.checked}: this rank waited {waited:.0f} "
    "s (half the {timeout:.0f} s that a Paddle collective waits) for the others' plan "
    "check{why}. The ranks ran different numbers of steps: a rank skipped a batch (`continue`) "
    "or ran out of data while the others trained on, and its {terms.unit}s have been paired "
    "with the others' next ones since. Take every step on every rank: a rank with nothing to "
    "contribute records an empty step, `with gm: gm.backward()` (gradmgr has no Join on "
    "Paddle). This rank's later steps on this process group raise at once"
)
_LEFT = ", and another rank gave up on the checks meanwhile (see its RanksOutOfStepError)"
_EARLIER = (
    "data parallel: a rank gave up on an earlier {terms.checked}'s plan check (a "
    "RanksOutOfStepError), so the checks of this process group would pair with the wrong "
    "steps: start the ranks again. {cause}"
)


def group_timeout_s(group: Any) -> float:
    """How long a collective of ``group`` waits: gloo's 30 s; otherwise ``PADDLE_PG_TIMEOUT``
    (milliseconds), as ``init_parallel_env()`` reads it."""
    if pdist.get_backend(group).lower() == "gloo":
        return GLOO_TIMEOUT_S
    return int(os.getenv("PADDLE_PG_TIMEOUT", "1800000")) / 1000


class Arrivals:
    """One group's count of plan checks in the store: ``made`` by this rank, and the error
    to raise at every later check once a rank gave up (``broken``)."""

    def __init__(self, store: Any, key: str, world: int, timeout_s: float) -> None:
        self._store, self._key, self._world = store, key, world
        self.timeout_s = timeout_s
        self.patience_s = max(timeout_s / 2, timeout_s - 60.0)
        self.made = 0
        self.broken: Optional[Tuple[type, str]] = None

    def arrive(self, terms: CheckTerms) -> _Arrival:
        """Count this rank in at its next check (raises at once where a rank gave up)."""
        if self.broken is not None:
            kind, message = self.broken
            raise kind(message)
        self.made += 1
        arrival = _Arrival(self, self.made * self._world, terms)
        arrival.count = self._store.add(self._key, 1)
        if arrival.count < 0:  # poisoned: another rank gave up
            self._give_up(arrival, left=True)
        return arrival

    def wait(self, arrival: _Arrival) -> None:
        """Wait until every rank counted itself in at ``arrival``'s check, or raise
        :class:`RanksOutOfStepError` once the patience since the arrival ran out."""
        count, pause = arrival.count, _FIRST_POLL_S
        while count < arrival.target:
            if count < 0:
                self._give_up(arrival, left=True)
            if time.monotonic() - arrival.started > self.patience_s:
                if self._store.add(self._key, -_POISON) + _POISON >= arrival.target:
                    self._store.add(self._key, _POISON)  # the last rank came meanwhile: go on
                    return
                self._give_up(arrival, left=False)
            time.sleep(pause)
            pause = min(2 * pause, _LAST_POLL_S)
            count = self._store.add(self._key, 0)

    def _give_up(self, arrival: _Arrival, left: bool) -> None:
        terms = arrival.terms
        message = _OUT_OF_STEP.format(waited=time.monotonic() - arrival.started,
                                      timeout=self.timeout_s, terms=terms,
                                      why=_LEFT if left else "")
        self.broken = (RanksOutOfStepError, _EARLIER.format(cause=message, terms=terms))
        raise RanksOutOfStepError(message)


class _Arrival:
    """This rank's arrival at one check: when, the count every rank's makes (``target``),
    and the count last read."""

    __slots__ = ("arrivals", "target", "terms", "started", "count")

    def __init__(self, arrivals: Arrivals, target: int, terms: CheckTerms) -> None:
        self.arrivals, self.target, self.terms = arrivals, target, terms
        self.started = time.monotonic()
        self.count = 0


class _CheckTask:
    """A check counted in; ``wait()`` waits for every rank's arrival, then runs the check's
    collective (so it meets only the others' checks) and gives its sum."""

    __slots__ = ("_arrival", "_transport", "_flat")

    def __init__(self, arrival: _Arrival, transport: Any, flat: Any) -> None:
        self._arrival, self._transport, self._flat = arrival, transport, flat

    def wait(self) -> Any:
        self._arrival.arrivals.wait(self._arrival)
        return self._transport.allreduce_async(self._flat).wait()


_ARRIVALS: Dict[int, Arrivals] = {}  # by group id: every transport of a group counts alike


def arrivals(group: Any) -> Arrivals:
    """The count of ``group``'s checks (None: the default group)."""
    gid = 0 if group is None else group.id
    found = _ARRIVALS.get(gid)
    if found is None:
        found = _ARRIVALS[gid] = Arrivals(core.create_or_get_global_tcp_store(),
                                          f"gradmgr/plan-checks/{gid}",
                                          pdist.get_world_size(group), group_timeout_s(group))
    return found


class CheckTransport:
    """The plan checks' transport over ``transport`` (a PaddleTransport): each collective
    waits for every rank's arrival first (:meth:`Arrivals.arrive`), then runs there."""

    def __init__(self, transport: Any, terms: CheckTerms = STEPS) -> None:
        self._transport, self._terms = transport, terms

    def world_size(self) -> int:
        return int(self._transport.world_size())

    def rank(self) -> int:
        return int(self._transport.rank())

    def allreduce_async(self, flat: Any) -> _CheckTask:
        arrival = arrivals(self._transport.group).arrive(self._terms)
        return _CheckTask(arrival, self._transport, flat)
