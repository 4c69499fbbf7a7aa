"""Full sharding's plan check: the ranks compared at every recording, before its collectives.

Under full sharding the engine (FSDP2) gathers each block's parameters in every forward and
backward, inside ``no_sync`` too, and reduce-scatters the gradients of the synced ones. Those
collectives pair by their order alone, so ranks that disagree about ``no_sync`` pair one
rank's reduce-scatter with another's gather, and a rank that skipped a batch pairs its last
step with whatever the others do after their loop: a crash inside gloo, or a hang until the
process group's timeout. The check the other paths run (:class:`~..consistency.PlanCheck`,
in the checks' own process group) catches both, as it does there: where the ranks disagree,
every rank raises :class:`RankMismatchError`; where a rank's check meets none, it raises
:class:`RanksOutOfStepError` after the check group's patience.

Two differences from the allreduce callback's check, both because FSDP2's forward already
communicates: it runs at every recording, not only the synced ones (a recording inside
``no_sync`` gathers too, so it must meet the others' recording, not their next synced one),
and it is read at once, at ``record()`` (it cannot overlap the forward, whose first gather
must not go out before the ranks are known to agree).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ..consistency import RECORDINGS, PlanCheck, names_from, plan_fingerprint, verify_mode
from ..transport import control_transport

MODE = "full sharding (FSDP2): gathered and reduce-scattered by the framework"


class FullShardCheck:
    """One manager's checks under full sharding, over ``checks`` (the transport of the plan
    checks) for the module's parameters ``params``; ``verify`` as the allreduce callback's
    (``True``/``"step"``: every recording; ``"plan"``: the first, and where this rank's
    trainable parameters changed; ``False``: never)."""

    def __init__(self, ops: Any, checks: Any, module: Any, params: Sequence[Any],
                 verify: Any) -> None:
        self._ops, self._checks, self._module = ops, checks, module
        self._params = list(params)
        self._verify = verify_mode(verify)
        self._flags: Optional[tuple] = None  # which parameters were trainable when planned
        self._tensors: List[Any] = []
        self._fingerprint: List[int] = []
        self._unsynced = 0  # recordings inside no_sync since the last synced one

    def record(self, synced: bool) -> None:
        """Compare this recording with the other ranks' (a collective in the checks' group);
        raise the error every rank raises where they differ."""
        if self._verify is None or not self._params:
            return
        accumulated = self._unsynced if synced else None
        self._unsynced = 0 if synced else self._unsynced + 1
        if not self._replan() and self._verify == "plan":
            return
        check = PlanCheck(self._checks, self._ops, self._fingerprint, self._params[0],
                          accumulated=accumulated, terms=RECORDINGS)
        if not check.agreed():
            self._unsynced = 0  # every rank starts counting afresh (see PlanCheck)
            raise check.error(self._tensors, MODE, "their modules' trainable parameters",
                              names_from(self._module))

    def _replan(self) -> bool:
        """The fingerprint of the trainable parameters, made again where they changed."""
        ops = self._ops
        flags = tuple(ops.trainable(p) for p in self._params)
        if flags == self._flags:
            return False
        self._flags = flags
        self._tensors = [p for p, trainable in zip(self._params, flags) if trainable]
        self._fingerprint = plan_fingerprint(ops, self._tensors, MODE)
        return True


def full_shard_check(ops: Any, transport: Any, module: Any, params: Sequence[Any],
                     verify: Any) -> Optional[FullShardCheck]:
    """The check over ``transport``'s checks (its ``control()``, see
    :func:`~..transport.control_transport`), or None with one rank."""
    verify_mode(verify)
    if transport.world_size() < 2:
        return None
    return FullShardCheck(ops, control_transport(transport, RECORDINGS), module, params, verify)


__all__: List[str] = ["FullShardCheck", "full_shard_check"]
