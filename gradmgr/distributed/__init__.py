"""Data-parallel training with gradmgr: allreduce callbacks over existing collective engines.

Importing this package imports no framework; each backend's adapters (tensor operations and
transports, :mod:`gradmgr.distributed.contract`) are imported on first use.

Example:
    >>> from gradmgr.distributed import make_allreduce_cb
    >>> cb = make_allreduce_cb("mean")
    >>> # gm = GradManager().attach(model.parameters(), callbacks=[cb])
"""

from .broadcasting import broadcast
from .contract import Handle, TensorOps, Transport
from .errors import RankFailedError, RankMismatchError, RanksOutOfStepError, SparseGradientError
from .launch import free_port, run_ranks, spawn_local
from .reduce.allreduce import (
    AllreduceCallback,
    ReduceScatterCallback,
    make_allreduce_cb,
    make_reduce_scatter_cb,
)
from .reduce.bucket import Bucket, BucketPlan
from .reduce.no_sync import no_sync
from .sharded.dcp_state import get_state_dict, set_state_dict
from .sharded.sharded_optimizer import ShardedOptimizer
from .wrap import data_parallel

__all__ = [
    "AllreduceCallback",
    "Bucket",
    "BucketPlan",
    "Handle",
    "RankFailedError",
    "RankMismatchError",
    "RanksOutOfStepError",
    "ReduceScatterCallback",
    "ShardedOptimizer",
    "SparseGradientError",
    "TensorOps",
    "Transport",
    "broadcast",
    "data_parallel",
    "free_port",
    "get_state_dict",
    "make_allreduce_cb",
    "make_reduce_scatter_cb",
    "no_sync",
    "run_ranks",
    "set_state_dict",
    "spawn_local",
]
