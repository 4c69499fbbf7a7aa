"""TorchBackend: the PyTorch adapter (CPU and CUDA) that the core talks to."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
from torch.autograd.graph import GradientEdge

from gradmgr.backend import Backend, Capabilities, Tape
from gradmgr.errors import AttachError

from . import grads
from .compile import keep_dynamo_out
from .engine import own_seed
from .graph import reachable_leaves
from .tape import TorchTape

keep_dynamo_out()


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

    # no extra frame: the one call every backward(loss) makes (typed for torch's tensors)
    ones_like = staticmethod(own_seed)  # type: ignore[assignment]

    def is_output(self, obj: Any) -> bool:
        return isinstance(obj, (torch.Tensor, GradientEdge))

    def seed_problem(self, y: Any, dy: Any) -> Optional[str]:
        # The manager calls the engine directly (see engine.run_engine), so it checks what
        # torch.autograd.backward would: the engine itself casts dtypes and rejects devices
        # (and checks a GradientEdge's dy against its node's input).
        if isinstance(y, GradientEdge):
            return None
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

    # data parallelism (gradmgr.distributed.contract), imported on first use
    transport_names = ("torch",)

    def environment(self) -> Dict[str, str]:
        """torch.distributed's backends, and the CUDA devices torch sees."""
        import torch.distributed as dist

        found = {name: getattr(dist, f"is_{name}_available", lambda: False)()
                 for name in ("gloo", "nccl", "mpi")}
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        devices = f"{len(names)} ({', '.join(names)})" if names else "none"
        available = ", ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in found.items())
        return {"torch.distributed": available if dist.is_available() else "not built",
                "torch CUDA": f"built for {torch.version.cuda or 'none'}; devices: {devices}"}

    def parity_adapter(self, model: Any) -> Any:
        from .parity import TorchParity

        return TorchParity(model)

    def hold_rendezvous(self, world: int) -> Any:
        from .rendezvous import hold

        return hold(world)

    def tensor_ops(self) -> Any:
        from .ops import TORCH_OPS

        return TORCH_OPS

    def transport(self, group: Any = None, name: Optional[str] = None) -> Any:
        if name not in (None, "torch"):
            raise self.unknown_transport(name)
        from .transport import TorchTransport

        return TorchTransport(group)
