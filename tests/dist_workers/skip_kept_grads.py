"""A skipped batch (a recording with a forward and no backward) while ``.grad`` still holds the
last step's reduced gradients (``zero_grad`` at the start of a step, or accumulation across
steps), on each path, against DDP with the same forward never backwarded. Saves, per path,
``.grad`` after the skipped recording, after the next step, and whether the release raised."""

from __future__ import annotations

import copy
import os

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import data_parallel


def _grads(model) -> np.ndarray:
    return torch.cat([p.grad.flatten() for p in model.parameters()]).numpy().copy()


def main(rank: int, world: int, outdir: str) -> None:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(10 + rank)
    xs = [torch.randn(6, 4, generator=g) for _ in range(3)]
    saved = {}
    ddp = DDP(copy.deepcopy(base))
    ddp(xs[0]).square().mean().backward()
    ddp(xs[1])  # skipped: never backwarded
    saved["ddp_skipped"] = _grads(ddp.module)
    ddp(xs[2]).square().mean().backward()
    saved["ddp_next"] = _grads(ddp.module)
    for name, options in (("native", {}), ("buckets", {"native": False})):
        model = copy.deepcopy(base)
        gm = data_parallel(model, **options)
        with gm:
            gm.backward(model(xs[0]).square().mean())
        gm.record()
        model(xs[1])
        try:
            gm.release()
            saved[f"{name}_raised"] = np.array(0)
        except RuntimeError:
            saved[f"{name}_raised"] = np.array(1)
        saved[f"{name}_skipped"] = _grads(model)
        with gm:
            gm.backward(model(xs[2]).square().mean())
        saved[f"{name}_next"] = _grads(model)
        del gm
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **saved)
