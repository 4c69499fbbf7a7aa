"""The per-step plan check's options, side by side: 2 gloo ranks on the CPU, ratios to DDP.

Each model (bench_ddp's mlp-256 and 1,000 tensors) is trained by DDP and by gradmgr's
``make_allreduce_cb("mean")`` (torch's reducer path) with the plan check done in different
ways, each on its own copy of the model:

* ``step``: the default (``verify="step"``): one small allreduce launched at ``record()``,
  read before the step launches its first bucket;
* ``step, waited at once``: the same collective, waited for inside ``record()``
  (option (c) of issue 27: the check read earlier);
* ``plan``: ``verify="plan"``: compared only where this rank re-planned (the cost of option (a),
  "check only where the local plan changed", without its periodic check; it misses a rank that
  alone froze, attached or entered ``no_sync``);
* ``off``: ``verify=False``, no comparison at all (the floor).

A round is ``--steps`` steps of every variant, each step of each variant in a new shuffled
order (the same on both ranks, behind a barrier); the ratio of a variant's median step to DDP's
in the same round is printed per round, then as the range over ``--rounds`` rounds. The model
with 1,000 tensors takes a quarter of the steps (its steps are 15-20 times longer).

    python bench/bench_plan_check.py [--rounds 5] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, ranks_output  # noqa: E402
from bench_ddp import BATCH, MODELS, WIDTH, init  # noqa: E402

from gradmgr import GradManager  # noqa: E402
from gradmgr.distributed import consistency, make_allreduce_cb  # noqa: E402

VARIANTS = ("ddp", "step", "step, waited at once", "plan", "off")
_WAIT_AT_ONCE = [False]  # read by the patched PlanCheck below, per variant


def _patch_wait_at_once() -> None:
    """Make a PlanCheck wait for its collective as soon as it is launched, where asked (the
    handle is waited again, at once, where the synchronizer reads it)."""
    launch = consistency.PlanCheck.__init__

    def init_and_wait(self, *args, **kwargs) -> None:
        launch(self, *args, **kwargs)
        if _WAIT_AT_ONCE[0]:
            self._handle.wait()

    consistency.PlanCheck.__init__ = init_and_wait


def steppers(name: str, rank: int) -> Dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    build = MODELS[name]
    nets = {v: build() for v in VARIANTS}
    for net in nets.values():
        net.load_state_dict(nets["ddp"].state_dict())
    verify = {"step": "step", "step, waited at once": "step", "plan": "plan", "off": False}
    managers = {v: GradManager().attach(nets[v].parameters(),
                                        callbacks=[make_allreduce_cb("mean", verify=mode)])
                for v, mode in verify.items()}
    ddp = DDP(nets["ddp"])
    opts = {v: torch.optim.SGD(net.parameters(), lr=1e-3) for v, net in nets.items()}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH[name], generator=g)
    y = torch.randn(BATCH, WIDTH[name], generator=g)

    def make(v: str) -> Callable[[], None]:
        gm, net, opt = managers.get(v), nets[v], opts[v]

        def step() -> None:
            _WAIT_AT_ONCE[0] = v == "step, waited at once"
            if gm is None:
                ((ddp(x) - y) ** 2).mean().backward()
            else:
                with gm:
                    gm.backward(((net(x) - y) ** 2).mean())
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return {v: make(v) for v in VARIANTS}


def rounds_of(name: str, rank: int, rounds: int, steps: int) -> List[Dict[str, float]]:
    """Per round, each variant's median step (s)."""
    fns = steppers(name, rank)
    for fn in fns.values():  # warm-up: plans, reducers, first-step checks
        for _ in range(5):
            fn()
    order = random.Random(0)
    out = []
    for _ in range(rounds):
        times: Dict[str, List[float]] = {v: [] for v in fns}
        for _ in range(steps):  # every step of every variant in a new order: a burst of
            names = list(fns)   # load from elsewhere lands on all of them alike
            order.shuffle(names)
            for v in names:
                dist.barrier()
                start = time.perf_counter()
                fns[v]()
                times[v].append(time.perf_counter() - start)
        out.append({v: statistics.median(t) for v, t in times.items()})
    return out


def main_rank(rank: int, world: int, port: int, rounds: int, steps: int, out: str) -> None:
    init(rank, port, "cpu")  # (bench_ddp's: gloo, one thread per rank)
    _patch_wait_at_once()
    try:
        lines = []
        for name in MODELS:
            n = steps if name == "mlp-256" else max(4, steps // 4)
            per_round = rounds_of(name, rank, rounds, n)
            lines.append(f"\n{name}: step time / DDP's, per round, then the range")
            for i, medians in enumerate(per_round):
                cells = " ".join(f"{v}={medians[v] / medians['ddp']:.3f}" for v in VARIANTS[1:])
                lines.append(f"  round {i + 1} (ddp {medians['ddp'] * 1e3:.2f} ms): {cells}")
            for v in VARIANTS[1:]:
                ratios = [m[v] / m["ddp"] for m in per_round]
                lines.append(f"  {v:>22}: {min(ratios):.3f}-{max(ratios):.3f} "
                             f"(median {statistics.median(ratios):.3f})")
        if rank == 0:
            with open(out, "w") as f:
                f.write("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()


def main(argv: list = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    print(machine_info(["torch"]))
    text = ranks_output(main_rank, 2, args.rounds, args.steps)
    if text is None:
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
