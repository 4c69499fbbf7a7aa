"""The data-parallel contract as scenarios that run unchanged on every backend.

Each scenario runs on one rank (``rank`` of ``world``) with the backend's default transport
(the fake framework's threads, torch.distributed gloo for PyTorch and MegEngine tensors,
Paddle's own collectives for Paddle's) and returns plain values: what gradmgr gave
(``got...``) and what it must give (``want...``, computed on the same rank without data
parallelism, from every rank's data; for the sharded
scenarios, which reduce-scatter and step a ShardedOptimizer over the framework's own SGD, the
values plain SGD gives on the mean gradient). The tests compare them
(``tests/test_dp_contract.py``); every scenario runs on the fake backend in threads and on
PyTorch, MegEngine and Paddle in processes (``dist_workers/contract_suite.py``). A path a
framework cannot take is still run there, for its refusal: a split backward where the engine
cannot split (``split_steps``), every sharded scenario on Paddle (:func:`run_all`).

The model only uses what every framework table has: elementwise ``*`` and ``+``, ``sin`` and
``sum``, on vectors of 4 (2 for ``c``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, List

import numpy as np

from gradmgr import GradManager, UnsupportedGraphError
from gradmgr.distributed import (
    RankFailedError,
    RankMismatchError,
    ShardedOptimizer,
    make_allreduce_cb,
    make_reduce_scatter_cb,
    no_sync,
)

Result = Dict[str, Any]
START = {"a": [0.5, -1.0, 1.5, 2.0], "b": [1.0, 0.25, -0.5, 0.75], "c": [0.3, -0.7]}


def params(fw: Any, offset: float = 0.0, start: Any = None) -> List[Any]:
    """``a``, ``b``, ``c``: START (or the arrays ``start``) plus ``offset``."""
    if start is None:
        start = [np.asarray(START[k], "float32") for k in "abc"]
    return [fw.parameter(np.asarray(v) + np.float32(offset)) for v in start]


def data(fw: Any, rank: int, micro: int = 0) -> Any:
    scale = np.float32(1 + rank + 2 * micro)
    return fw.tensor(np.asarray([0.1, -0.2, 0.3, 0.4], "float32") * scale)


def loss(fw: Any, ps: List[Any], x: Any) -> Any:
    a, b, c = ps
    return fw.sum(fw.sin(a * x) * b) + fw.sum(c * c) * 0.5


def grads(fw: Any, ps: List[Any]) -> List[Any]:
    return [fw.grad(p) for p in ps]


def local_grads(fw: Any, rank: int, micros=(0,), offset: float = 0.0,
                start: Any = None, loss_fn: Any = None) -> List[Any]:
    """The gradients one rank computes alone (no data parallelism), summed over micro-batches
    (``loss_fn(fw, ps, x, rank)``: the step's loss, :func:`loss` by default)."""
    ps = params(fw, offset, start)
    gm = GradManager().attach(ps)
    for m in micros:
        with gm:
            x = data(fw, rank, m)
            gm.backward(loss(fw, ps, x) if loss_fn is None else loss_fn(fw, ps, x, rank))
    return grads(fw, ps)


def mean_over_ranks(fw: Any, world: int, **kwargs: Any) -> List[Any]:
    per_rank = [local_grads(fw, r, **kwargs) for r in range(world)]
    # a tensor some ranks' losses do not use: their share is zero (None on every rank: None)
    return [None if all(x is None for x in g) else
            sum(x for x in g if x is not None) / np.float32(world) for g in zip(*per_rank)]


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
    _use_some(gm, fw, ps, rank)
    return {"got": grads(fw, ps), "want": _some_used_mean(fw, world)}


def _use_some(gm: Any, fw: Any, ps: List[Any], rank: int) -> None:
    """A step whose loss uses ``a`` on rank 0 only, ``b`` everywhere, ``c`` nowhere."""
    a, b, c = ps
    x = data(fw, rank)
    with gm:
        y = fw.sum(fw.sin(b * x))
        gm.backward(y + fw.sum(a * x) if rank == 0 else y)


def _some_used_mean(fw: Any, world: int) -> List[Any]:
    """The mean over ranks of :func:`_use_some`'s gradients (None for ``c``)."""
    x0 = fw.numpy(data(fw, 0))
    mean_b = sum(_cos_times(fw, r) for r in range(world)) / np.float32(world)
    return [x0 / np.float32(world), mean_b, None]


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
    gm = GradManager().attach(ps, callbacks=[_failing_once(rank, ps[0]),
                                             make_allreduce_cb("mean")])
    raised = _step_raising(gm, fw, ps, rank)
    kept = grads(fw, ps)
    step(gm, fw, ps, data(fw, rank))
    return {"raised": raised, "kept": kept, "got": grads(fw, ps),
            "want": mean_over_ranks(fw, world)}


def _failing_once(rank: int, tensor: Any) -> Any:
    """A callback raising on rank 1 the first time it sees ``tensor``'s gradient."""
    failing = [True]

    def fail_once(t: Any, grad: Any) -> Any:
        if rank == 1 and failing[0] and t is tensor:
            failing[0] = False
            raise ValueError("a bad batch on rank 1")
        return grad

    return fail_once


def _step_raising(gm: Any, fw: Any, ps: List[Any], rank: int) -> List[str]:
    """One step; the names of the errors it raised (RankFailedError, ValueError)."""
    try:
        step(gm, fw, ps, data(fw, rank))
    except (RankFailedError, ValueError) as error:
        return [type(error).__name__]
    return []


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


def _twice(fw: Any, ps: List[Any], x: Any, rank: int) -> Any:
    """A loss that uses ``a`` twice (a tied weight): its gradient is the sum of both uses."""
    a, b, c = ps
    return fw.sum(fw.sin(a * x) * b) + fw.sum(fw.sin(a * b) * x) + fw.sum(c * c) * 0.5


def used_twice(fw: Any, rank: int, world: int) -> Result:
    """A tensor used twice in the forward is reduced once, with both uses' gradient."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    with gm:
        gm.backward(_twice(fw, ps, data(fw, rank), rank))
    return {"got": grads(fw, ps), "want": mean_over_ranks(fw, world, loss_fn=_twice)}


def no_sync_on_one_rank(fw: Any, rank: int, world: int) -> Result:
    """Rank 0 alone records a micro-batch inside no_sync: every rank refuses that step with
    RankMismatchError (not a hang, nor rank 1's gradient reduced with nothing), keeps no
    gradient, and a step the ranks agree on then gives the mean."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    errors = []
    try:
        with no_sync(gm) if rank == 0 else contextlib.nullcontext():
            step(gm, fw, ps, data(fw, rank))
    except RankMismatchError as error:
        errors.append(str(error))
    refused = grads(fw, ps)
    step(gm, fw, ps, data(fw, rank))
    return {"errors": errors, "refused": refused, "got": grads(fw, ps),
            "want": mean_over_ranks(fw, world)}


def _some(fw: Any, ps: List[Any], x: Any, rank: int) -> Any:
    """:func:`_use_some`'s loss: ``a`` on rank 0 only, ``b`` everywhere, ``c`` nowhere."""
    a, b, _ = ps
    y = fw.sum(fw.sin(b * x))
    return y + fw.sum(a * x) if rank == 0 else y


def split_steps(fw: Any, rank: int, world: int) -> Result:
    """Two micro-batches, the first under no_sync, each a split backward: the input ``x``
    (attached while recording, no callback) first, the parameters at ``finish()``, with
    :func:`_some`'s loss. The parameters get the mean over ranks of both micro-batches'
    gradients (``c`` none), ``x`` this rank's own gradient. A backend whose engine cannot
    split refuses it on every rank before anything runs (``refused``)."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    out = _split_micro_batches(gm, fw, ps, rank)
    out["got"] = grads(fw, ps)
    if "refused" not in out:
        out["want"] = mean_over_ranks(fw, world, micros=(0, 1), loss_fn=_some)
    return out


def _split_micro_batches(gm: Any, fw: Any, ps: List[Any], rank: int) -> Result:
    """:func:`split_steps`' two micro-batches: each input's gradient and what it must be
    (``got_inputs``, ``want_inputs``), or ``refused``: the first split's error."""
    inputs = []
    for m in range(2):
        with no_sync(gm) if m == 0 else contextlib.nullcontext(), gm:
            x = fw.tensor(fw.numpy(data(fw, rank, m)), requires_grad=True)
            gm.attach(x)
            try:
                rest = gm.backward_split(_some(fw, ps, x, rank), first=[x])
            except UnsupportedGraphError as error:
                return {"refused": f"{type(error).__name__}: {error}"}
            inputs.append(fw.grad(x))
            rest.finish()
    return {"got_inputs": inputs, "want_inputs": [_input_grad(fw, rank, m) for m in range(2)]}


def _input_grad(fw: Any, rank: int, micro: int) -> Any:
    """The gradient of :func:`_some`'s loss at this rank's input, in one process."""
    x = fw.tensor(fw.numpy(data(fw, rank, micro)), requires_grad=True)
    gm = GradManager().attach(x)
    with gm:
        gm.backward(_some(fw, params(fw), x, rank))
    return fw.grad(x)


# ------------------------------------------------------------------ sharded (ZeRO-2)
LR = 0.25
"""The sharded scenarios' learning rate, with the framework's own plain SGD."""


def sharded(fw: Any, ps: List[Any], *before: Any, bucket_bytes: int = 2**20,
            **options: Any) -> tuple:
    """A manager reduce-scattering ``ps`` (after the callbacks ``before``) and a
    ShardedOptimizer over the framework's SGD (``options``: SGD's, besides ``lr``)."""
    cb = make_reduce_scatter_cb("mean", bucket_bytes=bucket_bytes)
    gm = GradManager().attach(ps, callbacks=[*before, cb])
    return gm, ShardedOptimizer(gm, fw.sgd(), lr=LR, **options)


def sgd_step(opt: Any, fw: Any, ps: List[Any]) -> List[Any]:
    """The optimizer's step; the values it leaves on this rank."""
    opt.step()
    opt.zero_grad()
    return [fw.numpy(p) for p in ps]


def after_sgd(start: List[Any], mean: List[Any], frozen=()) -> List[Any]:
    """``start - LR * mean`` where there is a gradient and the tensor is not ``frozen``."""
    return [v if g is None or i in frozen else v - np.float32(LR) * g
            for i, (v, g) in enumerate(zip(start, mean))]


def sgd_reference(fw: Any, world: int, steps: int = 1, frozen=(), **kwargs: Any) -> List[Any]:
    """The values after ``steps`` SGD steps in one process on the mean over ranks of every
    rank's gradients (``kwargs``: :func:`local_grads`'s), from START."""
    values = [np.asarray(START[k], "float32") for k in "abc"]
    for _ in range(steps):
        values = after_sgd(values, mean_over_ranks(fw, world, start=values, **kwargs), frozen)
    return values


def sharded_steps(fw: Any, rank: int, world: int) -> Result:
    """Two steps over one bucket (c, b, a: 10 elements) whose chunks cut ``b`` between the
    ranks: every rank ends each step with plain SGD's values on the mean gradient; ``.grad``
    holds no gradient (the reduced gradients are the shards: None, or on PyTorch a stand-in
    that refuses to be read) and each rank holds its chunk only."""
    ps = params(fw)
    gm, opt = sharded(fw, ps)
    step(gm, fw, ps, data(fw, rank))
    out = {"grads": [_held_grad(fw, p) for p in ps], "memory": opt.memory()}
    out["got_first"] = sgd_step(opt, fw, ps)
    step(gm, fw, ps, data(fw, rank))
    out["got"] = sgd_step(opt, fw, ps)
    out["want_first"], out["want"] = (sgd_reference(fw, world, s) for s in (1, 2))
    return out


def _held_grad(fw: Any, p: Any) -> Any:
    """``p``'s ``.grad`` after a sharded step: None, or "stand-in" where reading it raises
    the sharded path's error (PyTorch's stand-in, through which torch's clipping works)."""
    try:
        return fw.grad(p)
    except RuntimeError as exc:
        if "shard=True" not in str(exc):
            raise
        return "stand-in"


def sharded_without_sync(fw: Any, rank: int, world: int) -> Result:
    """Four micro-batches, the first two under no_sync, one bucket per tensor: the first
    synced backward reduce-scatters what ``.grad`` held plus its own gradient, the second
    adds its shards to those (as ``.grad`` accumulates until zero_grad)."""
    ps = params(fw)
    gm, opt = sharded(fw, ps, bucket_bytes=8)
    for m in range(4):
        with no_sync(gm) if m < 2 else contextlib.nullcontext():
            step(gm, fw, ps, data(fw, rank, m))
    return {"got": sgd_step(opt, fw, ps), "want": sgd_reference(fw, world, micros=range(4))}


def sharded_unused(fw: Any, rank: int, world: int) -> Result:
    """``a`` gets a gradient on rank 0 only, ``c`` on no rank: SGD steps ``a`` and ``b``
    with their means and leaves ``c`` as it was."""
    ps = params(fw)
    gm, opt = sharded(fw, ps)
    _use_some(gm, fw, ps, rank)
    return {"got": sgd_step(opt, fw, ps),
            "want": after_sgd(sgd_reference(fw, world, steps=0), _some_used_mean(fw, world))}


def sharded_broadcast_first(fw: Any, rank: int, world: int) -> Result:
    """Ranks start from different values and the optimizer is made before the first
    recording: the step starts from rank 0's values, which that recording broadcast (on
    frameworks whose segments are copies, the copies follow)."""
    ps = params(fw, offset=float(rank))
    gm, opt = sharded(fw, ps)
    step(gm, fw, ps, data(fw, rank))
    return {"got": sgd_step(opt, fw, ps), "want": sgd_reference(fw, world)}


def sharded_failing_rank(fw: Any, rank: int, world: int) -> Result:
    """Rank 1's backward raises: rank 0 raises RankFailedError, no rank keeps a shard (a step
    taken anyway changes nothing), and the next step is SGD's first."""
    ps = params(fw)
    gm, opt = sharded(fw, ps, _failing_once(rank, ps[0]))
    raised = _step_raising(gm, fw, ps, rank)
    kept = sgd_step(opt, fw, ps)
    step(gm, fw, ps, data(fw, rank))
    return {"raised": raised, "kept": kept, "want_kept": sgd_reference(fw, world, steps=0),
            "got": sgd_step(opt, fw, ps), "want": sgd_reference(fw, world)}


def sharded_state_dict(fw: Any, rank: int, world: int) -> Result:
    """Only ``a`` is used (its gradient is the data): rank 0's segments (``c``, most of
    ``b``) never get a gradient, so where the optimizer makes its state lazily (PyTorch, the
    fake one) rank 0 holds none at all. SGD with momentum: the consolidated state_dict, on
    every rank, is that of the unsharded optimizer stepped once with the mean gradient."""
    ps = params(fw)
    gm, opt = sharded(fw, ps, momentum=0.5)
    with gm:
        gm.backward(fw.sum(ps[0] * data(fw, rank)))
    sgd_step(opt, fw, ps)
    alone = params(fw)
    unsharded = fw.sgd()(alone, lr=LR, momentum=0.5)
    mean = sum(fw.numpy(data(fw, r)) for r in range(world)) / np.float32(world)
    fw.set_grad(alone[0], fw.tensor(mean))
    unsharded.step()
    return {"got": _numpy_state(fw, opt.state_dict()),
            "want": _numpy_state(fw, unsharded.state_dict())}


def _numpy_state(fw: Any, state_dict: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    """A state_dict's state as numpy arrays (MegEngine's optimizers save numpy already)."""
    return {int(i): {k: np.asarray(v) if isinstance(v, (np.ndarray, float)) else fw.numpy(v)
                     for k, v in state.items()}
            for i, state in state_dict["state"].items()}


def sharded_split(fw: Any, rank: int, world: int) -> Result:
    """:func:`split_steps`' micro-batches on the sharded path, then SGD: plain SGD's values on
    the mean gradient (``c`` kept); where the engine cannot split, ``refused`` on every
    rank and the values unchanged."""
    ps = params(fw)
    gm, opt = sharded(fw, ps)
    out = _split_micro_batches(gm, fw, ps, rank)
    out["got"] = sgd_step(opt, fw, ps)
    mean = None if "refused" in out else mean_over_ranks(fw, world, micros=(0, 1),
                                                         loss_fn=_some)
    out["want"] = sgd_reference(fw, world, steps=0)
    if mean is not None:
        out["want"] = after_sgd(out["want"], mean)
    return out


def sharded_frozen(fw: Any, rank: int, world: int) -> Result:
    """``b`` frozen on every rank before the optimizer is made: left out of the buckets and
    of the optimizer, it keeps its value; ``a`` and ``c`` are stepped."""
    ps = params(fw)
    fw.freeze(ps[1])
    gm, opt = sharded(fw, ps)
    step(gm, fw, ps, data(fw, rank))
    memory = opt.memory()
    return {"got": sgd_step(opt, fw, ps), "want": sgd_reference(fw, world, frozen=(1,)),
            "memory": memory}


SCENARIOS = [mean_in_buckets, summed, accumulated_without_sync, broadcast_first, unused_tensors,
             ranks_that_differ, a_failing_rank, used_twice, no_sync_on_one_rank, split_steps]
SHARDED = [sharded_steps, sharded_without_sync, sharded_unused, sharded_broadcast_first,
           sharded_failing_rank, sharded_state_dict, sharded_split]
FREEZING = [frozen_tensors, frozen_on_one_rank]


def run_all(fw: Any, rank: int, world: int) -> Dict[str, Result]:
    """Every scenario the framework can run; on one that cannot shard, each sharded scenario's
    refusal (``{"refused": "Type: message"}``) instead."""
    sharded = SHARDED + ([sharded_frozen] if fw.can_freeze else [])
    run = {s: s for s in SCENARIOS + (FREEZING if fw.can_freeze else [])}
    run.update({s: s if fw.can_shard else functools.partial(_refused, s) for s in sharded})
    return {scenario.__name__: call(fw, rank, world) for scenario, call in run.items()}


def _refused(scenario: Any, fw: Any, rank: int, world: int) -> Result:
    """What ``scenario`` raised on a framework that cannot shard (None: nothing)."""
    try:
        scenario(fw, rank, world)
    except NotImplementedError as error:
        return {"refused": f"{type(error).__name__}: {error}"}
    return {"refused": None}
