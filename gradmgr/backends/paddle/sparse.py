"""Sparse gradients on Paddle (``Embedding(sparse=True)``'s: rows and their values, a
``SelectedRows`` tensor), which have no ``clone()`` and no ``+``, and which ``assign``'s
backward misreads as dense (garbage sizes). Paddle's own engine handles them where they reach
a leaf through an embedding lookup of their rows: that is how they are copied, summed, and
run through the leaf's hooks here."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import paddle


def is_sparse(grad: Any) -> bool:
    return grad.is_selected_rows()


def through(leaf: Any, grad: Any) -> Tuple[List[Any], List[Any]]:
    """An output of ``leaf`` and its seed that give ``leaf``'s accumulation node ``grad``
    (the caller enables gradients, with ``leaf`` not frozen): ``assign``'s for a dense one,
    the lookup of its rows for a sparse one, whose backward makes it sparse again."""
    if not is_sparse(grad):
        return [paddle.assign(leaf)], [grad]
    rows = paddle.to_tensor(grad.rows(), dtype="int64")
    return [paddle.nn.functional.embedding(rows, leaf, sparse=True)], [_values(grad)]


def total(leaf: Any, grads: Sequence[Any]) -> Any:
    """The sum of ``leaf``'s gradients ``grads`` as Paddle's engine sums them at ``leaf``
    (sparse ones with the same rows merged, in its order; dense if one is dense), a new
    tensor: one ``paddle.grad``, which runs no hook of ``leaf``'s."""
    frozen = leaf.stop_gradient
    leaf.stop_gradient = False
    try:
        with paddle.set_grad_enabled(True):
            outs, seeds = [], []
            for grad in grads:
                out, seed = through(leaf, grad)
                outs += out
                seeds += seed
            return paddle.grad(outs, [leaf], seeds)[0]
    finally:
        leaf.stop_gradient = frozen


def _values(grad: Any) -> Any:
    """A copy of a sparse gradient's values (a dense tensor, one row per entry of its rows)."""
    with paddle.no_grad():
        return grad._get_tensor_from_selected_rows().clone()
