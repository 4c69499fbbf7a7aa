"""The order in which Paddle's engine finishes gradients, from its graph.

``paddle.grad`` returns every gradient at once (hooks on leaf tensors do not run under it), so
the tape runs the callbacks after the engine, in the order the engine made the gradients final:
a tensor's gradient is final when the node that produced it (a leaf's accumulation node) has
received the gradients of all its consumers, which is its place in a topological order of the
backward graph from the outputs.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Dict, List, Sequence


def _key(node: Any) -> int:
    return int(node.node_ptr())


def ready_order(ys: Sequence[Any], tensors: Sequence[Any]) -> List[int]:
    """Indices of ``tensors`` in the order a backward from ``ys`` makes their gradients final
    (ties, and tensors outside the graph, in their given order)."""
    roots = [y.grad_fn for y in ys if y.grad_fn is not None]
    nodes: Dict[int, Any] = {}
    parents: Dict[int, int] = {}
    stack = list(roots)
    for root in roots:
        nodes[_key(root)] = root
    while stack:  # count each node's consumers inside the graph
        node = stack.pop()
        for child in node.next_functions:
            if child is None:
                continue
            key = _key(child)
            parents[key] = parents.get(key, 0) + 1
            if key not in nodes:
                nodes[key] = child
                stack.append(child)
    position: Dict[int, int] = {}
    queue = deque(node for node in roots if parents.get(_key(node), 0) == 0)
    while queue:  # Kahn's order: a node runs once all its consumers have run
        node = queue.popleft()
        key = _key(node)
        if key in position:
            continue
        position[key] = len(position)
        for child in node.next_functions:
            if child is None:
                continue
            ckey = _key(child)
            parents[ckey] -= 1
            if parents[ckey] == 0:
                queue.append(child)
    last = len(position)

    def place(index: int) -> tuple:
        node = tensors[index].grad_fn
        return (last if node is None else position.get(_key(node), last), index)

    return sorted(range(len(tensors)), key=place)
