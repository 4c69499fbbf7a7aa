"""Rank program: ``ShardedOptimizer(gather="deferred")`` against the eager gather and DDP, on 2
ranks; every rank pickles what the parent checks to ``OUTDIR/rank{RANK}.pkl``.

Each run trains the wide model of :mod:`.zero_suite` (buckets of a few large segments, so the
updated parameters go by broadcasts, one weight through a temporary) for 5 AdamW steps. Between
the deferred run's steps, each read the optimizer must wait for: an evaluation forward under
``torch.no_grad()``, ``model.state_dict()`` on rank 0 alone, ``zero_grad`` (which waits for
nothing: it reads no parameter), a tied weight read
by the module it is tied into, a forward that raises half-way; and after the last step
``opt.finish_gather()`` then the process group destroyed (the documented end of training).
And distributed checkpoints (DCP) taken and loaded with a gather in flight (:func:`checkpoints`),
and an EMA of the model updated after each step (:func:`ema`).
"""

from __future__ import annotations

import hashlib
import os
import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import ShardedOptimizer, data_parallel

from .zero_dcp import dcp_load, dcp_save, same_state
from .zero_suite import LR, loss_of, params_of, wide

STEPS = 5


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def in_flight(opt: ShardedOptimizer) -> int:
    """How many parameters' broadcasts are still pending."""
    pending = opt._gathering.pending
    return 0 if pending is None else len(pending._by_position)


def train(rank: int, how: str, group=None) -> dict:
    """5 steps of the wide model; ``how``: 'eager', 'deferred' or 'ddp'."""
    net = wide(torch.float32)
    seen: dict = {"in_flight": [], "reads": {}}
    if how == "ddp":
        ddp = DDP(net)
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
    else:
        gm = data_parallel(net, shard=True, group=group)
        opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, gather=how)
    for step in range(STEPS):
        x = batch(step, rank)
        if how == "ddp":
            loss_of(ddp, x).backward()
        else:
            with gm:
                gm.backward(loss_of(net, x))
        opt.step()
        if how == "deferred":
            seen["in_flight"].append(in_flight(opt))
            reads(seen["reads"], step, net, opt, rank)
        if how == "deferred" and step == STEPS - 1:
            seen["in_flight_at_end"] = in_flight(opt)
            # the end of training: destroying a gloo group does not wait for what is in
            # flight (measured: the last step's values missing after it), hence the rule
            opt.finish_gather()
            if group is not None:
                dist.destroy_process_group(group)
            break
        opt.zero_grad()
        if step == 0:
            seen["eval"] = evaluate(net)
        if how == "eager":
            seen.setdefault("digests", []).append(digest(net.state_dict()))
    seen["params"] = params_of(net)
    return seen


def digest(state: dict) -> str:
    return hashlib.sha256(b"".join(v.numpy().tobytes() for v in state.values())).hexdigest()


def evaluate(net: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return net(torch.ones(2, 16)).clone()


def reads(out: dict, step: int, net: nn.Module, opt: ShardedOptimizer, rank: int) -> None:
    """One read per step that must see the step's parameters; how many broadcasts were
    pending after it (0: it waited for all; fewer than before: for its own)."""
    if step == 0:  # an evaluation forward, first layer only: waits for that layer alone
        with torch.no_grad():
            net[0](torch.ones(2, 16))
        out["first_layer"] = in_flight(opt)
    elif step == 1:  # `if rank == 0: torch.save(model.state_dict(), path)`; rank 1 trains on
        if rank == 0:  # with the broadcasts in flight
            out["state_dict"] = (digest(net.state_dict()), in_flight(opt))
    elif step == 2:  # zero_grad reads no parameter: the broadcasts stay in flight
        opt.zero_grad()
        out["zero_grad"] = in_flight(opt)
        opt.state_dict()  # every rank: it gathers the optimizer state
        out["optimizer_state_dict"] = in_flight(opt)
    elif step == 3:  # a forward that raises half-way: the rest stays in flight
        try:
            net(torch.ones(2, 17))
        except RuntimeError:
            out["raised"] = in_flight(opt)


def ema(rank: int) -> dict:
    """An EMA of the model (``AveragedModel.update_parameters(net)`` after each of 3 steps),
    eager and deferred: it reads ``model.parameters()``, which does not wait, so the deferred
    run calls ``opt.finish_gather()`` first (``in_flight``: what was pending before it); the
    EMA's parameters of both runs."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    out: dict = {"in_flight": []}
    for how in ("eager", "deferred"):
        net = wide(torch.float32)
        gm = data_parallel(net, shard=True)
        opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, gather=how)
        average = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.5))
        for step in range(3):
            with gm:
                gm.backward(loss_of(net, batch(step, rank)))
            opt.step()
            if how == "deferred":
                out["in_flight"].append(in_flight(opt))
                opt.finish_gather()
            average.update_parameters(net)
            opt.zero_grad()
        out[how] = params_of(average.module)
        del opt, gm
    return out


def tied(rank: int) -> dict:
    """A weight tied into a second module (an embedding and the output layer sharing it):
    the second module's forward alone waits for it."""
    torch.manual_seed(3)
    embed, head = nn.Embedding(1024, 512), nn.Linear(512, 1024, bias=False)
    head.weight = embed.weight
    net = nn.ModuleDict({"embed": embed, "head": head})
    gm = data_parallel(net, shard=True)
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, gather="deferred")
    ids = torch.arange(8).reshape(2, 4) + rank
    with gm:
        gm.backward(head(embed(ids)).square().mean())
    opt.step()
    before = in_flight(opt)
    with torch.no_grad():
        out = head(torch.ones(1, 512)).clone()
    after = in_flight(opt)
    opt.finish_gather()
    with torch.no_grad():
        expected = head(torch.ones(1, 512))
    return {"before": before, "after": after, "equal": torch.equal(out, expected)}


def _zero(how: str) -> tuple:
    net = wide(torch.float32)
    gm = data_parallel(net, shard=True)
    return net, gm, ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, gather=how)


def _steps(run: tuple, steps: range, rank: int) -> None:
    net, gm, opt = run
    for step in steps:
        with gm:
            gm.backward(loss_of(net, batch(step, rank)))
        opt.step()
        opt.zero_grad()  # waits for nothing: the gather stays in flight


def checkpoints(rank: int, outdir: str) -> dict:
    """3 steps eager and deferred, each saved with DCP right after its step (the deferred
    gather in flight); each checkpoint read into an eager optimizer; then loaded, by DCP
    or by load_state_dict, into a deferred optimizer whose own gather is in flight, and a
    step, against the eager run's step."""
    runs = {how: _zero(how) for how in ("eager", "deferred")}
    for run in runs.values():
        _steps(run, range(3), rank)
    out = {"in_flight_at_save": in_flight(runs["deferred"][2])}
    for how, (net, _, opt) in runs.items():
        dcp_save(net, opt, os.path.join(outdir, f"dcp-{how}"))
    read = {}
    for how in runs:
        net, _, opt = _zero("eager")
        dcp_load(net, opt, os.path.join(outdir, f"dcp-{how}"))
        read[how] = (params_of(net), opt.state_dict())
    out["saved_params_equal"] = all(torch.equal(a, b) for a, b in
                                    zip(read["deferred"][0], read["eager"][0]))
    out["saved_state_equal"] = same_state(read["deferred"][1], read["eager"][1])
    eager_net, _, eager_opt = runs["eager"]
    gathered = ({k: v.clone() for k, v in eager_net.state_dict().items()},
                eager_opt.state_dict())
    _steps(runs["eager"], range(3, 4), rank)
    for way in ("dcp", "load_state_dict"):
        run = _zero("deferred")
        _steps(run, range(7, 8), rank)  # a step of its own: its gather in flight
        out[f"{way}_in_flight"] = in_flight(run[2])
        if way == "dcp":
            dcp_load(run[0], run[2], os.path.join(outdir, "dcp-deferred"))
        else:
            run[0].load_state_dict(gathered[0])
            run[2].load_state_dict(gathered[1])
        _steps(run, range(3, 4), rank)
        run[2].finish_gather()
        out[f"{way}_stepped_params_equal"] = all(
            torch.equal(a, b) for a, b in zip(params_of(run[0]), params_of(eager_net)))
        out[f"{way}_stepped_state_equal"] = same_state(run[2].state_dict(),
                                                       eager_opt.state_dict())
    for _, _, opt in runs.values():
        opt.finish_gather()
    return out


def main(rank: int, world: int, outdir: str) -> None:
    out = {"eager": train(rank, "eager"), "ddp": train(rank, "ddp"),
           "tied": tied(rank), "checkpoints": checkpoints(rank, outdir), "ema": ema(rank)}
    group = dist.new_group(list(range(world)))
    out["deferred"] = train(rank, "deferred", group)
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
