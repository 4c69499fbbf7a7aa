"""What the per-step plan check costs, and why: 2 gloo ranks on the CPU.

Two measurements, each with its variants interleaved in a random order (the same on both
ranks) behind a barrier, medians of ``--steps``:

1. One 23-float allreduce (the check's size) alone: the wall time from launch to the end of
   its wait and the CPU time of the whole process (every thread: gloo's too), with the ranks
   idle (sleeping) or computing (matrix products about as long as mlp-256's forward) between
   launch and wait; "none" is the same without the collective. Where the compute variant
   costs more than the idle one, gloo's threads wait for a core held by the compute.
   "store" is a presence check that spawns no gloo work (issue 39 item 4's question): one
   ``add`` on the rendezvous store at launch; at the wait, the last rank to arrive sets a key
   that the others wait for.
2. mlp-256 (as in bench_ddp.py) trained by gradmgr's default (``verify="step"``), by
   ``verify="plan"`` and by DDP: per step, the wall time of ``record()`` (where the check is
   launched), forward, backward (where it is read), optimizer, and the process's CPU time.

On this repository's 2-core machine (session 11) the collective cost 0.3-0.4 ms of CPU per
rank and its result came 0.3-0.9 ms after a 0.7 ms forward, against about 6 us when the ranks
slept instead: the check's cost there is gloo's threads competing with two busy ranks for two
cores, which a machine with spare cores should not pay.

    python bench/probe_plan_check.py [--steps N]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, ranks_output  # noqa: E402
from bench_ddp import BATCH, init, mlp  # noqa: E402

from gradmgr import GradManager  # noqa: E402
from gradmgr.distributed import make_allreduce_cb  # noqa: E402

CHECK_FLOATS = 23  # the check's size with 2 ranks (see gradmgr.distributed.consistency)
Times = Dict[str, Dict[str, List[float]]]


def main_rank(rank: int, world: int, port: int, steps: int, out: str) -> None:
    init(rank, port, "cpu")  # (bench_ddp's: gloo, one thread per rank)
    try:
        lines = report("collective", collective(steps)) + report("mlp-256", steps_of(steps, rank))
        if rank == 0:
            with open(out, "w") as f:
                f.write("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()


def interleaved(variants: Dict[str, callable], steps: int) -> Times:
    """Run every variant once per step in a shuffled order; each returns its phases' times."""
    times: Times = {name: {} for name in variants}
    order = random.Random(0)
    for i in range(5 + steps):
        names = list(variants)
        order.shuffle(names)
        for name in names:
            dist.barrier()
            phases = variants[name]()
            if i >= 5:
                for phase, seconds in phases.items():
                    times[name].setdefault(phase, []).append(seconds)
    return times


def collective(steps: int) -> Times:
    a, w = torch.randn(BATCH, 256), torch.randn(256, 256)

    def compute() -> None:
        for _ in range(8):
            torch.mm(a, w)

    def run(launch: Any, work: callable) -> Dict[str, float]:
        cpu, start = time.process_time(), time.perf_counter()
        handle = launch() if launch else None
        work()
        waited = time.perf_counter()
        if handle is not None:
            handle.wait()
        end = time.perf_counter()
        return {"total": end - start, "wait": end - waited, "cpu": time.process_time() - cpu}

    def gloo() -> Any:
        return dist.all_reduce(torch.zeros(CHECK_FLOATS), async_op=True)

    store, world, keys = dist.distributed_c10d._get_default_store(), dist.get_world_size(), {}

    def arrive() -> Any:  # a rank counts itself in at the store; the last one tells the others
        n = keys["n"] = keys.get("n", 0) + 1
        return _Arrival(store, f"probe-arrival/{n}", world)

    idle = lambda: time.sleep(0.001)  # noqa: E731
    return interleaved({
        "idle": lambda: run(gloo, idle),
        "computing": lambda: run(gloo, compute),
        "store, idle": lambda: run(arrive, idle),
        "store, computing": lambda: run(arrive, compute),
        "none, idle": lambda: run(None, idle),
        "none, computing": lambda: run(None, compute),
    }, steps)


class _Arrival:
    """A presence check through the rendezvous store instead of a gloo collective (issue 39
    item 4's question: what a per-step check costs that spawns no gloo work): one ``add`` at
    launch; at the wait, the last rank to arrive sets a key the others wait for."""

    def __init__(self, store: Any, key: str, world: int) -> None:
        self._store, self._key = store, key
        self._last = store.add(key, 1) == world

    def wait(self) -> None:
        if self._last:
            self._store.set(self._key + "/all", "1")
        else:
            self._store.wait([self._key + "/all"])


def steps_of(steps: int, rank: int) -> Times:
    torch.manual_seed(0)
    nets = {name: mlp() for name in ("gradmgr", "plan-only", "ddp")}
    for net in nets.values():
        net.load_state_dict(nets["gradmgr"].state_dict())
    managers = {name: GradManager().attach(nets[name].parameters(),
                                           callbacks=[make_allreduce_cb("mean", verify=verify)])
                for name, verify in (("gradmgr", "step"), ("plan-only", "plan"))}
    ddp = DDP(nets["ddp"])
    opts = {name: torch.optim.SGD(net.parameters(), lr=1e-3) for name, net in nets.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, 256, generator=g), torch.randn(BATCH, 256, generator=g)

    def step(name: str) -> Dict[str, float]:
        cpu, t0 = time.process_time(), time.perf_counter()
        gm = managers.get(name)
        if gm is not None:
            gm.record()
        t1 = time.perf_counter()
        loss = (((ddp if gm is None else nets[name])(x) - y) ** 2).mean()
        t2 = time.perf_counter()
        loss.backward() if gm is None else gm.backward(loss)
        t3 = time.perf_counter()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        return {"record": t1 - t0, "forward": t2 - t1, "backward": t3 - t2, "optimizer": t4 - t3,
                "total": t4 - t0, "cpu": time.process_time() - cpu}

    return interleaved({name: (lambda name=name: step(name)) for name in nets}, steps)


def report(title: str, times: Times) -> List[str]:
    lines = [f"\n{title} (medians, ms; cpu: the process's CPU time, all threads)"]
    for name, phases in times.items():
        cells = " ".join(f"{phase} {statistics.median(v) * 1e3:7.3f}"
                         for phase, v in phases.items())
        lines.append(f"{name:>16}: {cells}")
    return lines


def main(argv: list = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    print(machine_info(["torch"]))
    text = ranks_output(main_rank, 2, args.steps)
    if text is None:
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
