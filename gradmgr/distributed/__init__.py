"""Data-parallel training with gradmgr: allreduce callbacks over existing collective engines.

Importing this package imports no framework; torch / megengine are imported on first use.

Example:
    >>> from gradmgr.distributed import make_allreduce_cb
    >>> cb = make_allreduce_cb("mean")
    >>> # gm = GradManager().attach(model.parameters(), callbacks=[cb])
"""

from .allreduce import AllreduceCallback, make_allreduce_cb
from .bucket import Bucket, BucketPlan
from .consistency import RankFailedError, RankMismatchError, SparseGradientError
from .launch import free_port, run_ranks, spawn_local
from .sync import broadcast, data_parallel, no_sync
from .transport import (
    Handle,
    MegEngineTransport,
    MegEngineViaTorchTransport,
    TorchTransport,
    Transport,
)

__all__ = [
    "AllreduceCallback",
    "Bucket",
    "BucketPlan",
    "Handle",
    "MegEngineTransport",
    "MegEngineViaTorchTransport",
    "RankFailedError",
    "RankMismatchError",
    "SparseGradientError",
    "TorchTransport",
    "Transport",
    "broadcast",
    "data_parallel",
    "free_port",
    "make_allreduce_cb",
    "no_sync",
    "run_ranks",
    "spawn_local",
]
