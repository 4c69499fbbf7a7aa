"""Where gradmgr's per-step Python time goes at 1,000 tensors (issue 39, wt/pertensor).

``bench_ddp.py``'s 1,000-tensor model (500 x Linear(32, 32) with tanh) trains under cProfile:

- ``single``: one process, no distributed: ``GradManager().attach(...)`` and ``with gm:
  gm.backward(loss)`` against plain ``loss.backward()`` (what the core costs alone);
- ``dist``: 2 gloo ranks, gradmgr's default ``make_allreduce_cb("mean")`` (torch's Reducer,
  ``native`` default), the same with ``verify="plan"`` (no per-step check collective), and DDP;
  rank 0 profiles, rank 1 runs the same steps unprofiled.

Each variant runs its warm-up steps unprofiled, then ``--steps`` steps under its own cProfile
(the variants alternate step by step). For each gradmgr variant the script prints the top
``--top`` functions by own time and by cumulative time, with their calls per step: a function
called about 1,000 times a step is a per-tensor cost. It also prints the step-time ratios
(medians of ``perf_counter`` around unprofiled steps, alternating; noisy on a shared machine,
no assertion) and the total Python function calls per step of each variant, which are not
noisy.

``costs`` (also in ``all``) times the two things the profiles point at, without a profiler:
one sweep over the 1,000 tensors reading ``.grad`` / ``dtype`` / ``requires_grad`` right
after a step and again at once, and the engine run alone with and without ``inputs=`` the
1,000 parameters (what ``gm.backward`` passes, DDP's backward does not).

    python bench/profile_per_tensor.py [--steps N] [--top K] [--mode single|dist|costs|all]
                                       [--dump PREFIX]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import operator
import os
import pstats
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import machine_info, ranks_output  # noqa: E402
from bench_ddp import many_tensors  # noqa: E402

from gradmgr import GradManager  # noqa: E402
from gradmgr.distributed import make_allreduce_cb  # noqa: E402

BATCH = 64
WIDTH = 32
WARMUP = 5


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((net(x) - y) ** 2).mean()


def variants(managers: Dict[str, GradManager], plain: Dict[str, torch.nn.Module],
             nets: Dict[str, torch.nn.Module], x: torch.Tensor,
             y: torch.Tensor) -> Dict[str, Callable[[], None]]:
    """One step function per variant: managed ones under ``with gm: gm.backward``."""
    steps: Dict[str, Callable[[], None]] = {}
    for name, gm in managers.items():
        def step(gm: GradManager = gm, net: torch.nn.Module = nets[name]) -> None:
            with gm:
                gm.backward(loss_of(net, x, y))
        steps[name] = step
    for name, net in plain.items():
        def step_plain(net: torch.nn.Module = net) -> None:
            loss_of(net, x, y).backward()
        steps[name] = step_plain
    return steps


def zero_grads(nets: Dict[str, torch.nn.Module]) -> None:
    for net in nets.values():
        for p in net.parameters():
            p.grad = None


def run(steps: Dict[str, Callable[[], None]], nets: Dict[str, torch.nn.Module], n: int,
        barrier: Callable[[], None], profile: bool) -> tuple:
    """Warm-up, then ``n`` timed rounds and ``n`` profiled rounds; (times, profiles)."""
    for _ in range(WARMUP):
        for fn in steps.values():
            zero_grads(nets)
            fn()
    times: Dict[str, List[float]] = {k: [] for k in steps}
    profs = {k: cProfile.Profile() for k in steps}
    for _ in range(n):
        for name, fn in steps.items():
            zero_grads(nets)
            barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    for _ in range(n):
        for name, fn in steps.items():
            zero_grads(nets)
            barrier()
            if profile:
                profs[name].enable()
            fn()
            if profile:
                profs[name].disable()
    return times, profs


def report(name: str, prof: cProfile.Profile, n: int, top: int) -> str:
    stats = pstats.Stats(prof)
    calls = stats.total_calls / n  # type: ignore[attr-defined]
    out = io.StringIO()
    out.write(f"\n=== {name}: {calls:.0f} Python function calls per step ===\n")
    everything = list(stats.stats.items())  # type: ignore[attr-defined]
    ours = [kv for kv in everything if "gradmgr/" in kv[0][0]]
    for rows, label, column in ((everything, "own time", 2), (everything, "cumulative time", 3),
                                (ours, "cumulative time, gradmgr's functions only", 3)):
        out.write(f"--- top {top} by {label} (calls per step, ms per step) ---\n")
        out.write(f"{'calls/step':>10} {'own ms':>8} {'cum ms':>8}  function\n")
        rows = sorted(rows, key=lambda kv: kv[1][column], reverse=True)
        for (file, line, func), (_cc, nc, tt, ct, _callers) in rows[:top]:
            where = f"{shorten(file)}:{line}({func})"
            out.write(f"{nc / n:10.0f} {1e3 * tt / n:8.3f} {1e3 * ct / n:8.3f}  {where}\n")
    return out.getvalue()


def shorten(file: str) -> str:
    for marker in ("gradmgr/", "torch/"):
        if marker in file:
            return marker + file.rsplit(marker, 1)[1]
    return file


def ratios(times: Dict[str, List[float]], base: str) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    return "\n".join(f"{k:>12}: median {1e3 * m:8.3f} ms  {m / med[base]:.3f}x {base}"
                     for k, m in med.items())


def models(names: List[str]) -> Dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    nets = {k: many_tensors() for k in names}
    first = nets[names[0]].state_dict()
    for net in nets.values():
        net.load_state_dict(first)
    return nets


def single(n: int, top: int) -> str:
    torch.set_num_threads(1)
    nets = models(["gradmgr", "plain"])
    gm = GradManager().attach(nets["gradmgr"].parameters())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    steps = variants({"gradmgr": gm}, {"plain": nets["plain"]}, nets, x, y)
    times, profs = run(steps, nets, n, lambda: None, True)
    text = "## single process, no distributed\n" + ratios(times, "plain")
    return text + "".join(report(k, profs[k], n, top) for k in profs)


def passes(n: int) -> str:
    """What one C-level sweep over the 1,000 tensors costs (``list(map(attrgetter(a), ...))``,
    the form gradmgr's snapshots and plan checks take), timed right after a training step
    (the step has pushed the tensors out of the caches) and again at once (warm)."""
    torch.set_num_threads(1)
    net = models(["one"])["one"]
    params = list(net.parameters())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    lines = ["## one sweep over the 1,000 parameters (medians)"]
    for attr in ("grad", "dtype", "requires_grad"):
        get = operator.attrgetter(attr)
        cold, warm = [], []
        for _ in range(n):
            zero_grads({"one": net})
            loss_of(net, x, y).backward()
            for samples in (cold, warm):
                start = time.perf_counter()
                list(map(get, params))
                samples.append(time.perf_counter() - start)
        lines.append(f"{attr:>14}: after a step {1e3 * statistics.median(cold):.3f} ms, "
                     f"again at once {1e3 * statistics.median(warm):.3f} ms")
    return "\n".join(lines)


def engine_inputs(n: int) -> str:
    """The engine run alone (thread CPU time), without ``inputs`` (``loss.backward()``) and
    with the 1,000 parameters as ``inputs`` (what gradmgr passes: only attached tensors get
    ``.grad``), interleaved."""
    from torch.autograd.graph import _engine_run_backward as run_backward
    torch.set_num_threads(1)
    net = models(["one"])["one"]
    params = tuple(net.parameters())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    times: Dict[str, List[float]] = {"no inputs": [], "inputs=params": []}
    for i in range(WARMUP + n):
        for name in (sorted(times) if i % 2 else sorted(times, reverse=True)):
            zero_grads({"one": net})
            loss = loss_of(net, x, y)
            start = time.thread_time()
            run_backward((loss,), (torch.ones_like(loss),), False, False,
                         params if name == "inputs=params" else (),
                         allow_unreachable=True, accumulate_grad=True)
            if i >= WARMUP:
                times[name].append(time.thread_time() - start)
    return "## the engine run alone, thread CPU time\n" + ratios(times, "no inputs")


def rank_main(rank: int, world: int, port: int, n: int, top: int, dump: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
        nets = models(["gradmgr", "plan-only", "ddp"])
        managers = {
            "gradmgr": GradManager().attach(nets["gradmgr"].parameters(),
                                            callbacks=[make_allreduce_cb("mean")]),
            "plan-only": GradManager().attach(
                nets["plan-only"].parameters(),
                callbacks=[make_allreduce_cb("mean", verify="plan")]),
        }
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
        steps = variants(managers, {"ddp": DDP(nets["ddp"])}, nets, x, y)
        times, profs = run(steps, nets, n, dist.barrier, rank == 0)
        if rank == 0:
            if dump:
                for name, prof in profs.items():
                    prof.dump_stats(f"{dump}.{name}")
            text = "## 2 gloo ranks (rank 0 profiled)\n" + ratios(times, "ddp")
            text += "".join(report(k, profs[k], n, top) for k in profs)
            with open(out, "w") as f:
                f.write(text)
    finally:
        dist.destroy_process_group()


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--mode", choices=("single", "dist", "costs", "all"), default="all")
    parser.add_argument("--dump", default="", help="write rank 0's profiles to DUMP.<variant> "
                        "(pstats files, for print_callees)")
    args = parser.parse_args()
    print(machine_info(["torch"]))
    print(f"load (1 min) at start: {load()}")
    if args.mode in ("single", "all"):
        print(single(args.steps, args.top))
    if args.mode in ("costs", "all"):
        print(passes(args.steps))
        print(engine_inputs(args.steps))
    if args.mode in ("dist", "all"):
        text = ranks_output(rank_main, 2, args.steps, args.top, args.dump)
        print(text if text is not None else "a rank failed")


if __name__ == "__main__":
    main()
