"""The differential programs (diff_program.py) on Paddle: its op table, and one program run
through gradmgr and through ``paddle.grad`` with the callback chains applied by hand.

Both runs execute the same kernels on the same data, so the gradients must be bit-identical.
The reference lifts an attached value's ``stop_gradient`` flag where gradmgr does (an attached
input, or a value computed from constants only), right after it is made.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
from diff_interp import Engine, build, make_leaves
from diff_program import Callback, Program

from gradmgr import Future, GradManager


class PaddleEngine(Engine):
    name = "paddle"

    def __init__(self) -> None:
        import paddle
        import paddle.nn.functional as F

        self.paddle = paddle
        self.F = F

    def leaf(self, data, leaf, requires_grad):
        return self.paddle.to_tensor(np.array(data, copy=True), stop_gradient=not requires_grad)

    def tensor(self, data):
        return self.paddle.to_tensor(np.asarray(data))

    def apply(self, op, args):
        paddle, F, name, p = self.paddle, self.F, op.name, op.params
        x = args[0]
        unary = {"neg": lambda t: -t, "exp": paddle.exp, "sin": paddle.sin,
                 "tanh": paddle.tanh, "sigmoid": F.sigmoid, "relu": F.relu}
        if name in unary:
            return unary[name](x)
        arithmetic = {"square": lambda: x * x, "scale": lambda: x * p[0],
                      "shift": lambda: x + p[0], "add": lambda: x + args[1],
                      "sub": lambda: x - args[1], "mul": lambda: x * args[1],
                      "div": lambda: x / (args[1] * args[1] + 1)}
        if name in arithmetic:
            return arithmetic[name]()
        if name == "matmul":
            return paddle.matmul(x, args[1])
        if name in ("sum_all", "mean_all"):
            return paddle.sum(x) if name == "sum_all" else paddle.mean(x)
        if name in ("sum_axis", "mean_axis"):
            reduce = paddle.sum if name == "sum_axis" else paddle.mean
            return reduce(x, axis=p[0], keepdim=p[1])
        if name == "reshape":
            return paddle.reshape(x, list(p[0]))
        if name == "transpose":
            perm = list(range(x.ndim))
            perm[p[0]], perm[p[1]] = perm[p[1]], perm[p[0]]
            return paddle.transpose(x, perm)
        if name == "slice":
            axis, start, stop, step = p
            return x[(slice(None),) * axis + (slice(start, stop, step),)]
        if name == "expand":
            return paddle.broadcast_to(x, list(p[0]))
        raise ValueError(f"op {name} is not in the Paddle table")

    def reduce(self, kind, t):
        return self.paddle.sum(t) if kind == "sum" else self.paddle.mean(t)

    def ones_like(self, t):
        return self.paddle.ones_like(t)

    def numpy(self, t):
        return np.array(t.numpy(), copy=True)

    def zeros_like(self, t):
        return self.paddle.zeros_like(t)


# ------------------------------------------------------------------ callbacks
def _now(link: Callback, g: Any) -> Any:
    if link.kind == "identity":
        return g
    if link.kind == "scale":
        return g * link.c
    if link.kind == "future_resolved":
        return Future.resolved(g * link.c)
    if link.kind == "future_lazy":
        return Future(lambda: g * link.c)
    raise ValueError(link.kind)


def _callback(link: Callback):
    def callback(tensor: Any, grad: Any) -> Any:
        if isinstance(grad, Future):  # a Future from the link before: stay lazy
            return Future(lambda: _value(_now(link, grad.get())))
        return _now(link, grad)

    return callback


def _value(g: Any) -> Any:
    return g.get() if isinstance(g, Future) else g


def by_hand(chain, grad: Any) -> Any:
    """What the chain makes of ``grad``: the same multiplications, in the same order."""
    for link in chain:
        grad = _value(_now(link, grad))
    return grad


# ------------------------------------------------------------------ the two runs
def run_gradmgr(program: Program, eng: PaddleEngine) -> Dict[str, Any]:
    leaves = make_leaves(program, eng, reference=False)
    gm = GradManager()
    attached = program.attached()
    values: Dict[int, Any] = {}

    def attach(vid: int, t: Any) -> None:
        values[vid] = t
        gm.attach(t, callbacks=[_callback(link) for link in program.chain(vid)])

    for vid in attached:
        if vid < program.n_leaves and not program.leaves[vid].late:
            attach(vid, leaves[vid])
    with gm:
        built = build(program, eng, leaves, on_attach=attach)
        gm.backward(built.y, built.dy)
    return {"grads": {v: values[v].grad for v in attached},
            "others": [leaves[v].grad for v in range(program.n_leaves) if v not in attached],
            "flags": [leaves[v].stop_gradient for v in range(program.n_leaves)]}


def run_reference(program: Program, eng: PaddleEngine) -> Dict[int, Optional[np.ndarray]]:
    leaves = make_leaves(program, eng, reference=True)
    attached = program.attached()

    def lift(vid: int, t: Any) -> None:
        t.stop_gradient = False  # what attaching does (leaves already have it)

    built = build(program, eng, leaves, on_attach=lift)
    values = built.values
    pairs = [(y, dy) for y, dy in zip(built.ys, built.dys) if not y.stop_gradient]
    grads: List[Optional[Any]] = [None] * len(attached)
    if pairs:
        grads = eng.paddle.grad([y for y, _ in pairs], [values[v] for v in attached],
                                grad_outputs=[dy for _, dy in pairs], allow_unused=True)
    return {v: None if g is None else eng.numpy(by_hand(program.chain(v), g))
            for v, g in zip(attached, grads)}
