"""The main of a worker that runs named scenarios (``HABITS_SCENARIOS``, comma-separated) in
order on one rank, saving what they recorded after each, so that a scenario that kills the rank
costs only itself and those after it."""

from __future__ import annotations

import os

import numpy as np
import torch.distributed as dist


def run_named(scenarios: dict, rank: int, world: int, outdir: str) -> None:
    out: dict = {}
    path = os.path.join(outdir, f"rank{rank}.npz")
    for name in os.environ["HABITS_SCENARIOS"].split(","):
        scenarios[name](out, rank, world)
        out[f"{name}_done"] = np.array(True)
        np.savez(path, **out)
    dist.barrier()
