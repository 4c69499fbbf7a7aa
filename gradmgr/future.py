"""A minimal thread-safe Future: a gradient that a callback promises to deliver later."""

from __future__ import annotations

import threading
from typing import Any, Callable, Generic, Optional, TypeVar

T = TypeVar("T")

_UNSET = object()


class Future(Generic[T]):
    """A value that becomes available later.

    Callbacks may return a ``Future`` instead of a gradient (for example an allreduce still in
    flight). ``GradManager.backward`` calls ``.get()`` on it after the after-backward callbacks
    have run. Any object with a ``get()`` method is accepted the same way.

    Example:
        >>> f = Future()
        >>> f.set(3)
        >>> f.get()
        3
        >>> Future.resolved(4).get()
        4
        >>> Future(lambda: 5).get()   # computed on first get()
        5
    """

    __slots__ = ("_value", "_ready", "_compute", "_lock")

    replaces_grad = False
    """True for a Future whose value is the tensor's complete new ``.grad`` (it replaces what
    ``.grad`` holds instead of being added, and gradmgr stores it without copying); a value of
    None then delivers nothing. Only for gradients a library builds for gradmgr (the
    data-parallel callback's reduced gradients, which already include what ``.grad`` held)."""

    def __init__(self, compute: Optional[Callable[[], T]] = None) -> None:
        self._value: Any = _UNSET
        self._ready = threading.Event()
        self._compute = compute
        self._lock = threading.Lock()

    @classmethod
    def resolved(cls, value: T) -> Future[T]:
        future: Future[T] = cls()
        future.set(value)
        return future

    def set(self, value: T) -> None:
        """Deliver the value; wakes every waiting ``get()``."""
        self._value = value
        self._ready.set()

    def done(self) -> bool:
        return self._ready.is_set()

    def get(self, timeout: Optional[float] = None) -> T:
        """Return the value, computing or waiting for it first."""
        if not self._ready.is_set() and self._compute is not None:
            with self._lock:
                if not self._ready.is_set():
                    self.set(self._compute())
        if not self._ready.wait(timeout):
            raise TimeoutError(f"Future not resolved within {timeout} s")
        return self._value


def is_future(obj: Any) -> bool:
    """True for a :class:`Future` or any non-tensor object with a callable ``get``."""
    return isinstance(obj, Future) or callable(getattr(obj, "get", None))
