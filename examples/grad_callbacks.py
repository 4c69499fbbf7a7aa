"""Gradient clipping and NaN checks as attach callbacks.

``gm.attach(params, callbacks=[check_finite, clip])`` runs, for each parameter, first the NaN/Inf
check and then per-tensor norm clipping, as ``grad = cb(tensor, grad)``, while the backward is
still running and as soon as that parameter's gradient is ready. The script checks:

* the clipped ``.grad`` equals the framework's own gradient clipped in numpy (rtol 1e-5,
  atol 1e-6) and no norm exceeds the limit;
* the callbacks ran inside the backward (``get_backwarding_grad_manager()`` is the manager) and
  the output layer's gradient arrived before the input layer's;
* a batch containing a NaN makes ``check_finite`` raise, the error reaches the caller, no
  ``.grad`` is written and the manager can record the next (clean) batch at once.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
from cli import assert_close, expect, run
from models import init_mlp, make_dataset, mlp_forward

from gradmgr import GradManager, get_backwarding_grad_manager

MAX_NORM = 0.05


def make_callbacks(names: Dict[int, str], norm: Callable, finite: Callable,
                   arrivals: List[Tuple[str, Any]]) -> list:
    """``[check_finite, clip]`` callbacks; ``arrivals`` records, in the order gradients
    arrive, (parameter name, the backwarding manager at that moment)."""

    def check_finite(tensor, grad):
        name = names[id(tensor)]
        arrivals.append((name, get_backwarding_grad_manager()))
        if not finite(grad):
            raise FloatingPointError(f"non-finite gradient for {name}")
        return grad

    def clip(tensor, grad):
        scale = min(1.0, MAX_NORM / (norm(grad) + 1e-12))
        return grad * scale

    return [check_finite, clip]


def clipped(grad: np.ndarray) -> np.ndarray:
    return grad * min(1.0, MAX_NORM / (float(np.linalg.norm(grad)) + 1e-12))


def demo(fw: SimpleNamespace) -> None:
    data = make_dataset()
    x_np, y_np = data.vectors[:64], data.labels[:64]
    weights = init_mlp()
    params = {k: fw.ops.parameter(v) for k, v in weights.items()}
    names = {id(p): k for k, p in params.items()}
    arrivals: List[Tuple[str, Any]] = []
    gm = GradManager().attach(
        list(params.values()), callbacks=make_callbacks(names, fw.norm, fw.finite, arrivals)
    )

    # 1. clipping
    with gm:
        loss = fw.ops.cross_entropy(mlp_forward(fw.ops, params, fw.ops.tensor(x_np)),
                                    fw.ops.tensor(y_np))
        gm.backward(loss)
    raw = fw.reference(weights, x_np, y_np)
    for name, p in params.items():
        got = fw.ops.numpy(p.grad)
        print(f"  {name:11s} |grad| {np.linalg.norm(raw[name]):.4f} -> {np.linalg.norm(got):.4f}")
        expect(np.linalg.norm(got) <= MAX_NORM * (1 + 1e-5), f"{name} was not clipped")
        assert_close(f"clipped {name}", got, clipped(raw[name]))

    # 2. callbacks run during backward, output layer first
    order = [name for name, _ in arrivals]
    print(f"  gradients arrived in the order: {', '.join(order)}")
    expect(all(m is gm for _, m in arrivals), "a callback ran outside gm's backward")
    expect(sorted(order) == sorted(weights), "each parameter's chain must run exactly once")
    last = len(weights) // 2 - 1
    expect(order.index(f"fc{last}.weight") < order.index("fc0.weight"),
           "the output layer's gradient should be ready before the input layer's")
    print("  check: the chains ran inside backward, the output layer's first")

    # 3. a NaN in the batch
    before = {k: fw.ops.numpy(p.grad).copy() for k, p in params.items()}
    bad = x_np.copy()
    bad[3, 5] = np.nan
    try:
        with gm:
            loss = fw.ops.cross_entropy(mlp_forward(fw.ops, params, fw.ops.tensor(bad)),
                                        fw.ops.tensor(y_np))
            gm.backward(loss)
    except FloatingPointError as exc:
        print(f"  a NaN batch raised FloatingPointError: {exc}")
    else:
        raise AssertionError("the NaN batch was not caught by check_finite")
    expect(get_backwarding_grad_manager() is None, "global state left changed after the error")
    for name, p in params.items():
        expect(np.array_equal(fw.ops.numpy(p.grad), before[name]), f"{name}.grad was modified")
    print("  check: the failed backward left every .grad untouched")

    with gm:  # the manager was released by the failed backward and records again
        loss = fw.ops.cross_entropy(mlp_forward(fw.ops, params, fw.ops.tensor(x_np)),
                                    fw.ops.tensor(y_np))
        gm.backward(loss)
    for name, p in params.items():
        assert_close(f"accumulated {name}", fw.ops.numpy(p.grad), 2 * clipped(raw[name]))


def run_torch() -> None:
    import torch
    from models import torch_ops

    ops = torch_ops()

    def reference(weights, x, y):
        leaves = {k: torch.from_numpy(v).requires_grad_(True) for k, v in weights.items()}
        loss = ops.cross_entropy(mlp_forward(ops, leaves, torch.from_numpy(x)),
                                 torch.from_numpy(y))
        grads = torch.autograd.grad(loss, list(leaves.values()))
        return {k: g.numpy() for k, g in zip(leaves, grads)}

    demo(SimpleNamespace(ops=ops, reference=reference, norm=lambda g: float(g.norm()),
                         finite=lambda g: bool(torch.isfinite(g).all())))


def run_megengine() -> None:
    from quiet_megengine import import_megengine

    megengine = import_megengine()  # without the CUDA banner of a GPU-less machine
    import megengine.functional as F
    from megengine.autodiff import GradManager as NativeGradManager
    from models import megengine_ops

    ops = megengine_ops()

    def reference(weights, x, y):
        leaves = {k: megengine.Parameter(v) for k, v in weights.items()}
        gm = NativeGradManager().attach(list(leaves.values()))
        with gm:
            gm.backward(ops.cross_entropy(mlp_forward(ops, leaves, megengine.tensor(x)),
                                          megengine.tensor(y)))
        return {k: p.grad.numpy() for k, p in leaves.items()}

    def finite(g):
        return bool(np.isfinite(g.numpy()).all())

    demo(SimpleNamespace(ops=ops, reference=reference,
                         norm=lambda g: float(F.sqrt((g * g).sum())), finite=finite))


if __name__ == "__main__":
    sys.exit(run(__doc__.splitlines()[0], {"torch": run_torch, "megengine": run_megengine}))
