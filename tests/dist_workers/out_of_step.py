"""Ranks with different numbers of steps, outside ``Join`` (issue 25's last habit row): one rank
skips a batch (``continue``), so the other has a step more. Run by tests/test_out_of_step.py.

Each scenario runs in a process group of its own with a short timeout (:data:`TIMEOUT_S`),
started from a file in OUTDIR: the rank that gives up leaves gradmgr's check group unusable
until a new process group, as its error says. What each rank saw is pickled to
``OUTDIR/rank{RANK}.pkl`` after every scenario.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist

from gradmgr import GradManager
from gradmgr.distributed import ShardedOptimizer, data_parallel, make_allreduce_cb, no_sync

# The process groups': a rank gives up a check after half of it (its patience). Every check,
# the in-step ones before a skip too, must find the other rank within that patience: at 3 s
# (TIMEOUT_S = 6) a rank lagging the other by more than 3 s at load ~17 had its first step's
# check given up on (both ranks raised at once). 5 s costs 2 s more at each of the 9 patience
# waits of tests/test_out_of_step.py.
TIMEOUT_S = 10.0
STEPS = 3


def group(outdir: str, name: str, rank: int, world: int, timeout_s: float = TIMEOUT_S) -> None:
    """A fresh gloo group per case, with a short timeout (so a short patience)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, name)}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _torch_side(path: str, out: dict = None):
    """A model, its manager on ``path`` ("cuda": the default path, the model on the GPU,
    gloo still; "handbuilt": a manager with make_allreduce_cb) and an optimizer: one
    training step per call; the parameters into ``out``."""
    device = "cuda" if path == "cuda" else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 3)).to(device)
    if path == "handbuilt":  # make_allreduce_cb on a plain manager: torch's Join takes none
        gm = GradManager().attach(list(model.parameters()),
                                  callbacks=[make_allreduce_cb("mean")])
    else:
        gm = data_parallel(model, **({"shard": True} if path == "sharded"
                                     else {"shard": "full", "blocks": [torch.nn.Linear]}
                                     if path == "full"
                                     else {"native": path in ("native", "cuda")}))
    opt = (ShardedOptimizer(gm, torch.optim.SGD, lr=0.1) if path == "sharded"
           else torch.optim.SGD(model.parameters(), lr=0.1))

    def step(rank: int, i: int, paused=()) -> None:
        for micro in range(2 if paused else 1):
            g = torch.Generator().manual_seed(100 * rank + i + 1000 * micro)
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            pause = micro == 0 and (rank, i) in paused
            with no_sync(gm) if pause else contextlib.nullcontext(), gm:
                gm.backward(torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)))
        opt.step()
        opt.zero_grad()
        if out is not None:
            out["params"] = [p.detach().cpu().numpy().copy() for p in model.parameters()]
    return step


def _megengine_side(path: str):
    """MegEngine parameters under the allreduce callback (torch's gloo through host memory)."""
    import megengine as mge
    import megengine.functional as F
    import megengine.optimizer as optim

    w = mge.Parameter(np.linspace(-1, 1, 18, dtype="float32").reshape(6, 3))
    gm = GradManager().attach([w], callbacks=[make_allreduce_cb("mean")])
    opt = optim.SGD([w], lr=0.1)

    def step(rank: int, i: int) -> None:
        x = mge.tensor(np.random.default_rng(100 * rank + i).standard_normal((4, 6), "float32"))
        with gm:
            gm.backward(F.sum(F.matmul(x, w) ** 2))
        opt.step().clear_grad()
    return step


def _train(step, rank: int, skipper: int, skipped=(1,)) -> dict:
    """:data:`STEPS` steps; rank ``skipper`` skips those in ``skipped``. What happened, and
    when."""
    start = time.monotonic()
    try:
        for i in range(STEPS):
            if i in skipped and rank == skipper:
                continue
            step(rank, i)
    except Exception as error:  # noqa: BLE001 - the scenario's data
        return {"error": type(error).__name__, "message": str(error),
                "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def in_step(rank: int) -> bool:
    """One allreduce on the user's group (after the loop, or after an error): the ranks still
    pair."""
    check = torch.tensor([float(rank), 1.0])
    try:
        dist.all_reduce(check)
    except RuntimeError:
        return False
    world = dist.get_world_size()
    return check.tolist() == [world * (world - 1) / 2, float(world)]


def skip(outdir: str, rank: int, world: int, path: str, skipper: int) -> dict:
    """Rank ``skipper`` skips a batch; then every rank makes one allreduce of its own (an
    evaluation's), then starts training again with a new manager in the same group."""
    side = _megengine_side if path == "megengine" else _torch_side
    seen = {"loop": _train(side(path), rank, skipper), "in_step": in_step(rank)}
    start = time.monotonic()
    try:  # a ShardedOptimizer's comparison when made is a plan check: it may raise already
        again = side(path)
    except Exception as error:  # noqa: BLE001 - the scenario's data
        seen["again"] = {"error": type(error).__name__, "message": str(error),
                         "seconds": time.monotonic() - start}
    else:
        seen["again"] = _train(again, rank, skipper=-1)
    return seen


def even(outdir: str, rank: int, world: int, path: str, skipper: int) -> dict:
    """No rank skips: the plan checks agree, the parameters after the steps."""
    seen: dict = {}
    seen["loop"] = _train(_torch_side(path, seen), rank, skipper=-1)
    return seen


def nosync(outdir: str, rank: int, world: int, path: str, skipper: int) -> dict:
    """Two micro-batches a step; at step 1 rank ``skipper`` alone takes the first inside
    ``no_sync`` (after a step every rank synced, so not the first recording)."""
    step = _torch_side(path)
    paused = [(skipper, 1)]
    seen = {"loop": _train(lambda r, i: step(r, i, paused), rank, skipper=-1)}
    seen["in_step"] = in_step(rank)
    return seen


def idle(outdir: str, rank: int, world: int, path: str, skipper: int) -> dict:
    """Rank ``skipper`` has no batch at all (an empty shard): the other's first step, which
    also broadcasts the parameters, is the one nobody else starts."""
    seen = {"loop": _train(_torch_side(path), rank, skipper, skipped=range(STEPS))}
    seen["in_step"] = in_step(rank)
    return seen


def left(outdir: str, rank: int, world: int, path: str, skipper: int) -> dict:
    """Rank ``skipper`` skips a batch, then ends as a script does: destroys its process group
    (and would exit); the others are told it left."""
    seen = {"loop": _train(_torch_side(path), rank, skipper)}
    if rank == skipper:
        dist.destroy_process_group()
    return seen


def save0(outdir: str, rank: int, world: int, path: str, saver: int) -> dict:
    """Rank ``saver`` alone calls ``dcp.save`` after step 0 (DDP scripts' ``if rank == 0:
    torch.save(...)`` habit; DCP's save is a collective) and stops; the other trains on, then
    calls ``dcp.save`` itself, which meets the saver's."""
    import torch.distributed.checkpoint as dcp

    from gradmgr.distributed import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    gm = data_parallel(model, shard=True)
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=0.1)

    def save() -> None:
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state},
                 checkpoint_id=os.path.join(outdir, "save0"))

    def step(rank: int, i: int) -> None:
        with gm:
            gm.backward(model(torch.full((2, 6), float(rank + i))).square().mean())
        opt.step()
        if rank == saver:
            save()

    seen = {"loop": _train(step, rank, skipper=saver, skipped=range(1, STEPS))}
    if rank != saver:
        save()  # the saver waits in its dcp.save since step 0: its group's timeout, not over
    seen["in_step"] = in_step(rank)
    return seen


def main(rank: int, world: int, outdir: str) -> None:
    results = {}
    for n, case in enumerate(os.environ["OUT_OF_STEP_CASES"].split(",")):
        scenario, path, skipper = case.split(":")
        group(outdir, f"store{n}", rank, world)
        results[case] = globals()[scenario](outdir, rank, world, path, int(skipper))
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    group(outdir, "store-end", rank, world)  # dist_workers.run's barrier and teardown
