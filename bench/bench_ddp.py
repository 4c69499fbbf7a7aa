"""Step time of gradmgr + allreduce callback divided by PyTorch DDP's, 2 ranks on gloo.

Both run the same MLP on the same data in the same processes; steps alternate between the two
(and which goes first alternates too), so machine noise hits both alike. Prints the machine,
the versions, both median step times and their ratio (below 1: gradmgr is faster).

    python bench/bench_ddp.py [--steps N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradmgr
from gradmgr import GradManager
from gradmgr.distributed import make_allreduce_cb, spawn_local

WIDTH, DEPTH, BATCH = 256, 4, 64  # per rank


def model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def rank_main(rank: int, world: int, port: int, steps: int, warmup: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        net_gm, net_ddp = model(), model()
        gm = GradManager().attach(net_gm.parameters(), callbacks=[make_allreduce_cb("mean")])
        ddp = DDP(net_ddp)
        opt_gm = torch.optim.SGD(net_gm.parameters(), lr=1e-3)
        opt_ddp = torch.optim.SGD(net_ddp.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)

        def step_gm() -> None:
            with gm:
                gm.backward(((net_gm(x) - y) ** 2).mean())
            opt_gm.step()
            opt_gm.zero_grad(set_to_none=True)

        def step_ddp() -> None:
            ((ddp(x) - y) ** 2).mean().backward()
            opt_ddp.step()
            opt_ddp.zero_grad(set_to_none=True)

        times = {"gradmgr": [], "ddp": []}
        for i in range(warmup + steps):
            order = [("gradmgr", step_gm), ("ddp", step_ddp)]
            for name, fn in order if i % 2 == 0 else order[::-1]:
                dist.barrier()
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
                if i >= warmup:
                    times[name].append(elapsed)
        same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                   for a, b in zip(net_gm.parameters(), net_ddp.parameters()))
        if rank == 0:
            report(times, same)
    finally:
        dist.destroy_process_group()


def report(times: dict, same: bool) -> None:
    gm_ms = statistics.median(times["gradmgr"]) * 1e3
    ddp_ms = statistics.median(times["ddp"]) * 1e3
    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores")
    print(f"versions: python {platform.python_version()}, torch {torch.__version__}, "
          f"gradmgr {gradmgr.__version__}")
    print(f"setup: 2 ranks, gloo on 127.0.0.1, 1 thread each, MLP {DEPTH}x{WIDTH}, "
          f"batch {BATCH} per rank, {len(times['ddp'])} timed steps each (median)")
    print(f"gradmgr + make_allreduce_cb step: {gm_ms:.3f} ms")
    print(f"DDP step:                         {ddp_ms:.3f} ms")
    print(f"ratio gradmgr/DDP: {gm_ms / ddp_ms:.3f}")
    print(f"parameters of both after training agree: {same}")


def main(argv: list = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    return spawn_local(rank_main, 2, args.steps, args.warmup)


if __name__ == "__main__":
    sys.exit(main())
