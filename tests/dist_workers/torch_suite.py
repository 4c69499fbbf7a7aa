"""Rank program for the PyTorch checks: gradmgr + allreduce callback next to DDP.

Every scenario writes its gradients into one dict saved as ``rank{rank}.npz``; the parent
test compares them with single-process references, with DDP, and across ranks.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr import GradManager
from gradmgr.distributed import make_allreduce_cb

from .data import batch, shard, weights


class Net(nn.Module):
    """The MLP of data.py, plus ``extra`` (used only when asked) and ``never`` (never used)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3)
        )
        with torch.no_grad():
            for p, w in zip(self.mlp.parameters(), weights()):
                p.copy_(torch.from_numpy(w))
        self.extra = nn.Parameter(torch.linspace(-1.0, 1.0, 4))
        self.never = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        loss = ((self.mlp(x) - y) ** 2).mean()
        if use_extra:
            loss = loss + 0.5 * (self.extra**2).sum()
        return loss


def local_batch(step: int, rank: int, world: int) -> tuple:
    x, y = batch(step)
    return torch.from_numpy(shard(x, rank, world)), torch.from_numpy(shard(y, rank, world))


def grads(module: nn.Module) -> list:
    return [None if p.grad is None else p.grad.detach().numpy().copy()
            for p in module.parameters()]


def save(out: dict, prefix: str, values: list) -> None:
    for i, v in enumerate(values):
        if v is not None:
            out[f"{prefix}{i}"] = v


def gm_step(net: Net, cb, rank: int, world: int, step: int = 0, use_extra: bool = False):
    gm = GradManager().attach(net.parameters(), callbacks=[cb])
    x, y = local_batch(step, rank, world)
    with gm:
        gm.backward(net(x, y, use_extra))
    return gm


def ddp_step(rank: int, world: int, step: int = 0, use_extra: bool = False, **kw) -> list:
    net = Net()
    ddp = DDP(net, **kw)
    x, y = local_batch(step, rank, world)
    ddp(x, y, use_extra).backward()
    return grads(net)


def train(out: dict, rank: int, world: int) -> None:
    """Three SGD steps, gradmgr and DDP side by side; first-step grads and final params."""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    gm = GradManager().attach(net_gm.parameters(), callbacks=[make_allreduce_cb("mean")])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net_gm, net_ddp)]
    for step in range(3):
        x, y = local_batch(step, rank, world)
        with gm:
            gm.backward(net_gm(x, y))
        ddp(x, y).backward()
        if step == 0:
            save(out, "mean_g", grads(net_gm))
            save(out, "ddp_g", grads(net_ddp))
            out["mean_dtypes"] = np.array([str(p.grad.dtype) for p in net_gm.parameters()
                                           if p.grad is not None])
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    save(out, "train_gm_p", [p.detach().numpy().copy() for p in net_gm.parameters()])
    save(out, "train_ddp_p", [p.detach().numpy().copy() for p in net_ddp.parameters()])


def reduce_variants(out: dict, rank: int, world: int) -> None:
    net = Net()
    gm_step(net, make_allreduce_cb("sum"), rank, world)
    save(out, "sum_g", grads(net))
    for name, size in (("small", 200), ("one", 2**30)):
        net, cb = Net(), make_allreduce_cb("mean", bucket_bytes=size)
        gm = gm_step(net, cb, rank, world)
        save(out, f"{name}_g", grads(net))
        out[f"{name}_nbuckets"] = np.array(len(cb.buckets(gm)))
    for comp in ("fp16", "bf16"):
        net = Net()
        gm_step(net, make_allreduce_cb("mean", compression=comp), rank, world)
        save(out, f"{comp}_g", grads(net))


def arrival_order(out: dict, rank: int, world: int) -> None:
    """Ranks build the same terms in opposite orders, so gradients arrive in opposite orders;
    one bucket per tensor makes a launch-order mismatch fail loudly."""
    pa, pb, pc = (torch.linspace(0.1, 1.0, n, requires_grad=True) for n in (5, 7, 3))
    arrived = []
    gm = GradManager().attach(
        [pa, pb, pc],
        callbacks=[lambda t, g: (arrived.append(len(t)), g)[1],
                   make_allreduce_cb("mean", bucket_bytes=1)],
    )
    k = float(rank + 1)
    with gm:
        terms = [lambda: (torch.sin(pa) * k).sum(), lambda: (pb**2 * k).sum(),
                 lambda: (pc * k).sum()]
        values = [f() for f in (terms if rank == 0 else terms[::-1])]
        gm.backward(values[0] + values[1] + values[2])
    out["order_arrived"] = np.array(arrived)
    save(out, "order_g", [pa.grad.numpy(), pb.grad.numpy(), pc.grad.numpy()])
    save(out, "order_p", [pa.detach().numpy(), pb.detach().numpy(), pc.detach().numpy()])


def unused(out: dict, rank: int, world: int) -> None:
    """``extra`` is used on rank 0 only; ``never`` on no rank."""
    for name, size in (("unused", 25 * 2**20), ("unused_small", 1)):
        net = Net()
        gm_step(net, make_allreduce_cb("mean", bucket_bytes=size), rank, world,
                use_extra=rank == 0)
        save(out, f"{name}_g", grads(net))
    save(out, "unused_ddp_g", ddp_step(rank, world, use_extra=rank == 0,
                                        find_unused_parameters=True))
    # A rank with nothing to differentiate still takes part (bind first: cb never ran there).
    net, cb = Net(), make_allreduce_cb("mean")
    gm = GradManager().attach(net.mlp.parameters(), callbacks=[cb])
    x, y = local_batch(0, rank, world)
    if rank == 0:
        with gm:
            gm.backward(net(x, y))
        local = Net()
        local(x, y).backward()
        save(out, "noout_local", grads(local.mlp))
    else:
        cb.bind(gm)
        with gm:
            gm.backward()
    save(out, "noout_g", grads(net.mlp))


def accumulation(out: dict, rank: int, world: int) -> None:
    """Two rounds of 3 micro-batches, the first 2 under no_sync, gradmgr vs DDP.no_sync."""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    cb = make_allreduce_cb("mean", bucket_bytes=300)
    gm = GradManager().attach(net_gm.parameters(), callbacks=[cb])
    for rnd in range(2):
        for micro in range(3):
            x, y = local_batch(3 * rnd + micro, rank, world)
            sync = micro == 2
            with cb.no_sync() if not sync else _null(), gm:
                gm.backward(net_gm(x, y, use_extra=micro == 0))
            with ddp.no_sync() if not sync else _null():
                ddp(x, y, use_extra=micro == 0).backward()
            if rnd == 0 and micro == 0:
                save(out, "nosync_first_gm", grads(net_gm))
                save(out, "nosync_first_ddp", grads(net_ddp))
        save(out, f"nosync_r{rnd}_gm", grads(net_gm))
        save(out, f"nosync_r{rnd}_ddp", grads(net_ddp))
        for m in (net_gm, net_ddp):
            m.zero_grad(set_to_none=True)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(rank: int, world: int, outdir: str) -> None:
    out: dict = {}
    train(out, rank, world)
    reduce_variants(out, rank, world)
    arrival_order(out, rank, world)
    unused(out, rank, world)
    accumulation(out, rank, world)
    dist.barrier()
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **out)
