"""Split backward on PyTorch: the gradients of some attached tensors now, the rest later.

The first part runs the engine for the chosen tensors only (a pipeline stage's input
activations: what the previous stage waits for) while a pre-hook on every boundary node (see
:class:`.graph.SplitPlan`) records the gradients it computes with. The rest runs the engine
again from those nodes for the remaining tensors (the weights), one run per independent group,
and the same pre-hooks hand the recorded gradients back; a boundary node's outputs toward
first-part nodes are dropped there, since the first part already accounted for them. Together
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
from torch.autograd.graph import GradientEdge

from gradmgr.errors import GradMgrWarning, UnsupportedGraphError

from .flags import FLAGS
from .grads import zeros_like_cheaply
from .graph import graph_root, split_plan

_CAPTURE, _KEEP, _REPLAY, _DONE = range(4)

_COMPILED_BOUNDARY = (
    "backward_split: the first tensors' gradient path and the rest's meet inside a "
    "torch.compile'd region (its backward is one CompiledFunctionBackward node). A split runs "
    "such a node twice, needing other outputs each time, and with the default (inductor) "
    "backend PyTorch computes wrong gradients in the second run (two torch.autograd.grad calls "
    "over a compiled region do the same). Use "
    "gm.backward() for this stage, or leave the layers that hold attached weights uncompiled"
)


class _Handover:
    """Node pre-hook on one boundary node for the life of a split backward: records the
    gradients the node gets in the first part (after its tensor hooks), and while the rest runs
    returns them instead of what the engine gives it there (a zero stand-in, see
    :meth:`stand_in`). Inert once the split is done (a retained graph may be run again)."""

    __slots__ = ("grads", "state", "_stand_in", "_name")

    def __init__(self, name: str) -> None:
        self.grads: tuple = ()
        self.state = _CAPTURE
        self._stand_in: Optional[torch.Tensor] = None
        self._name = name

    def __call__(self, grad_outputs: tuple) -> Optional[tuple]:
        state = self.state
        if state == _REPLAY:
            if any(g is not None and g is not self._stand_in for g in grad_outputs):
                self._check_hooks_kept_zero(grad_outputs)
            return self.grads
        if state == _CAPTURE:
            self.grads, self.state = grad_outputs, _KEEP
        return None

    def stand_in(self) -> Optional[Tuple[int, torch.Tensor]]:
        """``(input, zero stand-in)`` to start the rest from this node (an input that got a
        gradient in the first part), or None when it got none (it has nothing to give)."""
        for i, grad in enumerate(self.grads):
            if grad is not None:
                self._stand_in = zeros_like_cheaply(grad)
                return i, self._stand_in
        return None

    def _check_hooks_kept_zero(self, grad_outputs: tuple) -> None:
        """A hook on the node's output tensor changed the zero stand-in: harmless for every
        gradient (the recorded ones replace it), but a ``retain_grad()`` on that tensor adds
        what the hook returned, so say so where that is not zero."""
        if any(g is not None and bool(g.any()) for g in grad_outputs):
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
    now, later = [], []
    for t in inputs:
        (now if id(t) in first_ids else later).append(t)
    plan = split_plan(outputs, now, later)
    if any(type(node).__name__ == "CompiledFunctionBackward" for node in plan.boundary):
        raise UnsupportedGraphError(_COMPILED_BOUNDARY)
    entry_of = {id(t): e for t, e in zip(inputs, entries)}
    rest = Rest(tape, plan, outputs, seeds, entry_of, retain_graph, flagged)
    if plan.now:
        try:
            # The boundary nodes run again in the rest: keep what they saved. The manager
            # accumulates the first part right after it, so the engine may do that itself.
            accumulate = tape.none_eager(plan.now)
            entries = () if accumulate else [entry_of[id(t)] for t in plan.now]
            tape.run(outputs, seeds, True, False, plan.now, entries, accumulate=accumulate)
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
        # Outputs the first part does not reach start the rest too (their nodes, not the
        # tensors: those may be large, and the caller may be done with them).
        self._roots = {i: GradientEdge(graph_root(outputs[i]), outputs[i].output_nr)
                       for _, indices, _ in plan.groups for i in indices}
        self._handovers = {}
        for node in plan.boundary:
            hook = self._handovers[node] = _Handover(node.name())
            node.register_prehook(hook)

    def run(self, may_accumulate: bool) -> None:
        """Run the rest; ``may_accumulate``: as for :meth:`TorchTape.backward`."""
        plan, tape, handovers, entry_of = self._plan, self._tape, self._handovers, self._entry_of
        flagged = [t for t in (ref() for ref in self._flagged)
                   if t is not None and FLAGS.acquire(t)]
        try:
            for hook in handovers.values():
                hook.state = _REPLAY
            for nodes, root_indices, tensors in plan.groups:
                edges, grads, drops = [], [], []
                for node in nodes:
                    root = handovers[node].stand_in()
                    if root is None:
                        continue
                    edges.append(GradientEdge(node, root[0]))
                    grads.append(root[1])
                    # A boundary node's first-part child can lead on to another boundary
                    # node of the same group (never back to itself): drop what it would get.
                    if len(nodes) > 1:
                        mask = [child in plan.first_nodes for child, _ in node.next_functions]
                        if any(mask):
                            drops.append((node, "register_hook", _dropping(mask)))
                for i in root_indices:
                    edges.append(self._roots[i])
                    grads.append(self._seeds[i])
                if edges and tensors:
                    accumulate = may_accumulate and tape.none_eager(tensors)
                    entries = () if accumulate else [entry_of[id(t)] for t in tensors]
                    tape.run(edges, grads, self._retain, False, tensors, entries, drops,
                             accumulate=accumulate)
        finally:
            for t in flagged:
                FLAGS.release(t)
            self.release()

    def release(self) -> None:
        """Let go of the recorded gradients and the graph; the hooks stay behind, inert."""
        for hook in self._handovers.values():
            hook.state, hook.grads, hook._stand_in = _DONE, (), None
        self._handovers = {}
        self._plan = self._roots = self._seeds = self._entry_of = None
        self._flagged = []


def _dropping(mask: List[bool]) -> Any:
    """A node hook that drops the node's gradients toward first-part nodes (``mask``)."""
    def hook(grad_inputs: Any, grad_outputs: Any) -> Any:
        return tuple(None if drop else g for drop, g in zip(mask, grad_inputs))

    return hook
