"""Rank program: gradmgr's data parallelism on a Paddle model, next to ``paddle.DataParallel``
on the same script, over Paddle's own collectives (gloo on CPU).

Run as a Paddle user runs it: ``spawn_local(main, 2, outdir)`` (gradmgr's launcher sets what
``paddle.distributed.init_parallel_env()`` reads). Each rank saves ``rank{r}.pkl``: parameters
after every optimizer step, ours and Paddle's, and the errors of the refused cases.
"""

from __future__ import annotations

import os
import pickle
import runpy

import numpy as np

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")
STEPS = 3
BATCH = 8


def batch(step: int):
    rng = np.random.default_rng(100 + step)
    return (rng.standard_normal((BATCH, 6)).astype("float32"),
            rng.standard_normal((BATCH, 3)).astype("float32"))


def shard(a, rank: int, world: int):
    n = len(a) // world
    return a[rank * n:(rank + 1) * n]


def net(seed: int, extra: bool = False):
    import paddle

    paddle.seed(seed)
    layers = [paddle.nn.Linear(6, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 3)]
    if extra:
        layers.append(paddle.nn.Linear(3, 3))
    return paddle.nn.Sequential(*layers)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def optimizer(kind: str, model):
    import paddle

    if kind == "sgd":
        return paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    return paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())


def values(model) -> list:
    return [p.numpy().copy() for p in model.parameters()]


def grads(model) -> list:
    return [None if p.grad is None else p.grad.numpy().copy() for p in model.parameters()]


def error_of(run) -> object:
    """What ``run()`` raised, as ``"Type: message"``; None if nothing."""
    try:
        run()
    except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
        return f"{type(e).__name__}: {e}"
    return None


def local(step: int, rank: int, world: int):
    import paddle

    x, y = batch(step)
    return paddle.to_tensor(shard(x, rank, world)), paddle.to_tensor(shard(y, rank, world))


def ours(kind: str, rank: int, world: int, frozen: bool = False, micro: int = 1,
         skip: int = -1, **options) -> dict:
    """gradmgr: ``data_parallel(model)``; ranks start from different weights (seed = rank),
    the broadcast gives rank 0's. ``micro`` > 1: the first micro-batches under no_sync."""
    from gradmgr.distributed import data_parallel, no_sync

    model = net(rank)
    if frozen:
        model[0].bias.stop_gradient = True
    gm = data_parallel(model, **options)
    opt = optimizer(kind, model)
    out: dict = {"params": [], "grads": []}
    for step in range(STEPS):
        if step == skip:  # a batch skipped (its forward raised): a recording, no backward
            try:
                with gm:
                    pass
            except RuntimeError as e:  # (what the test asserts there is none of)
                out["skip_error"] = str(e)
        for m in range(micro if step != skip else 0):
            x, y = local(step * micro + m, rank, world)
            if m < micro - 1:
                with no_sync(gm), gm:
                    gm.backward(loss_of(model, x, y))
            else:
                with gm:
                    gm.backward(loss_of(model, x, y))
        out["grads"].append(grads(model))
        opt.step()
        opt.clear_grad(set_to_zero=skip >= 0)  # skip: .grad kept (zeros) into the next step
        out["params"].append(values(model))
    return out


def by_hand(rank: int, world: int) -> dict:
    """``make_allreduce_cb`` attached by hand (it broadcasts rank 0's tensors at the first
    recording), with SGD: the script of ``ours("sgd", ...)`` without ``data_parallel``."""
    from gradmgr import GradManager
    from gradmgr.distributed import make_allreduce_cb

    model = net(rank)
    gm = GradManager().attach(model.parameters(), callbacks=[make_allreduce_cb("mean")])
    opt = optimizer("sgd", model)
    out: dict = {"params": [], "grads": []}
    for step in range(STEPS):
        with gm:
            gm.backward(loss_of(model, *local(step, rank, world)))
        out["grads"].append(grads(model))
        opt.step()
        opt.clear_grad(set_to_zero=False)
        out["params"].append(values(model))
    return out


def paddles(kind: str, rank: int, world: int, frozen: bool = False, micro: int = 1,
            skip: int = -1) -> dict:
    """The same script on ``paddle.DataParallel`` (which also broadcasts rank 0's weights)."""
    import contextlib

    import paddle

    model = net(rank)
    if frozen:
        model[0].bias.stop_gradient = True
    dp = paddle.DataParallel(model)
    opt = optimizer(kind, model)
    out: dict = {"params": [], "grads": []}
    for step in range(STEPS):
        for m in range(micro if step != skip else 0):
            x, y = local(step * micro + m, rank, world)
            with dp.no_sync() if m < micro - 1 else contextlib.nullcontext():
                loss_of(dp, x, y).backward()
        out["grads"].append(grads(model))
        opt.step()
        opt.clear_grad(set_to_zero=skip >= 0)
        out["params"].append(values(model))
    return out


def attached_input(rank: int, world: int, ours_side: bool) -> dict:
    """An input with ``stop_gradient=False``, not a parameter, a new tensor each step: attached
    to ``data_parallel``'s manager before the recording (step 0) and inside it (step 1); on
    the other side, the same script on ``paddle.DataParallel``. Each step's gradients of the
    parameters, then of the input."""
    import paddle

    from gradmgr.distributed import data_parallel

    model = net(rank)
    gm = data_parallel(model) if ours_side else None
    dp = None if ours_side else paddle.DataParallel(model)
    out: dict = {"grads": []}
    for step in range(2):
        x, y = local(step, rank, world)
        x.stop_gradient = False
        if gm is None:
            loss_of(dp, x, y).backward()
        else:
            if step == 0:
                gm.attach(x)
            with gm:
                if step == 1:
                    gm.attach(x)
                gm.backward(loss_of(model, x, y))
        out["grads"].append(grads(model) + [None if x.grad is None else x.grad.numpy().copy()])
        model.clear_gradients()
    return out


def refusals(rank: int, world: int) -> dict:
    """What the Paddle path cannot do: each raises on every rank, and the ranks go on."""
    import paddle

    from gradmgr.distributed import data_parallel

    errors: dict = {}
    for name, options in (("shard", {"shard": True}), ("full", {"shard": "full"}),
                          ("fp16", {"compression": "fp16"}),
                          ("comm_hook", {"comm_hook": lambda state, bucket: bucket}),
                          ("transport", {"transport": "gloo"})):
        model = net(0)
        try:
            gm = data_parallel(model, **options)
            with gm:
                gm.backward(loss_of(model, *local(0, rank, world)))
        except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
            errors[name] = f"{type(e).__name__}: {e}"
        gm = None
    model = net(0)
    try:
        data_parallel(paddle.DataParallel(model))  # a kept wrapper: two reducers
    except Exception as e:  # noqa: BLE001
        errors["wrapper"] = f"{type(e).__name__}: {e}"
    gm = data_parallel(model)
    try:
        gm.join()
    except Exception as e:  # noqa: BLE001
        errors["join"] = f"{type(e).__name__}: {e}"
    return errors


def wrapped_after(rank: int, world: int) -> dict:
    """``paddle.DataParallel(model)`` built after ``data_parallel(model)``, a ``register_hook``
    (x2) on ``2.weight``, two steps through the wrapper inside the recording: what each step
    raised (on the old code step 1's forward failed in Paddle's reducer, step 0 gave the right
    gradients); then a step through the model itself."""
    import paddle

    from gradmgr.distributed import data_parallel

    model = net(rank)
    gm = data_parallel(model)
    wrapper = paddle.DataParallel(model)
    model[2].weight.register_hook(lambda grad: grad * 2)
    out: dict = {"errors": []}
    for step in range(2):
        try:
            with gm:
                gm.backward(loss_of(wrapper, *local(step, rank, world)))
            out["errors"].append(None)
        except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
            out["errors"].append(f"{type(e).__name__}: {e}")
        out.setdefault("grads_after", grads(model))
        model.clear_gradients(set_to_zero=False)
    with gm:
        gm.backward(loss_of(model, *local(0, rank, world)))
    out["grads"] = grads(model)
    return out


def one_rank_fails(rank: int, world: int) -> dict:
    """Rank 1's forward raises inside the recording (no backward there); rank 0's backward
    must raise RankFailedError and leave .grad as it was; the next step is a normal one."""
    from gradmgr.distributed import data_parallel

    model = net(rank)
    gm = data_parallel(model)
    out: dict = {}
    x, y = local(0, rank, world)
    try:
        with gm:
            if rank == 1:
                raise ValueError("rank 1's forward failed")
            gm.backward(loss_of(model, x, y))
    except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
        out["error"] = f"{type(e).__name__}: {e}"
    out["grads_after_failure"] = grads(model)
    with gm:
        gm.backward(loss_of(model, x, y))
    out["grads"] = grads(model)
    return out


def mismatch(rank: int, world: int) -> str:
    """Rank 1's model has one more layer: every rank raises, none hangs."""
    from gradmgr.distributed import data_parallel

    try:
        data_parallel(net(0, extra=rank == 1))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def main(rank: int, world: int, port: int, outdir: str) -> None:
    import paddle.distributed as dist

    dist.init_parallel_env()
    out: dict = {}
    for case, kwargs in (("sgd", {}), ("adam", {}), ("no_sync", {"micro": 2}),
                         ("no_sync_4", {"micro": 4}), ("frozen", {"frozen": True}),
                         ("skipped", {"skip": 1})):
        kind = "adam" if case == "adam" else "sgd"
        out[case] = {"ours": ours(kind, rank, world, **kwargs),
                     "paddle": paddles(kind, rank, world, **kwargs)}
    out["bf16"] = {"ours": ours("sgd", rank, world, compression="bf16")}
    out["input"] = {"ours": attached_input(rank, world, True),
                    "paddle": attached_input(rank, world, False)}
    out["by_hand"] = {"ours": by_hand(rank, world), "paddle": out["sgd"]["paddle"]}
    out["refusals"] = refusals(rank, world)
    out["wrapped_after"] = wrapped_after(rank, world)
    out["one_fails"] = one_rank_fails(rank, world)
    out["mismatch"] = mismatch(rank, world)
    from . import paddle_habits, paddle_rank_habits, paddle_steps, paddle_wrappers

    out["habits"] = paddle_habits.run(rank, world)  # (they import this module)
    out["wrappers"] = paddle_wrappers.run(rank, world)
    out["steps"] = paddle_steps.run(rank, world)
    out["rank_habits"] = paddle_rank_habits.run(rank, world)
    example = runpy.run_path(os.path.join(EXAMPLES, "paddle_data_parallel.py"), run_name="ex")
    example["fit"](rank, world, 3)  # docs/paddle.md's example (it asserts the ranks agree)
    out["example"] = "ran"
    dist.barrier()
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
