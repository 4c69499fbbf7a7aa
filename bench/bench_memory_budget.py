"""A model that does not fit a rank's memory budget unsharded trains under full sharding (issue 39).

Model: 8 x ``nn.Linear(W, W)`` (W = 2048: P = 128 MiB of fp32 parameters), AdamW, MSE loss,
batch 16 per rank, gloo on the CPU, 2 ranks. Each rank builds the whole model, then sets a
budget: ``RLIMIT_DATA`` (the kernel's limit on a process's private writable memory, which
covers torch's CPU allocations: glibc maps large blocks with ``mmap``, counted since Linux 4.7)
at what the rank already holds, the model included, plus ``--budget`` MiB (default 2 P). Then it
wraps the model, makes the optimizer and trains ``--steps`` steps. An allocation beyond the
budget fails with torch's "can't allocate memory"; the rank records at which point and exits.

Variants (each in fresh processes):

- ``ddp``: ``DistributedDataParallel(model)`` + AdamW: every rank holds the gradients (P), DDP's
  buckets (P) and AdamW's two moments (2 P) beside the model: about 4 P above it;
- ``sharded``: gradmgr ``data_parallel(model, shard=True)`` + ``ShardedOptimizer(AdamW)``
  (ZeRO-2: parameters whole, gradients and state sharded);
- ``full``: gradmgr ``data_parallel(model, shard="full", blocks=[nn.Linear])`` + AdamW (full
  sharding on FSDP2, reshard after forward): the parameters themselves are sharded, so a rank
  holds P/N of each of parameters, gradients and state, and one or two blocks gathered at a
  time.

The claim measured (exit status 0 only if it holds): ``full`` trains every step within the
budget and ``ddp`` does not.

    python bench/bench_memory_budget.py [--width 2048] [--budget MIB] [--steps 3]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

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
    reset_peak_rss,
    rss,
)

from gradmgr.distributed import ShardedOptimizer, data_parallel, spawn_local  # noqa: E402

VARIANTS = ("ddp", "sharded", "full")
LAYERS, BATCH, LR, WORLD = 8, 16, 1e-4, 2
MIB = 2**20
OUT_OF_MEMORY = "can't allocate memory"  # torch's DefaultCPUAllocator, when malloc fails


def model(width: int, layers: int = LAYERS) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def private_memory() -> int:
    """``VmData``: the private writable memory ``RLIMIT_DATA`` limits, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmData line")


def wrapped(name: str, net: nn.Module) -> Tuple[Callable[[torch.Tensor, torch.Tensor], None], Any]:
    """(one backward, the optimizer) of a variant."""
    loss = nn.functional.mse_loss
    if name == "ddp":
        ddp = DDP(net)
        return (lambda x, y: loss(ddp(x), y).backward()), torch.optim.AdamW(net.parameters(),
                                                                              lr=LR)
    if name == "sharded":
        gm = data_parallel(net, shard=True)
        opt: Any = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR)
    elif name == "full":
        gm = data_parallel(net, shard="full", blocks=[nn.Linear])
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
    else:
        raise ValueError(f"unknown variant {name!r}")

    def backward(x: torch.Tensor, y: torch.Tensor) -> None:
        with gm:
            gm.backward(loss(net(x), y))
    return backward, opt


def train(name: str, net: nn.Module, data: List[Tuple[torch.Tensor, torch.Tensor]],
          progress: Dict[str, Any]) -> None:
    progress["at"] = "wrapping and the optimizer"
    backward, opt = wrapped(name, net)
    for i, (x, y) in enumerate(data):
        progress["at"] = f"step {i + 1}"
        backward(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        progress["steps"] = i + 1


def rank_main(rank: int, world: int, port: int, name: str, width: int, budget: int, steps: int,
              outdir: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    # Library code and the process group's lazily built state load before the budget is set.
    train(name, model(64, 2), [(torch.randn(4, 64), torch.randn(4, 64))] * 2, {})
    gc.collect()
    torch.manual_seed(0)
    net = model(width)
    data = [(torch.randn(BATCH, width), torch.randn(BATCH, width)) for _ in range(steps)]
    gc.collect()
    dist.barrier()
    base, base_rss = private_memory(), rss()
    reset_peak_rss()
    record: Dict[str, Any] = {"rank": rank, "steps": 0, "base": base}
    resource.setrlimit(resource.RLIMIT_DATA, (base + budget, resource.RLIM_INFINITY))
    start = time.perf_counter()
    try:
        train(name, net, data, record)
        record["outcome"] = "trained"
    except RuntimeError as error:
        if OUT_OF_MEMORY not in str(error):
            raise
        record["outcome"] = f"out of memory at {record['at']}"
    record["seconds"] = time.perf_counter() - start
    record["peak"] = peak_rss() - base_rss
    with open(os.path.join(outdir, f"{name}-rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if record["outcome"] != "trained":
        os._exit(3)  # the other rank waits in a collective: spawn_local stops it
    dist.destroy_process_group()


def run(name: str, width: int, budget: int, steps: int) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench_budget-") as outdir:
        failed = spawn_local(rank_main, WORLD, name, width, budget, steps, outdir)
        records = []
        for rank in range(WORLD):
            path = os.path.join(outdir, f"{name}-rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    records.append(json.load(f))
    if not records:
        raise RuntimeError(f"{name}: no rank wrote a record (a failure other than memory; "
                           f"spawn_local's output above says which)")
    out = [r for r in records if r["outcome"] != "trained"]
    first = out[0] if out else records[0]
    if failed and not out:
        raise RuntimeError(f"{name}: a rank failed after training (see above)")
    return {"outcome": first["outcome"], "steps": min(r["steps"] for r in records),
            "peak": max(r["peak"] for r in records), "seconds": first["seconds"]}


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=None,
                        help="MiB above what a rank holds with the whole model (default 2 P)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    params_mib = LAYERS * (args.width * args.width + args.width) * 4 / MIB
    budget_mib = args.budget if args.budget is not None else 2 * params_mib
    print(machine_info(["torch"]))
    print(f"{WORLD} gloo ranks, 8 x Linear({args.width}) (P = {params_mib:.1f} MiB), AdamW, "
          f"{args.steps} steps; budget per rank: RLIMIT_DATA at the whole model + "
          f"{budget_mib:.1f} MiB")
    results = {}
    with allocator(MMAP_THRESHOLD):  # freed blocks leave the process
        for name in args.variants:
            results[name] = run(name, args.width, int(budget_mib * MIB), args.steps)
    print(f"\n{'variant':<8} {'outcome':<44} {'steps':>5} {'peak RSS above model (MiB)':>27}")
    for name, r in results.items():
        print(f"{name:<8} {r['outcome']:<44} {r['steps']:>5} {r['peak'] / MIB:>27.1f}")
    holds = True
    if "full" in results and "ddp" in results:
        holds = (results["full"]["outcome"] == "trained"
                 and results["ddp"]["outcome"] != "trained")
        print(f"{RESULT_PREFIX} full sharding trains within the budget and DDP does not: "
              f"{'yes' if holds else 'NO'}")
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
