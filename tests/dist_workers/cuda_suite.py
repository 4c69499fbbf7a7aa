"""Rank program for CUDA tensors over nccl: one GPU per rank (world = GPUs, at most 2)."""

from __future__ import annotations

import os

import numpy as np
import torch

from gradmgr import GradManager
from gradmgr.distributed import make_allreduce_cb

from .torch_suite import Net, local_batch


def main(rank: int, world: int, outdir: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    out: dict = {}
    for name, kw in (("mean", {}), ("small", {"bucket_bytes": 200}),
                     ("fp16", {"compression": "fp16"})):
        net = Net().to(device)
        gm = GradManager().attach(net.parameters(), callbacks=[make_allreduce_cb("mean", **kw)])
        x, y = (t.to(device) for t in local_batch(0, rank, world))
        with gm:
            gm.backward(net(x, y))
        for i, p in enumerate(net.parameters()):
            if p.grad is None:  # extra and never: used by no rank, so left as they were
                out[f"{name}_none{i}"] = np.array(True)
                continue
            out[f"{name}_g{i}"] = p.grad.cpu().numpy()
            out[f"{name}_dev{i}"] = np.array(str(p.grad.device))
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **out)
