"""gradmgr on PyTorch: per-step overhead against the number of attached tensors.

``N`` parameter tensors of 4 elements each feed one ``torch.cat``, so the computation itself
stays small and what grows with ``N`` is the per-tensor bookkeeping. For each ``N`` in 10, 100,
1,000, 10,000 the plain step ``loss.backward()`` and the gradmgr step ``with gm: ...;
gm.backward(loss)`` (and the gradmgr step with a no-op callback on every tensor) run in turn
(order shuffled each round) on separate copies; overhead = median gradmgr step - median plain
step. The per-tensor cost is the slope of a least-squares line through (N, overhead); the growth
is called linear when the marginal cost per tensor from 1,000 to 10,000 is within 2x of that
from 100 to 1,000 (super-linear above, sub-linear below).

    python bench/bench_tensor_count.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import grad_clearers, interleaved, machine_info, result, samples_for  # noqa: E402

from gradmgr import GradManager  # noqa: E402

COUNTS = (10, 100, 1000, 10000)


def variants_for(n: int):
    """Step functions and .grad-clearing set-ups for N attached tensors."""
    g = torch.Generator().manual_seed(n)
    base = [torch.randn(4, generator=g) for _ in range(n)]
    weight = torch.randn(4 * n, generator=g)
    params = {k: [t.clone().requires_grad_(True) for t in base]
              for k in ("plain", "gradmgr", "+noop")}
    gm = GradManager().attach(params["gradmgr"])
    gm_cb = GradManager().attach(params["+noop"], callbacks=lambda t, grad: grad)

    def plain() -> None:
        loss = (torch.cat(params["plain"]) * weight).sum()
        loss.backward()

    def managed(name: str, manager: GradManager) -> Callable[[], None]:
        ps = params[name]

        def step() -> None:
            with manager:
                loss = (torch.cat(ps) * weight).sum()
                manager.backward(loss)

        return step

    variants = {"plain": plain, "gradmgr": managed("gradmgr", gm),
                "+noop": managed("+noop", gm_cb)}
    return variants, grad_clearers(params)


def slope_and_linearity(counts: List[int], overhead_us: List[float]):
    """(least-squares us per tensor, marginal 100->1000, marginal 1000->10000)."""
    slope = float(np.polyfit(np.array(counts, float), np.array(overhead_us), 1)[0])
    per = dict(zip(counts, overhead_us))
    low = (per[1000] - per[100]) / 900
    high = (per[10000] - per[1000]) / 9000
    return slope, low, high


def growth(low: float, high: float) -> str:
    """A verdict on how the overhead grows, from the two marginal per-tensor costs."""
    if low <= 0 or high <= 0:
        return "too noisy to tell (a marginal cost is not positive)"
    if high / low > 2.0:
        return "SUPER-linear (per-tensor cost rises with N)"
    if high / low < 0.5:
        return "sub-linear (per-tensor cost falls with N: fixed costs dominate small N)"
    return "linear"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="gradmgr overhead vs attached tensors")
    parser.add_argument("--quick", action="store_true", help="fewer samples (noisier)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    budget = 0.3 if args.quick else 1.5
    print(__doc__.split("\n\n")[0])
    print(machine_info(["torch"]) + ", torch threads: 1")
    print(f"{'N':>6} {'samples':>7} {'plain us':>9} {'gradmgr us':>10} {'overhead us':>11} "
          f"{'us/tensor':>9} {'+noop us':>9} {'overhead us':>11} {'us/tensor':>9}")
    overheads: Dict[str, List[float]] = {"gradmgr": [], "+noop": []}
    for n in COUNTS:
        variants, setups = variants_for(n)
        samples = samples_for(variants["plain"], budget, setup=setups["plain"])
        t = interleaved(variants, samples, setups)
        us = {k: v.median * 1e6 for k, v in t.items()}
        over = {k: us[k] - us["plain"] for k in overheads}
        for k in overheads:
            overheads[k].append(over[k])
        print(f"{n:6d} {samples:7d} {us['plain']:9.1f} {us['gradmgr']:10.1f} "
              f"{over['gradmgr']:11.1f} {over['gradmgr'] / n:9.3f} {us['+noop']:9.1f} "
              f"{over['+noop']:11.1f} {over['+noop'] / n:9.3f}", flush=True)
    print()
    for k, label in (("gradmgr", "gradmgr"), ("+noop", "gradmgr + no-op callback")):
        slope, low, high = slope_and_linearity(list(COUNTS), overheads[k])
        print(f"{label}: {slope:.3f} us per attached tensor (least squares); marginal "
              f"{low:.3f} us/tensor for 100->1000, {high:.3f} for 1000->10000: "
              f"{growth(low, high)}")
        result(f"tensor count {label} per-tensor overhead", slope, unit=" us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
