"""gradmgr on MegEngine: step time relative to MegEngine's native ``GradManager``.

The same models as bench_torch.py (MLPs of width 64/256/1024, a small CNN, 500 Linear(8, 8)
layers = 1,000 parameter tensors), each step ``with gm: loss = loss_fn(model(x), y);
gm.backward(loss)`` with ``gm`` either ``megengine.autodiff.GradManager`` or
``gradmgr.GradManager``, each on its own copy of the model, stepped in turn (order shuffled each
round) on the same batch, ``.grad`` cleared (untimed) before every step; ratios of median step
times over 1.5 s of samples per model, and at least 100 (the slow models' ratios wander by a few
percent with fewer). Also with a no-op callback attached to every parameter on both sides.
Target: <= 1.05 everywhere.

    python bench/bench_megengine.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Callable, Dict, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megengine  # noqa: E402
import megengine.functional as F  # noqa: E402
import megengine.module as M  # noqa: E402
import numpy as np  # noqa: E402
from _common import grad_clearers, interleaved, machine_info, result, samples_for  # noqa: E402
from megengine.autodiff import GradManager as NativeGradManager  # noqa: E402

from gradmgr import GradManager  # noqa: E402

TARGET = 1.05


class CNN(M.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv0 = M.Conv2d(3, 16, 3, padding=1)
        self.conv1 = M.Conv2d(16, 32, 3, padding=1)
        self.pool = M.AvgPool2d(2)
        self.fc = M.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(F.relu(self.conv0(x)))))
        return self.fc(F.flatten(x, 1))


def mlp(width: int) -> M.Module:
    return M.Sequential(
        M.Linear(width, width), M.ReLU(), M.Linear(width, width), M.ReLU(),
        M.Linear(width, width), M.ReLU(), M.Linear(width, 10),
    )


def cases() -> Dict[str, Tuple[M.Module, megengine.Tensor, megengine.Tensor]]:
    rng = np.random.default_rng(0)
    megengine.random.seed(0)

    def data(shape, classes):
        x = megengine.tensor(rng.standard_normal(shape).astype(np.float32))
        return x, megengine.tensor(rng.integers(0, classes, shape[0]).astype(np.int32))

    out = {f"mlp-{w}": (mlp(w), *data((64, w), 10)) for w in (64, 256, 1024)}
    out["cnn"] = (CNN(), *data((16, 3, 16, 16), 10))
    out["1000-tensors"] = (M.Sequential(*[M.Linear(8, 8) for _ in range(500)]), *data((4, 8), 8))
    return out


def step_fns(model: M.Module, x, y):
    models = {k: copy.deepcopy(model) for k in ("native", "gradmgr", "native+noop", "gradmgr+noop")}

    def noop(tensor, grad):
        return grad

    managers = {
        "native": NativeGradManager().attach(models["native"].parameters()),
        "gradmgr": GradManager().attach(models["gradmgr"].parameters()),
        "native+noop": NativeGradManager().attach(models["native+noop"].parameters(),
                                                  callbacks=noop),
        "gradmgr+noop": GradManager().attach(models["gradmgr+noop"].parameters(),
                                             callbacks=noop),
    }

    def make(name: str) -> Callable[[], None]:
        m, gm = models[name], managers[name]

        def step() -> None:
            with gm:
                loss = F.nn.cross_entropy(m(x), y)
                gm.backward(loss)
            # MegEngine runs kernels asynchronously: wait so the step's work is inside the timing
            loss.numpy()

        return step

    return {k: make(k) for k in models}, grad_clearers(
        {k: list(m.parameters()) for k, m in models.items()})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="gradmgr vs native GradManager on MegEngine")
    parser.add_argument("--quick", action="store_true", help="fewer samples (noisier)")
    args = parser.parse_args(argv)
    budget = 0.3 if args.quick else 1.5
    print(__doc__.split("\n\n")[0])
    print(machine_info(["megengine"]))
    print(f"{'model':>13} {'samples':>7} {'native us':>10} {'gradmgr us':>10} {'ratio':>6} "
          f"{'native+noop':>11} {'gradmgr+noop':>12} {'ratio':>6}")
    rows = []
    for name, (model, x, y) in cases().items():
        variants, setups = step_fns(model, x, y)
        n = samples_for(variants["native"], budget, lo=30 if args.quick else 100,
                        setup=setups["native"])
        t = interleaved(variants, n, setups)
        ratio = t["gradmgr"].median / t["native"].median
        noop = t["gradmgr+noop"].median / t["native+noop"].median
        us = {k: v.median * 1e6 for k, v in t.items()}
        print(f"{name:>13} {n:7d} {us['native']:10.1f} {us['gradmgr']:10.1f} {ratio:6.3f} "
              f"{us['native+noop']:11.1f} {us['gradmgr+noop']:12.1f} {noop:6.3f}", flush=True)
        rows.append((name, ratio, noop))
    print()
    for name, ratio, noop in rows:
        result(f"megengine {name} gradmgr/native", ratio, TARGET)
        result(f"megengine {name} gradmgr/native, no-op callbacks", noop, TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
