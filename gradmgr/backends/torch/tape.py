"""TorchTape: one manager's watched tensors, hooks and recording state on PyTorch."""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from typing import Any, Collection, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge

from gradmgr.backend import GradSink, Tape
from gradmgr.errors import UnsupportedGraphError

from . import prerecord, split
from .delegated import delivery_hooks
from .engine import OWN_SEED, run_engine, run_engine_plain
from .flags import FLAGS, GRAD_MODE
from .foreign import ForeignBackwards
from .grads import zeros_like_cheaply
from .graph import current_sequence_nr, graph_root, reentrant_checkpoints, walk
from .refusals import (
    INPUT_IN_PLACE,
    LEAF_IN_PLACE,
    REENTRANT_CHECKPOINT,
    check_non_leaves,
    differentiable,
    refuse_reentrant_checkpoint,
    run_callbacks,
)
from .watched import Entry, Watched, at_snapshots, input_without_flag

# Looked up once: every recording and backward asks them (a global is cheaper than torch.X)
_graph_task_id = torch._C._current_graph_task_id
_inference_mode = torch.is_inference_mode_enabled
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_thread_id = threading.get_ident

STAND_IN_BYTES = 2**16
"""Gradients at least this large are freed as soon as a callback replaced them (see _hook)."""


def _hook(tape_ref: weakref.ref, key: int, leaf: bool,
          grad: torch.Tensor) -> Optional[torch.Tensor]:
    """A watched tensor's gradient is ready in some backward: deliver it if it is this tape's.

    Tensor hooks fire in every backward that reaches the tensor, also another manager's (in
    another thread, or one run inside a callback), so the gradient is delivered only in the
    engine's graph task that this tape's backward started (see :func:`_claim`).

    For a leaf whose callbacks returned something else (a bucket's Future), a gradient of at
    least ``STAND_IN_BYTES`` is replaced for the engine by a zero-size stand-in, so that the
    engine does not hold it until it returns (it would keep it as the result for ``inputs=``,
    which the tape ignores for this tensor). Smaller ones are left with the engine: handing a
    tensor back costs the engine more time than holding a small gradient is worth
    (``bench/bench_ddp.py``'s ``native=False`` variant on 1,000 tensors measures it). So are
    sparse ones: the engine refuses a hook that changes a gradient's layout.
    """
    tape = tape_ref()
    if tape is None:
        return None
    if not tape._running or _graph_task_id() != tape._task:
        if tape._recording and not tape._running and leaf:
            tape.note_foreign(key, grad)
        return None
    if grad is None:  # a custom Function's backward gave this input no gradient: as if unused
        return None
    sink = tape.watched.eager.get(key)
    if sink is None or tape._only is not None and key not in tape._only:
        return None
    tape._fired.add(key)
    if (run_callbacks(sink, grad) is grad or not leaf
            or grad.numel() * grad.element_size() < STAND_IN_BYTES
            or grad.layout != torch.strided):
        return None
    stand_ins = tape.watched.stand_ins
    stand_in = stand_ins.get(key)
    if stand_in is None or stand_in.shape != grad.shape:
        stand_in = stand_ins[key] = zeros_like_cheaply(grad)
    return stand_in


def _register_without_collecting(tensor: torch.Tensor, hook: Any) -> Any:
    """``tensor.register_hook(hook)`` with the garbage collector held off: a dead tape's
    finalizer (``WatchedTensors.remove_hooks``) drops an emptied hook dict, and run by a
    collection inside ``register_hook`` (between torch reading the tensor's hook dict and
    filling it) it failed that call ("'NoneType' object does not support item assignment")."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return tensor.register_hook(hook)
    finally:
        if collecting:
            gc.enable()


def _root_node(output: Any) -> Any:
    return output.node if isinstance(output, GradientEdge) else graph_root(output)


def _claim(tape_ref: weakref.ref, grad_outputs: Any) -> None:
    """Pre-hook on the backward's root nodes, made for this backward alone (see
    :meth:`TorchTape._run_capturing`): the first one the engine runs is in this tape's graph
    task, before any gradient of an attached tensor is ready there."""
    tape = tape_ref()
    if tape is not None and tape._running and tape._task is None:
        tape._task = _graph_task_id()


class TorchTape(Tape):
    """One manager's watched tensors and recording state on PyTorch.

    Watches persist across recordings (``persistent_watch``), so a training step costs a few
    list operations per attached tensor rather than a Python call each.
    """

    persistent_watch = True

    def __init__(self) -> None:
        self.watched = Watched()
        self._fired: set = set()  # keys whose hook delivered in the running backward
        self._flagged: List[torch.Tensor] = []  # inputs this recording turned requires_grad on
        # No hooks on the tensors while backwards are delegated (each would cost the engine a
        # Python call per tensor); put back by the first backward that delivers to sinks.
        self._hooks_suspended = False
        self._running = False
        self._task: Optional[int] = None  # its graph task, once the engine started it
        # ids of the tensors a part of a split backward delivers (None: all watched ones).
        # The split's other parts run some of the same nodes, whose hooks must not deliver.
        self._only: Optional[set] = None
        self._recording = False
        self._thread = 0  # the recording's thread (see note_foreign)
        self._late = False  # some tensor was attached mid-recording (needs its own snapshot)
        self._grad_mode_thread = 0
        self._record_seq = 0
        self._record_threads: Optional[int] = None  # see prerecord.thread_mark
        # Watched leaves a backward that was not a manager's reached while recording (see
        # note_foreign). None: none.
        self._foreign: Optional[ForeignBackwards] = None
        self._checked = False  # the graph was checked (each manager's first backward)
        self._warned = False
        weakref.finalize(self, self.watched.remove_hooks)

    @property
    def has_snapshots(self) -> bool:
        """Some watched tensor is a non-leaf, whose gradient is taken at its snapshot edge."""
        return self.watched.snapshots > 0

    # -- watching ---------------------------------------------------------------------
    def watch(self, tensor: torch.Tensor, sink: GradSink, eager: bool) -> None:
        key = id(tensor)
        watched = self.watched
        entry = watched.entries.get(key)
        if entry is None or entry.ref() is not tensor:
            since = None
            if self._recording:
                self._late = True
                since = current_sequence_nr() if prerecord.check_mode() != "off" else 0
            entry = watched.add(tensor, sink, eager, since)
        if key not in watched.needs_flag and input_without_flag(tensor):
            # An input from this attach() on (also one attached before, that the user froze
            # since): the flag is on while this manager records, from now if it does.
            watched.needs_flag[key] = entry.ref
            watched.order = None
            if self._recording:
                self._acquire_flag(tensor)
        entry.sink = sink
        eager = entry.eager = eager or entry.edge is not None
        if eager:
            watched.eager[key] = sink
            self._ensure_hook(tensor, key)
        else:
            watched.eager.pop(key, None)

    def note_foreign(self, key: int, grad: Optional[torch.Tensor]) -> None:
        """A backward that is not a manager's reached watched leaf ``key`` while this tape
        records: keep what its ``.grad`` holds before that backward accumulates, so that
        :meth:`stop` can tell whether it wrote ``.grad`` (without the callbacks) in a
        recording that then ends without ``gm.backward()``. Not another thread's backward
        (S12): the engine runs a CPU backward in the thread that called it, so a CPU
        gradient seen in another thread than the recording's is that thread's (on a device,
        the engine's own threads run every backward, which cannot be told apart)."""
        if grad is not None and grad.device.type == "cpu" and _thread_id() != self._thread:
            return
        if self._foreign is None:
            self._foreign = ForeignBackwards()
        entry = self.watched.entries.get(key)
        self._foreign.note(key, None if entry is None else entry.ref)

    def _ensure_hook(self, tensor: torch.Tensor, key: int) -> None:
        watched = self.watched
        if key in watched.handles or self._hooks_suspended:
            return
        if not tensor.requires_grad:  # cannot take a hook yet: _add_missing_hooks adds it
            watched.hookless[key] = watched.entries[key].ref
            return
        watched.hookless.pop(key, None)
        hook = functools.partial(_hook, weakref.ref(self), key, tensor.is_leaf)
        watched.handles[key] = _register_without_collecting(tensor, hook)

    def _add_missing_hooks(self) -> None:
        """Hooks for eager tensors that require grad now but did not when watched (a frozen
        Parameter unfrozen after attach()): without one, their callbacks would run after the
        engine returns instead of as their gradient is ready."""
        hookless = self.watched.hookless
        for key, ref in list(hookless.items()):
            tensor = ref()
            if tensor is None or key not in self.watched.eager:
                del hookless[key]
            elif tensor.requires_grad:
                self._ensure_hook(tensor, key)

    def _resume_hooks(self) -> None:
        self._hooks_suspended = False
        watched = self.watched
        for key in watched.eager:
            tensor = watched.entries[key].ref()
            if tensor is not None:
                self._ensure_hook(tensor, key)

    def _acquire_flag(self, tensor: torch.Tensor) -> None:
        if FLAGS.acquire(tensor):
            self._flagged.append(tensor)

    # -- recording --------------------------------------------------------------------
    def start(self) -> None:
        if _inference_mode():
            raise RuntimeError(
                "cannot record under torch.inference_mode(): autograd records nothing there, "
                "so backward() would compute no gradient; record outside inference mode"
            )
        self._recording = True
        self._thread = _thread_id()
        watched = self.watched
        # (the first half of _wants_pre_record_check, asked first: the usual recording,
        # checked already, then makes no call for it)
        if ((not self._checked or prerecord.every_backward)
                and self._wants_pre_record_check()):
            self._record_seq = current_sequence_nr()  # a later attach() takes its own
            self._record_threads = prerecord.thread_mark()
        if watched.needs_flag:
            for key, ref in list(watched.needs_flag.items()):
                tensor = ref()
                if tensor is not None:
                    self._acquire_flag(tensor)
                    if key in watched.eager:
                        self._ensure_hook(tensor, key)
        # (grad mode on and no hold anywhere: the usual step, known without a call)
        self._grad_mode_thread = (0 if _grad_enabled() and not GRAD_MODE.by_thread
                                  else GRAD_MODE.start(self))

    def explain(self, error: BaseException) -> Optional[BaseException]:
        flagged = self._flagged
        if not flagged or LEAF_IN_PLACE not in str(error):
            return None
        shapes = ", ".join(str(tuple(t.shape)) for t in flagged[:4])
        return RuntimeError(INPUT_IN_PLACE.format(n=len(flagged), shapes=shapes))

    def stop(self) -> None:
        # Every backward ends its recording: a seed the engine did not take (y needed no
        # gradient, an error before the engine) is forgotten here (see engine.OWN_SEED).
        OWN_SEED[0] = None
        if not self._recording:
            return
        if self._foreign is not None:
            foreign, self._foreign = self._foreign, None
            message = foreign.message()
            if message is not None:
                self.bypassed = message
        self._recording = False
        self._running = False
        if self._grad_mode_thread:
            GRAD_MODE.stop(self, self._grad_mode_thread)
            self._grad_mode_thread = 0
        if self._flagged:
            flagged, self._flagged = self._flagged, []
            for tensor in flagged:
                FLAGS.release(tensor)
        if self._late:
            self._late = False
            for entry in self.watched.entries.values():
                entry.since = None

    # -- backward ---------------------------------------------------------------------
    def backward(
        self, ys: Sequence[Any], dys: Sequence[Any], *, create_graph: bool, retain_graph: bool,
        may_accumulate: bool = False,
    ) -> None:
        watched = self.watched
        if (may_accumulate and not create_graph and self._checked and len(ys) == 1
                and not watched.eager and not watched.snapshots
                and not prerecord.every_backward):
            # The usual step (no callbacks, nothing to check): what loss.backward() costs.
            y = ys[0]
            if y.requires_grad if type(y) is _Tensor else differentiable(y):
                inputs = watched.trainable()[1]
                if inputs:
                    try:
                        run_engine_plain(y, dys[0], retain_graph, inputs)
                    except RuntimeError as error:
                        refuse_reentrant_checkpoint(error)
            return
        prepared = self._prepare_backward(ys, dys)
        if prepared is not None:
            outputs, seeds, entries, inputs = prepared
            self.run(outputs, seeds, retain_graph or create_graph, create_graph, inputs,
                     entries, accumulate=(may_accumulate and not self.watched.eager
                                          and not create_graph))

    def backward_accumulating(self, ys: Sequence[Any], dys: Sequence[Any], *,
                              create_graph: bool, retain_graph: bool,
                              taken: Optional[Collection[int]] = None) -> None:
        prepared = self._prepare_backward(ys, dys)
        if prepared is None:
            return
        outputs, seeds, entries, inputs = prepared
        if not self._hooks_suspended:
            self._hooks_suspended = True
            self.watched.remove_hooks()
        node_hooks: List[Tuple[Any, str, Any]] = []
        if self.watched.snapshots or taken is not None:
            node_hooks = delivery_hooks(entries, inputs, taken, self._in_own_task)
            inputs = at_snapshots(inputs, entries)  # (the engine must not retain their grad)
        if node_hooks:
            outputs, claims = self._claiming(outputs)
            node_hooks += claims
        self._running = bool(node_hooks)
        try:
            self.run(outputs, seeds, retain_graph or create_graph, create_graph, inputs,
                     entries, node_hooks, accumulate=True)
        finally:
            self._running, self._task = False, None

    def backward_split(self, ys: Sequence[Any], dys: Sequence[Any], first: Sequence[Any], *,
                       retain_graph: bool) -> Any:
        prepared = self._prepare_backward(ys, dys)
        if prepared is None:
            return None
        outputs, seeds, entries, inputs = prepared
        return split.first_part(self, outputs, seeds, entries, inputs, first, retain_graph,
                                self._flagged)

    def _prepare_backward(self, ys: Sequence[Any], dys: Sequence[Any]) -> Optional[tuple]:
        """``(outputs, seeds, entries, inputs)`` of a backward (the outputs that require grad
        and the watched tensors that do), after the graph check; None: nothing to do."""
        if len(ys) == 1:
            if not differentiable(ys[0]):
                return None
            outputs, seeds = ys, dys
        else:
            outputs = [y for y in ys if differentiable(y)]
            seeds = [dy for y, dy in zip(ys, dys) if differentiable(y)]
            if not outputs:
                return None
        entries, inputs = self.watched.trainable()
        if not inputs:
            return None
        for y in outputs:
            if not isinstance(y, GradientEdge) and y.grad_fn is None:
                graph_root(y)  # refuses a view with no gradient path, as the engine would
        if self.watched.snapshots:
            check_non_leaves(inputs, entries)
        if not self._checked or prerecord.every_backward:
            self._check_graph(outputs, inputs, entries)
        return outputs, seeds, entries, inputs

    def run(self, outputs: Sequence[Any], seeds: Sequence[torch.Tensor], retain: bool,
            create_graph: bool, inputs: List[torch.Tensor], entries: List[Entry],
            node_hooks: Sequence[Tuple[Any, str, Any]] = (), accumulate: bool = False,
            only: bool = False) -> None:
        """Run the engine for the gradients of ``inputs`` (``outputs``: tensors or gradient
        edges) and deliver them to their sinks: eager ones from tensor hooks while the engine
        runs, the others when it returns. ``node_hooks``: ``(node, "register_hook" or
        "register_prehook", fn)`` registered for this run only.

        ``accumulate`` (only when no tensor of ``inputs`` is eager and nothing runs between
        computing and accumulating, or when a backward delegate takes the sinks' place): the
        engine accumulates into ``.grad`` itself, which is what a plain ``loss.backward()``
        costs, and no sink is called (``entries`` is not used then: ``inputs`` are handed to
        the engine as they are). ``only``: deliver to no watched tensor but ``inputs`` (a part
        of a split backward)."""
        handles = [getattr(node, kind)(fn) for node, kind, fn in node_hooks]
        try:
            if accumulate:
                run_engine(outputs, seeds, retain, create_graph, inputs, accumulate=True)
                return
            engine_inputs = at_snapshots(inputs, entries) if self.watched.snapshots else inputs
            if only:
                self._only = {id(t) for t in inputs}
            grads = self._run_capturing(outputs, seeds, retain, create_graph, inputs,
                                        engine_inputs)
        except RuntimeError as error:
            refuse_reentrant_checkpoint(error)
        finally:
            self._only = None
            for handle in handles:
                handle.remove()
        fired = self._fired
        # Callbacks see the grad mode they see in a hook, where the engine sets it.
        with torch.set_grad_enabled(create_graph):
            for tensor, entry, grad in zip(inputs, entries, grads):
                if grad is None:
                    continue
                if not entry.eager:
                    entry.sink(grad)
                elif id(tensor) not in fired:  # its hook could not fire (added mid-backward)
                    run_callbacks(entry.sink, grad)

    def none_eager(self, tensors: Sequence[torch.Tensor]) -> bool:
        """No tensor of ``tensors`` is delivered by a hook (callbacks, or a non-leaf), so the
        engine may accumulate them itself (:meth:`run`'s ``accumulate``)."""
        return self.watched.none_eager(list(tensors))

    def _run_capturing(self, outputs: Sequence[Any], seeds: Sequence[torch.Tensor],
                       retain: bool, create_graph: bool, inputs: List[torch.Tensor],
                       engine_inputs: Sequence[Any]) -> Sequence[Optional[torch.Tensor]]:
        """Run the engine returning the gradients at ``engine_inputs`` (the tensors of
        ``inputs``, or their snapshot edges); hooks feed the eager sinks meanwhile."""
        if not self.watched.eager:
            return run_engine(outputs, seeds, retain, create_graph, engine_inputs,
                              accumulate=False)
        if self._hooks_suspended:
            self._resume_hooks()
        if self.watched.hookless:
            self._add_missing_hooks()
        self.watched.hooks_last(inputs)
        outputs, claims = self._claiming(outputs)
        handles = [getattr(node, kind)(fn) for node, kind, fn in claims]
        self._running = True
        self._fired.clear()
        try:
            return run_engine(outputs, seeds, retain, create_graph, engine_inputs,
                              accumulate=False)
        finally:
            self._running = False
            for handle in handles:
                handle.remove()

    def _claiming(self, outputs: Sequence[Any]) -> Tuple[List[Any], List[Tuple[Any, str, Any]]]:
        """``outputs`` for a backward whose hooks deliver only in its own graph task, with the
        ``(node, "register_prehook", fn)`` that tells the task (see :func:`_claim`). Each
        output is seen through a view made now: its node is this backward's alone, so the
        task that runs it is this backward's, also when another thread differentiates the
        same tensor (a shared parameter as an output) at the same time."""
        with torch.enable_grad():
            outputs = [y if isinstance(y, GradientEdge) else y.view_as(y) for y in outputs]
        self._task = None
        claim = functools.partial(_claim, weakref.ref(self))
        return outputs, [(_root_node(y), "register_prehook", claim) for y in outputs]

    def _in_own_task(self) -> bool:
        """The engine runs this tape's backward now (not another one through its nodes).
        (Task ids are never reused; the task stays claimed if the recording is released
        from another thread while its backward runs.)"""
        return _graph_task_id() == self._task

    # -- the graph check --------------------------------------------------------------
    def _wants_pre_record_check(self) -> bool:
        mode = prerecord.check_mode()
        return mode != "off" and not self._warned and (mode == "always" or not self._checked)

    def _check_graph(self, outputs: Sequence[Any], inputs: List[torch.Tensor],
                     entries: List[Entry]) -> None:
        """One walk of the graph: refuse what gradmgr cannot differentiate, and warn where the
        result differs from MegEngine's (each manager's first backward; every backward in
        "always" mode)."""
        parents = walk(graph_root(y) for y in outputs)
        if reentrant_checkpoints(parents):
            raise UnsupportedGraphError(REENTRANT_CHECKPOINT)
        if not self._wants_pre_record_check():
            self._checked = True
            return
        base = self._record_seq
        since = [base if e.since is None else e.since for e in entries]
        if 0 in since:
            return  # no snapshot could be taken (inference mode, functorch): check a later step
        self._checked = True
        if not prerecord.alone_since(self._record_threads):
            return  # a thread started since record() may have made nodes: numbered its own way
        if prerecord.warn_if_pre_record(parents, inputs, since, base):
            self._warned = True
