"""The op table (tests/frameworks.py) implemented with MegEngine.

``reference_grads`` uses MegEngine's native ``megengine.autodiff.GradManager``: that is the
behaviour gradmgr must reproduce on MegEngine tensors.
"""

from __future__ import annotations

import numpy as np
from frameworks import Framework

_DEVICES = {"cpu": "cpux", "cuda": "gpux"}


class MegEngineFramework(Framework):
    name = "megengine"

    def __init__(self, device: str = "cpu") -> None:
        import megengine
        import megengine.functional as F

        if device not in _DEVICES:
            raise ValueError(f"device must be one of {sorted(_DEVICES)}, got {device!r}")
        self.mge = megengine
        self.F = F
        self.device = _DEVICES[device]

    @property
    def supports_cuda(self) -> bool:  # type: ignore[override]
        return bool(self.mge.is_cuda_available())

    # tensors -------------------------------------------------------------
    def tensor(self, data, requires_grad=False, dtype="float32"):
        # MegEngine has no requires_grad flag: attaching is what makes a tensor differentiable.
        return self.mge.Tensor(np.asarray(data, dtype=dtype), device=self.device)

    def parameter(self, data):
        return self.mge.Parameter(np.asarray(data, dtype="float32"), device=self.device)

    def numpy(self, t):
        return t.numpy()

    def detach(self, t):
        return t.detach()

    def ones_like(self, t):
        return self.F.ones_like(t)

    def zeros_like(self, t):
        return self.F.zeros_like(t)

    # ops -----------------------------------------------------------------
    def matmul(self, a, b):
        return self.F.matmul(a, b)

    def relu(self, x):
        return self.F.relu(x)

    def exp(self, x):
        return self.F.exp(x)

    def sin(self, x):
        return self.F.sin(x)

    def cos(self, x):
        return self.F.cos(x)

    def sum(self, x):
        return self.F.sum(x)

    def mean(self, x):
        return self.F.mean(x)

    def where(self, cond, a, b):
        return self.F.where(cond, a, b)

    def greater(self, a, b):
        return a > b

    def linear(self, x, w, b):
        return self.F.linear(x, w, b)

    def conv2d(self, x, w, b, stride=1, padding=0):
        # MegEngine wants the bias broadcastable over NCHW: shape (1, C, 1, 1).
        bias = None if b is None else b.reshape(1, -1, 1, 1)
        return self.F.conv2d(x, w, bias, stride=stride, padding=padding)

    def batch_norm(self, x, weight, bias, eps=1e-5):
        shape = (1, -1, 1, 1)
        return self.F.batch_norm(
            x, None, None, weight.reshape(*shape), bias.reshape(*shape), training=True, eps=eps
        )

    def softmax_cross_entropy(self, logits, labels):
        return self.F.nn.cross_entropy(logits, labels.astype("int32"))

    def flatten(self, x):
        return self.F.flatten(x, 1)

    def sgd(self):
        import contextlib

        from megengine.optimizer import SGD

        mge, device = self.mge, self.device

        @contextlib.contextmanager
        def default_device():
            previous = mge.get_default_device()
            mge.set_default_device(device)
            try:
                yield
            finally:
                mge.set_default_device(previous)

        class SGDOnDevice(SGD):
            """MegEngine's SGD makes its state and its scalars (the learning rate) on the
            default device, and fails on parameters on another ("assertion `t.comp_node ==
            out_cn'"; the tensors here are on cpux): it is made and steps with theirs as the
            default."""

            def __init__(self, *args, **kwargs):
                with default_device():
                    super().__init__(*args, **kwargs)

            def step(self):
                with default_device():
                    return super().step()

        return SGDOnDevice

    def reference_grads(self, fn, inputs):
        from megengine.autodiff import GradManager

        leaves = [self.mge.Tensor(x.numpy(), device=x.device) for x in inputs]
        gm = GradManager().attach(leaves)
        with gm:
            gm.backward(fn(*leaves))
        return [None if x.grad is None else x.grad.numpy() for x in leaves]
