"""Rank program part: habits that change what ``data_parallel(model)`` reduces, on a Paddle
model; run inside paddle_suite.py's spawn (no spawn of its own).

Ranks that disagree (only rank 0 wraps a micro-batch in ``no_sync``, only rank 1 freezes a
weight, ``loss.backward()`` typed inside ``with gm:`` on every rank or on rank 1), a sparse
gradient (``Embedding(sparse=True)``, its forward inside and before ``with gm:``), a weight
unfrozen on every rank after a step (frozen when ``data_parallel(model)`` ran), a layer
replaced on every rank after a step. Each keeps what every step raised and its ``.grad``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import paddle

from . import paddle_suite as suite

STEPS = 3


def _before(habit: str, model, step: int, rank: int) -> None:
    """What the habit changes before ``step``'s forward."""
    if habit == "one_freezes" and rank == 1:
        model[0].weight.stop_gradient = step == 1  # frozen at step 1 only, on rank 1 only
    if habit == "unfreeze" and step == 1:
        model[0].weight.stop_gradient = False  # on every rank
    if habit == "replaced" and step == 1:
        paddle.seed(10 + rank)  # as a new layer is: each rank's own initial weights
        model[2] = paddle.nn.Linear(8, 3)


def _step(habit: str, gm, model, step: int, rank: int, world: int) -> None:
    from gradmgr.distributed import no_sync

    x, y = suite.local(step, rank, world)
    alone = no_sync(gm) if habit == "no_sync_rank0" and rank == 0 and step == 0 else None
    with alone or contextlib.nullcontext(), gm:
        loss = suite.loss_of(model, x, y)
        typed = habit == "backward_every" or habit == "backward_rank1" and rank == 1
        if typed and step == 0:
            loss.backward()  # the habit: Paddle's own backward inside the recording
        else:
            gm.backward(loss)


def train(habit: str, rank: int, world: int) -> dict:
    """The habit on ``data_parallel(model)`` with SGD: what each step raised, its ``.grad``
    and the parameters after it (a step that raised is not applied)."""
    from gradmgr.distributed import data_parallel

    model = suite.net(rank)
    if habit == "unfreeze":
        model[0].weight.stop_gradient = True
    gm = data_parallel(model)
    opt = suite.optimizer("sgd", model)
    out: dict = {"errors": [], "grads": [], "params": []}
    for step in range(STEPS):
        _before(habit, model, step, rank)
        error = suite.error_of(lambda: _step(habit, gm, model, step, rank, world))  # noqa: B023
        out["errors"].append(error)
        out["grads"].append(suite.grads(model))
        if error is None:
            opt.step()
        opt.clear_grad(set_to_zero=False)
        out["params"].append(suite.values(model))
    if habit == "replaced":  # as the refusal says: a new manager, a new optimizer
        del gm
        gm, opt = data_parallel(model), suite.optimizer("sgd", model)
        out["rewrapped_error"] = suite.error_of(lambda: _step(habit, gm, model, STEPS, rank, world))
        out["rewrapped_grads"] = suite.grads(model)
        opt.step()
        out["rewrapped_params"] = suite.values(model)
    return out


def sparse(rank: int, world: int, forward_first: bool) -> dict:
    """An ``Embedding(10, 4, sparse=True)`` then a Linear: what the step raised and which
    ``.grad`` it left; then a dense step (the same lookup, ``sparse=False``): its gradients."""
    from gradmgr.distributed import data_parallel

    paddle.seed(rank)
    model = paddle.nn.Sequential(paddle.nn.Embedding(10, 4, sparse=True),
                                 paddle.nn.Linear(4, 1))
    gm = data_parallel(model)
    ids = paddle.to_tensor(np.array([[1, 3, 3]], dtype="int64"))

    def step() -> None:
        loss = model(ids).sum() if forward_first else None  # the forward before `with gm:`
        with gm:
            gm.backward(model(ids).sum() if loss is None else loss)

    out: dict = {"error": suite.error_of(step), "grads_after": suite.grads(model)}
    with gm:
        dense = paddle.nn.functional.embedding(ids + rank, model[0].weight)  # ranks' own rows
        gm.backward(model[1](dense).sum())
    out["grads"] = suite.grads(model)
    return out


def run(rank: int, world: int) -> dict:
    habits = ("no_sync_rank0", "one_freezes", "backward_every", "backward_rank1", "unfreeze",
              "replaced")
    out = {habit: train(habit, rank, world) for habit in habits}
    out["sparse"] = {"inside": sparse(rank, world, False), "before": sparse(rank, world, True)}
    return out
