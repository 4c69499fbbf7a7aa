"""The ``stop_gradient`` flags that recordings lift from attached tensors, and restore.

An attached input (``stop_gradient=True``) must get a gradient, so a recording sets its flag to
False, as the PyTorch backend does with ``requires_grad``. A parameter with
``stop_gradient=True`` is frozen instead and gets no gradient, as with ``loss.backward()`` and
``paddle.DataParallel`` (and a frozen ``torch.nn.Parameter`` on the PyTorch backend). Several
managers may attach the same tensor: the user's flag comes back only when the last recording
that lifted it ends.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List

from paddle.base.framework import EagerParamBase

_lock = threading.RLock()  # the weakref callback may run during a collection inside lift()
_lifted: Dict[int, List[Any]] = {}  # id -> [weakref to the tensor, how many recordings lift it]


def lift(tensor: Any) -> bool:
    """Make ``tensor`` differentiable for one recording; True if this call lifted it (the
    recording must call :func:`restore` once for it)."""
    with _lock:
        entry = _lifted.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            entry[1] += 1
            return True
        if not tensor.stop_gradient or isinstance(tensor, EagerParamBase):
            return False  # trainable, or a frozen parameter: nothing to restore
        _lifted[id(tensor)] = [weakref.ref(tensor, _forget(id(tensor))), 1]
        tensor.stop_gradient = False
        return True


def _forget(key: int) -> Any:
    """A tensor dropped while a recording held its flag lifted: its entry goes with it."""
    def forget(ref: Any) -> None:
        with _lock:
            entry = _lifted.get(key)
            if entry is not None and entry[0] is ref:
                del _lifted[key]

    return forget


def restore(tensor: Any) -> None:
    """One recording that lifted ``tensor`` ended; the last one gives the user's flag back."""
    with _lock:
        entry = _lifted.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _lifted[id(tensor)]
            tensor.stop_gradient = True


def lifted_count() -> int:
    """How many tensors recordings hold lifted now (0 once every recording ended)."""
    with _lock:
        return len(_lifted)
