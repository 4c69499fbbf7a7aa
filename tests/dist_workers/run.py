"""Entry point of one rank: ``python -m dist_workers.run SUITE RANK WORLD PORT OUTDIR BACKEND``.

Initialises torch.distributed over 127.0.0.1 with a bounded timeout, runs ``SUITE.main(rank,
world, outdir)`` and saves nothing itself: suites write ``OUTDIR/rank{RANK}.npz``.
"""

from __future__ import annotations

import datetime
import importlib
import sys


def main(argv: list) -> None:
    suite, rank, world, port, outdir, backend = argv
    rank, world = int(rank), int(world)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        importlib.import_module(f"dist_workers.{suite}").main(rank, world, outdir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
