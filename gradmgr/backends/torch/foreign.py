"""Backwards that are not a manager's (``loss.backward()`` typed by habit, or
``torch.autograd.grad``) reaching watched leaves while a tape records: whether they wrote
``.grad`` behind the callbacks' back, told when the recording ends without ``gm.backward()``."""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

from gradmgr import get_backwarding_grad_manager

BYPASSED = (
    "loss.backward() (or torch.autograd.backward) ran inside a recording (`with gm:`) and the "
    "recording ended without gm.backward(): PyTorch wrote the .grad of {n} attached "
    "tensor(s) itself and the manager's callbacks never ran on them, so .grad holds the "
    "gradients without what the callbacks do (MegEngine tensors have no .backward() at all). "
    "Call gm.backward(loss) inside `with gm:` instead"
)


class ForeignBackwards:
    """The watched leaves a foreign backward reached in one recording, by key, each with what
    its ``.grad`` held before that backward accumulated: ``(ref, .grad then, its version)``."""

    __slots__ = ("_before",)

    def __init__(self) -> None:
        self._before: Dict[int, Tuple[weakref.ref, Any, Optional[int]]] = {}

    def note(self, key: int, ref: Optional[weakref.ref]) -> None:
        """A backward reached watched leaf ``key`` (``ref``: its weak reference, None if no
        longer watched) outside the tape's own backward; kept unless that backward is another
        manager's (nested, or run inside a callback)."""
        if ref is None or key in self._before or get_backwarding_grad_manager() is not None:
            return
        tensor = ref()
        if tensor is not None:
            grad = tensor.grad
            self._before[key] = (ref, grad, None if grad is None else grad._version)

    def written(self) -> int:
        """How many of the noted leaves' ``.grad`` changed since the note."""
        changed = 0
        for ref, grad, version in self._before.values():
            tensor = ref()
            if tensor is not None and (tensor.grad is not grad or grad is not None
                                       and grad._version != version):
                changed += 1
        return changed

    def message(self) -> Optional[str]:
        """What the manager raises (``Tape.bypassed``) where the recording ends without
        ``gm.backward()``, or None where no foreign backward wrote ``.grad``."""
        written = self.written()
        return BYPASSED.format(n=written) if written else None
