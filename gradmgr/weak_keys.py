"""Tables keyed by ``id(tensor)`` whose entries go when their tensors die.

A manager's attached tensors and a tape's watched ones are kept by ``id(tensor)`` (a tensor's
``__eq__`` is elementwise, so it cannot be a key itself) and held weakly: the entry must go
when its tensor dies, since a new tensor may reuse the id. :func:`forgetting_ref` is that
weak reference. Its callback holds the table's owner weakly too (tensors outlive managers and
tapes: a strong reference would keep every manager that ever attached a tensor alive), and
hands the owner the key and the dead reference, so that the owner drops the entry only if it
is still that reference's (not a newer tensor's that reused the id).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, TypeVar

Owner = TypeVar("Owner")


def forgetting_ref(tensor: Any, owner: Owner,
                   forget: Callable[[Owner, int, weakref.ref], None]) -> weakref.ref:
    """A weak reference to ``tensor`` that calls ``forget(owner, id(tensor), ref)`` when the
    tensor dies, while ``owner`` (held weakly) lives.

    Example:
        >>> import gc
        >>> class Table:
        ...     def __init__(self):
        ...         self.refs = {}
        ...     def forget(self, key, dead):
        ...         if self.refs.get(key) is dead:
        ...             del self.refs[key]
        >>> class T:
        ...     pass
        >>> table, t = Table(), T()
        >>> table.refs[id(t)] = forgetting_ref(t, table, Table.forget)
        >>> del t; _ = gc.collect()
        >>> table.refs
        {}
    """
    key = id(tensor)
    held = weakref.ref(owner)

    def dead(ref: weakref.ref) -> None:
        found = held()
        if found is not None:
            forget(found, key, ref)

    return weakref.ref(tensor, dead)


__all__ = ["forgetting_ref"]
