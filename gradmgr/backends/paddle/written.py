"""Refuse a ``.grad`` that Paddle's own backward wrote while the tape's ``paddle.grad`` ran.

Paddle's ``fleet.utils.recompute`` with ``use_reentrant=True`` (its default) runs a backward
of its own inside the engine: it adds the recomputed layer's gradients to ``.grad`` itself and
``paddle.grad`` returns None for them, so a manager's callbacks (data parallelism's reduction
too) would never see them. Each leaf differentiated gets, once, a hook that Paddle runs after a
backward wrote its ``.grad`` (``paddle.grad`` never writes it); while :func:`watching` runs,
what it reports is refused.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence

from gradmgr.errors import UnsupportedGraphError

WRITTEN_BY_ANOTHER_BACKWARD = (
    "Paddle's own backward wrote the .grad of {names} while gradmgr's paddle.grad ran, and "
    "gave gradmgr no gradient for it: its callbacks (data_parallel's reduction too) never saw "
    "that gradient. This is paddle.distributed.fleet.utils.recompute with use_reentrant=True, "
    "its default: call recompute(..., use_reentrant=False), whose gradients reach gradmgr "
    "(that .grad now holds what Paddle's backward added to it)"
)

_armed: Dict[int, weakref.ref] = {}  # id(leaf): the leaf, for each leaf with the hook
_written: Optional[List[int]] = None  # the leaves written while watching, else None


def _arm(leaf: Any) -> None:
    """Give ``leaf`` the hook once (Paddle cannot remove it: it holds only the id). Paddle
    refuses it on a frozen tensor (``stop_gradient=True``): :func:`watching` arms such a
    tensor at the first backward it is not frozen in."""
    key = id(leaf)
    ref = _armed.get(key)
    if ref is not None and ref() is leaf:
        return
    leaf._register_backward_hook(lambda: _wrote(key))
    _armed[key] = weakref.ref(leaf, lambda dead: _forget(key, dead))


def _forget(key: int, dead: weakref.ref) -> None:
    if _armed.get(key) is dead:
        del _armed[key]


def _wrote(key: int) -> None:
    if _written is not None:
        _written.append(key)


@contextmanager
def watching(tensors: Sequence[Any]) -> Iterator[None]:
    """Raise UnsupportedGraphError after the block if a backward wrote the ``.grad`` of one of
    ``tensors`` inside it."""
    global _written
    for tensor in tensors:
        if tensor.is_leaf and not tensor.stop_gradient:
            _arm(tensor)
    outer, _written = _written, []
    try:
        yield
        written = set(_written)
    finally:
        _written = outer
    hit = [t for t in tensors if id(t) in written] if written else []
    if hit:
        names = ", ".join(repr(getattr(t, "name", "?")) for t in hit)
        raise UnsupportedGraphError(WRITTEN_BY_ANOTHER_BACKWARD.format(names=names))
