"""Ranks that disagree about sharding (issue 42): some call ``data_parallel(model,
shard=True)`` and make a ``ShardedOptimizer``, the others ``data_parallel(model)`` and a plain
optimizer. Run by tests/test_mixed_sharding.py.

``MIXED_CASES`` lists ``framework:sharded ranks`` (``torch:0+2``; ``hand``: torch with the
callbacks attached by hand, ``make_reduce_scatter_cb`` or ``make_allreduce_cb``). Each case
runs in a process group of its own with a short timeout (:data:`TIMEOUT_S`), started from a
file in OUTDIR. Every
rank records what its set-up and first step raised and how long they took, then whether the
process group still works: one allreduce, then a step of a plain ``data_parallel`` on every
rank (the parameters after it). What each rank saw is pickled to ``OUTDIR/rank{RANK}.pkl``
after every case.
"""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist

from gradmgr import GradManager
from gradmgr.distributed import (
    ShardedOptimizer,
    broadcast,
    data_parallel,
    make_allreduce_cb,
    make_reduce_scatter_cb,
)

from .out_of_step import group, in_step

TIMEOUT_S = 20.0  # the process groups': gloo's own error would come after it


def _torch_step(sharded: bool, rank: int, by_hand: bool = False):
    """A model with its manager (sharded or not) and optimizer, made now; one step per call;
    returns the parameters after it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if by_hand:
        broadcast(list(model.parameters()))
        make = make_reduce_scatter_cb if sharded else make_allreduce_cb
        gm = GradManager().attach(model.parameters(), callbacks=[make("mean")])
    else:
        gm = data_parallel(model, shard=sharded)
    opt = (ShardedOptimizer(gm, torch.optim.SGD, lr=0.1) if sharded
           else torch.optim.SGD(model.parameters(), lr=0.1))

    def step() -> list:
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        with gm:
            gm.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        return [p.detach().numpy().copy() for p in model.parameters()]
    return step


def _megengine_step(sharded: bool, rank: int):
    """The same with MegEngine (gradients over torch's gloo through host memory)."""
    import megengine as mge
    import megengine.functional as F
    import megengine.module as M
    import megengine.optimizer as optim

    model = M.Linear(6, 3)
    for p in model.parameters():
        p._reset(mge.Tensor(np.linspace(-1, 1, p.size, dtype="float32").reshape(p.shape)))
    gm = data_parallel(model, shard=sharded)
    opt = (ShardedOptimizer(gm, optim.SGD, lr=0.1) if sharded
           else optim.SGD(model.parameters(), lr=0.1))

    def step() -> list:
        x = mge.tensor(np.random.default_rng(rank).standard_normal((4, 6), "float32"))
        with gm:
            gm.backward(F.sum(model(x) ** 2))
        opt.step()
        opt.zero_grad() if sharded else opt.clear_grad()
        return [p.numpy().copy() for p in model.parameters()]
    return step


def _attempt(make, sharded: bool, rank: int) -> dict:
    """Make the manager and optimizer and take one step: what was raised, and when."""
    start = time.monotonic()
    try:
        make(sharded, rank)()
    except Exception as error:  # noqa: BLE001 - the case's data
        return {"error": type(error).__name__, "message": str(error),
                "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _by_hand(sharded: bool, rank: int):
    return _torch_step(sharded, rank, by_hand=True)


def case(framework: str, sharded_ranks: set, rank: int) -> dict:
    make = {"megengine": _megengine_step, "hand": _by_hand}.get(framework, _torch_step)
    if framework == "megengine":
        import megengine  # noqa: F401 - seconds on a busy machine: not part of the timing

        dist.barrier()
    seen = {"first": _attempt(make, rank in sharded_ranks, rank), "in_step": in_step(rank)}
    try:  # training goes on once every rank chose alike
        seen["params"] = make(False, rank)()
    except Exception as error:  # noqa: BLE001 - the case's data
        seen["params"] = f"{type(error).__name__}: {error}"
    return seen


def main(rank: int, world: int, outdir: str) -> None:
    results = {}
    for n, name in enumerate(os.environ["MIXED_CASES"].split(",")):
        framework, ranks = name.split(":")
        group(outdir, f"store{n}", rank, world, timeout_s=TIMEOUT_S)
        results[name] = case(framework, {int(r) for r in ranks.split("+")}, rank)
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    # a group for dist_workers.run's barrier and teardown
    group(outdir, "store-end", rank, world, timeout_s=TIMEOUT_S)
