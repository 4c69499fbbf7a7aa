"""The contract between the framework-neutral core and one framework's adapter.

A backend answers questions about tensors (is this a tensor of mine? may it be attached?),
creates one :class:`Tape` per :class:`~gradmgr.GradManager`, and hands out its data-parallel
adapters (:meth:`Backend.tensor_ops`, :meth:`Backend.transport`; their contract is in
:mod:`gradmgr.distributed.contract`). The core never imports a framework; everything
framework-specific goes through these.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    Collection,
    ContextManager,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
)

from .errors import UnsupportedBackendError

if TYPE_CHECKING:  # the data-parallel contract (a module that imports nothing)
    from .distributed.contract import TensorOps, Transport

GradSink = Callable[[Any], Any]
"""``sink(grad)`` delivers a tensor's gradient to its manager (running its callbacks) and
returns what the manager keeps for it (None if nothing)."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports; tests skip by capability with a reason.

    Example:
        >>> from gradmgr import get_backend
        >>> get_backend("torch").capabilities.split_backward
        True
    """

    higher_order: bool = False
    """Nested managers give second derivatives (contract point 10)."""
    cuda: bool = False
    """Tensors on CUDA devices work (contract point 13)."""
    exact_pre_record_semantics: bool = False
    """Operations done before ``record()`` never contribute gradient (contract point 9). When
    False the backend detects the case and warns instead."""
    detects_pre_record: bool = True
    """Where ``exact_pre_record_semantics`` is False: the backend detects such operations and
    warns. False: its engine cannot tell them apart (Paddle keeps no order of its graph's
    nodes), so they contribute gradient, as in the engine's own backward, with no warning;
    the backend's documentation says so."""
    requires_grad_flag: bool = False
    """Tensors carry a ``requires_grad`` flag that attach/release manage."""
    threads: bool = False
    """Managers work in any thread (contract point 12). When False, recording outside the main
    thread raises a RuntimeError that says so."""
    backward_in_callback: bool = False
    """A callback may run another manager's whole record/backward. When False that raises a
    RuntimeError that says so."""
    split_backward: bool = False
    """``GradManager.backward_split`` works (the tape implements :meth:`Tape.backward_split`).
    When False it raises UnsupportedGraphError."""


class Tape(ABC):
    """Records computation for one manager; started and stopped once per recording.

    One tape belongs to one manager for the manager's whole life, so a backend can keep
    per-tensor state (hooks, flags) across recordings instead of rebuilding it every step.

    Example:
        >>> from gradmgr import get_backend
        >>> tape = get_backend("torch").new_tape()   # what a manager does once
        >>> tape.start(); tape.stop()                # record(), release()
    """

    persistent_watch: ClassVar[bool] = False
    """False: the core calls :meth:`watch` for every attached tensor after each :meth:`start`.
    True: the core calls it for a tensor whenever it is attached (recording or not), also
    again; the tape keeps watching the tensor in every later recording until the tensor dies,
    holding it only weakly between recordings."""

    bypassed: Optional[str] = None
    """Set by :meth:`stop` where a backward that was not the manager's (PyTorch's
    ``loss.backward()`` typed by habit) wrote attached tensors' ``.grad`` during the recording:
    the message the manager raises if that recording ended without ``backward()`` (the
    callbacks were skipped). The manager reads and clears it at every release."""

    @abstractmethod
    def start(self) -> None:
        """Begin recording (``GradManager.record()``)."""

    def explain(self, error: BaseException) -> Optional[BaseException]:
        """An error that says what went wrong, in place of ``error``, which left a ``with``
        block of the recording; None: ``error`` says it well enough (the default)."""
        return None

    @abstractmethod
    def watch(self, tensor: Any, sink: GradSink, eager: bool) -> None:
        """Snapshot ``tensor`` now; differentiate the next backward with respect to it.

        ``sink(grad)`` must be called once with the tensor's gradient if the backward reaches
        it, and not at all otherwise. With ``eager`` it must be called as soon as that gradient
        is ready, while the engine is still running (callbacks overlap computation); without
        it the backend may deliver after the engine finishes. Watching an already watched
        tensor updates ``sink``/``eager`` and keeps the first snapshot.
        """

    def watch_all(self, items: Sequence[Tuple[Any, GradSink, bool]]) -> None:
        """:meth:`watch` each ``(tensor, sink, eager)``; what the core calls after :meth:`start`
        for a tape without ``persistent_watch``. Override to make that loop cheaper."""
        for tensor, sink, eager in items:
            self.watch(tensor, sink, eager)

    @abstractmethod
    def backward(
        self, ys: Sequence[Any], dys: Sequence[Any], *, create_graph: bool, retain_graph: bool,
        may_accumulate: bool = False,
    ) -> None:
        """Run reverse mode from ``ys`` seeded with ``dys``, feeding the sinks.

        ``create_graph``: a manager that started recording earlier (and is not in this
        manager's group) is recording, so the backward itself must be differentiable.
        ``retain_graph``: another manager that may have recorded the same computation is still
        recording, so the graph must survive this backward.
        ``may_accumulate``: nothing (no after-backward callback) runs between this backward and
        accumulation, so the tape may accumulate the gradients of tensors watched without
        ``eager`` into ``.grad`` itself (exactly as :meth:`Backend.accumulate` would) instead
        of calling their sinks.
        """

    def backward_accumulating(self, ys: Sequence[Any], dys: Sequence[Any], *,
                              create_graph: bool, retain_graph: bool,
                              taken: Optional[Collection[int]] = None) -> None:
        """Like :meth:`backward`, but the engine accumulates the watched tensors' gradients
        into ``.grad`` itself and their sinks are not called (a backward delegate, see
        :func:`gradmgr.hooks.set_backward_delegate`, handles them), except for those it
        cannot: a non-leaf's, and, where ``taken`` (ids: what the delegate takes) is given,
        those of eager tensors it does not take, which go to their sinks as in
        :meth:`backward`. PyTorch's tape implements it."""
        raise NotImplementedError("this backend cannot delegate a backward")

    def backward_split(self, ys: Sequence[Any], dys: Sequence[Any], first: Sequence[Any], *,
                       retain_graph: bool) -> Any:
        """Like :meth:`backward`, but feed only the sinks of the tensors in ``first`` now and
        return an object whose ``run(may_accumulate)`` feeds the others later (once, after
        :meth:`stop`; None if there is nothing left; ``may_accumulate`` as for
        :meth:`backward`). Only where ``capabilities.split_backward``."""
        raise NotImplementedError("this backend cannot split a backward")

    @abstractmethod
    def stop(self) -> None:
        """End recording and free what it kept. Idempotent."""


class Backend(ABC):
    """A framework adapter. Subclasses are registered by name in :mod:`gradmgr.registry`
    (built in: ``"torch"`` and ``"megengine"``; others through the entry-point group
    ``gradmgr.backends`` or :func:`gradmgr.register_backend`).

    Example:
        >>> import torch
        >>> from gradmgr import backend_for
        >>> backend = backend_for(torch.ones(1))
        >>> backend.name, backend.shape(torch.ones(2, 3))
        ('torch', (2, 3))
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    tensor_modules: ClassVar[Sequence[str]]
    """Top-level module names whose tensor types this backend owns (used for detection)."""

    @abstractmethod
    def is_tensor(self, obj: Any) -> bool:
        """True if ``obj`` is a tensor of this framework."""

    def is_output(self, obj: Any) -> bool:
        """True if ``obj`` can be a ``y`` of ``backward(y, dy)``: a tensor, or what else the
        framework lets a backward start from (PyTorch: a ``GradientEdge``, so that the output
        itself can be freed first; then ``dy`` must be given)."""
        return self.is_tensor(obj)

    @abstractmethod
    def check_attachable(self, tensor: Any) -> None:
        """Raise ``TypeError`` naming dtype and shape if ``tensor`` cannot get a gradient."""

    @abstractmethod
    def shape(self, tensor: Any) -> tuple:
        """The tensor's shape as a tuple of ints."""

    @abstractmethod
    def ones_like(self, tensor: Any) -> Any:
        """The default ``dy`` for ``tensor``."""

    def seed_problem(self, y: Any, dy: Any) -> Optional[str]:
        """Why ``dy`` cannot seed the backward of ``y`` (a phrase such as "has shape (3,) but
        y has shape (2,)"), or None if it can. The default requires equal shapes (``y`` is a
        tensor: a backend whose :meth:`is_output` takes more checks those itself)."""
        if self.shape(y) != self.shape(dy):
            return f"has shape {self.shape(dy)} but y has shape {self.shape(y)}"
        return None

    @abstractmethod
    def accumulate(self, tensor: Any, grad: Any) -> None:
        """Set ``tensor.grad = grad``, or add ``grad`` into an existing ``tensor.grad``.

        Where tensors are mutable, a new ``.grad`` must not share memory with ``grad``: the
        same gradient object may be delivered for two tensors, or kept by a callback.
        """

    def set_grad(self, tensor: Any, grad: Any) -> None:
        """Make ``grad`` the tensor's ``.grad``, replacing what it holds (see
        ``Future.replaces_grad``: nobody else holds ``grad``, so it is not copied)."""
        tensor.grad = grad

    def grad_problem(self, tensor: Any, grad: Any) -> Optional[str]:
        """Why the tensor ``grad`` cannot be ``tensor``'s gradient (a phrase such as "got
        shape (1,), but the tensor has shape (3,)"), or None. Checked for every value a
        callback returns. The default compares shapes."""
        if self.shape(grad) != self.shape(tensor):
            return f"got shape {self.shape(grad)}, but the tensor has shape {self.shape(tensor)}"
        return None

    def describe(self, tensor: Any) -> str:
        """A tensor's shape, dtype and device, for messages."""
        return f"shape {self.shape(tensor)}"

    @abstractmethod
    def new_tape(self) -> Tape:
        """A tape for one new manager."""

    tracks_backwarding: ClassVar[bool] = False
    """The framework has its own notion of the backwarding manager: the core calls
    :meth:`enter_backward` / :meth:`exit_backward` around every backward."""

    def enter_backward(self, manager: Any) -> Any:
        """A manager's backward starts (only where ``tracks_backwarding``); returns a token."""
        return None

    def exit_backward(self, token: Any) -> None:
        """The backward that :meth:`enter_backward` returned ``token`` for has ended."""
        return None

    def recording_group(self) -> ContextManager[None]:
        """Context in which the members of a group ``gm1 | gm2`` start recording together."""
        return contextlib.nullcontext()

    def reachable(self, ys: Iterable[Any], tensors: Iterable[Any]) -> List[Any]:
        """Those of ``tensors`` that a backward from ``ys`` would give a gradient."""
        raise NotImplementedError(f"backend {self.name!r} cannot inspect its graph")

    # ------------------------------------------------------------ data parallelism
    def prepare_rank(self, rank: int, world: int) -> None:
        """This process is rank ``rank`` of ``world``, started by gradmgr's launcher
        (:func:`gradmgr.distributed.spawn_local` / ``run_ranks``): make the framework's own
        view of the job tell the truth where it would not (MegEngine's rank queries on ranks
        that talk over torch.distributed gloo). Called once the framework is imported."""
        return None

    def hold_rendezvous(self, world: int) -> Optional[Tuple[Any, int, Dict[str, str]]]:
        """For :func:`gradmgr.distributed.spawn_local`, in the launching process: start a
        rendezvous server on a port the system picks, held until the ranks are done, as
        torchrun's agent does. Returns ``(holder, port, environment for the ranks)``
        (the launcher keeps ``holder`` alive), or None where this framework has none (the
        launcher then looks for a free port)."""
        return None

    def tensor_ops(self) -> TensorOps:
        """The tensor operations data parallelism needs (bucketing, the cross-rank checks, the
        initial broadcast). A backend without data parallelism keeps this default."""
        raise UnsupportedBackendError(
            f"the {self.name!r} backend has no data-parallel adapters: data parallelism needs "
            f"its Backend to implement tensor_ops() and transport() (see "
            f"gradmgr.distributed.contract)"
        )

    def parity_adapter(self, model: Any) -> Any:
        """The parity tool's view of ``model``, one of this framework's modules
        (:class:`gradmgr.parity.contract.ModelAdapter`). The default refuses."""
        raise UnsupportedBackendError(
            f"the {self.name!r} backend has no parity adapter (gradmgr.parity.contract)")

    def environment(self) -> Dict[str, str]:
        """What ``python -m gradmgr env`` reports for this framework besides its version:
        its distributed backends and devices, by label. Nothing by default."""
        return {}

    transport_names: ClassVar[Sequence[str]] = ()
    """The names :meth:`transport` accepts besides None."""

    def transport(self, group: Any = None, name: Optional[str] = None) -> Transport:
        """The collectives for this framework's tensors over ``group`` (None: all ranks): the
        default one, or the one called ``name`` (one of :attr:`transport_names`)."""
        self.tensor_ops()  # raises the same error for a backend without data parallelism
        raise UnsupportedBackendError(f"the {self.name!r} backend has no transport")

    def unknown_transport(self, name: str) -> ValueError:
        """The error for a transport name this backend does not know."""
        return ValueError(f"unknown transport {name!r} for {self.name} tensors; choose one of "
                          f"{sorted(self.transport_names)}, or pass a transport object")
