"""Rank program: the data-parallel contract scenarios (``dp_scenarios``) on the framework named
by ``GRADMGR_CONTRACT_FRAMEWORK`` (torch or megengine), reduced over torch.distributed gloo, or
on Paddle over Paddle's own collectives (:func:`paddle_main`, started by ``spawn_local``); the
results are pickled to ``OUTDIR/rank{RANK}.pkl`` for the parent to compare."""

from __future__ import annotations

import os
import pickle

from dp_scenarios import run_all
from frameworks import make_framework


def main(rank: int, world: int, outdir: str, name: str = "") -> None:
    fw = make_framework(name or os.environ["GRADMGR_CONTRACT_FRAMEWORK"])
    results = run_all(fw, rank, world)
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


def paddle_main(rank: int, world: int, port: int, outdir: str) -> None:
    """The scenarios on Paddle tensors, as a Paddle user starts the ranks."""
    import paddle.distributed as dist

    dist.init_parallel_env()
    main(rank, world, outdir, "paddle")
    dist.barrier()
