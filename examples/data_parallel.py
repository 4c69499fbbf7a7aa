"""Data-parallel training on 2 CPU processes with gradmgr and an allreduce callback.

Each rank trains the same small MLP on its half of every batch; ``make_allreduce_cb("mean")``
averages the gradients over gloo while the backward is still running, so every rank takes the
same optimizer step. Rank 0 prints the loss; the script exits non-zero if the ranks' parameters
end up different.

Run it either way:
    torchrun --nproc_per_node 2 examples/data_parallel.py
    python examples/data_parallel.py          # spawns the 2 ranks itself
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
from torch import nn

from gradmgr import GradManager
from gradmgr.distributed import make_allreduce_cb, run_ranks

STEPS = 30
BATCH = 64  # global batch, split evenly over the ranks


def data(step: int) -> tuple:
    """A fixed regression task: y = sin(x @ A) plus noise, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    a = torch.linspace(-1.0, 1.0, 8 * 2).reshape(8, 2)
    x = torch.randn(BATCH, 8, generator=g)
    return x, torch.sin(x @ a) + 0.05 * torch.randn(BATCH, 2, generator=g)


def train(rank: int, world: int) -> bool:
    torch.manual_seed(0)  # same initial weights everywhere
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    gm = GradManager().attach(model.parameters(), callbacks=[make_allreduce_cb("mean")])
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    per_rank = BATCH // world
    for step in range(STEPS):
        x, y = data(step)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        with gm:
            loss = ((model(x) - y) ** 2).mean()
            gm.backward(loss)  # .grad is now the mean over all ranks
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step:2d}  loss {total.item() / world:.4f}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    same = all(torch.equal(copies[0], c) for c in copies)
    if rank == 0:
        print("parameters identical on all ranks" if same else "ERROR: ranks diverged")
    return same


def run(rank: int, world: int, port: int = 0) -> None:
    """One rank; ``port`` 0 means torchrun set MASTER_ADDR / MASTER_PORT."""
    torch.set_num_threads(1)
    init = f"tcp://127.0.0.1:{port}" if port else "env://"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        ok = train(rank, world)
        dist.barrier()  # every rank done communicating before its group goes
    finally:
        dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def main() -> int:
    return run_ranks(run, 2)  # torchrun's rank, or 2 ranks started here


if __name__ == "__main__":
    sys.exit(main())
