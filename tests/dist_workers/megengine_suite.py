"""Rank program for MegEngine tensors reduced through torch.distributed gloo (CPU machine).

Same MLP and data as the PyTorch suite, written with megengine.functional; the parent compares
with its PyTorch single-process reference.
"""

from __future__ import annotations

import contextlib
import os

import megengine as mge
import megengine.functional as F
import numpy as np

from gradmgr import GradManager
from gradmgr.distributed import make_allreduce_cb

from .data import batch, shard, weights


def params() -> list:
    """extra, never, then the MLP's w1, b1, w2, b2, w3, b3 (the PyTorch suite's order)."""
    extra = mge.Parameter(np.linspace(-1.0, 1.0, 4).astype("float32"))
    never = mge.Parameter(np.ones(2, "float32"))
    return [extra, never] + [mge.Parameter(w) for w in weights()]


def loss_fn(ps: list, x, y, use_extra: bool = False):
    h = x
    for i in range(3):
        w, b = ps[2 + 2 * i], ps[3 + 2 * i]
        h = F.matmul(h, w, transpose_b=True) + b
        if i < 2:
            h = F.tanh(h)
    loss = F.mean((h - y) ** 2)
    if use_extra:
        loss = loss + 0.5 * F.sum(ps[0] ** 2)
    return loss


def local_batch(step: int, rank: int, world: int) -> tuple:
    x, y = batch(step)
    return mge.Tensor(shard(x, rank, world)), mge.Tensor(shard(y, rank, world))


def run(cb, rank: int, world: int, steps=(0,), use_extra=False, no_sync_first: int = 0):
    ps = params()
    gm = GradManager().attach(ps, callbacks=[cb])
    for i, step in enumerate(steps):
        x, y = local_batch(step, rank, world)
        with cb.no_sync() if i < no_sync_first else contextlib.nullcontext(), gm:
            gm.backward(loss_fn(ps, x, y, use_extra=use_extra and i == 0))
    return ps, gm


def save(out: dict, prefix: str, ps: list) -> None:
    for i, p in enumerate(ps):
        if p.grad is not None:
            out[f"{prefix}{i}"] = p.grad.numpy()
            out[f"{prefix}_type{i}"] = np.array(type(p.grad).__module__)


def main(rank: int, world: int, outdir: str) -> None:
    out: dict = {}
    cb = make_allreduce_cb("mean")
    ps, gm = run(cb, rank, world)
    save(out, "mean_g", ps)
    out["transport"] = np.array(type(cb.transport_of(gm)).__name__)
    ps, _ = run(make_allreduce_cb("sum"), rank, world)
    save(out, "sum_g", ps)
    cb = make_allreduce_cb("mean", bucket_bytes=200)
    ps, gm = run(cb, rank, world)
    save(out, "small_g", ps)
    out["small_nbuckets"] = np.array(len(cb.buckets(gm)))
    ps, _ = run(make_allreduce_cb("mean", compression="fp16"), rank, world)
    save(out, "fp16_g", ps)
    ps, _ = run(make_allreduce_cb("mean", bucket_bytes=1), rank, world, use_extra=rank == 0)
    save(out, "unused_g", ps)
    ps, _ = run(make_allreduce_cb("mean", bucket_bytes=300), rank, world, steps=(0, 1, 2),
                use_extra=True, no_sync_first=2)
    save(out, "nosync_g", ps)
    ps = params()
    for p in ps:  # ranks start from different weights
        p._reset(p + float(rank))
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    with gm:
        gm.backward(loss_fn(ps, *local_batch(0, rank, world)))
    for i, p in enumerate(ps):
        out[f"synced_p{i}"] = p.numpy()
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **out)
