"""The data-parallel contract as scenarios that run unchanged on every backend.

Each scenario runs on one rank (``rank`` of ``world``) with the backend's default transport
(the fake framework's threads, torch.distributed gloo for PyTorch and MegEngine tensors,
Paddle's own collectives for Paddle's) and returns plain values: what gradmgr gave
(``got...``) and what it must give (``want...``, computed on the same rank without data
parallelism, from every rank's data; for the sharded scenarios of
``dp_scenarios_sharded.py``, which reduce-scatter and step a ShardedOptimizer over the
framework's own SGD, the values plain SGD gives on the mean gradient). The tests compare them
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
import warnings
from typing import Any, Dict, List

import numpy as np

from gradmgr import GradManager, UnfinishedBackwardWarning, UnsupportedGraphError
from gradmgr.distributed import RankFailedError, RankMismatchError, make_allreduce_cb, no_sync

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
    use_some(gm, fw, ps, rank)
    return {"got": grads(fw, ps), "want": some_used_mean(fw, world)}


def use_some(gm: Any, fw: Any, ps: List[Any], rank: int) -> None:
    """A step whose loss uses ``a`` on rank 0 only, ``b`` everywhere, ``c`` nowhere."""
    a, b, c = ps
    x = data(fw, rank)
    with gm:
        y = fw.sum(fw.sin(b * x))
        gm.backward(y + fw.sum(a * x) if rank == 0 else y)


def some_used_mean(fw: Any, world: int) -> List[Any]:
    """The mean over ranks of :func:`use_some`'s gradients (None for ``c``)."""
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
    gm = GradManager().attach(ps, callbacks=[failing_once(rank, ps[0]),
                                             make_allreduce_cb("mean")])
    raised = step_raising(gm, fw, ps, rank)
    kept = grads(fw, ps)
    step(gm, fw, ps, data(fw, rank))
    return {"raised": raised, "kept": kept, "got": grads(fw, ps),
            "want": mean_over_ranks(fw, world)}


def failing_once(rank: int, tensor: Any) -> Any:
    """A callback raising on rank 1 the first time it sees ``tensor``'s gradient."""
    failing = [True]

    def fail_once(t: Any, grad: Any) -> Any:
        if rank == 1 and failing[0] and t is tensor:
            failing[0] = False
            raise ValueError("a bad batch on rank 1")
        return grad

    return fail_once


def step_raising(gm: Any, fw: Any, ps: List[Any], rank: int) -> List[str]:
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


def frozen_in_window(fw: Any, rank: int, world: int) -> Result:
    """Every rank freezes a tensor after a no_sync micro-batch gave it a gradient: the synced
    step still reduces what it accumulated there (as DDP with find_unused_parameters), and
    the others' gradients of both micro-batches."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    with no_sync(gm):
        step(gm, fw, ps, data(fw, rank, 0))
    fw.freeze(ps[1])
    step(gm, fw, ps, data(fw, rank, 1))
    want = mean_over_ranks(fw, world, micros=(0, 1))
    want[1] = mean_over_ranks(fw, world, micros=(0,))[1]
    return {"got": grads(fw, ps), "want": want}


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


def some(fw: Any, ps: List[Any], x: Any, rank: int) -> Any:
    """:func:`use_some`'s loss: ``a`` on rank 0 only, ``b`` everywhere, ``c`` nowhere."""
    a, b, _ = ps
    y = fw.sum(fw.sin(b * x))
    return y + fw.sum(a * x) if rank == 0 else y


def split_steps(fw: Any, rank: int, world: int) -> Result:
    """Two micro-batches, the first under no_sync, each a split backward: the input ``x``
    (attached while recording, no callback) first, the parameters at ``finish()``, with
    :func:`some`'s loss. The parameters get the mean over ranks of both micro-batches'
    gradients (``c`` none), ``x`` this rank's own gradient. A backend whose engine cannot
    split refuses it on every rank before anything runs (``refused``)."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    out = split_micro_batches(gm, fw, ps, rank)
    out["got"] = grads(fw, ps)
    if "refused" not in out:
        out["want"] = mean_over_ranks(fw, world, micros=(0, 1), loss_fn=some)
    return out


def split_micro_batches(gm: Any, fw: Any, ps: List[Any], rank: int,
                        rests: Any = None) -> Result:
    """:func:`split_steps`' two micro-batches: each input's gradient and what it must be
    (``got_inputs``, ``want_inputs``), or ``refused``: the first split's error. Each
    ``finish()`` runs right after its first part, or is left in the list ``rests``."""
    inputs = []
    for m in range(2):
        with no_sync(gm) if m == 0 else contextlib.nullcontext(), gm:
            x = fw.tensor(fw.numpy(data(fw, rank, m)), requires_grad=True)
            gm.attach(x)
            try:
                rest = gm.backward_split(some(fw, ps, x, rank), first=[x])
            except UnsupportedGraphError as error:
                return {"refused": f"{type(error).__name__}: {error}"}
            inputs.append(fw.grad(x))
        if rests is None:
            rest.finish()
        else:
            rests.append(rest)
    return {"got_inputs": inputs, "want_inputs": [_input_grad(fw, rank, m) for m in range(2)]}


def split_out_of_order(fw: Any, rank: int, world: int) -> Result:
    """:func:`split_steps`' micro-batches, both first parts, then the synced one's
    ``finish()`` before the no_sync one's (``overtaken``: what that one raised): the
    parameters keep the synced micro-batch's mean alone, alike on every rank."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    out = finish_out_of_order(gm, fw, ps, rank)
    out["got"] = grads(fw, ps)
    if "refused" not in out:
        out["want"] = mean_over_ranks(fw, world, micros=(1,), loss_fn=some)
    return out


def finish_out_of_order(gm: Any, fw: Any, ps: List[Any], rank: int) -> Result:
    """:func:`split_micro_batches`, the synced ``finish()`` first; ``overtaken``: the error
    the no_sync one's raised."""
    rests: List[Any] = []
    out = split_micro_batches(gm, fw, ps, rank, rests)
    if rests:
        rests[1].finish()
        try:
            rests[0].finish()
        except RuntimeError as error:
            out["overtaken"] = str(error)
    return out


def split_dropped_on_one_rank(fw: Any, rank: int, world: int) -> Result:
    """A synced split backward whose handle rank 1 drops unfinished (its schedule raised, say),
    then a plain step on every rank (:func:`drop_split_on_rank_1`): ``.grad`` stays as it
    was (``kept``), and the next step is the mean."""
    ps = params(fw)
    gm = GradManager().attach(ps, callbacks=[make_allreduce_cb("mean")])
    out = drop_split_on_rank_1(gm, fw, ps, rank)
    out["kept"] = grads(fw, ps)
    if "refused" in out:
        return dict(out, got=out["kept"])
    step(gm, fw, ps, data(fw, rank))
    out.update(got=grads(fw, ps), want=mean_over_ranks(fw, world))
    return out


def drop_split_on_rank_1(gm: Any, fw: Any, ps: List[Any], rank: int) -> Result:
    """A synced split backward, finished on rank 0 and dropped unfinished on rank 1, whose
    next collective (its next recording's, or its sharded optimizer's) completes the dropped
    step's as a failed one: rank 0's ``finish()`` raises RankFailedError (``raised``). (Old
    code: it waited for buckets rank 1 never sent, and rank 1's next collective paired with
    them.) ``refused``: where the engine cannot split."""
    with gm:
        x = fw.tensor(fw.numpy(data(fw, rank)), requires_grad=True)
        gm.attach(x)
        try:
            rest = gm.backward_split(some(fw, ps, x, rank), first=[x])
        except UnsupportedGraphError as error:
            return {"refused": f"{type(error).__name__}: {error}"}
    raised = []
    if rank == 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnfinishedBackwardWarning)
            del rest  # never finished
    else:
        try:
            rest.finish()
        except RankFailedError as error:
            raised.append(type(error).__name__)
    return {"raised": raised, "got_inputs": [], "want_inputs": []}


def _input_grad(fw: Any, rank: int, micro: int) -> Any:
    """The gradient of :func:`some`'s loss at this rank's input, in one process."""
    x = fw.tensor(fw.numpy(data(fw, rank, micro)), requires_grad=True)
    gm = GradManager().attach(x)
    with gm:
        gm.backward(some(fw, params(fw), x, rank))
    return fw.grad(x)


SCENARIOS = [mean_in_buckets, summed, accumulated_without_sync, broadcast_first, unused_tensors,
             ranks_that_differ, a_failing_rank, used_twice, no_sync_on_one_rank, split_steps,
             split_out_of_order, split_dropped_on_one_rank]
FREEZING = [frozen_tensors, frozen_on_one_rank, frozen_in_window]


def run_all(fw: Any, rank: int, world: int) -> Dict[str, Result]:
    """Every scenario the framework can run; on one that cannot shard, each sharded scenario's
    refusal (``{"refused": "Type: message"}``) instead."""
    from dp_scenarios_sharded import SHARDED, sharded_frozen  # (they use this module's helpers)

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
