"""What a ``ShardedOptimizer`` is on PyTorch besides the core's class: a
``torch.optim.Optimizer``, so that torch's learning-rate schedulers (which check
``isinstance(optimizer, Optimizer)``) and other code typed against it accept it.

The core's class keeps its own ``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``
and ``param_groups`` (the wrapped optimizer's groups: the ``lr`` a scheduler sets is the one
the step uses); ``Optimizer.__init__`` is never run. The torch methods that would need it, or
that would silently do nothing on a sharded optimizer, raise here saying what to do instead.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

_UNSUPPORTED = (
    "ShardedOptimizer.{name}: not supported on a sharded optimizer ({why}). The wrapped "
    "optimizer over this rank's slices is opt.optimizer; its groups are opt.param_groups"
)


def _refuse(name: str, why: str) -> Any:
    def refused(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(_UNSUPPORTED.format(name=name, why=why))
    refused.__name__ = name
    refused.__doc__ = f"Raises NotImplementedError: {why}."
    return refused


_HOOKS = "its step and checkpoints are its own; call what the hook would do around them"


class TorchShardedBase(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` under the core's ``ShardedOptimizer`` (see the module)."""

    optimizer: torch.optim.Optimizer  # the wrapped one, set by ShardedOptimizer

    # (read-only properties where torch's Optimizer has attributes: on purpose)
    @property
    def defaults(self) -> Any:  # type: ignore[override]  # the wrapped one's (OneCycleLR reads it)
        return self.optimizer.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]  # refused: a rank holds its slices' only
        raise AttributeError(
            "ShardedOptimizer.state: each rank holds the state of its slices only, in "
            "opt.optimizer.state; opt.state_dict() (every rank) gives the whole state")

    add_param_group = _refuse("add_param_group", "the parameter set is fixed when it is made: "
                              "make a new ShardedOptimizer over all the groups")
    register_step_pre_hook = _refuse("register_step_pre_hook", _HOOKS)
    register_step_post_hook = _refuse("register_step_post_hook", _HOOKS)
    register_state_dict_pre_hook = _refuse("register_state_dict_pre_hook", _HOOKS)
    register_state_dict_post_hook = _refuse("register_state_dict_post_hook", _HOOKS)
    register_load_state_dict_pre_hook = _refuse("register_load_state_dict_pre_hook", _HOOKS)
    register_load_state_dict_post_hook = _refuse("register_load_state_dict_post_hook", _HOOKS)
    __getstate__ = _refuse("__getstate__", "it holds the manager and the process group: "
                           "pickle or copy opt.state_dict() instead")
