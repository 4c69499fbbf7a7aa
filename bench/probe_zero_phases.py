"""Phases of ``bench_zero.py``'s step, per variant (issue 27 item 3: why ZeRO-1 beats sharded on
4 ranks): the forward and backward, then the optimizer step (with ``zero_grad``), each ended by
a barrier, timed on rank 0 three ways: wall clock, the whole process's CPU time (every thread:
gloo's too) and the main thread's CPU time. On a machine busy with other jobs the wall clock
stretches and the CPU times do not: a variant that needs more CPU per step is slower wherever
the cores are the limit (4 ranks on 2 cores are).

    python bench/probe_zero_phases.py [--world 4] [--variants zero1,sharded] [--steps 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MMAP_THRESHOLD, allocator, ranks_output  # noqa: E402
from bench_zero import Variant, batches, model  # noqa: E402

CLOCKS = (("wall", time.perf_counter), ("process CPU", time.process_time),
          ("thread CPU", time.thread_time))


def rank_main(rank: int, world: int, port: int, names: List[str], steps: int, out: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    lines = []
    for name in names:
        torch.manual_seed(0)
        variant = Variant(name, model(), world)
        spent: Dict[str, List[List[float]]] = {c: [[], []] for c, _ in CLOCKS}
        for i, (x, y) in enumerate(batches(steps + 1, rank)):
            dist.barrier()
            t0 = [clock() for _, clock in CLOCKS]
            variant._backward(x, y)
            dist.barrier()
            t1 = [clock() for _, clock in CLOCKS]
            variant.opt.step()
            variant.opt.zero_grad(set_to_none=True)
            dist.barrier()
            t2 = [clock() for _, clock in CLOCKS]
            if i:  # the first step is a warm-up
                for (c, _), a, b, e in zip(CLOCKS, t0, t1, t2):
                    spent[c][0].append(b - a)
                    spent[c][1].append(e - b)
        med = {c: [statistics.median(v) * 1e3 for v in pair] for c, pair in spent.items()}
        lines.append(f"{name:>8}  " + "  ".join(
            f"{c}: fwd+bwd {m[0]:7.1f} opt {m[1]:7.1f} ms" for c, m in med.items()))
        del variant
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--variants", default="zero1,sharded")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    with allocator(MMAP_THRESHOLD):  # the setting its recorded results (issue 27) ran under
        text = ranks_output(rank_main, args.world, args.variants.split(","), args.steps)
    if text is None:
        return 1
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
