"""Walking PyTorch autograd graphs: reachability and node sequence numbers."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge


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


def has_own_flag(t: torch.Tensor) -> bool:
    """Whether a leaf view's ``requires_grad`` is its own, so that it has a gradient of its
    own. A view made before its base required grad shows the base's flag, but the engine
    gives it no gradient accumulator (nothing flows to it, nor through it to the base) unless
    its own flag is set; the edge a new node would take to it tells which."""
    with torch.enable_grad():
        node = t.view_as(t).grad_fn
    return node is not None and node.next_functions[0][0] is not None


def walk(roots: Iterable[Any]) -> Dict[Any, List[Any]]:
    """Every node reachable from ``roots``, mapped to its parents (nodes that feed it, once per
    edge)."""
    parents: Dict[Any, List[Any]] = {}
    stack = []
    for root in roots:
        if root is not None and root not in parents:
            parents[root] = []
            stack.append(root)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is not None:
                feeders = parents.get(child)
                if feeders is None:
                    parents[child] = [node]
                    stack.append(child)
                else:
                    feeders.append(node)
    return parents


_ACCUMULATE_GRAD = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)


def node_lookup(parents: Dict[Any, List[Any]]) -> Any:
    """``node_of(t)``: the node of ``t``'s gradient if it is in the walk ``parents``, else
    None. Leaves' nodes come from the walk itself (``get_gradient_edge`` would make a view of
    every tensor asked about)."""
    accumulators = {id(n.variable): n for n in parents if type(n) is _ACCUMULATE_GRAD
                    or _ACCUMULATE_GRAD is None and type(n).__name__ == "AccumulateGrad"}

    def node_of(t: torch.Tensor) -> Any:
        node = t.grad_fn if t.grad_fn is not None else accumulators.get(id(t))
        return node if node in parents else None

    return node_of


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
    node_of = node_lookup(parents)
    return [t for t in tensors if t.requires_grad and node_of(t) is not None]


def graph_root(y: Any) -> Any:
    """The node a backward from ``y`` starts with (``y``'s own AccumulateGrad for a leaf, the
    node of a ``GradientEdge``)."""
    if isinstance(y, GradientEdge):
        return y.node
    if y.grad_fn is not None:
        return y.grad_fn
    if y._is_view() and not has_own_flag(y):
        raise RuntimeError(
            "an output requires grad but has no gradient path: it is a view made where "
            "autograd recorded nothing (for example returned by checkpoint(..., "
            "use_reentrant=True) around a function without tensor inputs); PyTorch's own "
            "backward refuses it too. Compute it with autograd recording, or use "
            "use_reentrant=False"
        )
    return grad_node(y)


def topological(parents: Dict[Any, List[Any]]) -> List[Any]:
    """The nodes of a :func:`walk` with every node after all nodes that feed it.

    (Sorting by sequence number would do within one thread, but sequence numbers are per
    thread, and a forward may run partly in another thread.)
    """
    waiting = {node: len(feeders) for node, feeders in parents.items()}
    ready = [node for node, count in waiting.items() if count == 0]
    order = []
    while ready:
        node = ready.pop()
        order.append(node)
        for child, _ in node.next_functions:
            if child is not None:
                waiting[child] -= 1
                if waiting[child] == 0:
                    ready.append(child)
    return order


def reentrant_checkpoints(parents: Dict[Any, List[Any]]) -> List[Any]:
    """Nodes of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` in a walk."""
    from torch.utils.checkpoint import CheckpointFunction

    kind = CheckpointFunction._backward_cls
    return [node for node in parents if isinstance(node, kind)]


def pre_record_paths(
    parents: Dict[Any, List[Any]], inputs: List[torch.Tensor], since: List[int], base: int
) -> List[Tuple[int, List[str]]]:
    """Attached tensors whose gradient goes through operations done before their snapshot
    below operations recorded after it: ``(position in inputs, names of the older
    operations)``.

    A node's sequence number says when this thread created it, so a node numbered below a
    tensor's snapshot ``since`` predates the recording (or comes from another thread). For each
    node, ``low`` is the smallest number on any path from the outputs down to it and ``top``
    the largest. A tensor with ``low < since`` and ``top >= base`` (the recording's start)
    gets gradient through an older operation although the outputs were computed, at least in
    part, in the recording: MegEngine counts only the paths recorded entirely after the
    snapshot (treating older results as constants), so its gradient differs (it is None where
    every path goes through an older operation: ``r = w + 1`` before ``record()``, ``y = r * r``
    inside; or ``y = w * 2`` inside, then ``attach(w)``). One whose every path predates the
    recording (``top < base``: the whole forward ran before ``record()``, or in another
    thread) gets exactly what ``loss.backward()`` gives, and is not reported.
    """
    seq = {n: n._sequence_nr() for n in parents}
    never = float("inf")
    low: Dict[Any, float] = {}
    top: Dict[Any, float] = {}
    for node in topological(parents):
        feeders = parents[node]
        if feeders:
            low[node] = min(min(seq[p], low[p]) for p in feeders)
            top[node] = max(max(seq[p], top[p]) for p in feeders)
        else:
            low[node], top[node] = never, -never
    found = []
    node_of = node_lookup(parents)
    for i, (t, snapshot) in enumerate(zip(inputs, since)):
        node = node_of(t)
        if node is not None and low[node] < snapshot and top[node] >= base:
            found.append((i, _older_operations(parents, node, seq, snapshot)))
    return found


def _older_operations(parents: Dict[Any, List[Any]], target: Any, seq: Dict[Any, int],
                      snapshot: int) -> List[str]:
    """Names of the operations older than ``snapshot`` on paths from the outputs to ``target``."""
    names, seen, stack = [], {target}, [target]
    while stack:
        for feeder in parents[stack.pop()]:
            if feeder not in seen:
                seen.add(feeder)
                stack.append(feeder)
                if seq[feeder] < snapshot:
                    names.append(feeder.name())
    return names


def node_alive(node: Any) -> bool:
    """False for a custom Function's node freed with its output (its Python object lives on,
    and the engine would only say "does not require grad" for it)."""
    try:
        return node.next_functions is not None
    except RuntimeError:
        return False
