"""Data-parallel training of a small MLP, written with PyTorch's DistributedDataParallel
(ddp_train.py) and with gradmgr (gradmgr_train.py): `diff` the two files to see what switching
changes; docs/switching-from-ddp.md explains each changed line.

The model has a frozen layer and BatchNorm; each rank seeds itself differently (so the first
broadcast matters) and reads its own batches; every step accumulates gradients over ACCUM
micro-batches (the first ones without communication), clips them and takes an AdamW step.
Each rank saves its parameters, buffers and losses to OUT/rank<r>.pt.

    torchrun --nproc_per_node 2 examples/ddp/ddp_train.py --out /tmp/ddp
    torchrun --nproc_per_node 2 examples/ddp/gradmgr_train.py --out /tmp/gm
    python examples/ddp/gradmgr_train.py --out /tmp/gm    # spawn_local starts the 2 ranks
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, ACCUM, BATCH = 4, 2, 16


def make_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                          nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    model[3].requires_grad_(False)  # a frozen layer: trained elsewhere, not here
    return model


def batch(rank: int, step: int, micro: int) -> tuple:
    """Rank ``rank``'s own data: y = sin(sum(x))."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.randn(BATCH, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train(rank: int, out: str) -> None:
    torch.manual_seed(rank)  # different initial weights on each rank: rank 0's are broadcast
    model = make_model()
    model = DDP(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = batch(rank, step, micro)
            last = micro == ACCUM - 1  # only the last micro-batch communicates
            with contextlib.nullcontext() if last else model.no_sync():
                loss = nn.functional.mse_loss(model(x), y) / ACCUM
                loss.backward()
            losses.append(loss.item())
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
    torch.save({"state": model.module.state_dict(), "losses": losses},
               os.path.join(out, f"rank{rank}.pt"))


def run(rank: int, world: int, port: int, out: str) -> None:
    """One rank. ``port`` 0: torchrun set MASTER_ADDR and MASTER_PORT (``env://``)."""
    init = f"tcp://127.0.0.1:{port}" if port else "env://"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        train(rank, out)
        dist.barrier()  # every rank done communicating before its group goes
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for rank<r>.pt")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    # torchrun starts one process per rank and tells each which it is
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, args.out)


if __name__ == "__main__":
    main()
