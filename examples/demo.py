"""The gradmgr demo: one training loop, three frameworks, the same numbers.

Trains a small MLP and a small CNN on a synthetic data set (made here from a fixed seed) on
PyTorch, on MegEngine and, where it is installed (``gradmgr[paddle]``; ``make demo`` uses
``.venv-paddle`` when ``make setup`` built it), on PaddlePaddle, starting from the same
numpy-initialised weights, each step written as

    with GradManager() as gm:
        gm.attach(params)
        loss = loss_fn(model(x), y)
        gm.backward(loss)

It prints the losses of every framework side by side at every logging step, the largest gradient
difference between any two frameworks, and saves the loss curves to ``<out>/loss_curves.png``.
Exits non-zero if the first step's gradients (same weights, same batch) differ between two
frameworks by more than 1e-5, or if training did not lower a loss.

    python examples/demo.py --steps 300 --out demo_out
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import sys
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import train_megengine  # noqa: E402
import train_torch  # noqa: E402
from models import TrainLog  # noqa: E402
from tqdm import tqdm  # noqa: E402

# PaddlePaddle is optional (its wheel is 195 MB): the demo trains on it where it imports.
FRAMEWORKS = ("torch", "megengine") + (
    ("paddle",) if importlib.util.find_spec("paddle") is not None else ())
MODELS = ("mlp", "cnn")
FIRST_STEP_TOLERANCE = 1e-5
"""Same weights and batch: gradients may differ only by float32 kernel rounding."""


def grad_difference(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> Tuple[float, str]:
    """The largest |a - b| over all parameters, and the parameter where it occurs."""
    worst, where = 0.0, ""
    for name, ga in a.items():
        diff = float(np.max(np.abs(ga - b[name])))
        if diff >= worst:
            worst, where = diff, name
    return worst, where


def largest_difference(logs: Dict[Tuple[str, str], TrainLog], model: str,
                       step: int) -> Tuple[float, str]:
    """The largest gradient difference at ``step`` over every pair of frameworks, and where."""
    worst, where = 0.0, ""
    for a, b in itertools.combinations(FRAMEWORKS, 2):
        diff, param = grad_difference(logs[a, model].grads[step], logs[b, model].grads[step])
        if diff >= worst:
            worst, where = diff, f"{param}, {a} vs {b}"
    return worst, where


def trainers() -> Dict[str, Callable[..., TrainLog]]:
    found = {"torch": train_torch.train, "megengine": train_megengine.train}
    if "paddle" in FRAMEWORKS:
        import train_paddle

        found["paddle"] = train_paddle.train
    return found


def run_all(steps: int, log_every: int) -> Dict[Tuple[str, str], TrainLog]:
    """Train every model on every framework, with one progress bar for all of it."""
    train = trainers()
    logs: Dict[Tuple[str, str], TrainLog] = {}
    with tqdm(total=steps * len(FRAMEWORKS) * len(MODELS), unit="step", file=sys.stderr) as bar:
        for model in MODELS:
            for fw in FRAMEWORKS:
                bar.set_description(f"{fw:>9} {model}")
                logs[fw, model] = train[fw](
                    model, steps=steps, log_every=log_every, fresh_manager=True,
                    progress=bar.update,
                )
    return logs


def print_table(logs: Dict[Tuple[str, str], TrainLog]) -> List[Tuple[str, int, float, str]]:
    """Print losses side by side per logging step; return (model, step, diff, param) rows."""
    steps = sorted(logs["torch", "mlp"].grads)
    header = "  step | " + " | ".join(
        f"{m} loss {fw:>9}" for m in MODELS for fw in FRAMEWORKS
    ) + " | " + " | ".join(f"{m} max|dgrad|" for m in MODELS)
    print(header)
    print("-" * len(header))
    diffs = []
    for step in steps:
        cells = [f"{logs[fw, m].losses[step]:18.6f}" for m in MODELS for fw in FRAMEWORKS]
        grad_cells = []
        for m in MODELS:
            diff, where = largest_difference(logs, m, step)
            diffs.append((m, step, diff, where))
            grad_cells.append(f"{diff:15.2e}")
        print(f"{step:6d} | " + " | ".join(cells) + " | " + " | ".join(grad_cells))
    return diffs


def plot(logs: Dict[Tuple[str, str], TrainLog], path: str) -> None:
    """Loss curves of every framework per model, and their largest per-step difference."""
    # A framework switched the CPU to flush denormals to zero; numpy notices when matplotlib
    # asks for float64 limits (the log axis) and warns twice. The plot is unaffected.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The value of the smallest subnormal")
        _plot(logs, path)


def _plot(logs: Dict[Tuple[str, str], TrainLog], path: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {"torch": dict(color="tab:red", lw=2.5, alpha=0.6),
              "megengine": dict(color="tab:blue", lw=1.2, ls="--"),
              "paddle": dict(color="tab:orange", lw=1.0, ls=":")}
    for ax, model in zip(axes, MODELS):
        for fw in FRAMEWORKS:
            ax.plot(logs[fw, model].losses, label=f"{fw} + gradmgr", **styles[fw])
        ax.set_title(f"{model.upper()}: training loss")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[2]
    for model, color in zip(MODELS, ("tab:green", "tab:purple")):
        losses = np.array([logs[fw, model].losses for fw in FRAMEWORKS])
        ax.plot(losses.max(axis=0) - losses.min(axis=0), color=color, label=model.upper())
    ax.set_yscale("log", nonpositive="mask")
    ax.set_title("largest |loss difference| between frameworks (zeros not drawn)")
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.suptitle(f"Same weights, same data, one GradManager API on {len(FRAMEWORKS)} frameworks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Train on PyTorch, MegEngine (and PaddlePaddle where installed) with gradmgr.")
    parser.add_argument("--steps", type=int, default=300, help="SGD steps per run")
    parser.add_argument("--log-every", type=int, default=25, help="steps between table rows")
    parser.add_argument("--out", default="demo_out", help="folder for loss_curves.png")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    import torch

    torch.set_num_threads(1)
    logs = run_all(args.steps, args.log_every)
    for (fw, model), log in logs.items():
        print(f"{fw:>9} {model}: {args.steps} steps in {log.seconds:.2f} s")
    print()
    diffs = print_table(logs)
    model, step, worst, where = max(diffs, key=lambda row: row[2])
    print(f"\nlargest gradient difference between frameworks: {worst:.3e} "
          f"({model} {where}, step {step})")

    if "paddle" not in FRAMEWORKS:
        print("PaddlePaddle is not installed in this environment: `make setup` builds "
              ".venv-paddle, and `make demo` then trains on all three frameworks")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "loss_curves.png")
    plot(logs, path)
    print(f"loss curves saved to {path}")

    failures = [
        f"{m} step 0 gradients differ by {d:.3e} > {FIRST_STEP_TOLERANCE}"
        for m, s, d, _ in diffs if s == 0 and d > FIRST_STEP_TOLERANCE
    ]
    if args.steps >= 50:
        failures += [
            f"{fw} {m} loss did not drop: {log.losses[0]:.4f} -> {log.losses[-1]:.4f}"
            for (fw, m), log in logs.items() if not log.losses[-1] < log.losses[0]
        ]
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
