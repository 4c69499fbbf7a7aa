"""Rank program: the data-parallel contract scenarios (``dp_scenarios``) on the framework named
by ``GRADMGR_CONTRACT_FRAMEWORK`` (torch or megengine), reduced over torch.distributed gloo;
the results are pickled to ``OUTDIR/rank{RANK}.pkl`` for the parent to compare."""

from __future__ import annotations

import os
import pickle

from dp_scenarios import run_all
from frameworks import make_framework


def main(rank: int, world: int, outdir: str) -> None:
    fw = make_framework(os.environ["GRADMGR_CONTRACT_FRAMEWORK"])
    results = run_all(fw, rank, world)
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
