"""The second half of a split backward (:meth:`gradmgr.GradManager.backward_split`)."""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

from .errors import GradMgrWarning

if TYPE_CHECKING:
    from .manager import GradManager


class UnfinishedBackwardWarning(GradMgrWarning):
    """A split backward was garbage-collected before ``finish()``: the tensors it left for later
    never got their gradients, and its after-backward callbacks never ran."""


class DeferredBackward:
    """What :meth:`GradManager.backward_split` left for later: ``finish()`` computes the
    gradients of the other attached tensors, runs their callbacks, the manager's after-backward
    callbacks and Futures, and accumulates into ``.grad``, exactly once.

    It keeps only what that needs (the captured gradients at the split, and the graph below
    them); the manager may record other computations meanwhile, several deferred backwards may
    be outstanding, and they may be finished in any order.

    Example:
        >>> # with gm:
        >>> #     out = stage(x)                       # x attached while recording
        >>> #     rest = gm.backward_split(out, dy, first=[x])
        >>> # send(x.grad)                             # the previous stage waits for this
        >>> # rest.finish()                            # weight gradients, when there is time
    """

    __slots__ = ("_manager", "_rest", "_step", "_done", "__weakref__")

    def __init__(self, manager: GradManager, rest: Any, step: int) -> None:
        self._manager = weakref.ref(manager)
        self._rest = rest
        self._step = step
        self._done = False

    @property
    def done(self) -> bool:
        """True once :meth:`finish` ran."""
        return self._done

    @property
    def step(self) -> int:
        """The recording this backward belongs to (``GradManager.step`` at the time)."""
        return self._step

    def finish(self) -> None:
        """Compute and deliver the rest of the gradients.

        Raises:
            RuntimeError: already finished, the manager is gone, or its own backward is running.
        """
        if self._done:
            raise RuntimeError("this split backward was already finished: call finish() once")
        manager = self._manager()
        if manager is None:
            raise RuntimeError("the GradManager of this split backward no longer exists")
        manager._check_can_finish()  # before this is spent: refused, it can be finished later
        rest, self._rest = self._rest, None
        self._done = True
        manager._finish_split(rest, self._step)

    def __del__(self) -> None:
        if self._rest is not None:
            self._rest.release()  # what it kept on the graph (a retained graph outlives it)
        if not self._done and self._manager() is not None:
            warnings.warn(
                "a split backward was never finished: call finish() on what "
                "GradManager.backward_split returned, or the tensors it left for later get no "
                "gradient and the after-backward callbacks do not run",
                UnfinishedBackwardWarning,
                stacklevel=2,
            )
