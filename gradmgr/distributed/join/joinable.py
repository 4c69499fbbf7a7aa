"""The manager :func:`gradmgr.distributed.data_parallel` returns: a GradManager that is also a
joinable of the framework's context for uneven inputs (torch's ``Joinable``), as a DDP model
is. What a rank does inside the context is :mod:`.joining`'s."""

from __future__ import annotations

import weakref
from typing import Any, List, Optional

from ...manager import GradManager
from .joining import NOT_FIRST, JoinHook, Joining

_NO_JOIN = (
    "uneven inputs (torch's Join, DDP's model.join()) are PyTorch's: this framework has no "
    "such context. Give every rank the same number of batches (drop the last incomplete "
    "ones, or let a rank with fewer record empty steps inside no_sync(gm))"
)
_TWO = (
    "data_parallel under Join: two managers in one Join context (two models, as DDP allows) "
    "are not supported: a joined rank shadows the steps of the first manager only. Use one "
    "Join per manager that has uneven inputs, or one data_parallel over both models (an "
    "nn.ModuleList of them), or give every rank the same number of batches"
)
_VERIFY = (
    "data_parallel under Join needs its plan check at every synced step (verify=True, the "
    "default): a joined rank learns from it what the others' step does. Make the manager "
    "with verify=True"
)
_HOOK = (
    "data_parallel under Join: a comm_hook= is not supported yet (a joined rank would have "
    "to run the hook on zeros as the others' buckets travel, which is untested); drop the "
    "hook inside Join, or give every rank the same number of batches"
)
_DIVIDE = (
    "data_parallel under Join: divide_by_initial_world_size=False (dividing by the ranks "
    "that have not joined) is not supported; use the default, True (DDP's default too)"
)


class DataParallelManager(GradManager):
    """The GradManager :func:`gradmgr.distributed.data_parallel` returns: also a joinable of
    the framework's context for uneven inputs (torch's ``Joinable``: ``join_hook``,
    ``join_device``, ``join_process_group``), as a DDP model is.

    Example:
        Here a process group of one rank; under ``torchrun`` each rank may have its own
        number of batches (the guide "Uneven inputs" runs two):

        >>> import torch
        >>> import torch.distributed as dist
        >>> from gradmgr.distributed import data_parallel, free_port
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> gm = data_parallel(model)
        >>> with gm.join():                    # or: with Join([gm]):
        ...     for x in [torch.ones(3, 2)] * 2:
        ...         with gm:
        ...             gm.backward(model(x).sum())
        >>> model.weight.grad                  # two steps' gradients, accumulated
        tensor([[6., 6.]])
        >>> del gm
        >>> dist.destroy_process_group()
    """

    def __init__(self) -> None:
        super().__init__()
        self.joining: Optional[Joining] = None  # set by data_parallel where the framework can
        self._join_config: Any = None  # the context sets it (torch's Joinable protocol)
        self.no_join = _NO_JOIN  # why there is no Join here; a path without one says its own
        # the model, weakly (data_parallel sets it): where a deferred gather hooks its waits
        self.module_ref: Any = None

    def _joins(self) -> Joining:
        if self.joining is None:
            raise NotImplementedError(self.no_join)
        return self.joining

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """What a joined rank runs (called by the context, with its keyword arguments)."""
        joining = self._joins()
        if not kwargs.get("divide_by_initial_world_size", True):
            raise NotImplementedError(_DIVIDE)
        if joining.callback.verify != "step":
            raise ValueError(_VERIFY)
        if joining.callback.comm_hook is not None:
            raise NotImplementedError(_HOOK)
        return JoinHook(joining, self)

    @property
    def join_device(self) -> Any:
        """The device of the Join context's own collectives (torch's ``Joinable``)."""
        return self._joins().device()

    @property
    def join_process_group(self) -> Any:
        """The process group of the Join context's own collectives: the manager's."""
        joining = self._joins()
        _check_place(self)
        return joining.process_group()

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Any:
        """DDP's ``model.join()``: the context over this manager alone."""
        return self._joins().support.context(
            [self], enable, throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size)


# The latest manager the context made its first joinable (torch's Join asks every joinable for
# its process group in order, after setting each one's place): a later one in the same context
# is a second manager.
_FIRST_SEEN: List[weakref.ref] = []


def _check_place(gm: DataParallelManager) -> None:
    """Refuse a manager that is not the context's first joinable while the context is being
    made, and leave no joinable it refuses inside it (their steps would shadow a context
    that never starts)."""
    config = gm._join_config
    if config is None or not config.enable:
        return
    if config.is_first_joinable:
        _FIRST_SEEN[:] = [weakref.ref(gm)]
        return
    first: Optional[DataParallelManager] = _FIRST_SEEN[0]() if _FIRST_SEEN else None
    two = first is not None and first is not gm and first.joining is not None and (
        first.joining.active(first) and first._join_config.is_first_joinable)
    for refused in (gm, first) if two else (gm,):
        if refused is not None and refused.joining is not None:
            refused._join_config = refused.joining.support.disabled_config()
    _FIRST_SEEN.clear()
    raise ValueError(_TWO if two else NOT_FIRST)


__all__: List[str] = ["DataParallelManager"]
