"""PaddleBackend: the PaddlePaddle adapter that the core talks to."""

from __future__ import annotations

import threading
from typing import Any, Optional

import paddle

from gradmgr.backend import Backend, Capabilities, Tape
from gradmgr.errors import AttachError

from . import sparse
from .tape import PaddleTape, check_main_thread


class PaddleBackend(Backend):
    """Adapter for ``paddle.Tensor`` (parameters included), in dygraph mode."""

    name = "paddle"
    tensor_modules = ("paddle",)
    capabilities = Capabilities(
        higher_order=False,  # .grad cannot hold a differentiable tensor (tape.py)
        cuda=False,  # not tried yet: the tests run Paddle's CPU wheel
        exact_pre_record_semantics=False,
        detects_pre_record=False,  # Paddle's graph nodes carry no order: docs/paddle.md
        requires_grad_flag=True,  # stop_gradient, lifted while recording (flags.py)
        threads=False,
        backward_in_callback=True,  # callbacks run after the engine (order.py)
        split_backward=True,  # the shared part of the graph runs twice (split.py)
    )

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, paddle.Tensor)

    def check_attachable(self, tensor: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            check_main_thread("attach a Paddle tensor")  # raises: not the main thread
        if not paddle.is_floating_point(tensor):
            raise AttachError(
                f"only floating-point tensors can be attached to get gradients; got a "
                f"paddle tensor of dtype {_dtype(tensor)} and shape {self.shape(tensor)} "
                f"(cast it with .astype('float32') first)"
            )

    def shape(self, tensor: Any) -> tuple:
        return tuple(int(d) for d in tensor.shape)

    def ones_like(self, tensor: Any) -> Any:
        return paddle.ones_like(tensor)

    def accumulate(self, tensor: Any, grad: Any) -> None:
        # Paddle copies what is assigned to a leaf's .grad; a non-leaf's gradient (set by
        # _copy_gradient_from) would share ``grad``'s memory, so it gets a copy.
        old = tensor.grad
        if old is not None and (sparse.is_sparse(old) or sparse.is_sparse(grad)):
            self.set_grad(tensor, sparse.total(tensor, [old, grad]))  # no ``+`` for them
        elif old is not None:
            self.set_grad(tensor, old + grad)
        else:
            self.set_grad(tensor, grad if tensor.is_leaf else grad.clone())

    def set_grad(self, tensor: Any, grad: Any) -> None:
        if tensor.is_leaf:
            tensor.grad = grad
        else:  # Paddle refuses ``.grad =`` on a non-leaf; this is its own copy for them
            tensor._copy_gradient_from(grad)

    def grad_problem(self, tensor: Any, grad: Any) -> Optional[str]:
        # ``+`` would broadcast a wrong shape and promote a wrong dtype silently.
        if (not isinstance(grad, paddle.Tensor) or grad.dtype != tensor.dtype
                or self.shape(grad) != self.shape(tensor) or grad.place != tensor.place):
            return f"got {self.describe(grad)}, but the tensor has {self.describe(tensor)}"
        return None

    def describe(self, tensor: Any) -> str:
        return f"shape {self.shape(tensor)}, dtype {_dtype(tensor)}, device {tensor.place}"

    def parity_adapter(self, model: Any) -> Any:
        from .parity import PaddleParity

        return PaddleParity(model)

    def new_tape(self) -> Tape:
        return PaddleTape()

    transport_names = ("paddle",)

    def prepare_rank(self, rank: int, world: int) -> None:
        from . import world as paddle_world

        paddle_world.install(rank, world)

    def tensor_ops(self) -> Any:
        from .ops import PADDLE_OPS

        return PADDLE_OPS

    def transport(self, group: Any = None, name: Optional[str] = None) -> Any:
        from . import transport

        return transport.make(group, name, self)


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).replace("paddle.", "")
