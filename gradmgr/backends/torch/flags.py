"""State that recordings change and must restore: ``requires_grad`` flags and grad mode."""

from __future__ import annotations

import threading
import weakref
from typing import Container, Dict, List

import torch

from .graph import has_own_flag


class FlagLedger:
    """Who turned ``requires_grad`` on for which leaf, so that several managers recording the
    same input do not undo each other's change on release, and so that a flag a recording
    turned on is never mistaken for the user's own (:meth:`user_flag`)."""

    def __init__(self) -> None:
        self._holders: Dict[int, list] = {}  # id -> [weakref, count]

    def _held(self, t: torch.Tensor) -> bool:
        entry = self._holders.get(id(t))
        return entry is not None and entry[0]() is t

    def user_flag(self, t: torch.Tensor) -> bool:
        """Whether ``t`` requires grad by a flag of its own that the user set: not one a
        recording turned on, nor only its base's (a view made before its base required grad
        shows the base's flag, but gets no gradient of its own until its own flag is set)."""
        if not t.requires_grad or self._holders and self._held(t):
            return False
        return t.grad_fn is not None or not t._is_view() or has_own_flag(t)

    def lends_only(self, keys: Container[int]) -> bool:
        """Every flag a recording turned on is one of ``keys`` (ids)."""
        holders = self._holders
        return not holders or all(key in keys for key in holders)

    def acquire(self, t: torch.Tensor) -> bool:
        entry = self._holders.get(id(t))
        if entry is not None and entry[0]() is t:
            entry[1] += 1
            return True
        if self.user_flag(t):
            return False  # the user's own flag: nothing to restore
        t.requires_grad_(True)  # (on a view: its own flag, so that it gets its own gradient)
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
        # thread id -> [[owner, restore_off], ...]; empty in the usual step, which a tape tells
        # without calling start() (see TorchTape.start)
        self.by_thread: Dict[int, List[list]] = {}

    def start(self, owner: object) -> int:
        """Returns what :meth:`stop` needs: the thread, or 0 when there is nothing to track
        (grad mode on and no other hold in this thread: the usual step)."""
        thread = threading.get_ident()
        off = not torch.is_grad_enabled()
        holds = self.by_thread.get(thread)
        if not off and not holds:
            return 0
        if off:
            torch.set_grad_enabled(True)
        if holds is None:
            holds = self.by_thread[thread] = []
        holds.append([owner, off])
        return thread

    def stop(self, owner: object, thread: int) -> None:
        holds = self.by_thread.get(thread)
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
            del self.by_thread[thread]


GRAD_MODE = GradModeHolds()
