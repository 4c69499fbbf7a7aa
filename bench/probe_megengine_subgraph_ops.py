"""Probe (not a test): do the backwards of MegEngine 1.13's other "subgraph" operators give
wrong gradients on a CPU, as ``sync_batch_norm``'s do (bench/probe_megengine_syncbn_subgraph.py)?

The public functions built on subgraph operators (``megengine.core.tensor.utils.subgraph`` /
``subgraph_fn``; nothing in ``megengine.module``, ``optimizer`` or ``amp`` builds its own):
``F.nn.sync_batch_norm`` (its distributed path: ``SyncBnStage0`` ... ``SyncBnSplitStats``),
``F.pixel_shuffle`` (``LayerPixelShuffle``, only inside ``megengine.jit.trace``; eager calls
take a C++ fast path of ordinary operators) and ``F.where`` (``Where``, a subgraph with a
hand-written backward). Each OP below runs the same step STEPS times on fixed inputs, a fresh
input tensor each step, ``megengine.config.async_level = 0``, under MegEngine's own
GradManager (``--manager gradmgr``: gradmgr's), and counts the steps whose gradient is not
numpy's float64 reference within the OP's tolerance, and the steps whose gradient differs
from the most common one bit for bit.

    python bench/probe_megengine_subgraph_ops.py OP [STEPS] [--procs N] [--manager M]

OPs: ``syncbn`` (the known bad one, as a control), ``pixel_shuffle`` (eager: no subgraph),
``pixel_shuffle_subgraph`` (the ``LayerPixelShuffle`` operator applied eagerly, what a trace
records), ``pixel_shuffle_trace`` and ``where_trace`` (the step in ``jit.trace(symbolic=True)``),
``where``. ``--procs N`` runs N such processes side by side and sums them.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys

import numpy as np

RNG = np.random.RandomState(100)
X_BN, C_BN = RNG.randn(2, 3, 2, 2).astype("float32"), RNG.randn(2, 3, 2, 2).astype("float32")
X_PS, C_PS = RNG.randn(2, 8, 3, 3).astype("float32"), RNG.randn(2, 2, 6, 6).astype("float32")
X_W, Y_W, C_W = (RNG.randn(4, 5).astype("float32") for _ in range(3))
MASK_W = RNG.rand(4, 5) > 0.5


def _np_pixel_shuffle(x: np.ndarray, r: int) -> np.ndarray:
    n, c, h, w = x.shape
    return x.reshape(n, c // (r * r), r, r, h, w).transpose(0, 1, 4, 2, 5, 3).reshape(
        n, c // (r * r), h * r, w * r)


def _np_bn_grads(x: np.ndarray, c: np.ndarray, eps: float = 1e-5) -> list:
    """d sum(batch_norm(x) * c) / dx and / dweight (weight 1, bias 0), in float64."""
    x, c = x.astype("float64"), c.astype("float64")
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    inv = (x.var(axis=(0, 2, 3), keepdims=True) + eps) ** -0.5
    xhat = (x - mean) * inv
    dx = inv * (c - c.mean(axis=(0, 2, 3), keepdims=True)
                - xhat * (c * xhat).mean(axis=(0, 2, 3), keepdims=True))
    return [dx, (c * xhat).sum(axis=(0, 2, 3))]


def _reference(op: str) -> list:
    if op == "syncbn":
        return _np_bn_grads(X_BN, C_BN)
    if op.startswith("pixel_shuffle"):  # the backward moves c back to x's places
        index = _np_pixel_shuffle(np.arange(X_PS.size).reshape(X_PS.shape), 2)
        grad = np.zeros(X_PS.size, "float32")
        grad[index.ravel()] = C_PS.ravel()
        return [grad.reshape(X_PS.shape)]
    return [np.where(MASK_W, C_W, 0), np.where(MASK_W, 0, C_W)]


# Sync batch norm renormalises in float32: its rounding against float64 is about 1e-6 here;
# the other OPs only move or select values, so their gradients must be numpy's exactly.
TOLERANCE = {"syncbn": 1e-4}


def _step(op: str, manager: type, megengine, F, M) -> list:
    """One step; the gradients as numpy arrays."""
    if op == "syncbn":
        bn, x = M.SyncBatchNorm(3), megengine.tensor(X_BN)
        gm = manager().attach([x, bn.weight])
        with gm:
            gm.backward(F.sum(bn(x) * megengine.tensor(C_BN)))
        return [x.grad.numpy(), bn.weight.grad.numpy().ravel()]
    if op in ("where", "where_trace"):
        x, y = megengine.tensor(X_W), megengine.tensor(Y_W)
        gm = manager().attach([x, y])
        with gm:
            gm.backward(F.sum(F.where(megengine.tensor(MASK_W), x, y) * megengine.tensor(C_W)))
        return [x.grad.numpy(), y.grad.numpy()]
    x = megengine.tensor(X_PS)
    gm = manager().attach([x])
    with gm:
        if op == "pixel_shuffle_subgraph":
            import megengine.functional.nn as fnn

            out = fnn.layerPixelShuffle_traceable(x, 2)
        else:
            out = F.pixel_shuffle(x, 2)
        gm.backward(F.sum(out * megengine.tensor(C_PS)))
    return [x.grad.numpy()]


def _traced_step(op: str, manager: type, megengine, F, M):
    """The step inside ``jit.trace(symbolic=True)``: the gradients come out as its outputs
    (a traced function's attached tensors are its own)."""
    from megengine.jit import trace

    inner = "where" if op == "where_trace" else "pixel_shuffle"
    params = ([megengine.Parameter(X_W), megengine.Parameter(Y_W)] if inner == "where"
              else [megengine.Parameter(X_PS)])
    gm = manager().attach(params)

    @trace(symbolic=True)
    def step():
        with gm:
            if inner == "where":
                out = F.where(megengine.tensor(MASK_W), params[0], params[1]) * C_W
            else:
                out = F.pixel_shuffle(params[0], 2) * C_PS
            gm.backward(F.sum(out))
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return grads

    return lambda *_: [g.numpy() for g in step()]


def run(op: str, steps: int, manager_name: str) -> tuple:
    import megengine
    import megengine.functional as F
    import megengine.functional.distributed as fdist
    import megengine.functional.nn as fnn
    import megengine.module as M

    megengine.config.async_level = 0
    fnn.is_distributed = lambda: True  # sync_batch_norm's distributed path, in one process
    fnn.all_reduce_sum = fdist.all_reduce_sum = lambda stat, group=None: stat * 2
    if manager_name == "gradmgr":
        from gradmgr import GradManager as manager
    else:
        from megengine.autodiff import GradManager as manager
    step = _traced_step(op, manager, megengine, F, M) if op.endswith("_trace") else _step
    ref, tol = _reference(op), TOLERANCE.get(op, 0.0)
    seen, wrong, worst = [], [], 0.0
    for i in range(steps):
        grads = step(op, manager, megengine, F, M)
        seen.append(b"".join(g.tobytes() for g in grads))
        err = max(float(np.max(np.abs(g - r))) for g, r in zip(grads, ref))
        worst = max(worst, err) if np.isfinite(err) else float("inf")
        if not err <= tol * max(1.0, max(float(np.max(np.abs(r))) for r in ref)):
            wrong.append(i)
    common = collections.Counter(seen).most_common(1)[0][0]
    differ = sum(s != common for s in seen)
    return len(wrong), differ, worst, wrong[:10]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=["syncbn", "pixel_shuffle", "pixel_shuffle_subgraph",
                                       "pixel_shuffle_trace", "where", "where_trace"])
    parser.add_argument("steps", type=int, nargs="?", default=300)
    parser.add_argument("--manager", choices=["megengine", "gradmgr"], default="megengine")
    parser.add_argument("--procs", type=int, default=1)
    args = parser.parse_args()
    if args.procs > 1:
        cmd = [sys.executable, __file__, args.op, str(args.steps), "--manager", args.manager]
        children = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True) for _ in range(args.procs)]
        outs = [child.communicate()[0].strip().splitlines()[-1] for child in children]
        print("\n".join(outs))
        return max(child.returncode for child in children)
    wrong, differ, worst, first = run(args.op, args.steps, args.manager)
    tol = TOLERANCE.get(args.op, 0.0)
    print(f"{args.op} ({args.manager}): {wrong} of {args.steps} steps off numpy's reference "
          f"(tolerance {tol:g} x max|ref|; worst {worst:.3g}; steps {first}), {differ} differ "
          f"from the most common gradient")
    return 0


if __name__ == "__main__":
    sys.exit(main())
