"""Split backward on PyTorch: the gradients of some attached tensors now, the rest later.

The first part runs the engine for the chosen tensors only (a pipeline stage's input
activations: what the previous stage waits for) while a pre-hook on every boundary node (see
:class:`.split_plan.SplitPlan`) records the gradients it computes with. The rest runs the engine
again from those nodes for the remaining tensors (the weights), one run per independent group,
and the same pre-hooks hand the recorded gradients back; a boundary node's outputs toward
first-part nodes are not computed there (the engine does not need them), or are zeros in a
group of several boundary nodes, since the first part already accounted for them. Together
they compute what one backward computes, and no node's work is done twice: a boundary node
computes its first-part outputs in the first run and its other outputs in the second.

Hooks on a boundary node's output tensor (``register_hook``, ``retain_grad``) run in the first
part, where the node first runs. The engine calls them again when the rest runs the node; they
get a zero gradient there, and what they return is replaced by what the node computed with in
the first part, so every gradient (and a retained ``.grad``) is what one backward gives.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

from gradmgr.errors import GradMgrWarning, UnsupportedGraphError

from .flags import FLAGS
from .grads import zeros_like_cheaply
from .split_plan import split_plan

_CAPTURE, _KEEP, _REPLAY, _DONE = range(4)

_COMPILED_BOUNDARY = (
    "backward_split: the first tensors' gradient path and the rest's meet inside a "
    "torch.compile'd region (its backward is one CompiledFunctionBackward node). A split runs "
    "such a node twice, needing other outputs each time, and with the default (inductor) "
    "backend PyTorch computes wrong gradients in the second run (two torch.autograd.grad calls "
    "over a compiled region do the same). Use gm.backward() for this stage, or leave the "
    "layers that hold attached weights uncompiled"
)


class _Handover:
    """Node pre-hook on one boundary node for the life of a split backward: records the
    gradients the node gets in the first part (after its tensor hooks), and while the rest runs
    its group returns them instead of what the engine gives it there (zero stand-ins, see
    :meth:`stand_ins`). Inert once the split is done (a retained graph may be run again)."""

    __slots__ = ("grads", "state", "_stand_ins", "_name")

    def __init__(self, name: str) -> None:
        self.grads: tuple = ()
        self.state = _CAPTURE
        self._stand_ins: tuple = ()
        self._name = name

    def __call__(self, grad_outputs: tuple) -> Optional[tuple]:
        state = self.state
        if state == _REPLAY:
            if any(g is not None and g is not s for g, s in zip(grad_outputs, self._stand_ins)):
                self._check_hooks_kept_zero(grad_outputs)
            return self.grads
        if state == _CAPTURE:
            self.grads, self.state = grad_outputs, _KEEP
        return None

    def stand_ins(self) -> List[Tuple[int, torch.Tensor]]:
        """``(input, zero stand-in)`` for each input of the node that got a gradient in the
        first part: the rest starts the node from these (none: it has nothing to give)."""
        self._stand_ins = tuple(None if g is None else zeros_like_cheaply(g) for g in self.grads)
        return [(i, z) for i, z in enumerate(self._stand_ins) if z is not None]

    def _check_hooks_kept_zero(self, grad_outputs: tuple) -> None:
        """A hook on the node's output tensor changed the zero stand-in: harmless for every
        gradient (the recorded ones replace it), but a ``retain_grad()`` on that tensor adds
        what the hook returned, so say so where that is not zero. (Zeros passed on to it from
        another boundary node of its group become nan where the forward overflowed, 0 * inf:
        not a hook's doing, so only finite values count.)"""
        if any(g is not None and bool((g.isfinite() & (g != 0)).any()) for g in grad_outputs):
            warnings.warn(
                f"a gradient hook on the output of {self._name} returned a non-zero gradient "
                "for a zero one: a split backward's finish() calls hooks on that tensor again "
                "with zeros (and ignores what they return), so a retain_grad() on it got that "
                "value added to its .grad. Every other gradient is exact. Use backward() if "
                "that tensor's retained .grad matters, or a hook that maps zero to zero",
                GradMgrWarning,
                stacklevel=2,
            )


def first_part(tape: Any, outputs: List[torch.Tensor], seeds: List[torch.Tensor],
               entries: List[Any], inputs: List[torch.Tensor], first: Sequence[Any],
               retain_graph: bool, flagged: Sequence[torch.Tensor] = ()) -> Rest:
    """Run the first part on ``tape`` (delivering the first tensors' gradients to their sinks)
    and return what the rest needs. ``flagged``: inputs the recording made require grad."""
    first_ids = {id(t) for t in first}
    now: List[torch.Tensor] = []
    later: List[torch.Tensor] = []
    for t in inputs:
        (now if id(t) in first_ids else later).append(t)
    snapshots = None
    if tape.has_snapshots:  # attached non-leaves take their gradient at their snapshot
        snapshots = {id(t): e.edge.node for t, e in zip(inputs, entries) if e.edge is not None}
    plan = split_plan(outputs, now, later, snapshots)
    if any(type(node).__name__ == "CompiledFunctionBackward" for node in plan.boundary):
        raise UnsupportedGraphError(_COMPILED_BOUNDARY)
    entry_of = {id(t): e for t, e in zip(inputs, entries)}
    rest = Rest(tape, plan, outputs, seeds, entry_of, retain_graph, flagged)
    if plan.now and plan.first_outputs:
        try:
            # The boundary nodes run again in the rest: keep what they saved. The manager
            # accumulates the first part right after it, so the engine may do that itself.
            # Only outputs that reach the first tensors: the rest starts the others (hooks on
            # them would run twice).
            _run_part(tape, [outputs[i] for i in plan.first_outputs],
                      [seeds[i] for i in plan.first_outputs], True, plan.now, entry_of, (),
                      may_accumulate=True)
        except BaseException:
            rest.release()
            raise
    return rest


class Rest:
    """The second part of a split backward, run once by :meth:`run`."""

    def __init__(self, tape: Any, plan: Any, outputs: List[torch.Tensor],
                 seeds: List[torch.Tensor], entry_of: dict, retain_graph: bool,
                 flagged: Sequence[torch.Tensor] = ()) -> None:
        self._tape, self._plan, self._seeds = tape, plan, seeds
        self._entry_of, self._retain = entry_of, retain_graph
        # The recording turned requires_grad on for these inputs, and the rest runs after it
        # ended: a checkpointed region recomputed there must see the flags it was recorded
        # with, or it saves other tensors and torch.utils.checkpoint refuses.
        self._flagged = [weakref.ref(t) for t in flagged]
        # Outputs the first part does not reach start the rest too, each through a view node
        # made now (its node, not the tensor, which may be large): hooks on the output's own
        # node then run inside the rest's engine task, after the tape has claimed it.
        self._roots = {}
        for _, indices, _ in plan.groups:
            for i in indices:
                self._roots[i] = _own_root(outputs[i])
        self._handovers = {}
        self._only_needed = []
        for node in plan.boundary:
            hook = self._handovers[node] = _Handover(node.name())
            node.register_prehook(hook)
            if _OnlyNeeded.applies(node):
                only = _OnlyNeeded(node)
                node.register_prehook(only)
                self._only_needed.append(only)

    def run(self, may_accumulate: bool, retain_graph: bool = False) -> None:
        """Run the rest; ``may_accumulate``: as for :meth:`TorchTape.backward`;
        ``retain_graph``: keep the graph for another backward (as torch's split offers)."""
        plan, tape, handovers, entry_of = self._plan, self._tape, self._handovers, self._entry_of
        # A group of several boundary nodes runs the first-part nodes between them, which may
        # be another group's: keep what they saved for that group's run.
        retain = (retain_graph or self._retain
                  or any(len(nodes) > 1 for nodes, _, _ in plan.groups))
        flagged = [t for t in (ref() for ref in self._flagged)
                   if t is not None and FLAGS.acquire(t)]
        try:
            for nodes, root_indices, tensors in plan.groups:
                edges, grads, drops = [], [], []
                for node in nodes:
                    hook = handovers[node]
                    for i, zero in hook.stand_ins():
                        edges.append(GradientEdge(node, i))
                        grads.append(zero)
                    # A boundary node's first-part child can lead on to another boundary
                    # node of the same group (never back to itself), and the engine runs the
                    # nodes between them: they get zeros, as the boundary nodes' own hooks do.
                    if len(nodes) > 1:
                        mask = [child in plan.first_nodes for child, _ in node.next_functions]
                        if any(mask):
                            drops.append((node, "register_hook", _zeroing(mask)))
                for i in root_indices:
                    edges.append(self._roots[i])
                    grads.append(self._seeds[i])
                if not (edges and tensors):
                    continue
                # Only this group's boundary nodes hand over: another group's may lie between
                # two of them (a weight used on both sides of it), and passes zeros on there.
                for node in nodes:
                    handovers[node].state = _REPLAY
                try:
                    _run_part(tape, edges, grads, retain, tensors, entry_of, drops,
                              may_accumulate)
                finally:
                    for node in nodes:
                        handovers[node].state = _KEEP
        finally:
            for t in flagged:
                FLAGS.release(t)
            self.release()

    def release(self) -> None:
        """Let go of the recorded gradients and the graph; the hooks stay behind, inert."""
        for hook in self._handovers.values():
            hook.state, hook.grads, hook._stand_ins = _DONE, (), ()
        for only in self._only_needed:  # a retained graph runs as recorded again
            only.restore()
        self._only_needed = []
        self._handovers = {}
        self._plan, self._roots, self._seeds, self._entry_of = None, {}, [], {}
        self._flagged = []


class _OnlyNeeded:
    """Node pre-hook on a boundary node that is a custom ``autograd.Function``: its backward
    sees what each run needs, not what the forward recorded. Built-in nodes ask the engine
    which outputs it will use; a Function reads ``ctx.needs_input_grad``, fixed at the
    forward, and would compute its input side again in the rest and its weight side in the
    first part (work the engine then drops). Each run, the flags an input's node will not be
    executed get are turned off (those of the forward are put back in :meth:`restore`)."""

    __slots__ = ("_node", "_recorded")

    def __init__(self, node: Any) -> None:
        self._node = weakref.ref(node)
        self._recorded = tuple(node.needs_input_grad)

    @staticmethod
    def applies(node: Any) -> bool:
        """A Function's node whose flags are one per input edge (no non-tensor arguments)."""
        flags = getattr(node, "needs_input_grad", None)
        return (isinstance(node, BackwardCFunction) and isinstance(flags, tuple)
                and len(flags) == len(node.next_functions))

    def __call__(self, grad_outputs: tuple) -> None:
        node = self._node()
        if node is not None:
            node.needs_input_grad = tuple(
                wanted and child is not None and _needed(child)
                for wanted, (child, _) in zip(self._recorded, node.next_functions))

    def restore(self) -> None:
        node = self._node()
        if node is not None:
            node.needs_input_grad = self._recorded


_will_execute = torch._C._will_engine_execute_node


def _needed(child: Any) -> bool:
    """Whether the engine will run ``child``; True where torch cannot say (a leaf's node
    while the engine runs ``autograd.grad``, as gradmgr's own runs do): the Function then
    computes that side as recorded, and the engine drops what it does not need."""
    try:
        return _will_execute(child)
    except RuntimeError:
        return True


def _own_root(output: Any) -> GradientEdge:
    """Where the rest starts for an output the first part does not reach: a view's node made
    now, or the caller's own gradient edge (there is no tensor to view)."""
    if isinstance(output, GradientEdge):
        return output
    with torch.enable_grad():
        view = output.view_as(output)
    return GradientEdge(view.grad_fn, 0)


def _run_part(tape: Any, outputs: List[Any], seeds: List[torch.Tensor], retain: bool,
              tensors: List[torch.Tensor], entry_of: dict, node_hooks: Sequence[Any],
              may_accumulate: bool) -> None:
    """One engine run of a split backward, delivering to ``tensors`` only; the engine
    accumulates into ``.grad`` itself where ``may_accumulate`` and none of them is eager."""
    accumulate = may_accumulate and tape.none_eager(tensors)
    entries = () if accumulate else [entry_of[id(t)] for t in tensors]
    tape.run(outputs, seeds, retain, False, tensors, entries, node_hooks, accumulate=accumulate,
             only=True)


def _zeroing(mask: List[bool]) -> Any:
    """A node hook that replaces the node's gradients toward first-part nodes (``mask``) with
    zeros (the first part accounted for them)."""
    def hook(grad_inputs: Any, grad_outputs: Any) -> Any:
        return tuple(zeros_like_cheaply(g) if drop and g is not None else g
                     for drop, g in zip(mask, grad_inputs))

    return hook
