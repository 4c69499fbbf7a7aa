"""The second half of a split backward (:meth:`gradmgr.GradManager.backward_split`)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from .errors import GradMgrWarning


class UnfinishedBackwardWarning(GradMgrWarning):
    """A split backward was garbage-collected before ``finish()``: the tensors it left for later
    never got their gradients, and its after-backward callbacks never ran.

    Example:
        >>> # rest = gm.backward_split(out, dy, first=[x])
        >>> # del rest                      # UnfinishedBackwardWarning: call rest.finish()
    """


class FinishRefused(RuntimeError):
    """Raised by a finish function before it started anything: the handle stays finishable."""


_PENDING, _DONE, _FAILED = range(3)


class DeferredBackward:
    """What :meth:`GradManager.backward_split` left for later: ``finish()`` computes the
    gradients of the other attached tensors, runs their callbacks, the manager's after-backward
    callbacks and Futures, and accumulates into ``.grad``, exactly once.

    It keeps only what that needs (its manager, the captured gradients at the split and the
    graph below them); the manager may record other computations meanwhile, several deferred
    backwards may be outstanding, and they may be finished in any order.

    Example:
        >>> # with gm:
        >>> #     out = stage(x)                       # x attached while recording
        >>> #     rest = gm.backward_split(out, dy, first=[x])
        >>> # send(x.grad)                             # the previous stage waits for this
        >>> # rest.finish()                            # weight gradients, when there is time
    """

    __slots__ = ("_finish", "_rest", "_step", "_state", "__weakref__")

    def __init__(self, finish: Callable[[Any, int, bool], None], rest: Any, step: int) -> None:
        self._finish = finish  # the manager's: holding it keeps the manager alive
        self._rest = rest
        self._step = step
        self._state = _PENDING

    @property
    def done(self) -> bool:
        """True once :meth:`finish` ran."""
        return self._state == _DONE

    @property
    def step(self) -> int:
        """The recording this backward belongs to (``GradManager.step`` at the time)."""
        return self._step

    def finish(self, retain_graph: bool = False) -> None:
        """Compute and deliver the rest of the gradients; ``retain_graph`` keeps the graph for
        another backward through it (as ``torch.autograd.backward`` does).

        Raises:
            RuntimeError: already finished, or an earlier ``finish()`` failed (its gradients
                are lost), or the manager's own backward is running (then it can be finished
                later).
        """
        if self._state == _DONE:
            raise RuntimeError("this split backward was already finished: call finish() once")
        if self._state == _FAILED:
            raise RuntimeError(
                "an earlier finish() of this split backward raised (its error said why) after "
                "the rest of the backward had started: the gradients it was computing were not "
                "accumulated and are lost. Run the micro-batch's forward and backward again"
            )
        try:
            self._finish(self._rest, self._step, retain_graph)
        except FinishRefused:
            raise  # nothing started: it can be finished later
        except BaseException:
            self._spent(_FAILED)
            raise
        self._spent(_DONE)

    def _spent(self, state: int) -> None:
        rest: Optional[Any] = self._rest
        self._rest, self._state = None, state
        if rest is not None:
            rest.release()  # what it kept on the graph (a retained graph outlives it)

    def __del__(self) -> None:
        if self._rest is not None:
            self._rest.release()
        if self._state == _PENDING:
            warnings.warn(
                "a split backward was never finished: call finish() on what "
                "GradManager.backward_split returned, or the tensors it left for later get no "
                "gradient and the after-backward callbacks do not run",
                UnfinishedBackwardWarning,
                stacklevel=2,
            )
