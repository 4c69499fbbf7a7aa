"""gradmgr on PaddlePaddle: step time relative to Paddle's own ``loss.backward()``.

The models of bench_megengine.py written in Paddle (MLPs of width 64/256/1024, a small CNN, 500
Linear(8, 8) layers = 1,000 parameter tensors), each step ``loss = loss_fn(model(x), y)`` then
either Paddle's ``loss.backward()`` or ``with gm: ...; gm.backward(loss)`` with a
``gradmgr.GradManager`` attached to every parameter, each on its own copy of the model, stepped
in turn (order shuffled each round) on the same batch, ``.grad`` cleared (untimed) before every
step; ratios of median step times. Also with a no-op callback on every parameter (Paddle's side:
a ``register_hook`` that returns the gradient). On Paddle each gradmgr backward is one
``paddle.grad`` over the attached tensors, and the callbacks run afterwards in the engine's
order, which ``gradmgr/backends/paddle/order.py`` reads from Paddle's graph in Python: this
bench measures what that costs. No target is set yet (issue 40); the MegEngine and torch
benches aim at <= 1.05.

    python bench/bench_paddle.py [--quick]     (needs gradmgr[paddle]: .venv-paddle here)
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from typing import Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

with warnings.catch_warnings():  # Paddle's import warns that it found no ccache: harmless here
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle
import paddle.nn as nn  # noqa: E402
import paddle.nn.functional as F  # noqa: E402
from _common import interleaved, machine_info, result, samples_for  # noqa: E402

from gradmgr import GradManager  # noqa: E402


class CNN(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2D(3, 16, 3, padding=1)
        self.conv1 = nn.Conv2D(16, 32, 3, padding=1)
        self.pool = nn.AvgPool2D(2)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(F.relu(self.conv0(x)))))
        return self.fc(paddle.flatten(x, 1))


def mlp(width: int) -> nn.Layer:
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10),
    )


def cases() -> Dict[str, Tuple[nn.Layer, paddle.Tensor, paddle.Tensor]]:
    rng = np.random.default_rng(0)
    paddle.seed(0)

    def data(shape, classes):
        x = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
        return x, paddle.to_tensor(rng.integers(0, classes, shape[0]).astype(np.int64))

    out = {f"mlp-{w}": (mlp(w), *data((64, w), 10)) for w in (64, 256, 1024)}
    out["cnn"] = (CNN(), *data((16, 3, 16, 16), 10))
    out["1000-tensors"] = (nn.Sequential(*[nn.Linear(8, 8) for _ in range(500)]),
                           *data((4, 8), 8))
    return out


def step_fns(model: nn.Layer, x, y):
    names = ("native", "gradmgr", "native+noop", "gradmgr+noop")
    models = {k: copy.deepcopy(model) for k in names}

    def noop(*args):
        return args[-1]  # a Paddle hook gets (grad); a gradmgr callback (tensor, grad)

    for p in models["native+noop"].parameters():
        p.register_hook(noop)
    managers = {
        "gradmgr": GradManager().attach(models["gradmgr"].parameters()),
        "gradmgr+noop": GradManager().attach(models["gradmgr+noop"].parameters(),
                                             callbacks=noop),
    }

    def make(name: str) -> Callable[[], None]:
        m, gm = models[name], managers.get(name)

        def native() -> None:
            F.cross_entropy(m(x), y).backward()

        def ours() -> None:
            with gm:
                gm.backward(F.cross_entropy(m(x), y))

        return native if gm is None else ours

    def clearer(params: List[paddle.Tensor]) -> Callable[[], None]:
        def clear() -> None:
            for p in params:
                p.clear_gradient(False)
        return clear

    return ({k: make(k) for k in names},
            {k: clearer(list(models[k].parameters())) for k in names})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="gradmgr vs Paddle's own backward")
    parser.add_argument("--quick", action="store_true", help="fewer samples (noisier)")
    args = parser.parse_args(argv)
    paddle.set_device("cpu")
    budget = 0.3 if args.quick else 1.5
    print(__doc__.split("\n\n")[0])
    print(machine_info(["paddle"]))
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
        result(f"paddle {name} gradmgr/native", ratio)
        result(f"paddle {name} gradmgr/native, no-op callbacks", noop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
