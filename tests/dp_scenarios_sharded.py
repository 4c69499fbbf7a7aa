"""The data-parallel contract's sharded (ZeRO-2) scenarios (see ``dp_scenarios.py``, whose
helpers they use and whose ``run_all`` runs them): each reduce-scatters and steps a
ShardedOptimizer over the framework's own SGD and must give the values plain SGD gives on the
mean gradient.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List

import numpy as np
from dp_scenarios import (
    START,
    Result,
    data,
    drop_split_on_rank_1,
    failing_once,
    finish_out_of_order,
    mean_over_ranks,
    params,
    some,
    some_used_mean,
    split_micro_batches,
    step,
    step_raising,
    use_some,
)

from gradmgr import GradManager
from gradmgr.distributed import ShardedOptimizer, make_reduce_scatter_cb, no_sync

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
    use_some(gm, fw, ps, rank)
    return {"got": sgd_step(opt, fw, ps),
            "want": after_sgd(sgd_reference(fw, world, steps=0), some_used_mean(fw, world))}


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
    gm, opt = sharded(fw, ps, failing_once(rank, ps[0]))
    raised = step_raising(gm, fw, ps, rank)
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
    out = split_micro_batches(gm, fw, ps, rank)
    out["got"] = sgd_step(opt, fw, ps)
    mean = None if "refused" in out else mean_over_ranks(fw, world, micros=(0, 1),
                                                         loss_fn=some)
    out["want"] = sgd_reference(fw, world, steps=0)
    if mean is not None:
        out["want"] = after_sgd(out["want"], mean)
    return out


def sharded_split_out_of_order(fw: Any, rank: int, world: int) -> Result:
    """:func:`split_out_of_order` on the sharded path, then SGD: the synced micro-batch's
    mean gradient alone."""
    ps = params(fw)
    gm, opt = sharded(fw, ps)
    out = finish_out_of_order(gm, fw, ps, rank)
    out["got"] = sgd_step(opt, fw, ps)
    out["want"] = sgd_reference(fw, world, steps=0)
    if "refused" not in out:
        mean = mean_over_ranks(fw, world, micros=(1,), loss_fn=some)
        out["want"] = after_sgd(out["want"], mean)
    return out


def sharded_split_dropped(fw: Any, rank: int, world: int) -> Result:
    """:func:`drop_split_on_rank_1` on the sharded path, then SGD at once (rank 1's next
    collective is its optimizer's gather), then a plain step and SGD: the first SGD step
    changes nothing (``kept``), the second is SGD's first."""
    ps = params(fw)
    gm, opt = sharded(fw, ps)
    out = drop_split_on_rank_1(gm, fw, ps, rank)
    out["kept"] = sgd_step(opt, fw, ps)
    if "refused" in out:
        return dict(out, got=out["kept"], want=sgd_reference(fw, world, steps=0))
    step(gm, fw, ps, data(fw, rank))
    out.update(got=sgd_step(opt, fw, ps), want=sgd_reference(fw, world),
               want_kept=sgd_reference(fw, world, steps=0))
    return out


def sharded_split_dropped_between_steps(fw: Any, rank: int, world: int) -> Result:
    """:func:`drop_split_on_rank_1` three times after a step of SGD with momentum, each time
    followed by one of the optimizer's collectives between steps on every rank: state_dict(),
    consolidate_state_dict(), making a new ShardedOptimizer (loaded with the first). Each
    time rank 0's ``finish()`` raises RankFailedError (``raised``), the state is the one the
    first step left (``states``, ``want_state``), and the new optimizer takes SGD-with-momentum's
    second step (``got``, ``want``). (Old code: rank 1's collective met rank 0 still waiting in
    ``finish()``; state_dict() raised its "called it while not every rank did" on both ranks
    and the next step's plan check ran out of step.)"""
    ps = params(fw)
    gm, opt = sharded(fw, ps, momentum=0.5)
    step(gm, fw, ps, data(fw, rank))
    sgd_step(opt, fw, ps)
    out: Result = {"raised": [], "states": [], "want_state": _numpy_state(fw, opt.state_dict())}
    for collective in ("state_dict", "consolidate_state_dict", "a new one"):
        dropped = drop_split_on_rank_1(gm, fw, ps, rank)
        if "refused" in dropped:
            return dropped
        out["raised"].append(dropped["raised"])
        if collective == "state_dict":
            saved = opt.state_dict()
            out["states"].append(_numpy_state(fw, saved))
        elif collective == "consolidate_state_dict":
            opt.consolidate_state_dict(0)
            if rank == 0:
                out["states"].append(_numpy_state(fw, opt.state_dict()))
        else:
            new = ShardedOptimizer(gm, fw.sgd(), lr=LR, momentum=0.5)
            new.load_state_dict(saved)
    step(gm, fw, ps, data(fw, rank))
    return dict(out, got=sgd_step(new, fw, ps), want=_momentum_reference(fw, world, steps=2))


def _momentum_reference(fw: Any, world: int, steps: int) -> List[Any]:
    """The values after ``steps`` steps of the framework's SGD (momentum 0.5) in one process on
    the mean over ranks of every rank's gradients, from START."""
    alone = params(fw)
    unsharded = fw.sgd()(alone, lr=LR, momentum=0.5)
    for _ in range(steps):
        mean = mean_over_ranks(fw, world, start=[fw.numpy(p) for p in alone])
        for p, g in zip(alone, mean):
            fw.set_grad(p, fw.tensor(g))
        unsharded.step()
    return [fw.numpy(p) for p in alone]


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


SHARDED = [sharded_steps, sharded_without_sync, sharded_unused, sharded_broadcast_first,
           sharded_failing_rank, sharded_state_dict, sharded_split, sharded_split_out_of_order,
           sharded_split_dropped, sharded_split_dropped_between_steps]
