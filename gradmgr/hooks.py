"""What a library registers with a manager to build on its steps (the data-parallel callback
does): work at the start of every recording, after every backward, when a backward raises, when
a recording ends, a delegate that may take whole backwards over, and what its backwards refuse
(a split backward; a backward it would differentiate)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, TypeVar

from .errors import UnsupportedGraphError

Self = TypeVar("Self", bound="StepHooks")


def _nothing() -> None:
    pass


def _callable(callback: Any, what: str) -> None:
    if not callable(callback):
        raise TypeError(f"{what} must be callable, not {type(callback)}")


class StepHooks:
    """The registration half of :class:`gradmgr.GradManager` (registrations persist). What
    only a library built on the manager needs (the backward delegate, reading the
    registrations) are the functions below the class, kept out of the manager's ``help()``."""

    def __init__(self) -> None:
        self._record_callbacks: List[Callable[[], None]] = []
        self._after_backward_callbacks: List[Callable[[], None]] = []
        self._error_callbacks: List[Callable[[], None]] = []
        self._release_callbacks: List[Callable[[bool], None]] = []
        self._backward_delegate: Optional[Callable[[], Any]] = None
        self._split_refusal: Optional[str] = None  # why backward_split cannot run (refuse_split)
        # why a backward this manager would differentiate cannot run (refuse_higher_order)
        self._higher_order_refusal: Optional[str] = None
        # fails the steps of split backwards collected unfinished (the manager's scope's)
        self._fail_dropped: Callable[[], None] = _nothing

    def register_record_callback(self: Self, callback: Callable[[], None]) -> Self:
        """Call ``callback()`` at the start of every recording (``record()`` / ``with``),
        before anything is recorded; an exception ends that recording. Registrations persist.

        Example:
            >>> from gradmgr import GradManager
            >>> gm = GradManager().register_record_callback(lambda: print("step starts"))
            >>> with gm:
            ...     pass
            step starts
        """
        _callable(callback, "record callback")
        self._record_callbacks.append(callback)
        return self

    def register_after_backward_callback(self: Self, callback: Callable[[], None]) -> Self:
        """Call ``callback()`` after every backward's gradients are computed, before Futures
        resolve and before anything is accumulated into ``.grad``. Registrations persist.

        Example:
            >>> from gradmgr import GradManager
            >>> gm = GradManager().register_after_backward_callback(lambda: print("computed"))
            >>> with gm:
            ...     gm.backward()
            computed
        """
        _callable(callback, "after-backward callback")
        self._after_backward_callbacks.append(callback)
        return self

    _register_after_backward_callback = register_after_backward_callback  # MegEngine's name

    def register_backward_error_callback(self: Self, callback: Callable[[], None]) -> Self:
        """Call ``callback()`` when a backward (or a split backward's first part or
        ``finish()``) raises, before the error propagates; ``step`` is still that backward's.
        Also, at the next ``record()``, once for a split backward collected before its
        ``finish()`` (at its ``step``).
        For work the after-backward callbacks would have finished: an allreduce callback
        launches the step's remaining collectives there, so other ranks do not wait on them.
        An error the callback raises is chained to the backward's. Registrations persist.

        Example:
            >>> from gradmgr import GradManager
            >>> gm = GradManager().register_backward_error_callback(lambda: print("failed"))
        """
        _callable(callback, "backward error callback")
        self._error_callbacks.append(callback)
        return self

    def register_release_callback(self: Self, callback: Callable[[bool], None]) -> Self:
        """Call ``callback(backward_ran)`` when a recording ends (``release()``, the end of a
        ``with`` block or of a backward), after the manager stopped recording;
        ``backward_ran`` tells whether a backward (or a split backward's first part) ran in
        it. The data-parallel callback completes the step of a recording that ended without
        one. Registrations persist.

        Example:
            >>> from gradmgr import GradManager
            >>> gm = GradManager().register_release_callback(lambda ran: print("ran:", ran))
            >>> with gm:
            ...     pass
            ran: False
        """
        _callable(callback, "release callback")
        self._release_callbacks.append(callback)
        return self

    def _run_record_callbacks(self) -> None:
        for callback in self._record_callbacks:
            callback()

    def _run_after_backward_callbacks(self) -> None:
        for callback in self._after_backward_callbacks:
            callback()

    def _run_release_callbacks(self, backward_ran: bool) -> None:
        first_error = None
        for callback in self._release_callbacks:
            try:
                callback(backward_ran)
            except BaseException as error:  # every callback runs; the first error propagates
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def _run_error_callbacks(self, error: BaseException) -> None:
        for callback in self._error_callbacks:
            try:
                callback()
            except BaseException as raised:  # keep the backward's error; note this one
                raised.__context__ = error.__context__
                error.__context__ = raised


# ------------------------------------------------------------ for libraries built on a manager
def after_backward_callbacks(hooks: StepHooks) -> tuple:
    """The after-backward callbacks registered with ``hooks`` (a manager), in order."""
    return tuple(hooks._after_backward_callbacks)


def run_error_callbacks(hooks: StepHooks, error: BaseException) -> None:
    """Run ``hooks``' (a manager's) error callbacks for ``error``, what a backward raised."""
    hooks._run_error_callbacks(error)


def fail_dropped_splits(hooks: StepHooks) -> None:
    """What ``hooks``' (a manager's) next ``record()`` does first, now: run its error
    callbacks once for each split backward collected before its ``finish()``, at that
    backward's step. For a library whose collectives between steps (a sharded optimizer's
    step) must not pair with what such a step still owes the other ranks."""
    hooks._fail_dropped()


def refuse_split(hooks: Self, reason: Optional[str]) -> Self:
    """Make ``backward_split`` of ``hooks`` (a manager) raise ``UnsupportedGraphError(reason)``
    before anything runs (None: allow it again): full sharding does, whose engine reduces the
    gradients only in a plain backward over everything.

    Example:
        >>> import torch
        >>> from gradmgr import GradManager, UnsupportedGraphError
        >>> w = torch.ones(2, requires_grad=True)
        >>> gm = refuse_split(GradManager().attach(w), "not on this path; use backward()")
        >>> with gm:
        ...     try:
        ...         gm.backward_split((w * 2).sum(), first=[w])
        ...     except UnsupportedGraphError as error:
        ...         print(error)
        not on this path; use backward()
    """
    hooks._split_refusal = reason
    return hooks


def refuse_higher_order(hooks: Self, reason: Optional[str]) -> Self:
    """Make another manager's backward that ``hooks`` (a manager) would differentiate (one
    that began recording later, outside its group: second derivatives, a gradient penalty)
    raise ``UnsupportedGraphError(reason)`` before its engine runs (None: allow it again):
    full sharding does, whose engine frees each block's gathered parameters in a backward.

    Example:
        >>> import torch
        >>> from gradmgr import GradManager, UnsupportedGraphError
        >>> w = torch.ones(2, requires_grad=True)
        >>> outer = refuse_higher_order(GradManager().attach(w), "no second derivatives here")
        >>> inner = GradManager().attach(w)
        >>> with outer, inner:
        ...     try:
        ...         inner.backward((w * w).sum())
        ...     except UnsupportedGraphError as error:
        ...         print(error)
        no second derivatives here
    """
    hooks._higher_order_refusal = reason
    return hooks


def refuse_if_differentiated(earlier: Iterable[StepHooks]) -> None:
    """Raise the :func:`refuse_higher_order` refusal of the first of ``earlier`` (the
    managers that would differentiate the backward about to run) that set one."""
    for hooks in earlier:
        if hooks._higher_order_refusal is not None:
            raise UnsupportedGraphError(hooks._higher_order_refusal)


def set_backward_delegate(hooks: Self, delegate: Optional[Callable[[], Any]]) -> Self:
    """Let ``delegate`` take over whole backwards of ``hooks`` (a manager; None: stop): the
    data-parallel callback uses it to hand a step to PyTorch's C++ reducer.

    At the start of every ``backward`` (not ``backward_split``), ``delegate()`` returns None
    (this backward runs as usual) or an object with ``finish()`` and ``abort()``. Then the
    engine accumulates every attached tensor's gradient straight into ``.grad`` (no callback
    and no after-backward callback runs), after which ``finish()`` is called, or ``abort()``
    if the backward raised. Only a backend whose tape has ``backward_accumulating`` (PyTorch)
    can be delegated to. An attached non-leaf gets its gradient as in any backward; so does,
    where the object's ``taken`` is not None (the ids of the tensors it takes), an attached
    tensor with callbacks that it does not take (its callbacks run as its gradient is ready).
    A delegate object with ``run_engine(ys, dys, create_graph, retain_graph)`` runs the
    engine itself instead (full sharding: a plain backward over everything, as FSDP2's hooks
    need), and then gives the attached non-leaves their gradients itself.

    Example:
        >>> import torch
        >>> from gradmgr import GradManager
        >>> class Count:
        ...     calls = 0
        ...     def finish(self): Count.calls += 1
        ...     def abort(self): pass
        >>> w = torch.ones(2, requires_grad=True)
        >>> gm = set_backward_delegate(GradManager().attach(w), Count)
        >>> with gm:
        ...     gm.backward((w * 3).sum())
        >>> w.grad, Count.calls
        (tensor([3., 3.]), 1)
    """
    if delegate is not None:
        _callable(delegate, "backward delegate")
    hooks._backward_delegate = delegate
    return hooks
