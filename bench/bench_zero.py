"""Sharded data parallelism (issue 20): gradmgr's ZeRO-2 against DDP, ZeRO-1 and FSDP2, per rank.

Model: 8 x ``nn.Linear(2048, 2048)`` (128 MiB of fp32 parameters), AdamW, MSE loss, a batch of
16 x 2048 per rank (the rank's own data, the same for every variant), gloo on the CPU, one
thread per rank, 2 and 4 ranks. Variants:

- ``ddp``: ``DistributedDataParallel(model)`` + AdamW
- ``ddp-view``: the same with ``gradient_as_bucket_view=True``
- ``zero1``: DDP with bucket views + ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)``
- ``fsdp2``: ``fully_shard(reshard_after_forward=False)`` on every Linear and on the root, AdamW
- ``gradmgr``: gradmgr ``data_parallel(model)`` + AdamW (the allreduce path)
- ``sharded``: gradmgr ``data_parallel(model, shard=True)`` + ``ShardedOptimizer(gm, AdamW)``
- ``deferred``: the same with ``ShardedOptimizer(..., gather="deferred")``: the parameter
  gather left in flight by the step, waited for per layer in the next forward
- ``full``: gradmgr ``data_parallel(model, shard="full", blocks=[nn.Linear],
  reshard_after_forward=False)`` + AdamW: full sharding on FSDP2, set up as ``fsdp2`` is

Every variant runs in fresh processes (spawned), one job per variant and round; each round runs
every variant once, in a new random order, so that load from other jobs hits them alike; the
tables give medians over the rounds (and the least), the ratios are taken within each round
(variant / DDP of the same round) and then their median.

Time and memory come from separate runs, each under its own allocator. The timing rounds' ranks
run under glibc's default allocator, the one users run, and give the step times and the
parameter checks. The memory runs (``--memory-rounds``, 1 by default: memory moves by less than
1 MiB from one round to the next, 0.1 MiB in the runs bench/RESULTS.md records and 0.4 MiB in
wt/benchzero's check; more rounds print their largest spread) start their ranks with
``MALLOC_MMAP_THRESHOLD_=131072``: every block of 128 KiB and more is then a mapping of its own,
so a freed tensor leaves the resident set and the peaks below are exact. That setting also gives
every such block fresh pages to fault in, which charged a step that allocates afresh (ZeRO-2's)
with page faults when the times came from these runs too (bench/RESULTS.md, wt/zprofile). A
memory run skips the back-to-back steps.

Per rank, in the order a run does it: imports, process group, a warm-up of the same variant on
a small model (library code loads, lazily built state of the process group), the model and the
batches; then **base** (the resident set, RSS, and the peak RSS ``VmHWM`` reset to it by writing
5 to ``/proc/self/clear_refs``); wrapping, the optimizer, the warm-up step(s); then **warm**
(RSS again, the peak reset again); then the timed steps, each behind a barrier (the time of a
step is the slowest rank's). Columns:

- ``grads``, ``optim``, ``held``, ``peak``, ``peak/warm``: from the memory runs;
- ``grads``, ``optim``: bytes of ``.grad`` (the local shard of a DTensor; for sharded the
  gradient shards, ``opt.memory()``) after a backward, and of the optimizer's state tensors
  after a step, on the busiest rank; ``/(DDP/N)``: their sum over DDP's sum divided by the
  number of ranks (1.0 is a perfect 1/N share);
- ``held``: RSS at warm minus RSS at base (what stays between steps: state, buckets, shards;
  below 0 where the wrapping shards the parameters themselves, as FSDP2 does);
- ``peak``: the highest RSS during the warm-up and timed steps minus RSS at base (everything
  the variant adds to the process: state, buffers, gradients, activations, transients);
- ``peak/warm``: the highest RSS during the timed steps minus RSS at warm (the transients of a
  steady step alone);
- ``step``, ``time/DDP``: from the timing runs; median step time (forward, backward,
  optimizer step, ``zero_grad``);
- ``params``: from the timing runs; the parameters after the last step against DDP's (every rank
  holds the same): ``==`` bit for bit, else the largest and the mean absolute difference.
  sharded must equal DDP bit for bit on 2 ranks; elsewhere (4 ranks, where the collectives may
  sum in another order; FSDP2 on torch 2.8, whose arithmetic differs) the mean difference must
  stay below lr/10, or the run fails: the table never compares a broken run. (Not the largest:
  AdamW divides each gradient by its own running norm, so an element whose gradient is rounding
  noise moves by up to about lr per step either way; a wrong gradient moves almost every element
  by about lr per step.) AdamW hides a gradient scaled by a constant (the N-times gradients of
  FSDP2's average over gloo on torch 2.8, which ``fsdp2`` avoids by having FSDP2 sum and divide
  itself, as gradmgr's full sharding does), so the column also gives the first backward's
  whole-gradient norm over DDP's, which must be 1 within 1e-3; ``full`` and ``fsdp2`` (the same
  engine, the same sums) must agree bit for bit, and the largest difference between them is
  printed.

Targets (issue 20, sharded): grads + optimizer per rank <= DDP/N x 1.05; ``peak`` (everything
above the model) <= 240 MiB on 2 ranks; step time <= 1.05 x DDP.

    python bench/bench_zero.py [--worlds 2 4] [--rounds R] [--memory-rounds M] [--steps N]
                               [--warmup W] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    MMAP_THRESHOLD,
    RESULT_PREFIX,
    allocator,
    allocator_label,
    machine_info,
    peak_rss,
    reset_peak_rss,
    rss,
)

from gradmgr.distributed import ShardedOptimizer, data_parallel, spawn_local  # noqa: E402

try:  # FSDP2 (torch >= 2.6)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - old torch
    fully_shard = None

VARIANTS = ("ddp", "ddp-view", "zero1", "fsdp2", "gradmgr", "sharded", "deferred", "full")
LABELS = {
    "ddp": "DDP + AdamW",
    "ddp-view": "DDP(bucket view) + AdamW",
    "zero1": "DDP(bucket view) + ZeroRedundancyOptimizer(AdamW)",
    "fsdp2": "FSDP2 fully_shard(reshard_after_forward=False) per Linear + root, AdamW",
    "gradmgr": "gradmgr data_parallel(model) + AdamW",
    "sharded": "gradmgr data_parallel(model, shard=True) + ShardedOptimizer(AdamW)",
    "deferred": "the same, ShardedOptimizer(AdamW, gather='deferred')",
    "full": "gradmgr data_parallel(model, shard='full', blocks=[Linear], "
            "reshard_after_forward=False) + AdamW",
}
WIDTH, LAYERS, BATCH, LR = 2048, 8, 16, 1e-4
TIME_TARGET, STATE_TARGET, PEAK_TARGET_MIB = 1.05, 1.05, 240.0
MEAN_TOLERANCE = LR / 10  # mean |difference| from DDP's parameters (see the docstring)
NORM_TOLERANCE = 1e-3  # relative: the norm of float32 sums in another order (5e-5 seen)
MIB = 2**20
MEMORY = ("grads", "state", "held", "peak", "peak_warm")  # the columns the memory runs give
TIMING, MEASURING = None, MMAP_THRESHOLD  # the allocators: glibc's default; freed blocks unmapped


def model(width: int = WIDTH, layers: int = LAYERS) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def batches(n: int, rank: int, width: int = WIDTH) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The rank's own data, the same for every variant."""
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * step + rank)
        out.append((torch.randn(BATCH, width, generator=g), torch.randn(BATCH, width, generator=g)))
    return out


# ---------------------------------------------------------------------------------- memory
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def tensor_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if t is not None:
            t = _local(t)
            total += t.numel() * t.element_size()
    return total


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------------------------- variants
class Variant:
    """One way to train ``net``: ``step(x, y, probe)`` (``probe`` runs between the backward
    and the optimizer step), ``grads()`` and ``state()`` in bytes, ``params()`` flat."""

    def __init__(self, name: str, net: nn.Module, world: int) -> None:
        self.name, self.net = name, net
        loss = nn.functional.mse_loss
        if name in ("ddp", "ddp-view", "zero1"):
            ddp = DDP(net, gradient_as_bucket_view=name != "ddp")
            if name == "zero1":
                opt: Any = ZeroRedundancyOptimizer(net.parameters(),
                                                   optimizer_class=torch.optim.AdamW, lr=LR)
                self._local_opt = opt.optim
            else:
                opt = self._local_opt = torch.optim.AdamW(net.parameters(), lr=LR)

            def backward(x: torch.Tensor, y: torch.Tensor) -> None:
                loss(ddp(x), y).backward()
        elif name in ("fsdp2", "fsdp2-reshard"):  # the second: bench_scaling.py's
            if fully_shard is None:
                raise RuntimeError("this torch has no torch.distributed.fsdp.fully_shard")
            mesh = init_device_mesh("cpu", (world,))
            reshard = name == "fsdp2-reshard"
            for layer in net:
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(net, mesh=mesh, reshard_after_forward=reshard)
            # FSDP2 asks gloo's reduce-scatter for an average, which torch 2.8's gloo returns
            # as the sum (every gradient N times too large); a sum that FSDP2 divides itself is
            # the mean on every version, as gradmgr's full sharding has it
            for wrapped in [*net, net]:
                wrapped.set_force_sum_reduction_for_comms(True)
            opt = self._local_opt = torch.optim.AdamW(net.parameters(), lr=LR)

            def backward(x: torch.Tensor, y: torch.Tensor) -> None:
                loss(net(x), y).backward()
        elif name == "full":
            gm = data_parallel(net, shard="full", blocks=[nn.Linear],
                               reshard_after_forward=False)
            opt = self._local_opt = torch.optim.AdamW(net.parameters(), lr=LR)

            def backward(x: torch.Tensor, y: torch.Tensor) -> None:
                with gm:
                    gm.backward(loss(net(x), y))
        elif name in ("gradmgr", "sharded", "deferred"):
            gm = data_parallel(net, shard=name != "gradmgr")
            if name == "gradmgr":
                opt = self._local_opt = torch.optim.AdamW(net.parameters(), lr=LR)
            else:
                opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR,
                                       gather="deferred" if name == "deferred" else "eager")
                self._local_opt = None

            def backward(x: torch.Tensor, y: torch.Tensor) -> None:
                with gm:
                    gm.backward(loss(net(x), y))
        else:
            raise ValueError(f"unknown variant {name!r}")
        self.opt, self._backward = opt, backward

    def step(self, x: torch.Tensor, y: torch.Tensor,
             probe: Optional[Callable[[], None]] = None) -> None:
        self._backward(x, y)
        if probe is not None:
            probe()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def settle(self) -> None:
        """Wait for what the last step left in flight (the deferred gather)."""
        if self.name == "deferred":
            self.opt.finish_gather()

    def grads(self) -> int:
        if self.name in ("sharded", "deferred"):
            return self.opt.memory()["gradients"]
        return tensor_bytes(p.grad for p in self.net.parameters())

    def state(self) -> int:
        if self.name in ("sharded", "deferred"):
            return self.opt.memory()["optimizer"]
        return state_bytes(self._local_opt)

    def grad_norm(self) -> float:
        """The 2-norm of the whole reduced gradient (every rank's shards), after a backward."""
        if self.name in ("sharded", "deferred"):
            return float(self.opt.clip_grad_norm_(float("inf")))  # inf: scales nothing
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.net.parameters()
                                              if p.grad is not None])
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def params(self) -> torch.Tensor:
        if self.name == "deferred":
            self.opt.finish_gather()  # a read of the parameters outside the forward
        with torch.no_grad():
            return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p)
                              .detach().reshape(-1) for p in self.net.parameters()])


# ---------------------------------------------------------------------------------- a run
def rank_main(rank: int, world: int, port: int, name: str, steps: int, warmup: int,
              outdir: str, mode: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13's renamed collectives
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        _run(rank, world, name, steps, warmup, outdir, mode)
    finally:
        dist.destroy_process_group()


def _run(rank: int, world: int, name: str, steps: int, warmup: int, outdir: str,
         mode: str) -> None:
    """One run; ``mode`` "time" adds the back-to-back steps and saves the parameters, "memory"
    does neither (its peaks are read before them)."""
    # Library code and the process group's lazily built state load before the baseline: the
    # same variant trains a small model for two steps first.
    small = Variant(name, model(64, 2), world)
    for x, y in batches(2, rank, 64):
        small.step(x, y)
    del small
    gc.collect()

    torch.manual_seed(0)
    net = model()
    data = batches(warmup + 2 * steps, rank)
    gc.collect()
    dist.barrier()
    base = rss()
    reset_peak_rss()

    variant = Variant(name, net, world)
    del net
    counted: Dict[str, float] = {}

    def probe() -> None:
        counted["grads"] = variant.grads()
        counted["norm"] = variant.grad_norm()  # (a collective for sharded gradients)

    for i in range(warmup):
        variant.step(*data[i], probe=probe if i == 0 else None)
        if i == 0:
            counted["state"] = variant.state()
    peak_first = peak_rss()
    dist.barrier()
    warm = rss()
    reset_peak_rss()

    times = []
    for i in range(warmup, warmup + steps):
        x, y = data[i]
        dist.barrier()
        start = time.perf_counter()
        variant.step(x, y)
        times.append(time.perf_counter() - start)
    peak_steady = peak_rss()
    loop = _back_to_back(variant, data[warmup + steps:], steps) if mode == "time" else None
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    flat = variant.params()
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    if rank == 0 and mode == "time":
        torch.save(flat, os.path.join(outdir, f"params-{name}.pt"))
    record = {
        "rank": rank, "grads": counted["grads"], "state": counted["state"],
        "held": warm - base, "peak": max(peak_first, peak_steady) - base,
        "peak_warm": peak_steady - warm, "times": slowest.tolist(), "digest": digest,
        "norm": counted["norm"], "loop": loop,
    }
    with open(os.path.join(outdir, f"{mode}-{name}-rank{rank}.json"), "w") as f:
        json.dump(record, f)


def _back_to_back(variant: Variant, data: List[Tuple[torch.Tensor, torch.Tensor]],
                  steps: int) -> float:
    """The mean time of ``steps`` more steps, back to back, on the slowest rank."""
    # The same steps again back to back, one barrier before and one after the last (the
    # gather a deferred step leaves in flight is waited for inside it): the per-step barrier
    # above would wait for that gather outside the timed region (gloo's barrier waits for the
    # work issued before it), so only this time is fair to "deferred".
    dist.barrier()
    start = time.perf_counter()
    for x, y in data[:steps]:
        variant.step(x, y)
    variant.settle()
    loop = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
    dist.all_reduce(loop, op=dist.ReduceOp.MAX)
    return float(loop[0])


# ---------------------------------------------------------------------------------- parent
class Runs:
    """Results of one world size: per variant, one record per timing round (``rounds``) and
    one per memory round (``memory``)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.rounds: Dict[str, List[Dict[str, Any]]] = {v: [] for v in VARIANTS}
        self.memory: Dict[str, List[Dict[str, int]]] = {v: [] for v in VARIANTS}
        # per round, the largest and the mean |difference| from DDP's parameters
        self.params: Dict[str, List[Tuple[float, float]]] = {v: [] for v in VARIANTS}
        # per round, the first backward's whole-gradient norm over DDP's (1.0: DDP's mean)
        self.norms: Dict[str, List[float]] = {v: [] for v in VARIANTS}
        self.full_vs_fsdp2: List[float] = []  # per round, the largest |difference|


def spawn_variant(world: int, name: str, mode: str, steps: int, warmup: int,
                  outdir: str) -> List[Dict[str, Any]]:
    """One run of ``name`` on fresh ranks, under the allocator of ``mode`` ("time": glibc's
    default; "memory": freed blocks unmapped); the ranks' records."""
    with allocator(TIMING if mode == "time" else MEASURING):
        failed = spawn_local(rank_main, world, name, steps, warmup, outdir, mode)
    if failed:
        raise RuntimeError(f"{name} on {world} ranks failed ({mode} run)")
    ranks = []
    for rank in range(world):
        with open(os.path.join(outdir, f"{mode}-{name}-rank{rank}.json")) as f:
            ranks.append(json.load(f))
    if len({rec["digest"] for rec in ranks}) != 1:
        raise RuntimeError(f"{name} on {world} ranks: the ranks' parameters differ")
    return ranks


def run_world(world: int, variants: List[str], rounds: int, memory_rounds: int, steps: int,
              warmup: int, log: Callable[[str], None]) -> Runs:
    runs = Runs(world)
    for r in range(rounds):
        with tempfile.TemporaryDirectory(prefix="bench_zero-") as outdir:
            for name in _shuffled(variants, 1000 * world + r):
                start = time.perf_counter()
                ranks = spawn_variant(world, name, "time", steps, warmup, outdir)
                rec = {"step": statistics.median(ranks[0]["times"]),
                       "best": min(ranks[0]["times"]), "norm": ranks[0]["norm"],
                       "loop": ranks[0]["loop"]}
                runs.rounds[name].append(rec)
                log(f"  {world} ranks, round {r + 1}/{rounds}: {name:<8} step "
                    f"{rec['step'] * 1e3:7.1f} ms, back to back {rec['loop'] * 1e3:7.1f} ms "
                    f"({time.perf_counter() - start:.0f} s)")
            _compare_params(runs, variants, outdir)
    for r in range(memory_rounds):
        with tempfile.TemporaryDirectory(prefix="bench_zero-") as outdir:
            for name in _shuffled(variants, 1000 * world + 500 + r):
                start = time.perf_counter()
                ranks = spawn_variant(world, name, "memory", steps, warmup, outdir)
                mem = {k: max(rec[k] for rec in ranks) for k in MEMORY}
                runs.memory[name].append(mem)
                log(f"  {world} ranks, memory run {r + 1}/{memory_rounds}: {name:<8} held "
                    f"{mem['held'] / MIB:6.1f} MiB, peak {mem['peak'] / MIB:6.1f} MiB "
                    f"({time.perf_counter() - start:.0f} s)")
    return runs


def _shuffled(variants: List[str], seed: int) -> List[str]:
    order = list(variants)
    random.Random(seed).shuffle(order)
    return order


def _compare_params(runs: Runs, variants: List[str], outdir: str) -> None:
    """One timing round's parameters against DDP's, and full's against fsdp2's."""
    if "ddp" in variants:
        ref = torch.load(os.path.join(outdir, "params-ddp.pt"))
        for name in variants:
            diff = (ref - torch.load(os.path.join(outdir, f"params-{name}.pt"))).abs()
            runs.params[name].append((float(diff.max()), float(diff.mean())))
            del diff
            runs.norms[name].append(runs.rounds[name][-1]["norm"]
                                    / runs.rounds["ddp"][-1]["norm"])
        del ref
    if "full" in variants and "fsdp2" in variants:  # the same engine, the same sums
        full, fsdp2 = (torch.load(os.path.join(outdir, f"params-{n}.pt"))
                       for n in ("full", "fsdp2"))
        runs.full_vs_fsdp2.append(float((full - fsdp2).abs().max()))


def _med(values: List[float]) -> float:
    return statistics.median(values)


def report(runs: Runs, steps: int, warmup: int) -> Tuple[List[str], bool]:
    """Print the table of one world size; return the RESULT lines and whether the parameter
    checks passed."""
    world, rounds = runs.world, runs.rounds
    names = [v for v in VARIANTS if rounds[v]]
    n, m = len(rounds[names[0]]), len(runs.memory[names[0]])
    print(f"\n{world} ranks (gloo, 1 thread each), each run a fresh spawn of one variant, every "
          f"round in a new random order; step, time/DDP and params: {n} timing round(s) under "
          f"{allocator_label(TIMING)}, step the median of {steps} timed steps after {warmup} "
          f"warm-up; grads to peak/warm: {m} memory round(s) under "
          f"{allocator_label(MEASURING)}, MiB per rank (the busiest); medians over the rounds, "
          f"min in brackets")
    print(f"{'variant':>9} {'step ms':>15} {'time/DDP':>15} {'grads':>7} {'optim':>7} "
          f"{'/(DDP/N)':>8} {'held':>7} {'peak':>7} {'peak/warm':>9}  params vs DDP")
    ok = True
    ratios: Dict[str, List[float]] = {}
    for name in names:
        ok = _row(runs, name, ratios) and ok
    if runs.full_vs_fsdp2:
        worst = max(runs.full_vs_fsdp2)
        print(f"full against fsdp2 (the same engine, the same sums): parameters' largest "
              f"|difference| {worst:.1e}" + ("" if worst == 0 else "  BROKEN"))
        ok = ok and worst == 0
    if m > 1:  # memory is taken to be the same in every round: say how far it is
        spread = {(name, k): max(r[k] for r in runs.memory[name])
                  - min(r[k] for r in runs.memory[name]) for name in names for k in MEMORY}
        (name, k), most = max(spread.items(), key=lambda kv: kv[1])
        print(f"memory over the {m} memory rounds: largest spread {most / MIB:.2f} MiB "
              f"({name}, {k})")
    lines = _result_lines(runs, names, ratios)
    if not ok:
        print(f"BROKEN: a variant's parameters after training are not DDP's ({world} ranks): "
              f"its row compares a broken run")
    return lines, ok


def _share(runs: Runs, name: str) -> List[float]:
    """Per memory round, the variant's gradients + optimizer state over DDP's / N."""
    return [(r["grads"] + r["state"]) / ((d["grads"] + d["state"]) / runs.world)
            for r, d in zip(runs.memory[name], runs.memory["ddp"])]


def _row(runs: Runs, name: str, ratios: Dict[str, List[float]]) -> bool:
    """Print the variant's row (its time ratios into ``ratios``); False where it is broken."""
    recs, ddp = runs.rounds[name], runs.rounds.get("ddp") or []
    step = [r["step"] for r in recs]
    if ddp:
        ratios[name] = [r["step"] / d["step"] for r, d in zip(recs, ddp)]
        best = min(r["best"] for r in recs) / min(d["best"] for d in ddp)
        time_col = f"{_med(ratios[name]):6.3f} ({best:5.3f})"
        share_col = f"{_med(_share(runs, name)):8.3f}"
    else:
        time_col, share_col = f"{'-':>15}", f"{'-':>8}"
    ok, diffs = True, runs.params[name]
    if not diffs:
        params_col = "(no DDP run)"
    else:
        worst, mean = max(d[0] for d in diffs), max(d[1] for d in diffs)
        params_col = "==" if worst == 0 else f"|diff| max {worst:.1e}, mean {mean:.1e}"
        norm = max(runs.norms[name], key=lambda r: abs(r - 1.0))
        params_col += f", |grad|/DDP's {norm:.6f}"
        exact = name in ("sharded", "deferred") and runs.world == 2
        if (exact and worst != 0) or mean > MEAN_TOLERANCE or abs(norm - 1) > NORM_TOLERANCE:
            params_col += "  BROKEN"
            ok = False
    mib = {k: _med([r[k] for r in runs.memory[name]]) / MIB for k in MEMORY}
    print(f"{name:>9} {_med(step) * 1e3:7.1f} ({min(step) * 1e3:5.1f}) {time_col} "
          f"{mib['grads']:7.1f} {mib['state']:7.1f} {share_col} {mib['held']:7.1f} "
          f"{mib['peak']:7.1f} {mib['peak_warm']:9.1f}  {params_col}")
    return ok


def _result_lines(runs: Runs, names: List[str], ratios: Dict[str, List[float]]) -> List[str]:
    world, lines = runs.world, []
    if "sharded" in names and runs.rounds.get("ddp"):
        lines.append(_target(f"zero {world} ranks sharded (grads+optimizer)/(DDP/N)",
                             _med(_share(runs, "sharded")), STATE_TARGET, "x"))
        if world == 2:
            mem = runs.memory["sharded"]
            lines.append(_target(f"zero {world} ranks sharded peak RSS above the model",
                                 _med([r["peak"] for r in mem]) / MIB, PEAK_TARGET_MIB, " MiB"))
            steady = _med([r["peak_warm"] for r in mem]) / MIB
            lines.append(_said(f"zero {world} ranks sharded peak RSS above the resident set "
                               f"after the warm-up step: {steady:.1f} MiB"))
        lines.append(_target(f"zero {world} ranks sharded time/DDP", _med(ratios["sharded"]),
                             TIME_TARGET, "x"))
        for name in ("zero1", "fsdp2", "full", "gradmgr"):
            if name in ratios:
                lines.append(_said(f"zero {world} ranks {name} time/DDP "
                                   f"{_med(ratios[name]):.3f}x"))
    for name in names:  # back to back: the deferred gather's fair time (see _back_to_back)
        loop = _med([r["loop"] for r in runs.rounds[name]])
        lines.append(_said(f"zero {world} ranks {name} back-to-back step {loop * 1e3:.1f} ms"))
    return lines


def _said(text: str) -> str:
    line = f"{RESULT_PREFIX} {text}"
    print(line)
    return line


def _target(label: str, value: float, target: float, unit: str) -> str:
    verdict = "PASS" if value <= target else "MISS"
    number = f"{value:.1f}" if unit.strip() == "MiB" else f"{value:.3f}"
    line = f"{RESULT_PREFIX} {label}: {number}{unit} (target <= {target:g}{unit}) {verdict}"
    print(line, flush=True)
    return line


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="+", default=["2", "4"],
                        help="numbers of ranks (2 4, or 2,4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-rounds", type=int, default=1,
                        help="rounds of memory runs (under MALLOC_MMAP_THRESHOLD_); more than "
                             "1 prints the largest spread between them")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 ranks, 1 round (and 1 memory round), 2 timed steps")
    args = parser.parse_args(argv)
    worlds = [int(w) for item in args.worlds for w in item.split(",") if w]
    rounds, steps = args.rounds, args.steps
    if args.quick:
        worlds, rounds, steps = [2], 1, 2
        args.memory_rounds = 1
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown or min(args.warmup, steps, rounds, args.memory_rounds) < 1:
        parser.error(f"unknown variants {sorted(unknown)}" if unknown
                     else "--warmup, --steps, --rounds and --memory-rounds must be at least 1")
    if fully_shard is None and "fsdp2" in variants:
        print("fsdp2 left out: this torch has no torch.distributed.fsdp.fully_shard")
        variants.remove("fsdp2")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(__doc__.split("\n\n")[0])
    print(machine_info(["torch"]))
    print(f"model: {LAYERS} x Linear({WIDTH}, {WIDTH}), "
          f"{LAYERS * (WIDTH * WIDTH + WIDTH) * 4 / MIB:.1f} MiB fp32; batch {BATCH} x {WIDTH} "
          f"per rank; AdamW(lr={LR}); gloo on 127.0.0.1")
    for name in variants:
        print(f"  {name:>9}: {LABELS[name]}")
    start = time.perf_counter()
    lines: List[str] = []
    ok = True
    for world in worlds:
        runs = run_world(world, variants, rounds, args.memory_rounds, steps, args.warmup,
                         lambda s: print(s, file=sys.stderr, flush=True))
        more, fine = report(runs, steps, args.warmup)
        lines += more
        ok = ok and fine
    print(f"\ntook {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
