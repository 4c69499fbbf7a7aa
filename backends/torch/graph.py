"""Walking PyTorch autograd graphs: reachability and node sequence numbers."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch


def current_sequence_nr() -> int:
    """The sequence number the next autograd node created in this thread will get, or 0 (which
    turns the pre-record check off for this snapshot) where no node can be made: inference mode,
    functorch transforms."""
    with torch.enable_grad():
        probe = _PROBE.view_as(_PROBE)
    node = probe.grad_fn
    return 0 if node is None else node._sequence_nr() + 1


_PROBE = torch.zeros((), requires_grad=True)


def grad_node(t: torch.Tensor) -> Any:
    """The node whose output is ``t``'s gradient: ``grad_fn`` or the leaf's AccumulateGrad."""
    node = t.grad_fn
    if node is None:
        node = torch.autograd.graph.get_gradient_edge(t).node
    return node


def walk(roots: Iterable[Any]) -> Dict[Any, List[Any]]:
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
    parents = walk(y.grad_fn for y in ys)
    if tensors is None:
        return [n.variable for n in parents if hasattr(n, "variable")]
    found = []
    for t in tensors:
        if not t.requires_grad:
            continue
        if (t.grad_fn is None and grad_node(t) in parents) or (
            t.grad_fn is not None and t.grad_fn in parents
        ):
            found.append(t)
    return found


def pre_record_paths(
    outputs: List[torch.Tensor], inputs: List[torch.Tensor], watch_seq: List[int]
) -> List[torch.Tensor]:
    """Attached tensors whose gradient passes through a node created before their snapshot.

    ``low[n]`` is the smallest sequence number among the nodes on any path from the outputs
    down to ``n`` (``n`` excluded). Children are always created before their parents, so
    visiting nodes by decreasing sequence number sees every parent first; AccumulateGrad nodes
    (the leaves) have no children and go last.
    """
    parents = walk(y.grad_fn for y in outputs)
    seq = {n: n._sequence_nr() for n in parents}
    never = float("inf")
    low: Dict[Any, float] = {}
    for node in sorted(parents, key=lambda n: -1 if hasattr(n, "variable") else seq[n],
                       reverse=True):
        low[node] = min((min(seq[p], low[p]) for p in parents[node]), default=never)
    stale = []
    for t, since in zip(inputs, watch_seq):
        node = t.grad_fn if t.grad_fn is not None else grad_node(t)
        if low.get(node, never) < since:
            stale.append(t)
    return stale
