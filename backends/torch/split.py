"""Split backward on PyTorch: the gradients of some attached tensors now, the rest later.

The first part runs the engine for the chosen tensors only (a pipeline stage's input
activations: what the previous stage waits for) while pre-hooks capture the incoming gradient
of every boundary node (see :class:`.graph.SplitPlan`). The rest runs the engine again from
those nodes, with the captured gradients, for the remaining tensors (the weights), one run per
independent group; a boundary node's outputs toward first-part nodes are dropped there, since
the first part already accounted for them. Together they compute what one backward computes,
and no node's work is done twice: a boundary node computes its first-part outputs in the first
run and its other outputs in the second.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch
from torch.autograd.graph import GradientEdge

from .graph import graph_root, split_plan


def first_part(tape: Any, outputs: List[torch.Tensor], seeds: List[torch.Tensor],
               entries: List[Any], inputs: List[torch.Tensor], first: Sequence[Any],
               retain_graph: bool) -> Rest:
    """Run the first part on ``tape`` (delivering the first tensors' gradients to their sinks)
    and return what the rest needs."""
    first_ids = {id(t) for t in first}
    entry_of = {id(t): e for t, e in zip(inputs, entries)}
    plan = split_plan(outputs, [t for t in inputs if id(t) in first_ids],
                      [t for t in inputs if id(t) not in first_ids])
    captured: Dict[Any, Any] = {}

    def capture_at(node: Any) -> Any:
        def hook(grad_outputs: Any) -> None:
            captured[node] = grad_outputs

        return hook

    if plan.now:
        hooks = [(node, "register_prehook", capture_at(node)) for node in plan.boundary]
        # The boundary nodes run again in the rest: keep what they saved. The manager
        # accumulates the first part right after it, so the engine may do that itself.
        tape.run(outputs, seeds, True, False, plan.now, [entry_of[id(t)] for t in plan.now],
                 hooks, accumulate=tape.none_eager(plan.now))
    roots = [GradientEdge(graph_root(y), y.output_nr) for y in outputs]
    return Rest(tape, plan, captured, roots, seeds, entry_of, retain_graph)


class Rest:
    """The second part of a split backward, run once by :meth:`run`."""

    def __init__(self, tape: Any, plan: Any, captured: Dict[Any, Any], roots: List[Any],
                 seeds: List[torch.Tensor], entry_of: Dict[int, Any], retain_graph: bool) -> None:
        self._tape, self._plan, self._captured = tape, plan, captured
        self._roots, self._seeds, self._entry_of = roots, seeds, entry_of
        self._retain = retain_graph

    def run(self, may_accumulate: bool) -> None:
        """Run the rest; ``may_accumulate``: as for :meth:`TorchTape.backward`."""
        plan, captured, tape = self._plan, self._captured, self._tape
        first_nodes = plan.first_nodes
        try:
            for nodes, root_indices, tensors in plan.groups:
                edges, grads, hooks = [], [], []
                for node in nodes:
                    for i, grad in enumerate(captured.get(node, ())):
                        if grad is not None:
                            edges.append(GradientEdge(node, i))
                            grads.append(grad)
                    # A boundary node's first-part child can lead on to another boundary
                    # node of the same group (never back to itself): drop what it would get.
                    if len(nodes) > 1:
                        mask = [child in first_nodes for child, _ in node.next_functions]
                        if any(mask):
                            hooks.append((node, "register_hook", _dropping(mask)))
                for i in root_indices:
                    edges.append(self._roots[i])
                    grads.append(self._seeds[i])
                if edges and tensors:
                    tape.run(edges, grads, self._retain, False, tensors,
                             [self._entry_of[id(t)] for t in tensors], hooks,
                             accumulate=may_accumulate and tape.none_eager(tensors))
        finally:
            self.release()

    def release(self) -> None:
        """Let go of the captured gradients and the graph."""
        self._captured = {}
        self._plan = self._roots = self._seeds = self._entry_of = None


def _dropping(mask: List[bool]) -> Any:
    """A node hook that drops the node's gradients toward first-part nodes (``mask``)."""
    def hook(grad_inputs: Any, grad_outputs: Any) -> Any:
        return tuple(None if drop else g for drop, g in zip(mask, grad_inputs))

    return hook
