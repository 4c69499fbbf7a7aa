"""Optimizers made before ``data_parallel(model, shard="full")``, refused at their first step.

FSDP2's ``fully_shard`` puts new parameters (the shards) on the model; an optimizer made
before it holds the old ones, which no forward uses and no backward gives a gradient, so its
``step()`` changes nothing, silently (as under FSDP2 alone). One process-wide optimizer
step pre-hook (torch's ``register_optimizer_step_pre_hook``), installed with the first fully
sharded manager, checks each optimizer once (again where it gained a parameter group) and
raises where it holds a replaced parameter. The usual step pays a dictionary look-up.
"""

from __future__ import annotations

import weakref
from typing import Any, List

from torch.optim.optimizer import register_optimizer_step_pre_hook

_STALE = (
    "this optimizer ({kind}) holds {count} parameter(s) that data_parallel(model, "
    "shard='full') replaced{names}: FSDP2's fully_shard put the parameters' shards on the "
    "model, and the ones taken before it get no gradient, so this step would change "
    "nothing. Make the optimizer after data_parallel, over the model's own parameters: "
    "optimizer = {kind}(model.parameters(), ...)"
)

_REPLACED: weakref.WeakSet[Any] = weakref.WeakSet()  # each fully sharded manager's
_CHECKED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # -> groups
_HOOK: List[Any] = []


def refuse_stale_optimizers(replaced: Any) -> None:
    """From now on, an optimizer that holds a parameter ``replaced`` (a
    ``ReplacedParameters``) lists raises at its step, for as long as ``replaced`` lives."""
    _REPLACED.add(replaced)
    _CHECKED.clear()  # optimizers checked before may hold these
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check))


def _check(optimizer: Any, args: Any, kwargs: Any) -> None:
    groups = optimizer.param_groups
    if _CHECKED.get(optimizer) == len(groups):
        return
    for replaced in list(_REPLACED):
        stale = [p for group in groups for p in group["params"] if replaced.holds(p)]
        if stale:
            raise TypeError(_STALE.format(kind=type(optimizer).__name__, count=len(stale),
                                          names=replaced.named(stale)))
    _CHECKED[optimizer] = len(groups)


__all__: List[str] = ["refuse_stale_optimizers"]
