"""Compiled steps: gradmgr's data_parallel against DDP compiled the same way, side by side.

Two comparisons, each over its own copies of one model (4 x Linear(256, 256) with ReLU, batch
64 per rank), in the same processes:

* ``compile``: ``torch.compile(model)`` under ``data_parallel(model)`` (its default path,
  torch's C++ reducer) against ``torch.compile(DDP(model))`` (DDP's default
  ``optimize_ddp=True``: DDPOptimizer splits the graph at bucket boundaries);
* ``compiled autograd``: the same compiled models, each recording and backward under compiled
  autograd (``torch._dynamo.compiled_autograd._enable(torch.compile(backend=...))``, what
  ``torch._dynamo.config.compiled_autograd = True`` enters around a compiled step):
  gradmgr's post-backward path (the backward compiled whole, then its buckets reduced) against
  DDP's ``optimize_ddp="python_reducer"`` (an allreduce per parameter traced into the backward
  graph).

A step is forward, backward, SGD step and ``zero_grad``, timed alone behind a barrier; every
round runs each variant once, in a new random order (the same on every rank). Per comparison
the table gives the medians and the ratio gradmgr / DDP as the range over ``--blocks`` blocks of
rounds (the median of each block's samples; below 1: gradmgr faster). Compilation happens in
untimed warm-up steps. The parameters after the run are compared (gradmgr's against DDP's).
Graph breaks are not counted here (Dynamo counts them while compiling, which the variants
share): tests/test_compile_distributed.py counts gradmgr's in the backward.

CPU: 2 ranks over gloo. CUDA: one GPU here, so world size 1 over nccl (DDP and gradmgr still run
their collectives, over one rank: the numbers show the compiled step's cost, not scaling).

    python bench/bench_compile.py [--device cpu|cuda] [--backend inductor|aot_eager]
                                  [--rounds N] [--blocks K]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULT_PREFIX, machine_info, ranks_output  # noqa: E402

from gradmgr.distributed import data_parallel  # noqa: E402

BATCH, WIDTH, WARMUP = 64, 256, 5
PAIRS = {"compile": ("gm-compile", "ddp-compile"),
         "compiled autograd": ("gm-ca", "ddp-ca")}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())][:-1])


def init(rank: int, world: int, port: int, device: str) -> torch.device:
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    if device == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def variants(device: torch.device, backend: str, rank: int) -> Dict[str, tuple]:
    """name -> (step function, module whose parameters train, config of its steps)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH, generator=g).to(device)
    y = torch.randn(BATCH, WIDTH, generator=g).to(device)
    ca = torch._dynamo.compiled_autograd._enable
    out = {}
    for name, ddp_mode in (("compile", True), ("ca", "python_reducer")):
        config = {"optimize_ddp": ddp_mode}
        with torch._dynamo.config.patch(**config):
            net_gm, net_ddp = mlp().to(device), mlp().to(device)
            gm, ddp = data_parallel(net_gm), DDP(net_ddp)
        model_gm = torch.compile(net_gm, backend=backend)
        model_ddp = torch.compile(ddp, backend=backend)
        around: Callable = (contextlib.nullcontext if name == "compile"
                            else lambda: ca(torch.compile(backend=backend)))

        def step_gm(gm=gm, model=model_gm, around=around) -> None:
            with around(), gm:
                gm.backward(((model(x) - y) ** 2).mean())

        def step_ddp(model=model_ddp, around=around) -> None:
            with around():
                ((model(x) - y) ** 2).mean().backward()

        out[f"gm-{name}"] = (step_gm, net_gm, config)
        out[f"ddp-{name}"] = (step_ddp, net_ddp, config)
    return out


def bench_main(rank: int, world: int, port: int, device_name: str, backend: str, rounds: int,
               out_path: str) -> None:
    device = init(rank, world, port, device_name)
    try:
        fns = variants(device, backend, rank)
        opts = {k: torch.optim.SGD(net.parameters(), lr=1e-3) for k, (_, net, _) in fns.items()}
        times: Dict[str, List[float]] = {k: [] for k in fns}
        order = random.Random(0)
        started = time.perf_counter()
        for i in range(WARMUP + rounds):
            names = list(fns)
            order.shuffle(names)  # the same order on every rank (same seed)
            for name in names:
                step, _, config = fns[name]
                with torch._dynamo.config.patch(**config):
                    dist.barrier()
                    sync(device)
                    start = time.perf_counter()
                    step()
                    opts[name].step()
                    opts[name].zero_grad(set_to_none=True)
                    sync(device)
                    elapsed = time.perf_counter() - start
                if i >= WARMUP:
                    times[name].append(elapsed)
        diffs = {}
        with torch.no_grad():
            for pair, (a, b) in PAIRS.items():
                diffs[pair] = max(float((p - q).abs().max()) for p, q in
                                  zip(fns[a][1].parameters(), fns[b][1].parameters()))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"times": times, "diffs": diffs,
                           "seconds": time.perf_counter() - started}, f)
    finally:
        dist.destroy_process_group()


def ratio_range(a: List[float], b: List[float], blocks: int) -> tuple:
    n = len(a) // blocks
    ratios = [statistics.median(a[k * n:(k + 1) * n]) / statistics.median(b[k * n:(k + 1) * n])
              for k in range(blocks)]
    return min(ratios), max(ratios)


def report(result: dict, args: argparse.Namespace, world: int) -> None:
    times, diffs = result["times"], result["diffs"]
    print(f"\n{world} rank(s), {args.device}, backend {args.backend}, {args.rounds} rounds "
          f"({result['seconds']:.0f} s with warm-up), ratio gradmgr / DDP over "
          f"{args.blocks} blocks")
    print("| comparison | gradmgr ms | DDP ms | ratio (range) | max param diff |")
    print("|---|---|---|---|---|")
    for pair, (a, b) in PAIRS.items():
        low, high = ratio_range(times[a], times[b], args.blocks)
        gm_ms, ddp_ms = (statistics.median(times[v]) * 1e3 for v in (a, b))
        print(f"| {pair} | {gm_ms:.3f} | {ddp_ms:.3f} | {low:.2f}-{high:.2f} | "
              f"{diffs[pair]:.1e} |")
        print(f"{RESULT_PREFIX} bench_compile {args.device} {pair}: gradmgr {gm_ms:.3f} ms, "
              f"DDP {ddp_ms:.3f} ms, ratio {low:.2f}-{high:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default: inductor on cuda, aot_eager on "
                             "cpu, where inductor's C++ compile takes minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    if args.backend is None:
        args.backend = "inductor" if args.device == "cuda" else "aot_eager"
    world = 1 if args.device == "cuda" else 2
    print(machine_info(["torch"]) if "torch" in sys.modules else "")
    text = ranks_output(bench_main, world, args.device, args.backend, args.rounds)
    if text is None:
        sys.exit(1)
    report(json.loads(text), args, world)


if __name__ == "__main__":
    main()
