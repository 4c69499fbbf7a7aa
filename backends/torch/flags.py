"""State that recordings change and must restore: ``requires_grad`` flags and grad mode."""

from __future__ import annotations

import threading
import weakref
from typing import Dict, List

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


class GradModeHolds:
    """Grad mode is on in a thread while any manager records there.

    Autograd records nothing with grad mode off (under ``torch.no_grad()``, or inside a gradient
    callback, where the engine turns it off), so a recording started there would silently
    differentiate nothing. ``start`` turns it on and notes whether it was off; when the
    recording that found it off stops, it is turned off again, unless a recording started
    later in the same thread is still running, which then inherits that duty (recordings need
    not stop in the order they started).
    """

    def __init__(self) -> None:
        self._by_thread: Dict[int, List[list]] = {}  # thread id -> [[owner, restore_off], ...]

    def start(self, owner: object) -> int:
        """Returns what :meth:`stop` needs: the thread, or 0 when there is nothing to track
        (grad mode on and no other hold in this thread: the usual step)."""
        thread = threading.get_ident()
        off = not torch.is_grad_enabled()
        holds = self._by_thread.get(thread)
        if not off and not holds:
            return 0
        if off:
            torch.set_grad_enabled(True)
        if holds is None:
            holds = self._by_thread[thread] = []
        holds.append([owner, off])
        return thread

    def stop(self, owner: object, thread: int) -> None:
        holds = self._by_thread.get(thread)
        if not holds:
            return
        i = next((i for i, hold in enumerate(holds) if hold[0] is owner), None)
        if i is None:
            return
        hold = holds.pop(i)
        if hold[1]:
            if i < len(holds):
                holds[i][1] = True  # a later recording still runs: it turns grad mode off
            elif thread == threading.get_ident():
                torch.set_grad_enabled(False)
        if not holds:
            del self._by_thread[thread]


GRAD_MODE = GradModeHolds()
