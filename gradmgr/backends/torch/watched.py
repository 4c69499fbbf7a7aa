"""The tensors one tape watches, weakly held, and what hangs on them: their sinks, the tensor
hooks of the eager ones, the stand-ins those hooks hand back, and the flags to turn on."""

from __future__ import annotations

import operator
import weakref
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
from torch.autograd.graph import GradientEdge

from gradmgr.backend import GradSink
from gradmgr.weak_keys import forgetting_ref

from .flags import FLAGS

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DEREF = weakref.ReferenceType.__call__  # ref -> its object, called from C


def input_without_flag(tensor: torch.Tensor) -> bool:
    """A leaf whose gradient is wanted although the user's ``requires_grad`` is off (a flag
    another recording turned on is not the user's): an input. A ``Parameter`` with
    ``requires_grad=False`` is frozen instead, and gets no gradient (as with
    ``loss.backward()`` and DDP)."""
    return (tensor.grad_fn is None and not isinstance(tensor, torch.nn.Parameter)
            and not FLAGS.user_flag(tensor))


def _alive(ref: weakref.ref) -> torch.Tensor:
    tensor = ref()
    if tensor is None:
        raise RuntimeError("gradmgr: a tensor died while being watched (an internal error)")
    return tensor


class Entry:
    """One watched tensor: weakly held, with its sink and snapshot sequence number, and for a
    non-leaf the gradient edge it had when watched."""

    __slots__ = ("ref", "sink", "eager", "since", "edge", "version")

    def __init__(self, ref: weakref.ref, sink: GradSink, eager: bool, since: Optional[int],
                 edge: Optional[GradientEdge]):
        self.ref = ref
        self.sink = sink
        self.eager = eager
        self.since = since  # None: snapshot at record() time
        # A non-leaf's gradient is taken at this edge, so that an in-place operation on the
        # tensor after attach() does not move it (contract point 8's snapshot); its tensor hook
        # (on the same node) delivers it, after the user's own hooks.
        self.edge = edge
        # (watched while alive: ref() is the tensor) see refusals.check_non_leaves
        self.version = None if edge is None else _alive(ref)._version


def at_snapshots(inputs: List[torch.Tensor], entries: List[Entry]) -> List[Any]:
    """``inputs`` as the engine takes them: each non-leaf at its snapshot edge (``entries``:
    theirs, in the same order)."""
    return [t if e.edge is None else e.edge for t, e in zip(inputs, entries)]


class Watched:
    """What one tape watches, by ``id(tensor)``; an entry and all that hangs on it go when its
    tensor dies. Holds no reference to the tape (the tape holds it)."""

    __slots__ = ("entries", "eager", "handles", "stand_ins", "hookless", "needs_flag", "order",
                 "snapshots", "__weakref__")

    def __init__(self) -> None:
        self.entries: Dict[int, Entry] = {}
        self.eager: Dict[int, GradSink] = {}  # the sinks fed by tensor hooks
        self.handles: Dict[int, Any] = {}  # those hooks
        self.stand_ins: Dict[int, torch.Tensor] = {}  # see tape.hook
        # Eager tensors with no hook yet: their requires_grad was off (a frozen Parameter).
        self.hookless: Dict[int, weakref.ref] = {}
        self.needs_flag: Dict[int, weakref.ref] = {}  # inputs: requires_grad on while recording
        # (entries, weakrefs) of the watched tensors when all were alive and required grad at
        # the last backward; None whenever a tensor is watched or dies.
        self.order: Optional[Tuple[List[Entry], List[weakref.ref]]] = None
        self.snapshots = 0  # how many entries have a snapshot edge (non-leaf tensors)

    def add(self, tensor: torch.Tensor, sink: GradSink, eager: bool,
            since: Optional[int]) -> Entry:
        key = id(tensor)
        edge = None if tensor.grad_fn is None else GradientEdge(tensor.grad_fn, tensor.output_nr)
        entry = Entry(forgetting_ref(tensor, self, Watched._forget), sink, eager, since, edge)
        self.entries[key] = entry
        if edge is not None:
            self.snapshots += 1
        self.order = None
        return entry

    def _forget(self, key: int, dead: weakref.ref) -> None:
        entry = self.entries.get(key)
        if entry is None or entry.ref is not dead:
            return  # a tensor that reused the id is watched now
        del self.entries[key]
        if entry.edge is not None:
            self.snapshots -= 1
        self.order = None
        for table in (self.eager, self.stand_ins, self.handles, self.hookless, self.needs_flag):
            table.pop(key, None)  # (a hook dies with its tensor)

    def trainable(self) -> Tuple[List[Entry], List[torch.Tensor]]:
        """The watched tensors that get a gradient now, with their entries, in watch order:
        this tape's inputs and those that require grad by the user's flag (not by one another
        manager's recording turned on for an input of its own: frozen for this tape)."""
        order = self.order
        if order is not None and FLAGS.lends_only(self.needs_flag):
            # the usual step: the same tensors as last time, all trainable
            entries, refs = order
            alive = list(map(_DEREF, refs))  # (no Python frame, unlike a comprehension)
            try:
                if all(map(_REQUIRES_GRAD, alive)):  # (so none is None)
                    return entries, cast(List[torch.Tensor], alive)
            except AttributeError:  # None: a tensor died since
                pass
        entries, inputs = [], []
        needs_flag = self.needs_flag
        for key, entry in self.entries.items():
            tensor = entry.ref()
            if (tensor is not None and tensor.requires_grad
                    and (key in needs_flag or FLAGS.user_flag(tensor))):
                entries.append(entry)
                inputs.append(tensor)
        all_in = len(entries) == len(self.entries)
        self.order = (entries, [entry.ref for entry in entries]) if all_in else None
        return entries, inputs

    def none_eager(self, tensors: List[torch.Tensor]) -> bool:
        """No tensor of ``tensors`` is delivered by a hook (callbacks, or a non-leaf)."""
        eager = self.eager
        return not eager or not any(id(t) in eager for t in tensors)

    def hooks_last(self, inputs: List[torch.Tensor]) -> None:
        """Move the tape's hook after hooks the user registered later, so that callbacks see
        the gradient AccumulateGrad would get (tensor hooks run in registration order)."""
        handles = self.handles
        for tensor in inputs:
            hooks = tensor._backward_hooks
            if hooks is not None and len(hooks) > 1:
                handle = handles.get(id(tensor))
                # (Not in this dict after an in-place op: the tape's hook stayed with the
                # snapshot's node, and the user's later ones went to the new node's dict.)
                if (handle is not None and handle.id in hooks
                        and next(reversed(hooks)) != handle.id):
                    # The engine walks the dict in insertion order: re-insert at the end.
                    hooks[handle.id] = hooks.pop(handle.id)

    def remove_hooks(self) -> None:
        """Remove the tape's tensor hooks. Removing a handle leaves an empty hook dict, and
        PyTorch still calls into Python for it in every backward, once per tensor (what that
        costs: ``bench/bench_ddp.py``'s 1,000-tensor model on the reducer path), so a tensor
        left with no Python hook gets none at all (which drops that call)."""
        for key, handle in list(self.handles.items()):
            handle.remove()
            entry = self.entries.get(key)
            tensor = None if entry is None else entry.ref()
            if tensor is not None and not tensor._backward_hooks:
                tensor._backward_hooks = None
        self.handles.clear()
