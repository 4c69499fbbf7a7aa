"""Sharded data parallel (ZeRO-2) against DDP, ZeRO-1 and FSDP2: memory per rank and step time.

Model: 8 x Linear(2048, 2048) (128 MiB of fp32 parameters), AdamW, a batch of ``--batch`` rows
per rank, gloo on the CPU. Variants, each in fresh processes (``spawn_local``), their runs
interleaved over ``--rounds`` rounds in a rotating order, medians over the rounds:

* ``ddp``: ``DistributedDataParallel`` + AdamW
* ``ddp-view``: the same with ``gradient_as_bucket_view=True``
* ``zero1``: DDP (bucket view) + ``ZeroRedundancyOptimizer(AdamW)``
* ``fsdp2``: ``fully_shard`` on each Linear and the root, ``reshard_after_forward=False``
  (ZeRO-2's equivalent; it shards the parameters too)
* ``gradmgr``: ``data_parallel(model)`` + AdamW (the allreduce path)
* ``sharded``: ``data_parallel(model, shard=True)`` + ``ShardedOptimizer(gm, AdamW)``

Per rank: ``peak``, the peak resident set from the wrapping of the model to the end of the
measured steps above the resident set before it (``VmHWM`` reset through
``/proc/self/clear_refs`` once imports, the process group and the model exist, and an AdamW
built once so that the modules it loads lazily are in; glibc told to mmap blocks of 128 KiB and
more so that freed tensors leave the resident set): everything a variant adds to the model,
its gradients, optimizer state, buckets, activations, whatever is in flight; ``transient``,
the same peak above the resident set after the warm-up step (what a step adds on top of what
stays); the bytes of gradients and of optimizer state held right after a backward; and the
median step time (forward, backward, optimizer step, each step behind a barrier).
Every variant's parameters after the steps are compared with DDP's (``same``: bit for bit).

Targets (issue 20): gradients + optimizer state per rank <= DDP's / world x 1.05; whole-process
peak above the baseline <= 240 MiB on 2 ranks; step time <= 1.05 x DDP's.

    python bench/bench_zero.py [--worlds 2 4] [--steps 5] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULT_PREFIX, machine_info, peak_rss, reset_peak_rss, rss  # noqa: E402

from gradmgr.distributed import ShardedOptimizer, data_parallel, spawn_local  # noqa: E402

VARIANTS = ["ddp", "ddp-view", "zero1", "fsdp2", "gradmgr", "sharded"]
WIDTH, LAYERS, LR = 2048, 8, 1e-4
MIB = 2**20
MEMORY_SLACK, PEAK_TARGET_MIB, TIME_TARGET = 1.05, 240, 1.05


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensors


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(_local(v).nbytes for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


class Variant:
    """One way to train the model: ``step(x, y)`` and what it holds."""

    def __init__(self, name: str, net: nn.Module) -> None:
        self.name, self.net, self.gm = name, net, None
        adamw = dict(lr=LR)
        if name in ("ddp", "ddp-view", "zero1"):
            self.module = DDP(net, gradient_as_bucket_view=name != "ddp")
        elif name == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in net:
                fully_shard(layer, reshard_after_forward=False)
            self.module = fully_shard(net, reshard_after_forward=False)
        else:
            self.module = net
            self.gm = data_parallel(net, shard=name == "sharded")
        if name == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, **adamw)
            self.inner = self.opt.optim
        elif name == "sharded":
            self.opt = ShardedOptimizer(self.gm, torch.optim.AdamW, **adamw)
            self.inner = self.opt.optimizer
        else:
            self.opt = self.inner = torch.optim.AdamW(net.parameters(), **adamw)

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.gm is None:
            ((self.module(x) - y) ** 2).mean().backward()
        else:
            with self.gm:
                self.gm.backward(((self.module(x) - y) ** 2).mean())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.backward(x, y)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def held(self) -> Dict[str, int]:
        """Gradient and optimizer-state bytes on this rank, right after a backward."""
        if self.name == "sharded":
            return self.opt.memory()
        grads = sum(_local(p.grad).nbytes for p in self.net.parameters() if p.grad is not None)
        return {"gradients": grads, "optimizer": _state_bytes(self.inner)}

    def params_digest(self) -> str:
        digest = hashlib.sha256()
        for p in self.net.parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            digest.update(full.detach().contiguous().numpy().tobytes())
        return digest.hexdigest()


def run_rank(rank: int, world: int, port: int, name: str, steps: int, batch: int,
             out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    try:
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # its lazy imports before the baseline
        net = model()
        gen = torch.Generator().manual_seed(1000 + rank)
        data = [(torch.randn(batch, WIDTH, generator=gen), torch.randn(batch, WIDTH, generator=gen))
                for _ in range(steps + 1)]
        dist.barrier()
        base = rss()
        reset_peak_rss()  # VmHWM := the resident set now
        variant = Variant(name, net)
        variant.step(*data[0])  # warm-up: state allocated, buckets built
        after_warm_up = rss()
        times: List[float] = []
        held: Dict[str, int] = {}
        for x, y in data[1:]:
            dist.barrier()
            start = time.perf_counter()
            variant.backward(x, y)
            if not held:
                held = variant.held()  # before the step frees anything
            variant.opt.step()
            variant.opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        peak, transient = peak_rss() - base, peak_rss() - after_warm_up
        digest = variant.params_digest()
        del variant
        dist.barrier()
        with open(f"{out}.rank{rank}", "w") as f:
            json.dump({"time": statistics.median(times), "peak": peak, "transient": transient,
                       "digest": digest,
                       **held}, f)
    finally:
        dist.destroy_process_group()


def measure(world: int, steps: int, rounds: int, batch: int) -> Dict[str, Dict[str, float]]:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # read by the spawned processes
    runs: Dict[str, List[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            k = r % len(VARIANTS)
            for name in VARIANTS[k:] + VARIANTS[:k]:
                out = os.path.join(tmp, f"{name}-{r}")
                if spawn_local(run_rank, world, name, steps, batch, out):
                    raise RuntimeError(f"{name} on {world} ranks failed")
                ranks = []
                for rank in range(world):
                    with open(f"{out}.rank{rank}") as f:
                        ranks.append(json.load(f))
                runs[name].append({
                    "time": statistics.median(x["time"] for x in ranks),
                    "peak": max(x["peak"] for x in ranks),
                    "transient": max(x["transient"] for x in ranks),
                    "gradients": max(x["gradients"] for x in ranks),
                    "optimizer": max(x["optimizer"] for x in ranks),
                    "digest": ranks[0]["digest"],
                    "ranks_agree": len({x["digest"] for x in ranks}) == 1,
                })
    table = {}
    for name, rows in runs.items():
        table[name] = {key: statistics.median(row[key] for row in rows)
                       for key in ("time", "peak", "transient", "gradients", "optimizer")}
        table[name]["digest"] = rows[0]["digest"]
        table[name]["ranks_agree"] = all(row["ranks_agree"] for row in rows)
    return table


def report(world: int, table: Dict[str, Dict[str, float]]) -> None:
    ddp = table["ddp"]
    print(f"\n{world} ranks (MiB per rank; time: median step; same: parameters equal DDP's)")
    print(f"{'variant':>9} {'peak':>7} {'transnt':>7} {'grads':>7} {'optim':>7} {'g+o':>7} "
          f"{'g+o/DDP':>8} {'step ms':>8} {'time/DDP':>9} {'same':>5} {'ranks agree':>12}")
    for name, row in table.items():
        held = row["gradients"] + row["optimizer"]
        print(f"{name:>9} {row['peak'] / MIB:7.1f} {row['transient'] / MIB:7.1f} "
              f"{row['gradients'] / MIB:7.1f} "
              f"{row['optimizer'] / MIB:7.1f} {held / MIB:7.1f} "
              f"{held / (ddp['gradients'] + ddp['optimizer']):8.3f} {row['time'] * 1e3:8.1f} "
              f"{row['time'] / ddp['time']:9.3f} {str(row['digest'] == ddp['digest']):>5} "
              f"{str(row['ranks_agree']):>12}")
    sharded = table["sharded"]
    held = sharded["gradients"] + sharded["optimizer"]
    bound = (ddp["gradients"] + ddp["optimizer"]) / world * MEMORY_SLACK
    checks = [
        (f"gradients+optimizer {held / MIB:.1f} MiB <= DDP/{world} x {MEMORY_SLACK} "
         f"= {bound / MIB:.1f} MiB", held <= bound),
        (f"step time {sharded['time'] / ddp['time']:.3f} x DDP <= {TIME_TARGET}",
         sharded["time"] / ddp["time"] <= TIME_TARGET),
        ("parameters equal DDP's bit for bit" + ("" if world == 2 else
         " (more than 2 ranks: gloo's sum order may differ, rounding expected)"),
         sharded["digest"] == ddp["digest"]),
    ]
    if world == 2:
        checks.append((f"peak {sharded['peak'] / MIB:.1f} MiB <= {PEAK_TARGET_MIB} MiB",
                       sharded["peak"] / MIB <= PEAK_TARGET_MIB))
    for what, ok in checks:
        print(f"{RESULT_PREFIX} zero {world} ranks sharded: {what} {'OK' if ok else 'MISS'}")


def main(argv: list = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="2 ranks, 2 steps, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.steps, args.rounds = [2], 2, 1
    print(__doc__.splitlines()[0])
    print(machine_info(["torch"]))
    print(f"model: {LAYERS} x Linear({WIDTH}, {WIDTH}), AdamW, batch {args.batch} per rank, "
          f"{args.steps} measured steps, {args.rounds} round(s), gloo, 1 thread per rank")
    for world in args.worlds:
        report(world, measure(world, args.steps, args.rounds, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
