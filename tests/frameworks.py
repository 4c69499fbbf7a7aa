"""A thin per-framework op table, so one test program runs on every backend.

Each test receives a :class:`Framework` from the ``fw`` fixture (see conftest.py) and builds
tensors and programs only through it; gradients come back as numpy arrays for comparison.
The parity suite uses the same table to run one program on both frameworks.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np


class Framework:
    """The op table. Tensors are float32 unless a dtype is given."""

    name: str  # the gradmgr backend name
    supports_cuda = False
    can_freeze = False  # tensors have a requires_grad flag that freezes them
    can_shard = True  # gradmgr's sharded path (make_reduce_scatter_cb) takes its tensors

    def freeze(self, t: Any) -> None:
        raise NotImplementedError(f"{self.name} tensors cannot be frozen")

    def unfreeze(self, t: Any) -> None:
        raise NotImplementedError(f"{self.name} tensors cannot be frozen")

    # tensors -------------------------------------------------------------
    def tensor(self, data: Any, requires_grad: bool = False, dtype: str = "float32") -> Any:
        raise NotImplementedError

    def parameter(self, data: Any) -> Any:
        """A trainable leaf (torch: requires_grad=True; megengine: Parameter)."""
        raise NotImplementedError

    def int_tensor(self, data: Any) -> Any:
        return self.tensor(data, dtype="int32")

    def numpy(self, t: Any) -> np.ndarray:
        raise NotImplementedError

    def grad(self, t: Any) -> Optional[np.ndarray]:
        """``t.grad`` as numpy, or None."""
        g = t.grad
        return None if g is None else self.numpy(g)

    def set_grad(self, t: Any, value: Optional[Any]) -> None:
        t.grad = value

    def take_grad(self, t: Any) -> Any:
        """``t.grad`` as a tensor that stays what it is when ``t.grad`` is reset later (Paddle's
        ``.grad`` is a view of the tensor's gradient, emptied by ``t.grad = None``)."""
        return t.grad

    def detach(self, t: Any) -> Any:
        raise NotImplementedError

    def ones_like(self, t: Any) -> Any:
        raise NotImplementedError

    def zeros_like(self, t: Any) -> Any:
        raise NotImplementedError

    # ops -----------------------------------------------------------------
    def matmul(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def relu(self, x: Any) -> Any:
        raise NotImplementedError

    def exp(self, x: Any) -> Any:
        raise NotImplementedError

    def sin(self, x: Any) -> Any:
        raise NotImplementedError

    def cos(self, x: Any) -> Any:
        raise NotImplementedError

    def sum(self, x: Any) -> Any:
        raise NotImplementedError

    def mean(self, x: Any) -> Any:
        raise NotImplementedError

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def greater(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def linear(self, x: Any, w: Any, b: Any) -> Any:
        """``x @ w.T + b`` with ``w`` of shape (out, in)."""
        raise NotImplementedError

    def conv2d(self, x: Any, w: Any, b: Any, stride: int = 1, padding: int = 0) -> Any:
        raise NotImplementedError

    def batch_norm(self, x: Any, weight: Any, bias: Any, eps: float = 1e-5) -> Any:
        """Training-mode batch norm over (N, H, W) per channel, no running stats."""
        raise NotImplementedError

    def softmax_cross_entropy(self, logits: Any, labels: Any) -> Any:
        """Mean cross-entropy of integer ``labels`` under ``softmax(logits)``."""
        raise NotImplementedError

    def flatten(self, x: Any) -> Any:
        raise NotImplementedError

    def sgd(self) -> Any:
        """The framework's own plain SGD optimizer class, called as
        ``sgd()(params_or_groups, lr=...)``."""
        raise NotImplementedError

    def reference_grads(self, fn, inputs: list) -> list:
        """Gradients of scalar ``fn(*inputs)`` with respect to ``inputs`` by the framework's
        own autodiff (the reference gradmgr is compared against), as numpy arrays."""
        raise NotImplementedError


class TorchFramework(Framework):
    name = "torch"
    can_freeze = True

    def freeze(self, t):
        t.requires_grad_(False)

    def unfreeze(self, t):
        t.requires_grad_(True)

    def __init__(self, device: str = "cpu") -> None:
        import torch

        self.torch = torch
        self.device = device

    def tensor(self, data, requires_grad=False, dtype="float32"):
        t = self.torch.as_tensor(np.asarray(data, dtype=dtype), device=self.device)
        return t.requires_grad_(requires_grad) if requires_grad else t

    def parameter(self, data):
        return self.torch.nn.Parameter(self.tensor(data))

    def numpy(self, t):
        return t.detach().cpu().numpy().copy()  # a view would change with later in-place adds

    def grad(self, t):
        g = t.grad if t.is_leaf or t.retains_grad else _nonleaf_grad(t)
        return None if g is None else self.numpy(g)

    def detach(self, t):
        return t.detach()

    def ones_like(self, t):
        return self.torch.ones_like(t)

    def zeros_like(self, t):
        return self.torch.zeros_like(t)

    def matmul(self, a, b):
        return a @ b

    def relu(self, x):
        return self.torch.relu(x)

    def exp(self, x):
        return self.torch.exp(x)

    def sin(self, x):
        return self.torch.sin(x)

    def cos(self, x):
        return self.torch.cos(x)

    def sum(self, x):
        return x.sum()

    def mean(self, x):
        return x.mean()

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def greater(self, a, b):
        return a > b

    def linear(self, x, w, b):
        return self.torch.nn.functional.linear(x, w, b)

    def conv2d(self, x, w, b, stride=1, padding=0):
        return self.torch.nn.functional.conv2d(x, w, b, stride=stride, padding=padding)

    def batch_norm(self, x, weight, bias, eps=1e-5):
        return self.torch.nn.functional.batch_norm(x, None, None, weight, bias, True, 0.1, eps)

    def softmax_cross_entropy(self, logits, labels):
        return self.torch.nn.functional.cross_entropy(logits, labels.long())

    def flatten(self, x):
        return x.flatten(1)

    def sgd(self):
        return self.torch.optim.SGD

    def reference_grads(self, fn, inputs):
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        grads = self.torch.autograd.grad(fn(*leaves), leaves, allow_unused=True)
        return [None if g is None else self.numpy(g) for g in grads]


def _nonleaf_grad(t):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return t.grad


class FakeFramework(Framework):
    """The pure-Python fake framework (``fake_backend``): vectors and scalars, elementwise
    ``*`` and ``+``, ``sin``, ``cos``, ``exp`` and ``sum``; Python floats (double precision)."""

    name = "fake"
    can_freeze = True

    def __init__(self) -> None:
        import fake_backend

        self.ops = fake_backend
        self.kind = fake_backend.register().backend_cls.tensor_type

    def tensor(self, data, requires_grad=False, dtype="float32"):
        values = np.asarray(data, dtype="float64")
        return self.kind(values.tolist() if values.ndim else float(values), dtype)

    def parameter(self, data):
        return self.tensor(data)

    def numpy(self, t):
        return np.asarray(t.data if t.shape else t.data[0], dtype="float64")

    def sin(self, x):
        return self.ops.sin(x)

    def cos(self, x):
        return self.ops.cos(x)

    def exp(self, x):
        return self.ops.exp(x)

    def sum(self, x):
        return self.ops.sum_(x)

    def freeze(self, t):
        t.requires_grad = False

    def unfreeze(self, t):
        t.requires_grad = True

    def sgd(self):
        from fake_distributed import FakeSGD

        return FakeSGD


def make_framework(name: str, device: str = "cpu") -> Framework:
    if name == "fake":
        return FakeFramework()
    if name == "torch":
        return TorchFramework(device)
    if name == "megengine":
        from fw_megengine import MegEngineFramework

        return MegEngineFramework(device)
    if name == "paddle":
        from fw_paddle import PaddleFramework

        return PaddleFramework(device)
    raise ValueError(name)
