"""gradmgr + allreduce callback against PyTorch DDP: step time and peak memory, 2 ranks.

Time: for each model, gradmgr (its default path, torch's C++ Reducer), the same with
``verify="plan"`` (plans compared only where they change, no per-step collective: the "check"
column is what the per-step check costs), gradmgr with ``native=False`` (its own buckets) and
DDP train side by side in the same two processes (gloo on the CPU, or nccl with ``--device
cuda``); every step the variants run in a new random order, each step timed alone behind a
barrier; the ratios are of medians (below 1: gradmgr is faster).

Memory: the model of 8 x Linear(2048, 2048) (128 MiB of gradients per rank) is wrapped (DDP,
DDP with ``gradient_as_bucket_view=True``) or attached (gradmgr) and trains 4 steps, in fresh
processes per variant, the variants' runs interleaved, median of ``--memory-runs``. Peak memory
above the model: on the CPU, the peak resident set (``VmHWM``, reset once the model and the
batch exist) minus the resident set then, with glibc told to mmap blocks of 128 KiB and more so
that freed tensors leave the resident set; on CUDA, ``max_memory_allocated`` minus what was
allocated then. Both include each variant's buckets, gradients and activations, not library
code: gradmgr's torch backend and reducer module are imported before the baseline, like DDP's
module (until session 5 they were not, and every variant's first step also loaded about 100 MiB
of modules that all variants share; the ratios barely moved).

    python bench/bench_ddp.py [--steps N] [--device cpu|cuda] [--memory-runs K] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
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
from _common import (  # noqa: E402
    MMAP_THRESHOLD,
    RESULT_PREFIX,
    allocator,
    machine_info,
    peak_rss,
    ranks_output,
    reset_peak_rss,
    rss,
)

from gradmgr import GradManager  # noqa: E402
from gradmgr.distributed import make_allreduce_cb  # noqa: E402

BATCH = 64  # per rank
WORLD = 2
TIME_TARGET = 1.05
MEMORY_TARGET = 1.0


def mlp() -> nn.Module:
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())][:-1])


def many_tensors() -> nn.Module:
    """500 x Linear(32, 32) with tanh: 1,000 parameter tensors."""
    return nn.Sequential(*[m for _ in range(500) for m in (nn.Linear(32, 32), nn.Tanh())])


def memory_model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])


MODELS: Dict[str, Callable[[], nn.Module]] = {"mlp-256": mlp, "1000-tensors": many_tensors}
WIDTH = {"mlp-256": 256, "1000-tensors": 32, "memory": 2048}


def init(rank: int, port: int, device: str) -> torch.device:
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=dist_world(device), timeout=datetime.timedelta(seconds=120))
    if device == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def dist_world(device: str) -> int:
    return min(WORLD, torch.cuda.device_count()) if device == "cuda" else WORLD


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------- time
def time_main(rank: int, world: int, port: int, steps: int, device_name: str, out: str) -> None:
    device = init(rank, port, device_name)
    try:
        rows = [time_model(name, build, device, rank, steps) for name, build in MODELS.items()]
        if rank == 0:
            with open(out, "w") as f:
                for row in rows:
                    f.write(" ".join(map(str, row)) + "\n")
    finally:
        dist.destroy_process_group()


def time_model(name: str, build: Callable[[], nn.Module], device: torch.device, rank: int,
               steps: int) -> tuple:
    torch.manual_seed(0)
    net_gm, net_py, net_ddp = build().to(device), build().to(device), build().to(device)
    net_nv = build().to(device)
    for net in (net_py, net_ddp, net_nv):
        net.load_state_dict(net_gm.state_dict())
    gm = GradManager().attach(net_gm.parameters(), callbacks=[make_allreduce_cb("mean")])
    gm_nv = GradManager().attach(net_nv.parameters(),
                                 callbacks=[make_allreduce_cb("mean", verify="plan")])
    # the same callback kept off torch's C++ reducer: gradmgr's own buckets
    gm_py = GradManager().attach(net_py.parameters(),
                                 callbacks=[make_allreduce_cb("mean", native=False)])
    ddp = DDP(net_ddp)
    nets = {"gradmgr": net_gm, "plan-only": net_nv, "buckets": net_py, "ddp": net_ddp}
    opts = {k: torch.optim.SGD(net.parameters(), lr=1e-3) for k, net in nets.items()}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH[name], generator=g).to(device)
    y = torch.randn(BATCH, WIDTH[name], generator=g).to(device)

    def step_gm() -> None:
        with gm:
            gm.backward(((net_gm(x) - y) ** 2).mean())

    def step_nv() -> None:
        with gm_nv:
            gm_nv.backward(((net_nv(x) - y) ** 2).mean())

    def step_py() -> None:
        with gm_py:
            gm_py.backward(((net_py(x) - y) ** 2).mean())

    def step_ddp() -> None:
        ((ddp(x) - y) ** 2).mean().backward()

    fns = {"gradmgr": step_gm, "plan-only": step_nv, "buckets": step_py, "ddp": step_ddp}
    times: Dict[str, List[float]] = {k: [] for k in fns}
    order = random.Random(0)
    warmup = 5
    for i in range(warmup + steps):
        names = list(fns)
        order.shuffle(names)  # the same order on both ranks (same seed)
        for variant in names:
            dist.barrier()
            sync(device)
            start = time.perf_counter()
            fns[variant]()
            opts[variant].step()
            opts[variant].zero_grad(set_to_none=True)
            sync(device)
            if i >= warmup:
                times[variant].append(time.perf_counter() - start)
    same = all(torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d) for a, b, c, d in
               zip(net_gm.parameters(), net_py.parameters(), net_ddp.parameters(),
                   net_nv.parameters()))
    gm_ms, nv_ms, py_ms, ddp_ms = (statistics.median(times[v]) * 1e3
                                   for v in ("gradmgr", "plan-only", "buckets", "ddp"))
    return name, sum(1 for _ in net_gm.parameters()), steps, gm_ms, nv_ms, py_ms, ddp_ms, same


# ---------------------------------------------------------------------------------- memory
def memory_main(rank: int, world: int, port: int, variant: str, device_name: str,
                out: str) -> None:
    device = init(rank, port, device_name)
    try:
        # Library code loads before the baseline on both sides (DDP's at the top of this file;
        # gradmgr loads its torch backend and reducer module when first used).
        import gradmgr.backends.torch.reducer  # noqa: F401
        from gradmgr.registry import resolve_backend

        resolve_backend("torch")
        torch.manual_seed(0)
        net = memory_model().to(device)
        x = torch.randn(BATCH, 2048, device=device)
        y = torch.randn(BATCH, 2048, device=device)
        dist.barrier()
        sync(device)
        # Everything from here on counts: DDP's buckets, gradmgr's, gradients, activations.
        if device.type == "cuda":
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            base = rss()
            reset_peak_rss()  # reset VmHWM to the current resident set
        if variant == "gradmgr":
            gm = GradManager().attach(net.parameters(), callbacks=[make_allreduce_cb("mean")])
            model = net
        else:
            model = DDP(net, gradient_as_bucket_view=variant == "ddp-bucket-view")
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)

        def step() -> None:
            if variant == "gradmgr":
                with gm:
                    gm.backward(((model(x) - y) ** 2).mean())
            else:
                ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(4):
            step()
        sync(device)
        peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss())
        dist.barrier()
        if rank == 0:
            with open(out, "w") as f:
                f.write(str(peak - base))
    finally:
        dist.destroy_process_group()


def measure_memory(runs: int, device: str) -> Dict[str, float]:
    variants = ["ddp", "ddp-bucket-view", "gradmgr"]
    results: Dict[str, List[int]] = {v: [] for v in variants}
    with allocator(MMAP_THRESHOLD):  # the timing ranks ran before, under glibc's default
        for run in range(runs):
            for variant in variants[run % 3:] + variants[:run % 3]:  # rotate the order
                text = ranks_output(memory_main, dist_world(device), variant, device)
                if text is None:
                    raise RuntimeError(f"memory run of {variant} failed")
                results[variant].append(int(text))
    return {v: statistics.median(r) / 2**20 for v, r in results.items()}


# ---------------------------------------------------------------------------------- main
def main(argv: list = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--memory-runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="30 steps, 1 memory run")
    args = parser.parse_args(argv)
    steps, runs = (30, 1) if args.quick else (args.steps, args.memory_runs)
    print(machine_info(["torch"]))
    world = dist_world(args.device)
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(f"setup: {world} ranks, {backend} on 127.0.0.1, 1 thread each, batch {BATCH} per rank, "
          f"SGD; DDP with default settings for the time")
    text = ranks_output(time_main, world, steps, args.device)
    if text is None:
        return 1
    rows = [line.split() for line in text.splitlines()]
    print("gradmgr: the default (plain backwards reduced by torch's C++ Reducer); plan-only: the "
          "same with verify='plan' (no per-step plan check); buckets: the same callback with "
          "native=False (gradmgr's own buckets, per-tensor callbacks); ratio and buckets: to DDP; "
          "check: gradmgr / plan-only")
    print(f"\n{'model':>14} {'tensors':>7} {'steps':>5} {'gradmgr ms':>10} {'plan-only':>9} "
          f"{'buckets ms':>10} {'DDP ms':>8} {'ratio':>6} {'check':>6} {'buckets':>7}  "
          f"params equal")
    for name, tensors, n, gm_ms, nv_ms, py_ms, ddp_ms, same in rows:
        ratio = float(gm_ms) / float(ddp_ms)
        print(f"{name:>14} {tensors:>7} {n:>5} {float(gm_ms):>10.3f} {float(nv_ms):>9.3f} "
              f"{float(py_ms):>10.3f} {float(ddp_ms):>8.3f} {ratio:>6.3f} "
              f"{float(gm_ms) / float(nv_ms):>6.3f} {float(py_ms) / float(ddp_ms):>7.3f}  {same}")
        verdict = "OK" if ratio <= TIME_TARGET else "MISS"
        print(f"{RESULT_PREFIX} ddp {args.device} {name} gradmgr/DDP time {ratio:.3f} "
              f"(target <= {TIME_TARGET}) {verdict}")
        print(f"{RESULT_PREFIX} ddp {args.device} {name} per-step plan check "
              f"gradmgr/plan-only time {float(gm_ms) / float(nv_ms):.3f}")
    peaks = measure_memory(runs, args.device)
    kind = "max_memory_allocated" if args.device == "cuda" else "peak RSS (VmHWM)"
    print(f"\nmemory: 8 x Linear(2048, 2048), {world} ranks, {kind} above the model, "
          f"median of {runs} run(s) per variant")
    for variant, mib in peaks.items():
        print(f"{variant:>16}: {mib:8.1f} MiB")
    for ref in ("ddp-bucket-view", "ddp"):
        ratio = peaks["gradmgr"] / peaks[ref]
        target = f"(target <= {MEMORY_TARGET}) " if ref == "ddp-bucket-view" else ""
        verdict = ("OK" if ratio <= MEMORY_TARGET else "MISS") if target else ""
        print(f"{RESULT_PREFIX} ddp {args.device} memory gradmgr/{ref} {ratio:.3f} "
              f"{target}{verdict}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
