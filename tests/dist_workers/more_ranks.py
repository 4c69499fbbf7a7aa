"""More than 2 ranks (docs/switching-from-ddp.md, "Bit for bit, and with more ranks"): an MLP
seeded differently on each rank, trained 5 SGD steps on each rank's own batches by DDP and by
``data_parallel`` on each path. Saves, per side, the parameters after every step."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import data_parallel

STEPS = 5
SIDES = ("ddp", "native", "buckets")


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)  # each rank its own weights, until the broadcast
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _train(side: str, rank: int, batches: list) -> list:
    """The parameters, flattened, after each step of ``side``."""
    model = _model(rank)
    loss = torch.nn.functional.mse_loss
    if side == "ddp":
        ddp = DDP(model)

        def step(x, y):
            loss(ddp(x), y).backward()
    else:
        gm = data_parallel(model, native=side == "native")

        def step(x, y):
            with gm:
                gm.backward(loss(model(x), y))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    after = []
    for x, y in batches:
        step(x, y)
        opt.step()
        opt.zero_grad()
        after.append(torch.cat([p.detach().flatten() for p in model.parameters()]).numpy())
    return after


def main(rank: int, world: int, outdir: str) -> None:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
               for _ in range(STEPS)]
    saved = {f"{side}_s{i}": p for side in SIDES
             for i, p in enumerate(_train(side, rank, batches))}
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **saved)
