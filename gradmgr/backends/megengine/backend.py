"""MegEngineBackend: the MegEngine adapter that the core talks to."""

from __future__ import annotations

import threading
from typing import Any, ContextManager, Dict, Optional

import megengine
import megengine.functional as F
import numpy as np
from megengine.core.tensor.dtype import is_differentible_dtype
from megengine.jit.tracing import is_tracing

from gradmgr.backend import Backend, Capabilities, Tape
from gradmgr.errors import AttachError

from . import compat
from .tape import MegEngineTape, check_can_record

_ONE_ELEMENT = ((), (1,))


class MegEngineBackend(Backend):
    """Adapter for ``megengine.Tensor`` (``megengine.Parameter`` included)."""

    name = "megengine"
    tensor_modules = ("megengine",)
    capabilities = Capabilities(
        higher_order=True,
        cuda=True,
        exact_pre_record_semantics=True,
        requires_grad_flag=False,
        threads=False,  # MegEngine 1.13 works only in the main thread
        backward_in_callback=False,  # its engine cannot record while a backward runs
    )

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, megengine.Tensor)

    def check_attachable(self, tensor: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            check_can_record("attach a MegEngine tensor")  # raises: not the main thread
        if not is_differentible_dtype(tensor.dtype):
            raise AttachError(
                f"only floating-point tensors can be attached to get gradients; got a "
                f"megengine tensor of dtype {tensor.dtype} and shape {tuple(tensor.shape)} "
                f"(cast it with .astype('float32') first)"
            )

    def shape(self, tensor: Any) -> tuple:
        return tuple(int(d) for d in tensor.shape)

    def ones_like(self, tensor: Any) -> Any:
        return F.ones_like(tensor)

    def seed_problem(self, y: Any, dy: Any) -> Optional[str]:
        # F.ones_like of a 0-d tensor has shape (1,) in MegEngine, and the native manager takes
        # that as the seed of a 0-d loss, so () and (1,) match each other. Other differences
        # would be broadcast by MegEngine's engine, which gives a silently scaled gradient.
        y_shape, dy_shape = self.shape(y), self.shape(dy)
        if y_shape == dy_shape or (y_shape in _ONE_ELEMENT and dy_shape in _ONE_ELEMENT):
            return None
        return f"has shape {dy_shape} but y has shape {y_shape}"

    def accumulate(self, tensor: Any, grad: Any) -> None:
        # As the native manager does. MegEngine tensors are values: ``+=`` rebinds .grad to a
        # new tensor, so a gradient shared with a callback or another tensor is never changed.
        if tensor.grad is None:
            tensor.grad = grad
        else:
            tensor.grad += grad

    def grad_problem(self, tensor: Any, grad: Any) -> Optional[str]:
        # MegEngine's += would broadcast a wrong shape and promote a wrong dtype silently. Its
        # engine gives a 0-d tensor a gradient of shape (1,) (and the native manager stores
        # it), so () and (1,) match each other, as for seeds.
        if grad.dtype != tensor.dtype or grad.device != tensor.device:
            return f"got {self.describe(grad)}, but the tensor has {self.describe(tensor)}"
        if is_tracing():
            return None  # shapes are symbolic under jit.trace; the traced program checks them
        grad_shape, shape = self.shape(grad), self.shape(tensor)
        if grad_shape == shape or (grad_shape in _ONE_ELEMENT and shape in _ONE_ELEMENT):
            return None
        return f"got {self.describe(grad)}, but the tensor has {self.describe(tensor)}"

    def describe(self, tensor: Any) -> str:
        return (f"shape {self.shape(tensor)}, dtype {np.dtype(tensor.dtype).name}, "
                f"device {tensor.device}")

    def new_tape(self) -> Tape:
        return MegEngineTape()

    tracks_backwarding = True

    def enter_backward(self, manager: Any) -> Any:
        return compat.enter_backward(manager)

    def exit_backward(self, token: Any) -> None:
        compat.exit_backward(token)

    def recording_group(self) -> ContextManager[None]:
        return compat.recording_group()

    # data parallelism (gradmgr.distributed.contract), imported on first use
    transport_names = ("megengine", "megengine-via-torch")

    def prepare_rank(self, rank: int, world: int) -> None:
        from . import world as gloo_world

        gloo_world.install(rank, world)

    def environment(self) -> Dict[str, str]:
        """The GPUs MegEngine sees (its collectives run on them, or on gloo via gradmgr)."""
        return {"megengine GPUs": str(megengine.device.get_device_count("gpu"))}

    def parity_adapter(self, model: Any) -> Any:
        from .parity import MegEngineParity

        return MegEngineParity(model)

    def tensor_ops(self) -> Any:
        from .ops import MEGENGINE_OPS

        return MEGENGINE_OPS

    def transport(self, group: Any = None, name: Optional[str] = None) -> Any:
        from . import transport

        return transport.make(group, name, self)
