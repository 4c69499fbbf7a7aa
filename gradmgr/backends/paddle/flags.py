"""The ``stop_gradient`` flags that recordings lift from attached inputs, and restore.

An attached input must get a gradient, so a recording sets its flag to False, as the PyTorch
backend does with ``requires_grad``. Which tensors are a manager's inputs is decided when it
attaches them (:func:`is_input`, the contract's point 15, as on PyTorch): a plain tensor whose
flag is off then; one frozen after its attach, and a parameter with ``stop_gradient=True``,
are frozen instead and get what Paddle's ``loss.backward()`` gives them. Several managers may
attach the same tensor: the user's flag comes back only when the last recording that lifted it
ends, and a flag one recording lifted is no other manager's reason to differentiate the tensor
(:func:`lifted`).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List

from paddle.base.framework import EagerParamBase

from gradmgr.weak_keys import forgetting_ref


def is_input(tensor: Any) -> bool:
    """A plain tensor whose user's flag is off (``stop_gradient=True``; a flag a recording
    lifted is not the user's): attached now, it is an input of that manager from then on. A
    parameter with ``stop_gradient=True`` is frozen instead (as with ``loss.backward()``)."""
    return not isinstance(tensor, EagerParamBase) and (tensor.stop_gradient or lifted(tensor))


class LiftedFlags:
    """The flags recordings hold lifted: by ``id(tensor)``, the tensor's weak reference (whose
    entry goes when a tensor dropped while lifted dies) and how many recordings lift it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # the weakref callback may run in a collection in lift()
        self._lifted: Dict[int, List[Any]] = {}  # id -> [weakref to the tensor, count]

    def lifted(self, tensor: Any) -> bool:
        """A recording holds ``tensor``'s flag lifted now (the user's flag is off)."""
        with self._lock:
            entry = self._lifted.get(id(tensor))
            return entry is not None and entry[0]() is tensor

    def lift(self, tensor: Any) -> bool:
        """Make the input ``tensor`` differentiable for one recording; True if this call lifted
        it (the recording must call :meth:`restore` once for it)."""
        with self._lock:
            entry = self._lifted.get(id(tensor))
            if entry is not None and entry[0]() is tensor:
                entry[1] += 1
                return True
            if not tensor.stop_gradient:
                return False  # the user turned it on since: nothing to restore
            ref = forgetting_ref(tensor, self, LiftedFlags._forget)
            self._lifted[id(tensor)] = [ref, 1]
            tensor.stop_gradient = False
            return True

    def _forget(self, key: int, dead: weakref.ref) -> None:
        with self._lock:
            entry = self._lifted.get(key)
            if entry is not None and entry[0] is dead:
                del self._lifted[key]

    def restore(self, tensor: Any) -> None:
        """One recording that lifted ``tensor`` ended; the last one gives the user's flag
        back."""
        with self._lock:
            entry = self._lifted.get(id(tensor))
            if entry is None or entry[0]() is not tensor:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._lifted[id(tensor)]
                tensor.stop_gradient = True

    def count(self) -> int:
        """How many tensors recordings hold lifted now (0 once every recording ended)."""
        with self._lock:
            return len(self._lifted)


LIFTED = LiftedFlags()
lifted, lift, restore, lifted_count = LIFTED.lifted, LIFTED.lift, LIFTED.restore, LIFTED.count
