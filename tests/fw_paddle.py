"""The op table (tests/frameworks.py) implemented with PaddlePaddle (dygraph, CPU).

``reference_grads`` uses ``paddle.grad`` on fresh leaves: that is what gradmgr must give on
Paddle tensors. Linear weights are the tests' ``(out, in)``, transposed for Paddle's
``F.linear`` (whose weight is ``[in, out]``).
"""

from __future__ import annotations

import numpy as np
from frameworks import Framework


class PaddleFramework(Framework):
    name = "paddle"
    can_freeze = True
    can_shard = False  # gradmgr shards no Paddle model yet: NotImplementedError

    def __init__(self, device: str = "cpu") -> None:
        import paddle
        import paddle.nn.functional as F

        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.paddle = paddle
        self.F = F
        self.place = paddle.CPUPlace() if device == "cpu" else paddle.CUDAPlace(0)

    @property
    def supports_cuda(self) -> bool:  # type: ignore[override]
        return bool(self.paddle.device.is_compiled_with_cuda())

    def freeze(self, t):
        t.stop_gradient = True

    def unfreeze(self, t):
        t.stop_gradient = False

    # tensors -------------------------------------------------------------
    def tensor(self, data, requires_grad=False, dtype="float32"):
        return self.paddle.to_tensor(np.asarray(data, dtype=dtype), place=self.place,
                                     stop_gradient=not requires_grad)

    def parameter(self, data):
        return self.tensor(np.asarray(data, dtype="float32"), requires_grad=True)

    def numpy(self, t):
        return np.array(t.numpy(), copy=True)

    def take_grad(self, t):
        return t.grad.clone()

    def detach(self, t):
        return t.detach()

    def ones_like(self, t):
        return self.paddle.ones_like(t)

    def zeros_like(self, t):
        return self.paddle.zeros_like(t)

    # ops -----------------------------------------------------------------
    def matmul(self, a, b):
        return self.paddle.matmul(a, b)

    def relu(self, x):
        return self.F.relu(x)

    def exp(self, x):
        return self.paddle.exp(x)

    def sin(self, x):
        return self.paddle.sin(x)

    def cos(self, x):
        return self.paddle.cos(x)

    def sum(self, x):
        return self.paddle.sum(x)

    def mean(self, x):
        return self.paddle.mean(x)

    def where(self, cond, a, b):
        return self.paddle.where(cond, a, b)

    def greater(self, a, b):
        return a > b

    def linear(self, x, w, b):
        return self.F.linear(x, w.T, b)  # Paddle's weight is [in, out]

    def conv2d(self, x, w, b, stride=1, padding=0):
        return self.F.conv2d(x, w, b, stride=stride, padding=padding)

    def batch_norm(self, x, weight, bias, eps=1e-5):
        channels = x.shape[1]
        mean = self.paddle.zeros([channels])
        var = self.paddle.ones([channels])
        return self.F.batch_norm(x, mean, var, weight, bias, training=True, epsilon=eps)

    def softmax_cross_entropy(self, logits, labels):
        return self.F.cross_entropy(logits, labels.astype("int64"))

    def flatten(self, x):
        return self.paddle.flatten(x, 1)

    def sgd(self):
        import paddle

        class SGD(paddle.optimizer.SGD):
            """Paddle's SGD, called as the other frameworks' are: ``SGD(params, lr=...)``."""

            def __init__(self, params, lr):
                super().__init__(learning_rate=lr, parameters=params)

        return SGD

    def reference_grads(self, fn, inputs):
        leaves = [self.paddle.to_tensor(x.numpy(), place=self.place, stop_gradient=False)
                  for x in inputs]
        grads = self.paddle.grad([fn(*leaves)], leaves, allow_unused=True)
        return [None if g is None else self.numpy(g) for g in grads]
