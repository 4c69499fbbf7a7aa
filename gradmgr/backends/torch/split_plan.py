"""Planning a split backward (used by :mod:`.split`): one walk of the graph cuts it into a first
part, which computes the chosen tensors' gradients, and the rest's independent engine runs."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge

from .graph import graph_root, node_alive, node_lookup, walk


class SplitPlan:
    """How to cut one backward into a first part (the ``now`` tensors) and the rest.

    The first part runs the engine with ``inputs=now`` from the outputs that reach them
    (``first_outputs``): it executes the nodes on paths from those outputs to the ``now``
    tensors (``first_nodes``). The rest continues from the *boundary*: the nodes of the first
    part that also feed nodes only the rest needs (their incoming gradients are captured during
    the first part, and they run again in the rest, computing only the outputs the rest needs),
    and outputs the first part does not reach. The rest's tensors fall into independent groups
    (connected through the nodes only they need); each group is one engine run, so no run
    recomputes what another needs.

    Attributes:
        now: tensors the first part computes: the chosen ones, and others whose gradient only
            the first part can give (on a path to a chosen tensor, or below a chosen
            intermediate, where the first part stops).
        first_outputs: positions of the outputs the first part starts from.
        groups: ``(boundary nodes, root outputs, tensors)`` per engine run of the rest.
        first_nodes: the nodes the first part executes.
        holders: what keeps custom-Function boundary nodes alive once the outputs are
            dropped, where this torch holds them weakly (see :func:`weak_node_holders`).
    """

    __slots__ = ("now", "first_outputs", "groups", "first_nodes", "holders")

    def __init__(self, now: List[Any], first_outputs: List[int],
                 groups: List[Tuple[List[Any], List[int], List[Any]]], first_nodes: set,
                 holders: Sequence[Any] = ()) -> None:
        self.now, self.first_outputs = now, first_outputs
        self.groups, self.first_nodes = groups, first_nodes
        self.holders = holders

    @property
    def boundary(self) -> List[Any]:
        return [node for nodes, _, _ in self.groups for node in nodes]


def _upward(parents: Dict[Any, List[Any]], starts: Iterable[Any]) -> set:
    """``starts`` and every node on a path from the roots to them."""
    seen = set()
    stack = [node for node in starts if node in parents]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(parents[node])
    return seen


def _below(starts: Iterable[Any]) -> set:
    """Every node reachable from ``starts`` (not the starts themselves, unless reached)."""
    seen: set = set()
    stack = [child for node in starts for child, _ in node.next_functions if child is not None]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(child for child, _ in node.next_functions if child is not None)
    return seen


def split_plan(outputs: Sequence[torch.Tensor], now: Sequence[torch.Tensor],
               rest: Sequence[torch.Tensor], snapshots: Optional[Dict[int, Any]] = None
               ) -> SplitPlan:
    """One walk of the graph from ``outputs``; see :class:`SplitPlan`. ``snapshots``: the node
    whose gradient an attached non-leaf takes (its grad_fn when attached), by ``id``."""
    roots = [graph_root(y) for y in outputs]
    parents = walk(roots)
    node_of = _node_finder(parents, snapshots)
    now_nodes = [node for node in map(node_of, now) if node is not None]
    first, moved, later = _first_part(parents, now_nodes, rest, node_of, bool(snapshots))
    groups = _rest_groups(parents, first, roots, later)
    first_outputs = [i for i, root in enumerate(roots) if root in first]
    holders = weak_node_holders([n for g in groups for n in g[0]], parents, roots, outputs)
    return SplitPlan([*now, *moved], first_outputs, groups, first, holders)


def _node_finder(parents: Dict[Any, List[Any]], snapshots: Optional[Dict[int, Any]]
                 ) -> Callable[[torch.Tensor], Any]:
    """A tensor's node in this graph (None if not in it); an attached non-leaf's is its
    snapshot, where it has one."""
    lookup = node_lookup(parents)
    if not snapshots:
        return lookup

    def node_of(t: torch.Tensor) -> Any:
        node = snapshots.get(id(t))
        return lookup(t) if node is None else node if node in parents else None
    return node_of


def _first_part(parents: Dict[Any, List[Any]], now_nodes: List[Any], rest: Sequence[Any],
                node_of: Callable[[Any], Any], stops_at_intermediates: bool
                ) -> Tuple[set, List[Any], List[Tuple[Any, Any]]]:
    """The first part's nodes, the ``rest`` tensors it must compute too, and the other ``rest``
    tensors in the graph with their nodes."""
    first = _upward(parents, now_nodes)
    # At a chosen intermediate with no chosen tensor below it the first part takes the
    # gradient and stops (the engine captures there without running the node): tensors below
    # it get their gradient in the first part too, or no part would run that node for them.
    below = _below(n for n in now_nodes if n.next_functions and not any(
        child in first for child, _ in n.next_functions)) if stops_at_intermediates else ()
    moved: List[Tuple[Any, Any]] = []
    later: List[Tuple[Any, Any]] = []
    for t in rest:
        node = node_of(t)
        if node is not None:
            (moved if node in first or node in below else later).append((t, node))
    if below and any(node in below for _, node in moved):
        first = _upward(parents, [*now_nodes, *(node for _, node in moved)])
        still: List[Tuple[Any, Any]] = []
        for t, node in later:
            (moved if node in first else still).append((t, node))
        later = still
    return first, [t for t, _ in moved], later


def _climbs(parents: Dict[Any, List[Any]], first: set, later: List[Tuple[Any, Any]]
            ) -> Tuple[Dict[Any, int], Dict[Any, int], Callable[[int], int]]:
    """Climb from each later tensor's node through the nodes only the rest needs, stopping at
    first-part nodes (the boundary). Climbs that meet, at a node or at a boundary node, are
    one group: union-find over the climbs. Returns the climb of each rest-only node, the climb
    of each boundary node, and ``find`` (a climb's group)."""
    leader: List[int] = []

    def find(i: int) -> int:
        while leader[i] != i:
            leader[i] = leader[leader[i]]
            i = leader[i]
        return i

    label: Dict[Any, int] = {}
    boundary: Dict[Any, int] = {}
    for _, start in later:
        if start in label:
            continue
        climb = len(leader)
        leader.append(climb)
        stack = [start]
        while stack:
            node = stack.pop()
            met = boundary.setdefault(node, climb) if node in first else label.get(node)
            if met is None:
                label[node] = climb
                stack.extend(parents[node])
            elif met != climb:
                leader[find(met)] = find(climb)
    return label, boundary, find


def _rest_groups(parents: Dict[Any, List[Any]], first: set, roots: List[Any],
                 later: List[Tuple[Any, Any]]) -> List[Tuple[List[Any], List[int], List[Any]]]:
    """``SplitPlan.groups``: the rest's independent engine runs, latest operations first."""
    label, boundary, find = _climbs(parents, first, later)
    groups: Dict[int, Tuple[List[Any], List[int], List[Any]]] = {}

    def group(climb: int) -> Tuple[List[Any], List[int], List[Any]]:
        return groups.setdefault(find(climb), ([], [], []))

    for node, climb in boundary.items():
        group(climb)[0].append(node)
    for i, root in enumerate(roots):
        if root in label:
            group(label[root])[1].append(i)
    for t, node in later:
        group(label[node])[2].append(t)
    return sorted(groups.values(), key=lambda g: -max(
        [n._sequence_nr() for n in g[0]] + [roots[i]._sequence_nr() for i in g[1]], default=0))


_PY_NODE = torch._C._FunctionBase  # the grad_fn of a custom torch.autograd.Function's output


@functools.cache
def python_nodes_held_weakly() -> bool:
    """Whether a custom Function's node dies with its output although its Python ``grad_fn``
    object is still held. torch 2.8 does that (the Python object points to the C++ node
    through a weak pointer, and only the output and the nodes above own it); torch 2.13 keeps
    the node alive for as long as its Python object lives."""

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g

    with torch.enable_grad():
        node = Probe.apply(torch.zeros((), requires_grad=True)).grad_fn  # output dropped
    return node is None or not node_alive(node)


def weak_node_holders(nodes: Sequence[Any], parents: Dict[Any, List[Any]], roots: List[Any],
                      outputs: Sequence[torch.Tensor]) -> List[Any]:
    """Objects that keep the custom-Function nodes among ``nodes`` alive after the outputs
    are dropped, on a torch that holds them weakly (:func:`python_nodes_held_weakly`); else
    nothing. For each such node: the nearest C++ node above it (a C++ node's Python object
    owns it, and it owns the nodes it feeds), or, for an output's own node, the node of a
    view of that output made now (it owns no activation)."""
    weak = [node for node in nodes if isinstance(node, _PY_NODE)]
    if not weak or not python_nodes_held_weakly():
        return []
    output_of = {root: i for i, root in enumerate(roots)}
    return [_nearest_owner(node, parents, output_of, outputs) for node in weak]


def _nearest_owner(node: Any, parents: Dict[Any, List[Any]], output_of: Dict[Any, int],
                   outputs: Sequence[torch.Tensor]) -> Any:
    """A strong owner of ``node``: breadth first up the graph through custom-Function nodes
    (held weakly themselves), so that as few first-part nodes as possible stay alive."""
    queue, seen = [node], {node}
    while queue:
        current = queue.pop(0)
        if current in output_of:
            y = outputs[output_of[current]]
            if isinstance(y, GradientEdge):
                return y.node  # what the caller's edge holds is all there is
            with torch.enable_grad():
                return y.view_as(y).grad_fn
        for parent in parents[current]:
            if not isinstance(parent, _PY_NODE):
                return parent
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return None  # unreachable: every node of a walk is an output's node or below one
