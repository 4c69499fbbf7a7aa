"""gradmgr on PyTorch: step time relative to a plain ``loss.backward()``.

For each model, four copies with identical weights are stepped in turn (order shuffled each
round) on the same batch:

* plain:   ``loss = loss_fn(model(x), y); loss.backward()``
* gradmgr: ``with gm: loss = loss_fn(model(x), y); gm.backward(loss)``
* +noop:   the same with a no-op callback ``lambda t, g: g`` attached to every parameter
* engine:  the engine call gradmgr makes when no tensor has callbacks (``run_engine``: PyTorch's
  ``_engine_run_backward`` with ``inputs=params``, without ``torch.autograd.backward``'s
  argument handling): the floor for gradmgr; gradmgr/engine is the manager's own cost
* bare:    the same call without ``inputs=`` (what ``loss.backward()`` asks of the engine, less
  its argument handling): what ``inputs=`` itself costs is engine/bare. gradmgr cannot make
  this call in general: it writes ``.grad`` of every leaf the graph reaches, attached or not
  (tests/test_plain_step_engine_call.py)

``.grad`` is cleared (untimed) before every step. Ratios are medians of per-step times (2 s of
samples per model, at least 200); torch runs on one thread. Targets: <= 1.05 for the MLPs
and the CNN, <= 1.20 for the model with 1,000 parameter tensors; the no-op-callback variant is
reported without a target.

    python bench/bench_torch.py [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Callable, Dict, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import grad_clearers, interleaved, machine_info, result, samples_for  # noqa: E402
from torch import nn  # noqa: E402

from gradmgr import GradManager  # noqa: E402
from gradmgr.backends.torch.engine import own_seed, run_engine  # noqa: E402

Case = Tuple[nn.Module, torch.Tensor, torch.Tensor, float]


def mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10),
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.AvgPool2d(2), nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )


def many_tensors(layers: int = 500) -> nn.Module:
    """``layers`` Linear(8, 8): 2 * layers small parameter tensors."""
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])


def cases() -> Dict[str, Case]:
    """name -> (model, x, y, target ratio)."""
    g = torch.Generator().manual_seed(0)
    out: Dict[str, Case] = {}
    for width in (64, 256, 1024):
        x = torch.randn(64, width, generator=g)
        out[f"mlp-{width}"] = (mlp(width), x, torch.randint(0, 10, (64,), generator=g), 1.05)
    out["cnn"] = (cnn(), torch.randn(16, 3, 16, 16, generator=g),
                  torch.randint(0, 10, (16,), generator=g), 1.05)
    out["1000-tensors"] = (many_tensors(), torch.randn(4, 8, generator=g),
                           torch.randint(0, 8, (4,), generator=g), 1.20)
    return out


def step_fns(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """The three variants' step functions and their untimed .grad-clearing set-ups; on CUDA
    each step ends with a synchronize, so that its time includes the device's work."""
    loss_fn = nn.functional.cross_entropy
    models = {name: copy.deepcopy(model).to(x.device)
              for name in ("plain", "gradmgr", "+noop", "engine", "bare")}
    y = y.to(x.device)

    def plain() -> None:
        loss = loss_fn(models["plain"](x), y)
        loss.backward()

    engine_params = list(models["engine"].parameters())

    def engine() -> None:
        loss = loss_fn(models["engine"](x), y)
        run_engine([loss], [own_seed(loss)], False, False, engine_params, True)

    def bare() -> None:
        loss = loss_fn(models["bare"](x), y)
        run_engine([loss], [own_seed(loss)], False, False, (), True)

    def with_manager(name: str, gm: GradManager) -> Callable[[], None]:
        m = models[name]

        def step() -> None:
            with gm:
                loss = loss_fn(m(x), y)
                gm.backward(loss)

        return step

    gm = GradManager().attach(models["gradmgr"].parameters())
    gm_cb = GradManager().attach(models["+noop"].parameters(), callbacks=lambda t, g: g)
    variants = {"plain": plain, "gradmgr": with_manager("gradmgr", gm),
                "+noop": with_manager("+noop", gm_cb), "engine": engine, "bare": bare}
    if x.is_cuda:
        variants = {name: _synchronized(fn) for name, fn in variants.items()}
    return variants, grad_clearers({k: list(m.parameters()) for k, m in models.items()})


def _synchronized(fn: Callable[[], None]) -> Callable[[], None]:
    def step() -> None:
        fn()
        torch.cuda.synchronize()

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="gradmgr vs plain backward on PyTorch")
    parser.add_argument("--quick", action="store_true", help="fewer samples (noisier)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    budget = 0.3 if args.quick else 2.0
    print(__doc__.split("\n\n")[0])
    print(machine_info(["torch"]) + f", torch threads: 1, device: {args.device}")
    header = (f"{'model':>13} {'tensors':>7} {'samples':>7} {'plain us':>9} {'gradmgr us':>10} "
              f"{'ratio':>6} {'+noop us':>9} {'ratio':>6} {'best-of ratio':>13} "
              f"{'engine/plain':>12} {'gradmgr/engine':>14} {'bare/plain':>10}")
    print(header)
    rows = []
    for name, (model, x, y, target) in cases().items():
        variants, setups = step_fns(model, x.to(args.device), y)
        n = samples_for(variants["plain"], budget, lo=30 if args.quick else 200,
                        setup=setups["plain"])
        t = interleaved(variants, n, setups)
        ratio = t["gradmgr"].median / t["plain"].median
        noop = t["+noop"].median / t["plain"].median
        best = t["gradmgr"].best / t["plain"].best
        floor = t["engine"].median / t["plain"].median
        own = t["gradmgr"].median / t["engine"].median
        bare = t["bare"].median / t["plain"].median
        tensors = len(list(model.parameters()))
        print(f"{name:>13} {tensors:7d} {n:7d} {t['plain'].median * 1e6:9.1f} "
              f"{t['gradmgr'].median * 1e6:10.1f} {ratio:6.3f} {t['+noop'].median * 1e6:9.1f} "
              f"{noop:6.3f} {best:13.3f} {floor:12.3f} {own:14.3f} {bare:10.3f}", flush=True)
        rows.append((name, ratio, noop, target))
    print()
    where = "" if args.device == "cpu" else f" {args.device}"
    for name, ratio, noop, target in rows:
        result(f"torch{where} {name} gradmgr/plain", ratio, target)
        result(f"torch{where} {name} gradmgr+noop-callbacks/plain", noop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
