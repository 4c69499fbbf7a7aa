"""What a delegated backward (``TorchTape.backward_accumulating``) delivers itself.

While a backward is delegated (torch's C++ reducer takes the planned parameters), the engine
accumulates into ``.grad`` as a plain ``loss.backward()`` does, with no tape hook on any
tensor. The attached tensors the delegate does not take still get their gradient as in any
backward: a non-leaf (an activation attached for its own gradient) at its snapshot edge, and
a tensor with callbacks of its own (an input with a hook-like callback) through them, as each
gradient is ready. Each is fed to its sink from a pre-hook of its node, made for this backward
alone; the manager's delivery then accumulates what the sinks got, as after any backward. A
pre-hook runs after the tensor's own hooks, where the tape's hook would have run.

A node's pre-hook runs in every backward that runs the node, also one another thread starts
through the same graph meanwhile (``torch.autograd.grad`` of another output, with
``retain_graph=True``): it delivers only in this backward's graph task (``ours``), as the
tape's tensor hooks do; elsewhere it leaves the gradient to that backward.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Collection, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import get_gradient_edge

from .refusals import run_callbacks
from .watched import Entry


def delivery_hooks(entries: Sequence[Entry], inputs: Sequence[torch.Tensor],
                   taken: Optional[Collection[int]],
                   ours: Callable[[], bool]) -> List[Tuple[Any, str, Any]]:
    """``(node, "register_prehook", fn)`` for each tensor of ``inputs`` that this backward
    delivers: a non-leaf, and, where the delegate says what it takes (``taken``: ids), an
    eager tensor (with callbacks) it does not. ``ours()``: whether the engine runs this
    backward's graph task now."""
    hooks = []
    for entry, tensor in zip(entries, inputs):
        if entry.edge is not None:
            edge, leaf = entry.edge, False
        elif taken is not None and entry.eager and id(tensor) not in taken:
            edge, leaf = get_gradient_edge(tensor), True
        else:
            continue
        deliver = functools.partial(_deliver, ours, entry.sink, edge.output_nr, leaf)
        hooks.append((edge.node, "register_prehook", deliver))
    return hooks


def _deliver(ours: Callable[[], bool], sink: Any, output_nr: int, leaf: bool,
             grad_outputs: Sequence[Optional[torch.Tensor]]) -> Optional[tuple]:
    grad = grad_outputs[output_nr]
    if grad is None or not ours():  # (None: a custom Function gave it none, as if unused)
        return None
    run_callbacks(sink, grad)
    # A leaf's node is its gradient accumulator: handed no gradient, it adds nothing to
    # .grad, which the delivery writes with the callbacks' result instead.
    return (None,) if leaf else None


__all__: List[str] = ["delivery_hooks"]
