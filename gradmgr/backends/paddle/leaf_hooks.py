"""A leaf's own gradient hooks (``register_hook``), which ``paddle.grad`` skips.

Paddle keeps a leaf's hooks on its accumulation node, which runs them on the summed gradient
before adding it to ``.grad`` in ``loss.backward()``; ``paddle.grad`` returns the gradient
without running them, and Paddle shows no way to list them. So the tape asks the node whether
a hook was ever registered (:func:`registrations`), and for such a leaf runs the gradient
through that node once more with Paddle's own backward (:func:`run_hooks`): the hooks run as
``loss.backward()`` runs them, in their order, and a removed hook no more.
"""

from __future__ import annotations

from typing import Any, Optional

import paddle

from . import sparse


def _nothing(grad: Any) -> None:
    return None


def registrations(leaf: Any) -> int:
    """How many hooks were ever registered on ``leaf``'s accumulation node. Hook ids count
    up from 0 on each node and ``remove()`` does not lower the count, so registering a hook
    that does nothing, and removing it, tells (and adds one to the count)."""
    hook_id = leaf._register_grad_hook(_nothing)
    leaf._remove_grad_hook(hook_id)
    return int(hook_id)


class HookProbe:
    """Whether a leaf may have hooks: the count :func:`registrations` gave last time, and
    whether any registration besides the probe's own was ever seen."""

    __slots__ = ("next_id", "hooked")

    def __init__(self) -> None:
        self.next_id: Optional[int] = None
        self.hooked = False

    def may_have_hooks(self, leaf: Any) -> bool:
        if self.hooked:
            return True  # for good: no probe needed (Paddle cannot tell that all were removed)
        count = registrations(leaf)
        if count != (0 if self.next_id is None else self.next_id):
            self.hooked = True  # another registration (or another tape's probe): run them
        self.next_id = count + 1
        return self.hooked


def run_hooks(leaf: Any, grad: Any) -> Any:
    """``grad`` after ``leaf``'s hooks, as Paddle's backward gives it to ``.grad``; ``leaf``'s
    ``.grad`` is left as it was (restored from a copy: clearing it frees its memory)."""
    kept = _copy(leaf, leaf.grad)
    frozen = leaf.stop_gradient
    leaf.clear_gradient(False)
    try:
        leaf.stop_gradient = False  # frozen after the forward: its node still runs the hooks
        with paddle.set_grad_enabled(True):
            paddle.autograd.backward(*sparse.through(leaf, grad))
        hooked = _copy(leaf, leaf.grad)  # the restore below may write into .grad's memory
    finally:
        leaf.stop_gradient = frozen
        if kept is None:
            leaf.clear_gradient(False)
        else:
            leaf.grad = kept
    return hooked


def _copy(leaf: Any, grad: Optional[Any]) -> Optional[Any]:
    """A copy of ``leaf``'s gradient ``grad`` outside the graph (``.grad`` has
    ``stop_gradient=False``: a plain ``clone()`` would be recorded), as ``paddle.grad`` returns
    its gradients; a sparse one has no ``clone()``."""
    if grad is None:
        return None
    if sparse.is_sparse(grad):
        return sparse.total(leaf, [grad])
    with paddle.no_grad():
        return grad.clone()
