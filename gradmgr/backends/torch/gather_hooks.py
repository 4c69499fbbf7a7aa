"""Where a ``ShardedOptimizer(gather="deferred")`` waits for its parameters on a
``torch.nn.Module`` (see ``TensorOps.hook_parameter_reads``).

Each module waits in a forward pre-hook for the parameters registered on it directly, so a
tied weight registered on two modules is waited for by whichever runs first; the module's
``state_dict`` and ``load_state_dict`` pre-hooks wait for every parameter (a checkpoint must
not save, and a load must not be overwritten by, a broadcast still in flight). Pre-hooks run
under ``torch.no_grad()`` too, so an evaluation forward waits as a training one does.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch


class GatherHooks:
    """The handles of :func:`hook_parameter_reads`."""

    def __init__(self, handles: List[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def hook_parameter_reads(module: Any, wait_for: Callable[[Sequence[Any]], None],
                         wait_all: Callable[[], None]) -> Any:
    """Hooks on ``module`` and its submodules (None: ``module`` is not a ``Module``)."""
    if not isinstance(module, torch.nn.Module):
        return None
    handles = []
    for sub in module.modules():
        own = list(sub.parameters(recurse=False))
        if own:  # on every owner: a submodule's own state_dict() waits too
            handles += [sub.register_forward_pre_hook(_waiting_for(own, wait_for)),
                        sub.register_state_dict_pre_hook(lambda *args: wait_all()),
                        sub.register_load_state_dict_pre_hook(lambda *args: wait_all())]
    return GatherHooks(handles)


def _waiting_for(params: List[Any], wait_for: Callable[[Sequence[Any]], None]) -> Any:
    def hook(module: Any, args: Any) -> None:
        wait_for(params)
    return hook
