"""Where a split backward's time goes, per phase (issue 27 item 4).

For each of ``bench_split.py``'s models, one split step (``backward_split`` then ``finish()``)
is timed many times with the calling thread's CPU time (``time.thread_time``: the engine runs
a CPU graph on the calling thread, and other jobs on a busy machine do not count in it) around
gradmgr's own functions, and beside it
one plain ``gm.backward`` of the same model (interleaved, medians):

- ``plan``: ``split_plan`` (one walk of the graph: which nodes are on the first tensors' path,
  where the two parts meet, the weights' groups);
- ``first engine``: the first part's engine run (the input gradients);
- ``rest set-up``: ``Rest.__init__`` (a pre-hook on every boundary node, roots for outputs the
  first part does not reach);
- ``rest engine``: the weight-gradient engine runs, one per group (``_run_part`` inside
  ``Rest.run``), and ``rest other``: what ``Rest.run`` does around them (the zero stand-ins
  that restart each boundary node, its hooks);
- ``manager``: everything else of the step (recording, attach, the two manager entries,
  callbacks and accumulation, the handle), i.e. the step minus the phases above.

Each phase is given as its least time over the samples (the least disturbed by other jobs on
a busy machine; the phases' least times add up to about the split's least) and its median.

The forward is outside every timing (the same for both). What is inherent to running autograd
twice over a retained graph: the second run's own set-up (a graph task, the dependency walk
over the graph below its roots) and the boundary node called a second time.

    python bench/profile_split.py [--quick] [--models mlp-256,cnn,mlp-1024]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_split import cases  # noqa: E402

from gradmgr import GradManager  # noqa: E402
from gradmgr.backends.torch import split as split_impl  # noqa: E402

# The calling thread's CPU time: on a CPU graph the engine runs on the calling thread, and a
# busy machine's other jobs (which stretch wall-clock times many-fold) do not count in it.
CLOCK = time.thread_time

PHASES = ("plan", "first engine", "rest set-up", "rest engine", "rest other", "manager")


class Timers:
    """Wraps functions to add their time (minus the inner wrapped ones) to a phase."""

    def __init__(self) -> None:
        self.acc: Dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, attr: str, phase: Callable[..., str]) -> None:
        original = getattr(owner, attr)
        acc = self.acc

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = CLOCK()
            try:
                return original(*args, **kwargs)
            finally:
                acc[phase(*args, **kwargs)] += CLOCK() - start

        setattr(owner, attr, timed)


def install(timers: Timers) -> None:
    state = {"in_rest": False}
    timers.wrap(split_impl, "split_plan", lambda *a, **k: "plan")

    def part(*args: Any, **kwargs: Any) -> str:
        return "rest engine" if state["in_rest"] else "first engine"

    timers.wrap(split_impl, "_run_part", part)
    original_init, original_run = split_impl.Rest.__init__, split_impl.Rest.run

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        start = CLOCK()
        original_init(self, *args, **kwargs)
        timers.acc["rest set-up"] += CLOCK() - start

    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        state["in_rest"] = True
        before = timers.acc["rest engine"]
        start = CLOCK()
        try:
            original_run(self, *args, **kwargs)
        finally:
            state["in_rest"] = False
            spent = CLOCK() - start
            timers.acc["rest other"] += spent - (timers.acc["rest engine"] - before)

    split_impl.Rest.__init__, split_impl.Rest.run = init, run


def profile(timers: Timers, name: str, model: torch.nn.Module, x0: torch.Tensor,
            n: int) -> List[str]:
    models = {k: copy.deepcopy(model) for k in ("single", "split")}
    managers = {k: GradManager().attach(m.parameters()) for k, m in models.items()}
    dy = torch.randn_like(model(x0))
    rows: Dict[str, List[float]] = defaultdict(list)
    for i in range(n + 5):
        for kind in (("single", "split") if i % 2 else ("split", "single")):
            m, gm = models[kind], managers[kind]
            for p in m.parameters():
                p.grad = None
            with gm:
                x = x0.clone()
                gm.attach(x)
                out = m(x)
                timers.acc.clear()
                start = CLOCK()
                if kind == "single":
                    gm.backward(out, dy)
                else:
                    rest = gm.backward_split(out, dy, first=[x])
            if kind == "split":
                rest.finish()
            total = CLOCK() - start
            if i < 5:
                continue
            rows[kind].append(total)
            if kind == "split":
                inner = 0.0
                for phase in PHASES[:-1]:
                    rows[phase].append(timers.acc[phase])
                    inner += timers.acc[phase]
                rows["manager"].append(total - inner)
    single, split = min(rows["single"]), min(rows["split"])
    out = [f"{name}: {n} samples; one backward {single * 1e6:.0f} us, split {split * 1e6:.0f} us "
           f"({split / single:.3f}; medians {statistics.median(rows['split']) * 1e6:.0f} / "
           f"{statistics.median(rows['single']) * 1e6:.0f} us); split by phase (least us, "
           f"share of one backward's least; median us):"]
    for phase in PHASES:
        least, med = min(rows[phase]), statistics.median(rows[phase])
        out.append(f"   {phase:<13} {least * 1e6:9.0f} us  {least / single:6.3f}  "
                   f"{med * 1e6:9.0f} us")
    return out


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=None, help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    timers = Timers()
    install(timers)  # wraps the split module's functions once
    all_cases = cases()
    names = args.models.split(",") if args.models else list(all_cases)
    for name in names:
        model, x0 = all_cases[name]
        n = 40 if args.quick else 200
        if name in ("tf-stage", "mlp-1024"):
            n //= 4
        for line in profile(timers, name, model, x0, n):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
