"""Uneven inputs on PyTorch: torch's own ``torch.distributed.algorithms.Join`` context, which
the manager ``data_parallel`` returns takes part in as a DDP model does (the core's side is
:mod:`gradmgr.distributed.join.joining`; this module is what it needs of torch)."""

from __future__ import annotations

from typing import Any, List

import torch.distributed as dist
from torch.distributed.algorithms.join import Join, _JoinConfig


class TorchJoin:
    """:class:`gradmgr.distributed.contract.JoinSupport` over torch's ``Join``."""

    def disabled_config(self) -> Any:
        return _JoinConfig.construct_disabled_join_config()

    def notify(self, joinable: Any) -> Any:
        return Join.notify_join_context(joinable)

    def context(self, joinables: List[Any], enable: bool, throw_on_early_termination: bool,
                **kwargs: Any) -> Join:
        return Join(joinables, enable=enable,
                    throw_on_early_termination=throw_on_early_termination, **kwargs)

    def device(self, like: Any) -> Any:
        return like.device

    def process_group(self, group: Any) -> Any:
        return dist.group.WORLD if group is None else group
