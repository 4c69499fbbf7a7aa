"""A split backward (:meth:`gradmgr.GradManager.backward_split`): what its first part checks,
and the handle to its second half."""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional

from .backend import Backend
from .errors import GradMgrWarning, UnsupportedGraphError
from .registry import backend_for


class UnfinishedBackwardWarning(GradMgrWarning):
    """A split backward was garbage-collected before ``finish()``: the tensors it left for later
    never got their gradients, and its after-backward callbacks never ran.

    Example:
        >>> import warnings
        >>> import torch
        >>> from gradmgr import GradManager
        >>> w = torch.ones(2, requires_grad=True)
        >>> x = torch.ones(2)
        >>> gm = GradManager().attach(w)
        >>> with gm:
        ...     _ = gm.attach(x)
        ...     rest = gm.backward_split((w * x).sum(), first=[x])
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     del rest  # never finished: w never got its gradient
        >>> [type(c.message).__name__ for c in caught], w.grad
        (['UnfinishedBackwardWarning'], None)
    """


class FinishRefused(RuntimeError):
    """Raised by a finish function before it started anything: the handle stays finishable."""


def check_first(first: Any, attachments: Any, backend: Optional[Backend]) -> List[Any]:
    """``first`` of ``backward_split`` as a list, every item attached (to ``attachments``)."""
    items = [first] if backend_for(first) is not None else list(first)
    for i, t in enumerate(items):
        if attachments.spec_of(t) is None:
            what = (f"a tensor of {backend.describe(t)}"
                    if backend is not None and backend_for(t) is backend
                    else type(t).__name__)
            raise ValueError(
                f"backward_split(first=...): item {i} ({what}) is not attached to this "
                f"manager; attach it first (an activation: attach it while recording, "
                f"right after computing it)"
            )
    return items


def check_can_split(backend: Optional[Backend], refusal: Optional[str] = None) -> None:
    """Refuse a backend whose engine cannot split a backward (its capabilities say so), or a
    manager a library set a ``refusal`` on (:func:`gradmgr.hooks.refuse_split`)."""
    if refusal is not None:
        raise UnsupportedGraphError(refusal)
    if backend is not None and not backend.capabilities.split_backward:
        raise UnsupportedGraphError(
            f"the {backend.name} backend cannot split a backward (its engine has no way "
            f"to compute some gradients now and the others later); use backward()"
        )


def check_not_nested(create_graph: bool) -> None:
    """Refuse a split backward that an outer manager records (it would differentiate it)."""
    if create_graph:
        raise UnsupportedGraphError(
            "a manager that started recording earlier records this backward "
            "(higher-order derivatives), and a split backward cannot be "
            "differentiated; use backward() there"
        )


_PENDING, _DONE, _FAILED = range(3)


class DeferredBackward:
    """What :meth:`GradManager.backward_split` left for later: ``finish()`` computes the
    gradients of the other attached tensors, runs their callbacks, the manager's after-backward
    callbacks and Futures, and accumulates into ``.grad``, exactly once.

    It keeps only what that needs (its manager, the captured gradients at the split and the
    graph below them); the manager may record other computations meanwhile, several deferred
    backwards may be outstanding, and they may be finished in any order.

    Example:
        A pipeline stage: the input's gradient first, for the previous stage; the weight's
        when there is time.

        >>> import torch
        >>> from gradmgr import GradManager
        >>> stage = torch.nn.Linear(2, 1, bias=False)
        >>> torch.nn.init.ones_(stage.weight)
        Parameter containing:
        tensor([[1., 1.]], requires_grad=True)
        >>> gm = GradManager().attach(stage.parameters())
        >>> x = torch.tensor([[3.0, 4.0]])           # from the previous stage
        >>> with gm:
        ...     _ = gm.attach(x)                     # attached while recording
        ...     rest = gm.backward_split(stage(x).sum(), first=[x])
        >>> x.grad                                   # send it back now
        tensor([[1., 1.]])
        >>> rest.finish()                            # the weight's gradient, later
        >>> stage.weight.grad
        tensor([[3., 4.]])
    """

    __slots__ = ("_finish", "_dropped", "_rest", "_step", "_state", "__weakref__")

    def __init__(self, finish: Callable[[Any, int, bool], None], rest: Any, step: int,
                 dropped: Callable[[int], None] = lambda step: None) -> None:
        self._finish = finish  # the manager's: holding it keeps the manager alive
        self._dropped = dropped  # told the step of a backward collected before finish()
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
            self._dropped(self._step)
            warnings.warn(
                "a split backward was never finished: call finish() on what "
                "GradManager.backward_split returned, or the tensors it left for later get no "
                "gradient and the after-backward callbacks do not run",
                UnfinishedBackwardWarning,
                stacklevel=2,
            )
