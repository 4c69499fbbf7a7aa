"""Per-allocation trace of one training step of ``bench_zero.py``'s variants (issue 27 item 3).

Each rank trains ``bench_zero.py``'s model (8 x Linear(2048, 2048), AdamW) with one variant for
two untimed steps, then runs one step under ``torch.profiler.profile(profile_memory=True,
with_stack=True)``: every allocation and free of PyTorch's CPU allocator, with its size, time,
thread and the Python frames that made it. Rank 0 prints:

- the peak of the running sum of bytes allocated during the step (what was alive before the
  step, the model and the optimizer state, does not count), when it happens (the phase: the
  forward and backward, the optimizer step, ``zero_grad``), and every buffer alive at that
  moment, grouped by the frame that allocated it (size, count, when it was allocated and freed);
- every allocation of 1 MiB or more with its lifetime (ms from the step's start), in order.

Allocations are deterministic, so one traced step per variant is enough; the trace slows the
step, so its times are not step times (``bench_zero.py`` times them).

    python bench/trace_zero.py [--world 2] [--variants sharded,fsdp2] [--min-mib 1]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import warnings
from collections import defaultdict
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MMAP_THRESHOLD, allocator, ranks_output  # noqa: E402
from bench_zero import Variant, batches, model  # noqa: E402

MIB = 2**20
PHASES = ("forward+backward", "optimizer step", "zero_grad")
OWN = ("gradmgr/", "bench/", "torch/optim/", "torch/distributed/", "torch/nn/")


def rank_main(rank: int, world: int, port: int, name: str, min_mib: float, out: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        torch.manual_seed(0)
        variant = Variant(name, model(), world)
        data = batches(3, rank)
        for x, y in data[:2]:
            variant.step(x, y)
        dist.barrier()
        from torch.profiler import ProfilerActivity, profile, record_function

        x, y = data[2]
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                     with_stack=True) as prof:
            with record_function(PHASES[0]):
                variant._backward(x, y)
            with record_function(PHASES[1]):
                variant.opt.step()
            with record_function(PHASES[2]):
                variant.opt.zero_grad(set_to_none=True)
        if rank == 0:
            with open(out, "w") as f:
                f.write(analyse(prof, name, world, min_mib))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _site(event: Any) -> str:
    """The innermost frames of ours (gradmgr, the bench, torch's optim / distributed / nn) and
    the op that allocated, e.g. ``sharding.py(130): send > aten::clone``."""
    from torch._C._profiler import _EventType

    op, frames, node = None, [], event.parent
    while node is not None and len(frames) < 2:
        kind = node.typed[0]
        if kind == _EventType.TorchOp and op is None:
            op = node.name
        elif kind == _EventType.PyCall and any(s in node.name for s in OWN):
            frames.append(node.name.split("site-packages/")[-1].split("sharded-perf/")[-1])
        node = node.parent
    where = " < ".join(frames) if frames else "(no Python frame: a collective's thread)"
    return f"{op or '-'} @ {where}"


def _flatten(nodes: List[Any]) -> List[Any]:
    out, stack = [], list(nodes)
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children)
    return out


def analyse(prof: Any, name: str, world: int, min_mib: float) -> str:
    from torch._C._profiler import _EventType

    nodes = _flatten(prof.profiler.kineto_results.experimental_event_tree())
    phases = sorted((n.start_time_ns, n.end_time_ns, n.name) for n in nodes
                    if n.typed[0] == _EventType.TorchOp and n.name in PHASES)
    start = phases[0][0]

    def phase(t: int) -> str:
        for a, b, label in phases:
            if a <= t <= b:
                return label
        return "between"

    allocs = sorted((n for n in nodes if n.typed[0] == _EventType.Allocation),
                    key=lambda n: n.start_time_ns)
    live: Dict[int, Tuple[int, int, str]] = {}  # ptr -> (bytes, t, site)
    lifetimes: List[List[Any]] = []  # [bytes, t_alloc, t_free or None, site]
    open_: Dict[int, List[Any]] = {}
    running = peak = 0
    peak_at, at_peak = start, {}
    for n in allocs:
        f, t = n.typed[1], n.start_time_ns
        running += f.alloc_size
        if f.alloc_size > 0:
            site = _site(n)
            live[f.ptr] = (f.alloc_size, t, site)
            open_[f.ptr] = rec = [f.alloc_size, t, None, site]
            lifetimes.append(rec)
        else:
            live.pop(f.ptr, None)
            rec = open_.pop(f.ptr, None)
            if rec is not None:
                rec[2] = t
        if running > peak:
            peak, peak_at, at_peak = running, t, dict(live)
    ms = lambda t: (t - start) / 1e6  # noqa: E731
    lines = [f"== {name}, {world} ranks, rank 0: peak {peak / MIB:.1f} MiB above the step's "
             f"start, at {ms(peak_at):.1f} ms ({phase(peak_at)}); "
             f"{running / MIB:+.1f} MiB at its end"]
    for a, b, label in phases:
        lines.append(f"   phase {label:<17} {ms(a):8.1f} - {ms(b):8.1f} ms")
    lines.append("   alive at the peak (allocated during the step), by call site:")
    groups: Dict[str, List[Tuple[int, int]]] = defaultdict(list)
    for size, t, site in at_peak.values():
        groups[site].append((size, t))
    frees = {id(r): r for r in lifetimes}
    ends = {(r[1], r[0], r[3]): r[2] for r in frees.values()}
    for site, items in sorted(groups.items(), key=lambda kv: -sum(s for s, _ in kv[1])):
        total = sum(s for s, _ in items)
        if total < 0.05 * MIB:
            continue
        born = min(t for _, t in items)
        died = [ends.get((t, s, site)) for s, t in items]
        freed = "alive at end" if any(d is None for d in died) else \
            f"freed by {ms(max(died)):.1f} ms ({phase(max(died))})"
        lines.append(f"   {total / MIB:8.1f} MiB  x{len(items):<3} from {ms(born):7.1f} ms "
                     f"({phase(born)}), {freed}:  {site}")
    lines.append(f"   allocations >= {min_mib} MiB, in order (MiB, alloc ms - free ms):")
    for size, t, end, site in lifetimes:
        if size >= min_mib * MIB:
            free = "end" if end is None else f"{ms(end):.1f}"
            lines.append(f"   {size / MIB:7.2f}  {ms(t):7.1f} - {free:>7}  {site}")
    return "\n".join(lines) + "\n"


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--variants", default="sharded,fsdp2")
    parser.add_argument("--min-mib", type=float, default=1.0)
    args = parser.parse_args(argv)
    for name in args.variants.split(","):
        with allocator(MMAP_THRESHOLD):  # freed blocks leave the ranks, as they are traced
            text = ranks_output(rank_main, args.world, name, args.min_mib)
        if text is None:
            raise RuntimeError(f"{name} on {args.world} ranks failed")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
