"""The wrapped optimizer's group options, which a ``ShardedOptimizer`` sets from its own
``param_groups`` at every step: a change made behind it (a scheduler built on
``opt.optimizer``) is refused rather than silently overwritten."""

from __future__ import annotations

from typing import Any, Dict, List

_CHANGED_BEHIND = (
    "ShardedOptimizer: {key!r} of the wrapped optimizer's group {index} (opt.optimizer) was "
    "changed since its last step, and the step takes the groups' options from the "
    "ShardedOptimizer's own param_groups, so the change would be lost (an LR scheduler built "
    "on opt.optimizer trains at a constant rate). Build schedulers on the ShardedOptimizer "
    "itself (StepLR(opt, ...)) and change options through opt.param_groups"
)


def options(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def refuse_changes_behind(groups: List[Dict[str, Any]],
                          stepped_with: List[Dict[str, Any]]) -> None:
    """Options of ``opt.optimizer``'s groups that changed since its last step: a scheduler
    over the wrapped optimizer, whose change each step overwrites. New keys are fine (a
    scheduler made on ``opt`` adds ``initial_lr`` to the program's groups, copied in)."""
    for index, (group, before) in enumerate(zip(groups, stepped_with)):
        for key, old in before.items():
            new = group.get(key, old)
            if new is not old and not _equal(new, old):
                raise RuntimeError(_CHANGED_BEHIND.format(key=key, index=index))


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a tensor-valued option: only identity counts
        return False


__all__ = ["options", "refuse_changes_behind"]
