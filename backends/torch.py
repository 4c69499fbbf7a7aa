"""PyTorch backend: GradManager semantics on top of PyTorch's autograd engine.

How the contract maps onto autograd:

* ``backward`` runs the engine with ``inputs=<attached tensors>`` (see :func:`_run_engine`), so
  it only computes what attached tensors need and never touches ``.grad`` of anything else.
  Without callbacks or nesting the engine accumulates into ``.grad`` itself, like
  ``loss.backward()``; otherwise it returns the gradients (``None`` for unreached tensors, whose
  ``.grad`` stays ``None``) and the manager delivers them.
* A tensor with callbacks gets one tensor hook for the manager's whole life (not one per step):
  autograd fires it the moment that tensor's gradient is ready, and the hook feeds the callback
  chain while the engine goes on with earlier layers. Tensors without callbacks get no hook; their
  gradients are taken from the engine's result.
* Attaching a leaf with ``requires_grad=False`` (an input) turns the flag on while recording and
  restores it when the last manager recording it releases.
* Nesting: the backward is recorded (``create_graph``) only while a manager that started
  recording earlier is still recording; the graph is kept (``retain_graph``) while any other
  manager is recording.

What PyTorch cannot do exactly (see README "PyTorch notes"): autograd records operations on a
``requires_grad`` tensor whether or not a manager is recording, so gradient can flow through
operations done before ``record()`` (or before a mid-recording ``attach``). The backend detects
this from node sequence numbers and warns once per manager (:class:`PreRecordGradientWarning`).
"""

from __future__ import annotations

import functools
import operator
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from gradmgr.backend import Backend, Capabilities, GradSink, Tape
from gradmgr.errors import GradMgrWarning

__all__ = [
    "PreRecordGradientWarning",
    "TorchBackend",
    "TorchTape",
    "reachable_leaves",
    "set_pre_record_check",
]


class PreRecordGradientWarning(GradMgrWarning):
    """Gradient reached an attached tensor through operations done before it was recorded."""


_PRE_RECORD_CHECK = "first"
_CHECK_MODES = ("always", "first", "off")


def set_pre_record_check(mode: str) -> None:
    """How often backward checks for gradient paths through pre-``record()`` operations.

    ``"first"`` (default) walks the graph of each manager's first backward, which catches the
    usual cause (a value computed from parameters once, outside the loop) at no cost to later
    steps; ``"always"`` walks every backward (a Python walk over the graph: about 1 us per
    node); ``"off"`` never checks.

    Example:
        >>> set_pre_record_check("first")
        >>> set_pre_record_check("always")
    """
    global _PRE_RECORD_CHECK
    if mode not in _CHECK_MODES:
        raise ValueError(f"pre-record check mode must be one of {_CHECK_MODES}, not {mode!r}")
    _PRE_RECORD_CHECK = mode


# ----------------------------------------------------------------------------- engine entry
def _public_engine(outputs, seeds, retain, create_graph, inputs, accumulate):
    if accumulate:
        torch.autograd.backward(outputs, seeds, retain_graph=retain, inputs=inputs)
        return ()
    return torch.autograd.grad(outputs, inputs, grad_outputs=seeds, retain_graph=retain,
                               create_graph=create_graph, allow_unused=True)


_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)  # torch>=2.3
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _run_engine(
    outputs: List[torch.Tensor], seeds: List[torch.Tensor], retain: bool, create_graph: bool,
    inputs: List[torch.Tensor], accumulate: bool,
) -> Sequence[Optional[torch.Tensor]]:
    """Run the autograd engine: accumulate into ``.grad`` of ``inputs``, or return their grads.

    ``torch.autograd.backward``/``grad`` spend most of their Python time normalizing arguments
    and re-checking seeds, which the manager has already done (every seed is a tensor of its
    output's shape), and that is measurable on small models. So this goes straight to the
    function both of them end in, ``torch.autograd.graph._engine_run_backward``, which keeps
    PyTorch's own per-call set-up (debug-logging hooks, compiled-autograd context). Where that
    private function is missing, or inside a functorch transform (where the public functions
    raise their own error), the public functions are used.
    """
    if _engine_run_backward is None or _functorch_active():
        return _public_engine(outputs, seeds, retain, create_graph, inputs, accumulate)
    return _engine_run_backward(
        tuple(outputs), tuple(seeds), retain, create_graph, tuple(inputs),
        allow_unreachable=True, accumulate_grad=accumulate,
    )


# ----------------------------------------------------------------------------- graph helpers
def _current_sequence_nr() -> int:
    """The sequence number the next autograd node created in this thread will get, or 0 (which
    turns the pre-record check off for this snapshot) where no node can be made: inference mode,
    functorch transforms."""
    with torch.enable_grad():
        probe = _PROBE.view_as(_PROBE)
    node = probe.grad_fn
    return 0 if node is None else node._sequence_nr() + 1


_PROBE = torch.zeros((), requires_grad=True)


def _grad_node(t: torch.Tensor) -> Any:
    """The node whose output is ``t``'s gradient: ``grad_fn`` or the leaf's AccumulateGrad."""
    node = t.grad_fn
    if node is None:
        node = torch.autograd.graph.get_gradient_edge(t).node
    return node


def _walk(roots: Iterable[Any]) -> Dict[Any, List[Any]]:
    """Every node reachable from ``roots``, mapped to its parents (nodes that feed it)."""
    parents: Dict[Any, List[Any]] = {}
    stack = [(r, None) for r in roots if r is not None]
    while stack:
        node, parent = stack.pop()
        seen = node in parents
        entry = parents.setdefault(node, [])
        if parent is not None:
            entry.append(parent)
        if seen:
            continue
        for child, _ in node.next_functions:
            if child is not None:
                stack.append((child, node))
    return parents


def reachable_leaves(
    ys: Sequence[torch.Tensor], tensors: Optional[Iterable[Any]] = None
) -> List[Any]:
    """Tensors that a backward from ``ys`` would give a gradient.

    With ``tensors``, those of them (leaves or not) on a gradient path from ``ys``, in the given
    order. Without, every leaf that requires grad and is reachable (parameters a loss touches).

    Example:
        >>> a = torch.ones(2, requires_grad=True); b = torch.ones(2, requires_grad=True)
        >>> [t is a for t in reachable_leaves([(a * 2).sum()], [a, b])]
        [True]
    """
    parents = _walk(y.grad_fn for y in ys)
    if tensors is None:
        return [n.variable for n in parents if hasattr(n, "variable")]
    found = []
    for t in tensors:
        if not t.requires_grad:
            continue
        if (t.grad_fn is None and _grad_node(t) in parents) or (
            t.grad_fn is not None and t.grad_fn in parents
        ):
            found.append(t)
    return found


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _hook(tape_ref: weakref.ref, key: int, grad: torch.Tensor) -> None:
    tape = tape_ref()
    if tape is not None and tape._running:
        sink = tape._eager.get(key)
        if sink is not None:
            tape._fired.add(key)
            sink(grad)


# ----------------------------------------------------------------------------- requires_grad
class _FlagLedger:
    """Who turned ``requires_grad`` on for which leaf, so that several managers recording the
    same input do not undo each other's change on release."""

    def __init__(self) -> None:
        self._holders: Dict[int, list] = {}  # id -> [weakref, count]

    def acquire(self, t: torch.Tensor) -> bool:
        entry = self._holders.get(id(t))
        if entry is not None and entry[0]() is t:
            entry[1] += 1
            return True
        if t.requires_grad:
            return False  # the user's own flag: nothing to restore
        t.requires_grad_(True)
        self._holders[id(t)] = [weakref.ref(t), 1]
        return True

    def release(self, t: torch.Tensor) -> None:
        entry = self._holders.get(id(t))
        if entry is None or entry[0]() is not t:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._holders[id(t)]
            t.requires_grad_(False)


_FLAGS = _FlagLedger()


# ----------------------------------------------------------------------------- tape
class _Entry:
    """One watched tensor: weakly held, with its sink and snapshot sequence number."""

    __slots__ = ("ref", "sink", "eager", "since")

    def __init__(self, ref: weakref.ref, sink: GradSink, eager: bool, since: Optional[int]):
        self.ref = ref
        self.sink = sink
        self.eager = eager
        self.since = since  # None: snapshot at record() time


class TorchTape(Tape):
    """One manager's watched tensors and recording state on PyTorch.

    Watches persist across recordings (``persistent_watch``), so a training step costs a few
    list operations per attached tensor rather than a Python call each.
    """

    persistent_watch = True

    def __init__(self) -> None:
        self._entries: Dict[int, _Entry] = {}
        # [entries, weakrefs] of the watched tensors when all were alive and required grad at
        # the last backward; emptied whenever a tensor is watched or dies.
        self._order: List[Any] = []
        self._late = False  # some tensor was attached mid-recording (needs its own snapshot)
        self._eager: Dict[int, GradSink] = {}
        self._fired: set = set()
        self._flagged: List[torch.Tensor] = []
        self._needs_flag: Dict[int, weakref.ref] = {}
        self._handles: Dict[int, Any] = {}
        self._running = False
        self._recording = False
        self._record_seq = 0
        self._checked = False
        self._warned = False
        weakref.finalize(self, _remove_handles, self._handles)

    # -- watching ---------------------------------------------------------------------
    def watch(self, tensor: torch.Tensor, sink: GradSink, eager: bool) -> None:
        key = id(tensor)
        entry = self._entries.get(key)
        if entry is None or entry.ref() is not tensor:
            since = None
            if self._recording:
                self._late = True
                since = _current_sequence_nr() if _PRE_RECORD_CHECK != "off" else 0
            entry = _Entry(weakref.ref(tensor, self._forget_for(key)), sink, eager, since)
            self._entries[key] = entry
            self._order.clear()
            if tensor.is_leaf and not tensor.requires_grad:
                self._needs_flag[key] = entry.ref
                if self._recording:
                    self._acquire_flag(tensor)
        elif tensor.is_leaf and not tensor.requires_grad and key not in self._needs_flag:
            self._needs_flag[key] = entry.ref  # the user froze it after attaching
        entry.sink = sink
        entry.eager = eager
        if eager:
            self._eager[key] = sink
            self._ensure_hook(tensor, key)
        else:
            self._eager.pop(key, None)

    def _ensure_hook(self, tensor: torch.Tensor, key: int) -> None:
        # A leaf whose requires_grad is off cannot take a hook yet; start() adds it.
        if key not in self._handles and tensor.requires_grad:
            self._handles[key] = tensor.register_hook(
                functools.partial(_hook, weakref.ref(self), key)
            )

    def _forget_for(self, key: int):
        entries, eager, handles, needs_flag, order = (
            self._entries, self._eager, self._handles, self._needs_flag, self._order
        )

        def forget(dead: weakref.ref) -> None:
            entry = entries.get(key)
            if entry is not None and entry.ref is dead:
                del entries[key]
                order.clear()
                eager.pop(key, None)
                handles.pop(key, None)  # the hook died with the tensor
                needs_flag.pop(key, None)

        return forget

    def _acquire_flag(self, tensor: torch.Tensor) -> None:
        if _FLAGS.acquire(tensor):
            self._flagged.append(tensor)

    # -- recording --------------------------------------------------------------------
    def start(self) -> None:
        self._recording = True
        if self._entries and self._wants_check():  # a later attach() takes its own snapshot
            self._record_seq = _current_sequence_nr()
        if not self._needs_flag:
            return
        for key, ref in list(self._needs_flag.items()):
            tensor = ref()
            if tensor is not None:
                self._acquire_flag(tensor)
                if key in self._eager:
                    self._ensure_hook(tensor, key)

    def backward(
        self, ys: Sequence[Any], dys: Sequence[Any], *, create_graph: bool, retain_graph: bool
    ) -> None:
        if len(ys) == 1:
            if not ys[0].requires_grad:
                return
            outputs, seeds = ys, dys
        else:
            outputs = [y for y in ys if y.requires_grad]
            seeds = [dy for y, dy in zip(ys, dys) if y.requires_grad]
            if not outputs:
                return
        entries, inputs = self._inputs()
        if not inputs:
            return
        if self._wants_check():
            self._check_pre_record(outputs, inputs, entries)
        retain = retain_graph or create_graph
        if not self._eager and not create_graph:
            # Nothing to intercept: let the engine accumulate into .grad itself, which is what
            # a plain loss.backward() costs.
            _run_engine(outputs, seeds, retain, False, inputs, accumulate=True)
            return
        self._running = True
        self._fired.clear()
        try:
            grads = _run_engine(outputs, seeds, retain, create_graph, inputs, accumulate=False)
        finally:
            self._running = False
        fired = self._fired
        for tensor, entry, grad in zip(inputs, entries, grads):
            if grad is not None and not (entry.eager and id(tensor) in fired):
                entry.sink(grad)

    def _inputs(self) -> tuple:
        """The watched tensors that require grad now, with their entries, in watch order."""
        if self._order:  # the usual step: the same tensors as last time, all still trainable
            entries, refs = self._order
            inputs = [ref() for ref in refs]
            try:
                if all(map(_REQUIRES_GRAD, inputs)):
                    return entries, inputs
            except AttributeError:  # None: a tensor died since
                pass
        entries, inputs = [], []
        for entry in self._entries.values():
            tensor = entry.ref()
            if tensor is not None and tensor.requires_grad:
                entries.append(entry)
                inputs.append(tensor)
        if len(entries) == len(self._entries):
            self._order[:] = [entries, [entry.ref for entry in entries]]
        else:
            self._order.clear()
        return entries, inputs

    def _wants_check(self) -> bool:
        mode = _PRE_RECORD_CHECK
        return mode != "off" and not self._warned and (mode == "always" or not self._checked)

    def _check_pre_record(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                          entries: List[_Entry]) -> None:
        base = self._record_seq
        since = [base if e.since is None else e.since for e in entries]
        if 0 in since:
            return  # no snapshot could be taken (inference mode, functorch): check a later step
        self._checked = True
        stale = _pre_record_paths(outputs, inputs, since)
        if stale:
            self._warned = True
            shapes = ", ".join(str(tuple(t.shape)) for t in stale[:4])
            warnings.warn(
                f"gradmgr: gradient reaches {len(stale)} attached tensor(s) (shapes {shapes}) "
                "through operations done before record() or before attach(); MegEngine ignores "
                "those, PyTorch cannot, so they contribute here. Compute them inside the "
                "recording, or .detach() their results if they should be constants. "
                "(warned once per manager)",
                PreRecordGradientWarning,
                stacklevel=4,
            )

    def stop(self) -> None:
        if not self._recording:
            return
        self._recording = False
        self._running = False
        if self._flagged:
            flagged, self._flagged = self._flagged, []
            for tensor in flagged:
                _FLAGS.release(tensor)
        if self._late:
            self._late = False
            for entry in self._entries.values():
                entry.since = None


def _remove_handles(handles: Dict[int, Any]) -> None:
    for handle in list(handles.values()):
        handle.remove()
    handles.clear()


def _pre_record_paths(
    outputs: List[torch.Tensor], inputs: List[torch.Tensor], watch_seq: List[int]
) -> List[torch.Tensor]:
    """Attached tensors whose gradient passes through a node created before their snapshot.

    ``low[n]`` is the smallest sequence number among the nodes on any path from the outputs
    down to ``n`` (``n`` excluded). Children are always created before their parents, so
    visiting nodes by decreasing sequence number sees every parent first; AccumulateGrad nodes
    (the leaves) have no children and go last.
    """
    parents = _walk(y.grad_fn for y in outputs)
    seq = {n: n._sequence_nr() for n in parents}
    never = float("inf")
    low: Dict[Any, float] = {}
    for node in sorted(parents, key=lambda n: -1 if hasattr(n, "variable") else seq[n],
                       reverse=True):
        low[node] = min((min(seq[p], low[p]) for p in parents[node]), default=never)
    stale = []
    for t, since in zip(inputs, watch_seq):
        node = t.grad_fn if t.grad_fn is not None else _grad_node(t)
        if low.get(node, never) < since:
            stale.append(t)
    return stale


# ----------------------------------------------------------------------------- backend
class TorchBackend(Backend):
    """The PyTorch adapter (CPU and CUDA)."""

    name = "torch"
    tensor_modules = ("torch",)
    capabilities = Capabilities(
        higher_order=True,
        cuda=True,
        exact_pre_record_semantics=False,
        requires_grad_flag=True,
        threads=True,
        backward_in_callback=True,
    )

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def check_attachable(self, tensor: Any) -> None:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(
                f"only floating-point tensors can be attached to get gradients; got dtype "
                f"{tensor.dtype} and shape {tuple(tensor.shape)} (convert it with .float() first)"
            )

    def shape(self, tensor: Any) -> tuple:
        return tuple(tensor.shape)

    def ones_like(self, tensor: Any) -> Any:
        return torch.ones_like(tensor)

    def seed_problem(self, y: Any, dy: Any) -> Optional[str]:
        # The manager calls the engine directly (see _run_engine), so it checks what
        # torch.autograd.backward would: the engine itself casts dtypes and rejects devices.
        problem = super().seed_problem(y, dy)
        if problem is None and y.is_complex() != dy.is_complex():
            problem = (f"has dtype {dy.dtype} but y has dtype {y.dtype}: a complex y needs a "
                       "complex dy and a real y a real one")
        return problem

    def accumulate(self, tensor: Any, grad: Any) -> None:
        if tensor.is_leaf:
            existing = tensor.grad
        else:
            with warnings.catch_warnings():  # reading .grad of a non-leaf warns
                warnings.simplefilter("ignore")
                existing = tensor.grad
        if existing is None:
            tensor.grad = grad
        elif grad.requires_grad or existing.requires_grad:
            tensor.grad = existing + grad
        else:
            existing.add_(grad)

    def new_tape(self) -> Tape:
        return TorchTape()

    def reachable(self, ys: Iterable[Any], tensors: Iterable[Any]) -> List[Any]:
        return reachable_leaves([y for y in ys if y.requires_grad], tensors)

    def device_of(self, tensor: Any) -> Optional[str]:
        return str(tensor.device)

