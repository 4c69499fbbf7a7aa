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

    __slots__ = ("_value", "_event", "_compute", "_lock")

    replaces_grad = False
    """True for a Future whose value is the tensor's complete new ``.grad`` (it replaces what
    ``.grad`` holds instead of being added, and gradmgr stores it without copying); a value of
    None then delivers nothing. Only for gradients a library builds for gradmgr (the
    data-parallel callback's reduced gradients, which already include what ``.grad`` held)."""

    def __init__(self, compute: Optional[Callable[[], T]] = None) -> None:
        # The event and the compute lock are made only when a get() has to wait or compute:
        # a callback may return one Future per tensor, and most are resolved before get().
        self._value: Any = _UNSET
        self._event: Optional[threading.Event] = None
        self._compute = compute
        self._lock: Optional[threading.Lock] = None

    @classmethod
    def resolved(cls, value: T) -> Future[T]:
        """A Future that already holds ``value``."""
        future: Future[T] = cls()
        future._value = value  # nobody else can see it yet
        return future

    def set(self, value: T) -> None:
        """Deliver the value; wakes every waiting ``get()``."""
        with _GUARD:
            self._value = value
            event = self._event
        if event is not None:
            event.set()

    def done(self) -> bool:
        """Whether the value is there (``get()`` returns at once)."""
        return self._value is not _UNSET

    def get(self, timeout: Optional[float] = None) -> T:
        """Return the value, computing or waiting for it first."""
        value = self._value
        if value is not _UNSET:
            return value
        if self._compute is not None:
            with _GUARD:
                if self._lock is None:
                    self._lock = threading.Lock()
            with self._lock:  # one computation, also when several threads ask at once
                if self._value is _UNSET:
                    self.set(self._compute())
            return self._value
        with _GUARD:  # set() reads the event under the same lock: no wake-up is missed
            if self._value is not _UNSET:
                return self._value
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if not event.wait(timeout):
            raise TimeoutError(f"Future not resolved within {timeout} s")
        return self._value


_GUARD = threading.Lock()  # short sections only: publishing a value, making an event or lock


def is_future(obj: Any) -> bool:
    """True for a :class:`Future` or any non-tensor object with a callable ``get``.

    Example:
        >>> is_future(Future.resolved(1)), is_future(3.0)
        (True, False)
    """
    return isinstance(obj, Future) or callable(getattr(obj, "get", None))
