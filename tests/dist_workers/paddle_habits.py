"""Rank program part: rows of the habit table (docs/switching-from-ddp.md, "Habits, checked")
on a Paddle model, ``data_parallel(model)`` next to ``paddle.DataParallel`` on the same script
in the same processes; run inside paddle_suite.py's spawn (no spawn of its own).

Each habit trains :data:`STEPS` SGD steps on each rank's own rows (ranks seeded differently:
both sides broadcast rank 0's weights) and keeps every step's gradients and parameters.
Paddle's reference is ``paddle.DataParallel(find_unused_parameters=True)`` where a parameter
goes without a gradient (Paddle's reducer waits for it otherwise), and for the recomputed
layer (``fleet.utils.recompute``, ``use_reentrant=False``, and Paddle's default ``True``) the
same model without recomputation: Paddle's own reducer refuses a recomputed layer
(``PreconditionNotMet`` in ``RecomputeFunction``'s backward, seen with
find_unused_parameters True and False), and recomputing runs the same kernels again.
"""

from __future__ import annotations

import copy
import pickle

import paddle
from paddle.autograd import PyLayer

from . import paddle_suite as suite

STEPS = 3
HABITS = ("unused_layers", "tied", "function_none", "freeze_mid_training", "recompute",
          "recompute_reentrant", "parameter_hook")
# a parameter without a gradient at some step: find_unused_parameters=True
UNUSED = ("unused_layers", "function_none", "freeze_mid_training")


class _NoWeightGrad(PyLayer):
    """``x @ w`` whose backward gives ``w`` no gradient (None), ``x`` its own."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x @ w

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensor()
        return dy @ w.T, None


class HabitNet(paddle.nn.Layer):
    """fc1 (6 -> 8), tanh, fc2 (8 -> 3), fc3 (3 -> 3), as the habit uses them; for
    ``unused_layers`` fc4 (3 -> 3) too, used on rank 0 at step 0 only."""

    def __init__(self, seed: int, habit: str, rank: int, ours: bool) -> None:
        super().__init__()
        paddle.seed(seed)
        self.fc1, self.fc2 = paddle.nn.Linear(6, 8), paddle.nn.Linear(8, 3)
        self.fc3 = paddle.nn.Linear(3, 3)
        if habit == "unused_layers":
            self.fc4 = paddle.nn.Linear(3, 3)
        self.habit, self.rank, self.ours, self.step = habit, rank, ours, 0

    def forward(self, x):
        h = paddle.tanh(self.fc1(x))
        if self.habit == "function_none":  # fc2.weight: no gradient from the Function
            return self.fc3(_NoWeightGrad.apply(h, self.fc2.weight) + self.fc2.bias)
        if self.habit.startswith("recompute") and self.ours:
            from paddle.distributed.fleet.utils import recompute

            reentrant = self.habit == "recompute_reentrant"  # Paddle's default
            return self.fc3(recompute(self.fc2, h, use_reentrant=reentrant))
        out = self.fc3(self.fc2(h))
        if self.habit == "tied":  # fc3 a second time
            return out + self.fc3(out)
        if self.habit == "unused_layers" and self.rank == 0 and self.step == 0:
            return out + self.fc4(out)  # fc4 on rank 0 at step 0 only
        return out


def train(habit: str, rank: int, world: int, ours: bool) -> dict:
    """The habit on gradmgr (``ours``) or on ``paddle.DataParallel``: each step's gradients
    and parameters, and what gradmgr's step raised (the steps stop there)."""
    from gradmgr.distributed import data_parallel

    model = HabitNet(rank, habit, rank, ours)
    gm = data_parallel(model) if ours else None
    net = model if ours else paddle.DataParallel(model,
                                                 find_unused_parameters=habit in UNUSED)
    if habit == "parameter_hook":
        model.fc1.weight.register_hook(lambda grad: grad * 3)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    out: dict = {"params": [], "grads": [], "error": None, "fc2_weight": model.fc2.weight.name}
    for step in range(STEPS):
        model.step = step
        if habit == "freeze_mid_training" and step == 1:
            model.fc1.weight.stop_gradient = True  # on every rank
        loss = suite.loss_of(net, *suite.local(step, rank, world))
        if gm is None:
            loss.backward()
        else:
            try:
                with gm:
                    gm.backward(loss)
            except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
                out["error"] = f"{type(e).__name__}: {e}"
                break
        out["grads"].append(suite.grads(model))
        opt.step()
        opt.clear_grad()
        out["params"].append(suite.values(model))
    return out


def forgotten_with(rank: int, world: int) -> dict:
    """``with gm:`` forgotten: a plain ``loss.backward()`` after ``data_parallel(model)``.
    What each rank raised (or None) and the gradients it was left with; those of a
    ``copy.deepcopy`` and a pickled copy of the model after ``loss.backward()``; then what
    ``paddle.grad`` of a forward outside the recording raised (None) and the gradients of
    the next step inside ``with gm:``."""
    from gradmgr.distributed import data_parallel

    model = suite.net(rank)
    gm = data_parallel(model)
    out: dict = {"error": None, "grad_error": None}
    try:
        suite.loss_of(model, *suite.local(0, rank, world)).backward()
    except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
        out["error"] = f"{type(e).__name__}: {e}"
    out["grads"] = suite.grads(model)
    out["copies"] = []  # a copy of the model (an EMA's, a checkpoint's) trains unwatched
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        suite.loss_of(copied, *suite.local(0, rank, world)).backward()
        out["copies"].append(suite.grads(copied))
    try:  # this rank's gradients, as under paddle.DataParallel: no .grad written
        paddle.grad(suite.loss_of(model, *suite.local(0, rank, world)),
                    list(model.parameters()))
    except Exception as e:  # noqa: BLE001
        out["grad_error"] = f"{type(e).__name__}: {e}"
    model.clear_gradients(set_to_zero=False)
    with gm:
        gm.backward(suite.loss_of(model, *suite.local(0, rank, world)))
    out["step_grads"] = suite.grads(model)
    return out


def run(rank: int, world: int) -> dict:
    """Every habit, both sides, and the forgotten ``with gm:``."""
    out = {habit: {"ours": train(habit, rank, world, True),
                   "paddle": train(habit, rank, world, False)} for habit in HABITS}
    out["forgotten_with"] = forgotten_with(rank, world)
    return out


def skip_a_batch(rank: int, world: int, port: int, outdir: str) -> None:
    """A rank skips a batch before its forward (``continue``): rank 0 has a step more.
    After the loop every rank makes one allreduce; each rank pickles what it raised (None)
    and that allreduce's result to ``OUTDIR/rank{RANK}.pkl``; a rank that raised tries one
    step more (``again``: what it raised, and after how long). A separate spawn: on the old
    code it aborts a rank inside gloo."""
    import os
    import pickle
    import time

    import paddle.distributed as dist

    from gradmgr.distributed import data_parallel

    dist.init_parallel_env()
    model = suite.net(rank)
    gm = data_parallel(model)
    out: dict = {"error": None}
    for step in range(STEPS):
        if rank == 1 and step == 1:
            continue
        try:
            with gm:
                gm.backward(suite.loss_of(model, *suite.local(step, rank, world)))
        except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
            out["error"] = f"{type(e).__name__}: {e}"
    total = paddle.ones([1])
    dist.all_reduce(total)
    out["after"] = float(total.numpy()[0])
    if out["error"] is not None:  # its later steps raise at once, with no collective
        started = time.monotonic()
        try:
            with gm:
                gm.backward(suite.loss_of(model, *suite.local(0, rank, world)))
        except Exception as e:  # noqa: BLE001
            out["again"] = (f"{type(e).__name__}: {e}", time.monotonic() - started)
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
