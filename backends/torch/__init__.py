"""PyTorch backend: GradManager semantics on top of PyTorch's autograd engine.

How the contract maps onto autograd:

* ``backward`` runs the engine with ``inputs=<attached tensors>`` (see :mod:`.engine`), so it
  only computes what attached tensors need and never touches ``.grad`` of anything else.
  Without callbacks or nesting the engine accumulates into ``.grad`` itself, like
  ``loss.backward()``; otherwise it returns the gradients (``None`` for unreached tensors, whose
  ``.grad`` stays ``None``) and the manager delivers them.
* A tensor with callbacks gets one tensor hook for the manager's whole life (not one per step):
  autograd fires it the moment that tensor's gradient is ready, and the hook feeds the callback
  chain while the engine goes on with earlier layers. Tensors without callbacks get no hook; their
  gradients are taken from the engine's result.
* Attaching a leaf with ``requires_grad=False`` (an input) turns the flag on while recording and
  restores it when the last manager recording it releases (:mod:`.flags`).
* Nesting: the backward is recorded (``create_graph``) only while a manager that started
  recording earlier is still recording; the graph is kept (``retain_graph``) while any other
  manager is recording.

What PyTorch cannot do exactly (see README "PyTorch notes"): autograd records operations on a
``requires_grad`` tensor whether or not a manager is recording, so gradient can flow through
operations done before ``record()`` (or before a mid-recording ``attach``). The backend detects
this from node sequence numbers and warns (:mod:`.prerecord`).

The modules: :mod:`.engine` (entering the engine), :mod:`.graph` (graph walks),
:mod:`.flags` (requires_grad and grad-mode bookkeeping), :mod:`.prerecord` (the pre-record
check), :mod:`.grads` (writing ``.grad``), :mod:`.split` (split backward), :mod:`.tape`
(:class:`TorchTape`); this module holds :class:`TorchBackend`.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

import torch

from gradmgr.backend import Backend, Capabilities, Tape
from gradmgr.errors import AttachError

from . import grads
from .graph import reachable_leaves
from .prerecord import PreRecordGradientWarning, set_pre_record_check
from .tape import TorchTape

__all__ = [
    "PreRecordGradientWarning",
    "TorchBackend",
    "TorchTape",
    "reachable_leaves",
    "set_pre_record_check",
]


class TorchBackend(Backend):
    """The PyTorch adapter (CPU and CUDA)."""

    name = "torch"
    tensor_modules = ("torch",)
    capabilities = Capabilities(
        higher_order=True,
        cuda=True,
        exact_pre_record_semantics=False,
        requires_grad_flag=True,
        threads=True,
        backward_in_callback=True,
        split_backward=True,
    )

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def check_attachable(self, tensor: Any) -> None:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            raise AttachError(
                f"only floating-point tensors can be attached to get gradients; got dtype "
                f"{tensor.dtype} and shape {tuple(tensor.shape)} (convert it with .float() first)"
            )

    def shape(self, tensor: Any) -> tuple:
        return tuple(tensor.shape)

    def ones_like(self, tensor: Any) -> Any:
        return torch.ones_like(tensor)

    def seed_problem(self, y: Any, dy: Any) -> Optional[str]:
        # The manager calls the engine directly (see engine.run_engine), so it checks what
        # torch.autograd.backward would: the engine itself casts dtypes and rejects devices.
        problem = super().seed_problem(y, dy)
        if problem is None and y.is_complex() != dy.is_complex():
            problem = (f"has dtype {dy.dtype} but y has dtype {y.dtype}: a complex y needs a "
                       "complex dy and a real y a real one")
        return problem

    accumulate = staticmethod(grads.accumulate)  # no extra frame: it counts references

    def set_grad(self, tensor: Any, grad: Any) -> None:
        grads.set_grad(tensor, grad)

    def grad_problem(self, tensor: Any, grad: Any) -> Optional[str]:
        return grads.grad_problem(tensor, grad)

    def describe(self, tensor: Any) -> str:
        return grads.describe(tensor)

    def new_tape(self) -> Tape:
        return TorchTape()

    def reachable(self, ys: Iterable[Any], tensors: Iterable[Any]) -> List[Any]:
        return reachable_leaves([y for y in ys if y.requires_grad], tensors)

    def device_of(self, tensor: Any) -> Optional[str]:
        return str(tensor.device)
