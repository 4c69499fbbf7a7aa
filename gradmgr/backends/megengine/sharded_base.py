"""What a ``ShardedOptimizer`` is on MegEngine besides the core's class: a
``megengine.optimizer.Optimizer``, so that MegEngine's learning-rate schedulers (which check
``isinstance(optimizer, Optimizer)``) accept it.

The core's class keeps its own ``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``
and ``param_groups`` (the wrapped optimizer's groups: the ``lr`` a scheduler sets is the one
the step uses); ``Optimizer.__init__`` is never run. The methods that would need it raise.
"""

from __future__ import annotations

from typing import Any, NoReturn

from megengine.optimizer import Optimizer


class MegEngineShardedBase(Optimizer):
    """``megengine.optimizer.Optimizer`` under the core's ``ShardedOptimizer``."""

    def clear_grad(self) -> None:
        """Drop the gradient slices, as ``zero_grad``."""
        self.zero_grad()

    def add_param_group(self, param_group: dict) -> NoReturn:
        raise NotImplementedError(
            "ShardedOptimizer.add_param_group: the parameter set is fixed when it is made: "
            "make a new ShardedOptimizer over all the groups")

    def _create_state(self, param_group: Any) -> NoReturn:  # the wrapped optimizer's job
        raise NotImplementedError("ShardedOptimizer steps through opt.optimizer")

    def _updates(self, param_group: Any) -> NoReturn:
        raise NotImplementedError("ShardedOptimizer steps through opt.optimizer")
