"""PaddlePaddle backend: gradmgr on Paddle's dygraph autodiff (``paddle.grad``).

Each backward runs ``paddle.grad(ys, attached, grad_outputs=dys, allow_unused=True)``, which
leaves every ``.grad`` alone, so only attached tensors get one; the gradients then go through the
callbacks in the order Paddle's engine finishes them. What Paddle cannot do under GradManager
semantics raises a clear error (docs/paddle.md lists each).

The modules: :mod:`.backend` (:class:`PaddleBackend`, what the core talks to), :mod:`.tape`
(:class:`PaddleTape`), :mod:`.flags` (the ``stop_gradient`` flags a recording lifts), :mod:`.order`
(the order in which the engine finishes the gradients), :mod:`.split` (split backward).

Example:
    >>> import paddle
    >>> from gradmgr import GradManager
    >>> w = paddle.to_tensor([1.0, 2.0], stop_gradient=False)
    >>> gm = GradManager().attach(w)
    >>> with gm:
    ...     gm.backward((w * w).sum())
    >>> w.grad.numpy().tolist()
    [2.0, 4.0]
"""

from __future__ import annotations

from .backend import PaddleBackend
from .tape import PaddleTape

__all__ = ["PaddleBackend", "PaddleTape"]
