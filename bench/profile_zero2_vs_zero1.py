"""Where gradmgr's ZeRO-2 step spends the time ZeRO-1's does not (issue 39): bench_zero.py's
model (8 x Linear(2048), AdamW, 16 x 2048 a rank, gloo, one thread a rank), its ``zero1``
(DDP with bucket views + ZeroRedundancyOptimizer) and ``sharded`` (``data_parallel(model,
shard=True)`` + ``ShardedOptimizer``, eager gather), built fresh in each round, the rounds
interleaved (zero1, sharded, zero1, ...).

Per step, with one barrier before it and none inside, rank 0 times each phase by the wall
clock, the main thread's CPU and the whole process's CPU (gloo's threads too):

- ``forward``: the loss;
- ``backward``: ``backward()`` with its reductions (gradmgr's: ``gm.backward`` and the end of
  the ``with gm:`` block around the forward and it), until it returns (both wait there for the
  last reduction: DDP's reducer in its finalize, gradmgr's in ``gm.backward``); its wall time
  less its main-thread CPU is the time the main thread waited;
- ``opt: local AdamW``: the wrapped optimizer's ``step()`` on this rank's shard (timed by a
  wrapper on that optimizer object);
- ``opt: the rest``: the rest of ``step()``: the parameter broadcasts / all-gather and their
  wait, and the bookkeeping around the local step;
- ``zero_grad``.

Then one more step of each runs under ``torch.profiler`` on every rank: rank 0's collectives
(counted as bench/bench_scaling.py counts them) and the aten ops with the most self CPU time.

The allocator matters here: ``bench_zero.py`` sets ``MALLOC_MMAP_THRESHOLD_=131072`` (so that
freed memory leaves the process and its peak RSS is measurable), which gives every large
allocation fresh pages to fault in; ``--mmap-threshold 131072`` runs under that setting, the
default under glibc's own (bench/RESULTS.md, "wt/zprofile").

    python bench/profile_zero2_vs_zero1.py [--world 2] [--rounds 3] [--steps 4]
                                           [--mmap-threshold 131072]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import allocator, machine_info, ranks_output  # noqa: E402
from bench_scaling import collectives_of, summed  # noqa: E402
from bench_zero import LR, batches, model  # noqa: E402

from gradmgr.distributed import ShardedOptimizer, data_parallel  # noqa: E402

PHASES = ("forward", "backward", "opt: local AdamW", "opt: the rest", "zero_grad")
CLOCKS = (("wall", time.perf_counter), ("thread CPU", time.thread_time),
          ("process CPU", time.process_time))
MIB = 2**20
COPY_OPS = ("aten::copy_", "aten::mul_", "aten::mul", "aten::clone", "aten::zero_",
            "aten::div_")  # the gradient copies, scalings and clones around the reductions


class Timed:
    """Adds each call's clock readings of ``fn`` to ``into``."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.spent = fn, [0.0] * len(CLOCKS)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = [clock() for _, clock in CLOCKS]
        try:
            return self.fn(*args, **kwargs)
        finally:
            for i, (_, clock) in enumerate(CLOCKS):
                self.spent[i] += clock() - t0[i]

    def take(self) -> List[float]:
        spent, self.spent = self.spent, [0.0] * len(CLOCKS)
        return spent


class Setup:
    """One variant: ``forward(x, y)`` gives the loss, ``backward(loss)``, ``opt``, and
    ``local``: the wrapped optimizer's step, timed."""

    def __init__(self, name: str, world: int) -> None:
        torch.manual_seed(0)
        net = model()
        self.name = name
        if name == "zero1":
            ddp = DDP(net, gradient_as_bucket_view=True)
            self.opt: Any = ZeroRedundancyOptimizer(net.parameters(),
                                                    optimizer_class=torch.optim.AdamW, lr=LR)
            inner = self.opt.optim
            self.forward = lambda x, y: nn.functional.mse_loss(ddp(x), y)
            self.backward = lambda loss: loss.backward()
            self.recording: Any = contextlib.nullcontext()
        else:
            gm = data_parallel(net, shard=True)
            self.opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, gather="eager")
            inner = self.opt.optimizer
            self.forward = lambda x, y: nn.functional.mse_loss(net(x), y)
            self.backward = gm.backward
            # forward and backward in one block: a block left without a backward is a step
            # this rank skips, and it takes part in the other ranks' reductions with zeros
            self.recording = gm
        self.local = Timed(inner.step)
        inner.step = self.local  # the instance's own attribute: only this object is timed

    def step(self, x: torch.Tensor, y: torch.Tensor) -> List[List[float]]:
        """One step; per phase, its clock readings' differences."""
        marks = [[clock() for _, clock in CLOCKS]]
        with self.recording:
            with record_function("phase: forward"):
                loss = self.forward(x, y)
            marks.append([clock() for _, clock in CLOCKS])
            with record_function("phase: backward"):
                self.backward(loss)
        marks.append([clock() for _, clock in CLOCKS])
        with record_function("phase: step"):
            self.opt.step()
        marks.append([clock() for _, clock in CLOCKS])
        with record_function("phase: zero_grad"):
            self.opt.zero_grad(set_to_none=True)
        marks.append([clock() for _, clock in CLOCKS])
        span = [[b - a for a, b in zip(marks[i], marks[i + 1])] for i in range(4)]
        local = self.local.take()
        rest = [s - t for s, t in zip(span[2], local)]
        return [span[0], span[1], local, rest, span[3]]


def profiled(setup: Setup, x: torch.Tensor, y: torch.Tensor, world: int) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        setup.step(x, y)
    events = list(prof.profiler.kineto_results.events())
    counted = collectives_of(events, world)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    top = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in ops
           if e.key.startswith(("aten::", "gloo:", "c10d::"))][:10]
    phases = sorted(((e.name()[7:], e.start_ns(), e.end_ns()) for e in events
                     if e.name().startswith("phase: ")), key=lambda p: p[1])
    copies: Dict[tuple, List[float]] = {}  # (phase, op, numel): [calls, ms]
    for e in events:
        if e.name() in COPY_OPS:
            phase = next((n for n, a, b in phases if a <= e.start_ns() <= b), "?")
            shapes = e.shapes()
            numel = 1
            for d in (shapes[0] if shapes and shapes[0] else [0]):
                numel *= d
            entry = copies.setdefault((phase, e.name(), numel), [0, 0.0])
            entry[0] += 1
            entry[1] += (e.end_ns() - e.start_ns()) / 1e6
    by_kind: Dict[str, List[int]] = {}
    for c in counted["called"]:
        by_kind.setdefault(c["op"], []).append(c["bytes"])
    return {"summed": summed(counted["called"]), "kinds": by_kind, "top": top,
            "copies": sorted(((k, v) for k, v in copies.items() if v[1] >= 0.5),
                             key=lambda kv: -kv[1][1])}


def rank_main(rank: int, world: int, port: int, names: List[str], rounds: int, steps: int,
              out: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    data = batches(steps + 2, rank)
    spent: Dict[str, List[List[List[float]]]] = {n: [] for n in names}
    totals: Dict[str, List[float]] = {n: [] for n in names}
    prof: Dict[str, Dict[str, Any]] = {}
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        for name in names:
            setup = Setup(name, world)
            setup.step(*data[0])  # warm-up
            for x, y in data[1:steps + 1]:
                dist.barrier()
                start = time.perf_counter()
                spent[name].append(setup.step(x, y))
                totals[name].append(time.perf_counter() - start)
            if r == rounds - 1:
                prof[name] = profiled(setup, *data[steps + 1], world)
            del setup
            gc.collect()
        loads.append(os.getloadavg()[0])
    if rank == 0:
        with open(out, "w") as f:
            f.write(report(names, spent, totals, prof, loads, rounds, steps, world))
    dist.destroy_process_group()


def report(names: List[str], spent: Dict[str, Any], totals: Dict[str, List[float]],
           prof: Dict[str, Any], loads: List[float], rounds: int, steps: int, world: int) -> str:
    lines = [machine_info(["torch"]),
             f"{world} gloo ranks, {rounds} interleaved rounds x {steps} timed steps, rank 0; "
             f"1-minute load average at the start and after each round: "
             + ", ".join(f"{v:.2f}" for v in loads)
             + f"; MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}",
             "",
             "median ms a step, per phase: " + " | ".join(f"{n}" for n in names)]
    header = f"{'phase':<20}" + "".join(f"{c + ' ' + n:>24}" for c, _ in CLOCKS for n in names)
    lines.append(header)
    for p, phase in enumerate(PHASES + ("step (sum)",)):
        row = f"{phase:<20}"
        for c in range(len(CLOCKS)):
            for n in names:
                if p < len(PHASES):
                    vals = [s[p][c] for s in spent[n]]
                else:
                    vals = [sum(s[q][c] for q in range(len(PHASES))) for s in spent[n]]
                row += f"{statistics.median(vals) * 1e3:>24.1f}"
        lines.append(row)
    for n in names:
        bwd = [s[1][0] - s[1][1] for s in spent[n]]
        per_round = [statistics.median(totals[n][i * steps:(i + 1) * steps]) * 1e3
                     for i in range(rounds)]
        lines.append(f"{n}: backward's main thread idle (wall - thread CPU) median "
                     f"{statistics.median(bwd) * 1e3:.1f} ms; step wall median "
                     f"{statistics.median(totals[n]) * 1e3:.1f} ms, per round "
                     + ", ".join(f"{t:.0f}" for t in per_round))
    lines.append("")
    for n in names:
        p = prof[n]
        s = p["summed"]
        kinds = ", ".join(f"{k} x{len(v)} ({sum(v) / MIB:.1f} MiB)" for k, v in p["kinds"].items())
        lines.append(f"{n}: collectives {kinds}; data sent a rank {s['data_sent'] / MIB:.1f} MiB "
                     f"in {s['data_calls']} calls, control {s['control_calls']} calls")
        lines.append(f"{n}: most self CPU (ms, one profiled step): " + "; ".join(
            f"{k} x{c} {t:.1f}" for k, c, t in p["top"]))
        lines.append(f"{n}: copies and scalings by phase (ms, one profiled step, inclusive): "
                     + "; ".join(f"{ph} {op} of {numel / 2**18:.2f} MiB x{c} {t:.1f}"
                                 for (ph, op, numel), (c, t) in p["copies"]))
    return "\n".join(lines) + "\n"


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", default="zero1,sharded")
    parser.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="glibc's MALLOC_MMAP_THRESHOLD_ for the ranks (bench_zero.py "
                             "sets 131072 to measure peak RSS; unset: glibc's default)")
    args = parser.parse_args(argv)
    with allocator(args.mmap_threshold):
        text = ranks_output(rank_main, args.world, args.variants.split(","), args.rounds,
                            args.steps)
    if text is None:
        return 1
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
