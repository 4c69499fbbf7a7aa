"""What the torch tape refuses, each with a message that says what to do: a gradient callback
that changed its gradient in place, an output that cannot start a backward, reentrant
checkpointing, attached non-leaves whose gradient PyTorch cannot give exactly, an in-place
operation on an input the manager made require grad."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge

from gradmgr.backend import GradSink
from gradmgr.errors import CallbackResultError, UnsupportedGraphError

from .graph import node_alive
from .watched import Entry

LEAF_IN_PLACE = "a leaf Variable that requires grad is being used in an in-place operation"
INPUT_IN_PLACE = (
    "gradmgr: PyTorch refused an in-place operation on a leaf tensor that requires grad, inside "
    "the recording. This manager turned requires_grad on for {n} tensor(s) attached while it "
    "was off (inputs whose gradient it computes; shapes {shapes}) while it records; if the "
    "tensor changed in place is one of them, the flag is the manager's, not yours. Change the "
    "input before record() (or before attaching it), or write the operation out of place "
    "(x = x - 0.5) and compute with the result: the gradient then flows to the attached x"
)


def run_callbacks(sink: GradSink, grad: torch.Tensor) -> Any:
    """Feed a tensor's callback chain, refusing a chain that changed the gradient in place:
    the engine may still need that tensor for other gradients, and another attached tensor
    may have been given the same object (``a + b``), so theirs would change silently."""
    version = grad._version
    result = sink(grad)
    if grad._version != version:
        raise CallbackResultError(
            f"a gradient callback modified the gradient it was given in place (shape "
            f"{tuple(grad.shape)}; for example g *= 0.5 or g.mul_(...)): "
            "PyTorch may still need that tensor to compute other gradients, and another "
            "attached tensor may share it, so their gradients would change silently. Return "
            "a new tensor instead (g = g * 0.5), or modify a copy (g = g.clone())"
        )
    return result


def differentiable(y: Any) -> bool:
    """An output a backward starts from: a tensor that requires grad, or a gradient edge (the
    node of an output already dropped, as ``torch.autograd.graph.get_gradient_edge`` gives)."""
    if not isinstance(y, GradientEdge):
        return y.requires_grad
    if not node_alive(y.node):
        raise ValueError(
            f"the GradientEdge given as y points to a custom autograd.Function's node "
            f"({type(y.node).__name__}) that was freed with its output: this PyTorch "
            f"({torch.__version__}) keeps such a node alive only as long as the output "
            f"tensor. Keep the output until the backward, or pass the output itself"
        )
    return True


def refuse_reentrant_checkpoint(error: RuntimeError) -> None:
    """Re-raise an engine error; PyTorch's own refusal of reentrant checkpointing as
    UnsupportedGraphError, which says what to do."""
    if "use_reentrant=True" in str(error):
        raise UnsupportedGraphError(REENTRANT_CHECKPOINT) from error
    raise error


REENTRANT_CHECKPOINT = (
    "gradmgr: this backward goes through torch.utils.checkpoint.checkpoint(..., "
    "use_reentrant=True) (also what torch 2.x does when use_reentrant is not passed). "
    "Reentrant checkpointing runs an inner backward of its own that ignores which tensors are "
    "attached, and PyTorch refuses it whenever the engine is asked for specific inputs, as "
    "gradmgr always does; its parameters would get no gradient or a wrong one. Pass "
    "use_reentrant=False (PyTorch's recommended mode), which gradmgr differentiates exactly."
)


def check_non_leaves(inputs: Sequence[torch.Tensor], entries: Sequence[Entry]) -> None:
    """Refuse attached non-leaves whose gradient PyTorch cannot give exactly:

    - one that also has ``retain_grad()``: PyTorch would write its ``.grad`` and the manager
      would add its gradient again, doubling it;
    - a view changed in place since it was attached (itself, or the tensor it views: they
      share a version counter). PyTorch then rebuilds the base's history around the in-place
      operation, so the attached value's node misses every path through it: the gradient
      would be None or a part of the true one.
    """
    for tensor, entry in zip(inputs, entries):
        if entry.edge is None:
            continue
        if tensor.retains_grad:
            raise UnsupportedGraphError(
                f"gradmgr: an attached non-leaf tensor (shape {tuple(tensor.shape)}) also has "
                "retain_grad(): PyTorch would write its .grad and the GradManager would add "
                "the same gradient again, so .grad would hold it twice. Drop the "
                "retain_grad() call (the manager writes that .grad, after the tensor's "
                "attached callbacks), or do not attach the tensor"
            )
        if tensor._version != entry.version and tensor._is_view():
            raise UnsupportedGraphError(
                f"gradmgr: an attached tensor (shape {tuple(tensor.shape)}) is a view, and it "
                "or the tensor it views was changed in place after attach() (for example "
                "v.mul_(3), relu(inplace=True), or an assignment into the base). PyTorch then "
                "differentiates the in-place operation through the base, bypassing the "
                "attached value, so its gradient would be None or only part of it. Attach a "
                "tensor that is not a view (clone() it and compute with the clone), or "
                "write the in-place operation out of place (v = v * 3)"
            )
