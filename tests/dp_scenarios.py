"""The data-parallel contract as scenarios that run unchanged on every backend.

Each scenario runs on one rank (``rank`` of ``world``) with the backend's default transport
(the fake framework's threads, or torch.distributed gloo for PyTorch and MegEngine tensors) and
returns plain values: what gradmgr gave (``got...``) and what it must give (``want...``,
computed on the same rank without data parallelism, from every rank's data). The tests compare
them (``tests/test_dp_contract.py``); every scenario runs on the fake backend in threads and on
PyTorch and MegEngine in processes (``dist_workers/contract_suite.py``).

The model only uses what every framework table has: elementwise ``*`` and ``+``, ``sin`` and
``sum``, on vectors of 4 (2 for ``c``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List

import numpy as np

from gradmgr import GradManager
from gradmgr.distributed import (
    RankFailedError,
    RankMismatchError,
    make_allreduce_cb,
    no_sync,
)

Result = Dict[str, Any]
START = {"a": [0.5, -1.0, 1.5, 2.0], "b": [1.0, 0.25, -0.5, 0.75], "c": [0.3, -0.7]}


def params(fw: Any, offset: float = 0.0) -> List[Any]:
    return [fw.parameter(np.asarray(START[k], "float32") + np.float32(offset)) for k in "abc"]


def data(fw: Any, rank: int, micro: int = 0) -> Any:
    scale = np.float32(1 + rank + 2 * micro)
    return fw.tensor(np.asarray([0.1, -0.2, 0.3, 0.4], "float32") * scale)


def loss(fw: Any, ps: List[Any], x: Any) -> Any:
    a, b, c = ps
    return fw.sum(fw.sin(a * x) * b) + fw.sum(c * c) * 0.5


def grads(fw: Any, ps: List[Any]) -> List[Any]:
    return [fw.grad(p) for p in ps]


def local_grads(fw: Any, rank: int, micros=(0,), offset: float = 0.0) -> List[Any]:
    """The gradients one rank computes alone (no data parallelism), summed over micro-batches."""
    ps = params(fw, offset)
    gm = GradManager().attach(ps)
    for m in micros:
        with gm:
            gm.backward(loss(fw, ps, data(fw, rank, m)))
    return grads(fw, ps)


def mean_over_ranks(fw: Any, world: int, **kwargs: Any) -> List[Any]:
    per_rank = [local_grads(fw, r, **kwargs) for r in range(world)]
    return [None if g[0] is None else sum(g) / np.float32(world) for g in zip(*per_rank)]


def step(gm: Any, fw: Any, ps: List[Any], x: Any) -> None:
    with gm:
        gm.backward(loss(fw, ps, x))


# ------------------------------------------------------------------ the scenarios
def mean_in_buckets(fw: Any, rank: int, world: int) -> Result:
    """Gradients are the mean over ranks, whatever the bucket sizes; several buckets here."""
    ps = params(fw)
    cb = make_allreduce_cb("mean", bucket_bytes=8)
    gm = GradManager().attach(ps, callbacks=[cb])
    step(gm, fw, ps, data(fw, rank))
    return {"got": grads(fw, ps), "want": mean_over_ranks(fw, world),
            "buckets": len(cb.buckets(gm))}


def summed(fw: Any, rank: int, world: int) -> Result:
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("sum")])
    step(gm, fw, ps, data(fw, rank))
    want = [g * np.float32(world) for g in mean_over_ranks(fw, world)]
    return {"got": grads(fw, ps), "want": want}


def accumulated_without_sync(fw: Any, rank: int, world: int) -> Result:
    """Three micro-batches, the first two under no_sync: the synced step reduces what
    ``.grad`` held plus its own gradient."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    for m in range(3):
        with no_sync(gm) if m < 2 else contextlib.nullcontext():
            step(gm, fw, ps, data(fw, rank, m))
    return {"got": grads(fw, ps), "want": mean_over_ranks(fw, world, micros=(0, 1, 2))}


def broadcast_first(fw: Any, rank: int, world: int) -> Result:
    """Ranks start from different values; the first recording spreads rank 0's."""
    ps = params(fw, offset=float(rank))
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    step(gm, fw, ps, data(fw, rank))
    return {"got_values": [fw.numpy(p) for p in ps], "want_values": [fw.numpy(p) for p in
                                                                     params(fw)],
            "got": grads(fw, ps), "want": mean_over_ranks(fw, world)}


def unused_tensors(fw: Any, rank: int, world: int) -> Result:
    """``a`` gets a gradient on rank 0 only (the others reduce zeros); ``c`` on no rank (its
    ``.grad`` stays None, as with DDP's find_unused_parameters)."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    a, b, c = ps
    x = data(fw, rank)
    with gm:
        y = fw.sum(fw.sin(b * x))
        gm.backward(y + fw.sum(a * x) if rank == 0 else y)
    x0 = fw.numpy(data(fw, 0))
    mean_b = sum(_cos_times(fw, r) for r in range(world)) / np.float32(world)
    return {"got": grads(fw, ps), "want": [x0 / np.float32(world), mean_b, None]}


def _cos_times(fw: Any, rank: int) -> Any:
    """d/db sum(sin(b * x)) = cos(b * x) * x, computed by the framework's own autodiff."""
    b = params(fw)[1]
    gm = GradManager().attach(b)
    with gm:
        gm.backward(fw.sum(fw.sin(b * data(fw, rank))))
    return fw.grad(b)


def ranks_that_differ(fw: Any, rank: int, world: int) -> Result:
    """Rank 1 attaches one more tensor: every rank refuses the step with RankMismatchError
    (nothing is reduced, .grad stays None); a manager the ranks agree on then works."""
    ps = params(fw)
    cb = make_allreduce_cb("mean")
    extra = [fw.parameter(np.ones(2, "float32"))] if rank == 1 else []
    gm = GradManager().attach(ps + extra, callbacks=[cb])
    errors = []
    try:
        step(gm, fw, ps, data(fw, rank))
    except RankMismatchError as error:
        errors.append(str(error))
    refused = grads(fw, ps)
    gm2 = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    step(gm2, fw, ps, data(fw, rank))
    return {"errors": errors, "refused": refused, "got": grads(fw, ps),
            "want": mean_over_ranks(fw, world)}


def a_failing_rank(fw: Any, rank: int, world: int) -> Result:
    """Rank 1's backward raises in a callback: rank 0 raises RankFailedError, both keep .grad
    as it was, and the next step is reduced as usual."""
    ps = params(fw)
    failing = [True]

    def fail_once(tensor: Any, grad: Any) -> Any:
        if rank == 1 and failing[0] and tensor is ps[0]:
            failing[0] = False
            raise ValueError("a bad batch on rank 1")
        return grad

    gm = GradManager().attach(ps, callbacks=[fail_once, make_allreduce_cb("mean")])
    raised = []
    try:
        step(gm, fw, ps, data(fw, rank))
    except (RankFailedError, ValueError) as error:
        raised.append(type(error).__name__)
    kept = grads(fw, ps)
    step(gm, fw, ps, data(fw, rank))
    return {"raised": raised, "kept": kept, "got": grads(fw, ps),
            "want": mean_over_ranks(fw, world)}


def frozen_tensors(fw: Any, rank: int, world: int) -> Result:
    """A tensor frozen on every rank gets no gradient and is left out of the buckets; unfrozen
    on every rank, it is reduced again (only for frameworks that can freeze a tensor)."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    fw.freeze(ps[1])
    step(gm, fw, ps, data(fw, rank))
    frozen = grads(fw, ps)
    for p in ps:
        fw.set_grad(p, None)
    fw.unfreeze(ps[1])
    step(gm, fw, ps, data(fw, rank))
    return {"frozen": frozen, "want_frozen": mean_over_ranks(fw, world)[::2],
            "got": grads(fw, ps), "want": mean_over_ranks(fw, world)}


def frozen_on_one_rank(fw: Any, rank: int, world: int) -> Result:
    """After an agreed step, rank 1 alone freezes a tensor: the next step raises
    RankMismatchError on every rank instead of reducing mismatched buffers."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    step(gm, fw, ps, data(fw, rank))
    for p in ps:
        fw.set_grad(p, None)
    if rank == 1:
        fw.freeze(ps[1])
    errors = []
    try:
        step(gm, fw, ps, data(fw, rank))
    except RankMismatchError as error:
        errors.append(str(error))
    return {"errors": errors, "refused": grads(fw, ps)}


SCENARIOS = [mean_in_buckets, summed, accumulated_without_sync, broadcast_first, unused_tensors,
             ranks_that_differ, a_failing_rank]
FREEZING = [frozen_tensors, frozen_on_one_rank]


def run_all(fw: Any, rank: int, world: int) -> Dict[str, Result]:
    chosen = SCENARIOS + (FREEZING if fw.can_freeze else [])
    return {scenario.__name__: scenario(fw, rank, world) for scenario in chosen}
