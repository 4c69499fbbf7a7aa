"""The order in which Paddle's engine finishes gradients, from its graph.

``paddle.grad`` returns every gradient at once (hooks on leaf tensors do not run under it), so
the tape runs the callbacks after the engine, in the order the engine made the gradients final:
a tensor's gradient is final when the node that produced it (a leaf's accumulation node) has
received the gradients of all its consumers, which is its place in a topological order of the
backward graph from the outputs.

The graph is read once: each ``next_functions`` and ``node_ptr()`` call builds Python objects
(at 1,000 tensors they were most of this module's time), so the order is computed on the nodes'
keys alone.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Dict, List, Sequence


def _key(node: Any) -> int:
    return int(node.node_ptr())


def _consumers(roots: List[Any]) -> tuple:
    """Each node's children's keys (an edge each, ``None`` skipped), and how many edges inside
    the graph reach each node, by key."""
    children: Dict[int, List[int]] = {}
    parents: Dict[int, int] = {}
    # once per node: outputs of one operation share its node, whose edges count once
    stack = list({_key(root): root for root in roots}.items())
    seen = {key for key, _ in stack}
    while stack:
        key, node = stack.pop()
        kids = children[key] = []
        for child in node.next_functions:
            if child is None:
                continue
            ckey = _key(child)
            kids.append(ckey)
            parents[ckey] = parents.get(ckey, 0) + 1
            if ckey not in seen:
                seen.add(ckey)
                stack.append((ckey, child))
    return children, parents


def ready_order(ys: Sequence[Any], tensors: Sequence[Any]) -> List[int]:
    """Indices of ``tensors`` in the order a backward from ``ys`` makes their gradients final
    (ties, and tensors outside the graph, in their given order)."""
    roots = [y.grad_fn for y in ys if y.grad_fn is not None]
    children, parents = _consumers(roots)
    position: Dict[int, int] = {}
    queue = deque(key for key in map(_key, roots) if parents.get(key, 0) == 0)
    while queue:  # Kahn's order: a node runs once all its consumers have run
        key = queue.popleft()
        if key in position:
            continue
        position[key] = len(position)
        for ckey in children[key]:
            parents[ckey] -= 1
            if parents[ckey] == 0:
                queue.append(ckey)
    last = len(position)

    def place(index: int) -> tuple:
        node = tensors[index].grad_fn
        return (last if node is None else position.get(_key(node), last), index)

    return sorted(range(len(tensors)), key=place)
