"""``requires_grad`` flags that recordings turn on and must restore."""

from __future__ import annotations

import weakref
from typing import Dict

import torch


class FlagLedger:
    """Who turned ``requires_grad`` on for which leaf, so that several managers recording the
    same input do not undo each other's change on release."""

    def __init__(self) -> None:
        self._holders: Dict[int, list] = {}  # id -> [weakref, count]

    def acquire(self, t: torch.Tensor) -> bool:
        entry = self._holders.get(id(t))
        if entry is not None and entry[0]() is t:
            entry[1] += 1
            return True
        if t.requires_grad:
            return False  # the user's own flag: nothing to restore
        t.requires_grad_(True)
        self._holders[id(t)] = [weakref.ref(t), 1]
        return True

    def release(self, t: torch.Tensor) -> None:
        entry = self._holders.get(id(t))
        if entry is None or entry[0]() is not t:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._holders[id(t)]
            t.requires_grad_(False)


FLAGS = FlagLedger()
