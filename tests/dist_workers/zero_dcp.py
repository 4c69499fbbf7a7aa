"""Rank program: distributed checkpoints (torch.distributed.checkpoint) of ZeRO-2 next to the
gathered ``state_dict()``, across world sizes, and DDP's DCP checkpoints; every rank pickles
what the parent checks to ``OUTDIR/rank{RANK}.pkl``.

``GRADMGR_DCP_PART``: ``first`` (2 ranks: 3 AdamW steps, saved both ways; DDP trained alike and
saved with DCP), ``second`` (3 ranks: both loaded, compared, one step, saved again) or
``third`` (2 ranks: the same; then DDP's checkpoint into ZeRO-2 and back, and bad input).
Each part then runs full sharding's (dist_workers/full_dcp.py).
"""

from __future__ import annotations

import functools
import os
import pickle

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_state
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import (
    ShardedOptimizer,
    data_parallel,
    get_state_dict,
    no_sync,
    set_state_dict,
)

LR, WEIGHT_DECAY = 1e-2, 0.05


def model(extra: bool = False) -> nn.Module:
    """Layers whose weights cross chunk borders mid-row (small buckets, odd widths)."""
    torch.manual_seed(0)
    layers = [nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3)]
    if extra:
        layers.append(nn.Linear(3, 2))
    return nn.Sequential(*layers)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 7, generator=torch.Generator().manual_seed(1000 * step + rank))


def zero(net: nn.Module, optimizer: type = torch.optim.AdamW, bucket_bytes: int = 200,
         **options):
    gm = data_parallel(net, shard=True, bucket_bytes=bucket_bytes)
    options = options or {"lr": LR, "weight_decay": WEIGHT_DECAY}
    return gm, ShardedOptimizer(gm, optimizer, **options)


def train(net: nn.Module, gm, opt, steps: range, rank: int) -> None:
    for step in steps:
        with gm:
            gm.backward(net(batch(step, rank)).square().mean())
        opt.step()
        opt.zero_grad()


def params(net: nn.Module) -> list:
    return [p.detach().clone() for p in net.parameters()]


def same_state(a: dict, b: dict) -> bool:
    """Two optimizer state dicts (gathered form), every tensor bit for bit, same options."""
    if sorted(a["state"]) != sorted(b["state"]):
        return False
    for i in a["state"]:
        if sorted(a["state"][i]) != sorted(b["state"][i]):
            return False
        for key, value in a["state"][i].items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][i][key])):
                return False
    strip = [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]]
    return strip == [{k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]]


def dcp_save(net, opt, path: str) -> None:
    model_state, optim_state = get_state_dict(net, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def dcp_load(net, opt, path: str) -> None:
    model_state, optim_state = get_state_dict(net, opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=model_state, optim_state_dict=optim_state)


def gathered_save(net, opt, path: str, rank: int) -> None:
    state = opt.state_dict()  # every rank
    if rank == 0:
        torch.save({"params": net.state_dict(), "optimizer": state}, path)
    dist.barrier()


def gathered_load(net, opt, path: str) -> dict:
    saved = torch.load(path)
    net.load_state_dict(saved["params"])
    opt.load_state_dict(saved["optimizer"])
    return saved


def leg(out: dict, rank: int, outdir: str, load: str, save: str, step: int) -> None:
    """Load both checkpoints, compare, step once, save both again."""
    ours, theirs = model(), model()
    gm, opt = zero(ours)
    ref_gm, ref = zero(theirs)
    dcp_load(ours, opt, os.path.join(outdir, f"dcp{load}"))
    saved = gathered_load(theirs, ref, os.path.join(outdir, f"ref{load}.pt"))
    out["loaded_state_equal"] = same_state(opt.state_dict(), saved["optimizer"])
    out["loaded_params_equal"] = all(torch.equal(a, b) for a, b in
                                     zip(params(ours), saved["params"].values()))
    train(ours, gm, opt, range(step, step + 1), rank)
    train(theirs, ref_gm, ref, range(step, step + 1), rank)
    out["stepped_params"] = (params(ours), params(theirs))
    out["stepped_state_equal"] = same_state(opt.state_dict(), ref.state_dict())
    dcp_save(ours, opt, os.path.join(outdir, f"dcp{save}"))
    gathered_save(theirs, ref, os.path.join(outdir, f"ref{save}.pt"), rank)


def first(out: dict, rank: int, outdir: str) -> None:
    ours, theirs, plain = model(), model(), model()
    gm, opt = zero(ours)
    ref_gm, ref = zero(theirs)
    train(ours, gm, opt, range(3), rank)
    train(theirs, ref_gm, ref, range(3), rank)
    dcp_save(ours, opt, os.path.join(outdir, "dcp1"))
    gathered_save(theirs, ref, os.path.join(outdir, "ref1.pt"), rank)
    # DDP with torch's AdamW, the same steps, saved with DCP as torch's docs do
    ddp = DDP(plain)
    adamw = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(3):
        ddp(batch(step, rank)).square().mean().backward()
        adamw.step()
        adamw.zero_grad()
    model_state, optim_state = torch_state.get_state_dict(ddp, adamw)
    dcp.save({"model": model_state, "optim": optim_state},
             checkpoint_id=os.path.join(outdir, "ddp1"))
    if rank == 0:
        torch.save({"params": plain.state_dict(), "optimizer": adamw.state_dict()},
                   os.path.join(outdir, "ddp1.pt"))
    dist.barrier()


def third(out: dict, rank: int, outdir: str) -> None:
    leg(out, rank, outdir, "2", "3", 4)
    # DDP's DCP checkpoint into ZeRO-2 ...
    ddp_saved = torch.load(os.path.join(outdir, "ddp1.pt"))
    net = model()
    gm, opt = zero(net)
    for p in net.parameters():  # so that a model that loaded nothing cannot pass
        p.data.add_(1.0)
    dcp_load(net, opt, os.path.join(outdir, "ddp1"))
    out["from_ddp_state_equal"] = same_state(opt.state_dict(), ddp_saved["optimizer"])
    out["from_ddp_params_equal"] = all(torch.equal(a, b) for a, b in
                                       zip(params(net), ddp_saved["params"].values()))
    # ... and back: ZeRO-2's DCP checkpoint into DDP with torch's AdamW
    dcp_save(net, opt, os.path.join(outdir, "back"))
    ddp = DDP(model())
    adamw = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    model_state, optim_state = torch_state.get_state_dict(ddp, adamw)
    dcp.load({"model": model_state, "optim": optim_state},
             checkpoint_id=os.path.join(outdir, "back"))
    torch_state.set_state_dict(ddp, adamw, model_state_dict=model_state,
                               optim_state_dict=optim_state)
    out["to_ddp_state_equal"] = same_state(adamw.state_dict(), ddp_saved["optimizer"])
    out["to_ddp_params_equal"] = all(torch.equal(a, b) for a, b in
                                     zip(params(ddp.module), ddp_saved["params"].values()))
    mid_window(out, rank, outdir, zero_run, zero_snapshot, zero_equal, "zero")
    async_saved(out, rank, outdir, zero_run, zero_snapshot, zero_equal, "zero")
    bad_input(out, outdir)


def mid_window(out: dict, rank: int, outdir: str, make, snapshot, equal, name: str) -> None:
    """A DCP save inside a ``no_sync`` window (``.grad`` holds this rank's accumulation): the
    run goes on as the same run unsaved (``{name}_mid_window_goes_on``), and the checkpoint
    loads, before any step, into a manager made with another bucket size (``make(None)``;
    ``{name}_mid_window_loads``: equal to what the saving run held)."""
    path = os.path.join(outdir, f"{name}_mid_window")
    saving, unsaved = make(200), make(200)
    for (net, gm, opt), save in ((saving, True), (unsaved, False)):
        train(net, gm, opt, range(2), rank)
        with no_sync(gm), gm:
            gm.backward(net(batch(2, rank)).square().mean())
        if save:
            held = snapshot(net, opt)
            dcp_save(net, opt, path)
        train(net, gm, opt, range(3, 4), rank)
    out[f"{name}_mid_window_goes_on"] = equal(snapshot(saving[0], saving[2]),
                                              snapshot(unsaved[0], unsaved[2]))
    net, _, opt = make(None)
    dcp_load(net, opt, path)
    out[f"{name}_mid_window_loads"] = equal(snapshot(net, opt), held)


@functools.cache
def async_group():
    """The gloo group of :func:`async_saved`'s saves (made at the first, by every rank)."""
    return dist.new_group(backend="gloo")


def async_saved(out: dict, rank: int, outdir: str, make, snapshot, equal, name: str) -> None:
    """``dcp.async_save`` in a gloo group of its own (on the default group its collectives
    met the training's: gloo's timeout, plain DDP too) with a ``FileSystemWriter`` (torch
    2.13's default stager cannot copy a ShardedTensor), a step right after it returns: the
    checkpoint holds the state it was given (``{name}_async_saved``)."""
    path = os.path.join(outdir, f"{name}_async")
    net, gm, opt = make(200)
    train(net, gm, opt, range(2), rank)
    held = snapshot(net, opt)
    model_state, optim_state = get_state_dict(net, opt)
    saving = dcp.async_save({"model": model_state, "optim": optim_state},
                            process_group=async_group(),
                            storage_writer=dcp.FileSystemWriter(path))
    train(net, gm, opt, range(2, 3), rank)  # the saved state, stepped in place meanwhile
    saving.result()
    net, _, opt = make(None)
    dcp_load(net, opt, path)
    out[f"{name}_async_saved"] = equal(snapshot(net, opt), held)


def zero_run(bucket_bytes) -> tuple:
    net = model()
    return (net, *zero(net, bucket_bytes=bucket_bytes or 2**25))


def zero_snapshot(net, opt) -> tuple:
    return params(net), opt.state_dict()


def zero_equal(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and same_state(a[1], b[1])


def bad_input(out: dict, outdir: str) -> None:
    """A checkpoint without a key the template asks for, and one of another optimizer class:
    each raises, and the optimizer is as it was."""
    for name, net, optimizer, options in [
            ("missing_key", model(extra=True), torch.optim.AdamW, {}),
            ("wrong_class", model(), torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})]:
        gm, opt = zero(net, optimizer, **options)
        train(net, gm, opt, range(1), dist.get_rank())
        before = opt.state_dict()
        try:
            dcp_load(net, opt, os.path.join(outdir, "dcp1"))
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            out[name] = (type(error).__name__, str(error), same_state(opt.state_dict(), before))
        else:
            out[name] = None
        del opt, gm


def main(rank: int, world: int, outdir: str) -> None:
    torch.set_num_threads(1)
    out: dict = {"world": world}
    part = os.environ["GRADMGR_DCP_PART"]
    from . import full_dcp  # full sharding's part, after ZeRO-2's (it reads its checkpoints)

    if part == "first":
        first(out, rank, outdir)
        full_dcp.first(out, rank, outdir)
    elif part == "second":
        leg(out, rank, outdir, "1", "2", 3)
        full_dcp.second(out, rank, outdir)
    else:
        third(out, rank, outdir)
        full_dcp.third(out, rank, outdir)
    dist.barrier()
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
