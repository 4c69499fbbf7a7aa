"""Per-thread bookkeeping: which managers are recording and which one is backwarding.

Managers in different threads are independent (S12), so this state is thread-local. Engines may
run gradient callbacks on their own worker threads (PyTorch does on CUDA); the manager pushes
itself as the backwarding manager in whatever thread runs its callbacks.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional

if TYPE_CHECKING:
    from .backend import Backend

record_counter = itertools.count()
"""Global start order of recordings: earlier-started managers record later backwards."""


class StartingGroup(NamedTuple):
    """A group starting its members: each member's ``record()`` joins ``group`` (a token that
    identifies this start of the group) and, knowing no framework yet, takes ``backend`` (the
    other members' framework, or None)."""

    group: Any
    backend: Optional[Backend]


class ThreadState(threading.local):
    def __init__(self) -> None:
        self.recording: List[weakref.ref] = []  # weak references to the recording managers
        # GradManagers (this module sits below manager.py, so it does not name the type)
        self.backwarding: List[Any] = []
        self.starting_group: Optional[StartingGroup] = None


state = ThreadState()


def recording_managers() -> List[Any]:
    """The managers recording in this thread, in the order they started (live ones only)."""
    return [m for m in (ref() for ref in state.recording) if m is not None]
