"""Rank program's part for full sharding (``data_parallel(model, shard="full")``, FSDP2)
under distributed checkpoints, run by dist_workers/zero_dcp.py in the same spawns: gradmgr's
``get_state_dict``/``set_state_dict`` against plain FSDP2 (``fully_shard``) with torch's own
functions, across 2 -> 3 -> 2 ranks, both ways, and against ZeRO-2's checkpoints.

Every comparison is of whole tensors (``full_tensor()``: every rank calls it), bit for bit.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as torch_state
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from gradmgr.distributed import data_parallel, get_state_dict, set_state_dict

from .zero_dcp import (
    LR,
    WEIGHT_DECAY,
    async_saved,
    batch,
    dcp_load,
    mid_window,
    model,
    zero,
)


def full():
    net = model()
    gm = data_parallel(net, shard="full")
    return net, gm, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def plain():
    """Plain FSDP2 summing over gloo and dividing after, as full sharding has it do."""
    net = model()
    fully_shard(net)
    net.set_force_sum_reduction_for_comms(True)
    return net, None, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def train(net, gm, opt, steps: range, rank: int) -> None:
    for step in steps:
        loss = net(batch(step, rank)).square().mean()
        if gm is None:
            loss.backward()
        else:
            with gm:
                gm.backward(loss)
        opt.step()
        opt.zero_grad()


def _whole(value):
    return value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()


def whole(net, opt) -> tuple:
    """The parameters and the optimizer state, every tensor gathered (a collective)."""
    params = [_whole(p) for p in net.parameters()]
    state = [{k: _whole(v) for k, v in sorted(opt.state[p].items())} for p in net.parameters()]
    return params, state


def same(a: tuple, b: tuple) -> bool:
    (pa, sa), (pb, sb) = a, b
    if len(pa) != len(pb) or [sorted(s) for s in sa] != [sorted(s) for s in sb]:
        return False
    return (all(torch.equal(x, y) for x, y in zip(pa, pb))
            and all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k]))
                    for x, y in zip(sa, sb) for k in x))


def gathered(saved: dict) -> tuple:
    """ZeRO-2's gathered checkpoint (dist_workers/zero_dcp.py's ``ref*.pt``) as :func:`whole`."""
    state = saved["optimizer"]["state"]
    return (list(saved["params"].values()),
            [{k: state[i][k] for k in sorted(state[i])} for i in sorted(state)])


def save(net, opt, path: str, ours: bool) -> None:
    get = get_state_dict if ours else torch_state.get_state_dict
    model_state, optim_state = get(net, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load(net, opt, path: str, ours: bool) -> None:
    get = get_state_dict if ours else torch_state.get_state_dict
    put = set_state_dict if ours else torch_state.set_state_dict
    model_state, optim_state = get(net, opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    put(net, opt, model_state_dict=model_state, optim_state_dict=optim_state)


def first(out: dict, rank: int, outdir: str) -> None:
    """2 ranks: 3 steps, saved by gradmgr and by plain FSDP2 with torch's functions; a run
    resumed from gradmgr's checkpoint against the same run uninterrupted, 2 steps on."""
    net, gm, opt = full()
    train(net, gm, opt, range(3), rank)
    save(net, opt, os.path.join(outdir, "full1"), ours=True)
    saved = whole(net, opt)
    if rank == 0:
        torch.save(saved, os.path.join(outdir, "full1.pt"))
    train(net, gm, opt, range(3, 5), rank)
    uninterrupted = whole(net, opt)
    net, gm, opt = full()
    load(net, opt, os.path.join(outdir, "full1"), ours=True)
    out["full_loaded_equal"] = same(whole(net, opt), saved)
    train(net, gm, opt, range(3, 5), rank)
    out["full_resumed_equal"] = same(whole(net, opt), uninterrupted)
    net, gm, opt = plain()
    train(net, gm, opt, range(3), rank)
    out["full_trains_as_plain"] = same(whole(net, opt), saved)
    save(net, opt, os.path.join(outdir, "fsdp1"), ours=False)
    dist.barrier()


def second(out: dict, rank: int, outdir: str) -> None:
    """3 ranks: gradmgr loads plain FSDP2's checkpoint and plain FSDP2 gradmgr's; one step
    each; saved. ZeRO-2 loads full sharding's checkpoint and full sharding ZeRO-2's."""
    saved = torch.load(os.path.join(outdir, "full1.pt"))
    ours, theirs = full(), plain()
    load(ours[0], ours[2], os.path.join(outdir, "fsdp1"), ours=True)
    load(theirs[0], theirs[2], os.path.join(outdir, "full1"), ours=False)
    out["full_from_plain_equal"] = same(whole(ours[0], ours[2]), saved)
    out["plain_from_full_equal"] = same(whole(theirs[0], theirs[2]), saved)
    train(*ours, range(3, 4), rank)
    train(*theirs, range(3, 4), rank)
    out["full_stepped_as_plain"] = same(whole(ours[0], ours[2]), whole(theirs[0], theirs[2]))
    save(ours[0], ours[2], os.path.join(outdir, "full2"), ours=True)
    save(theirs[0], theirs[2], os.path.join(outdir, "fsdp2"), ours=False)
    across(out, outdir, saved)


def across(out: dict, outdir: str, saved: tuple) -> None:
    """ZeRO-2 and full sharding read each other's DCP checkpoints (both of 2 ranks)."""
    net = model()
    gm, opt = zero(net)
    dcp_load(net, opt, os.path.join(outdir, "full1"))
    state = opt.state_dict()  # every rank
    out["zero_from_full_equal"] = same(gathered({"params": net.state_dict(),
                                                 "optimizer": state}), saved)
    del opt, gm
    net, gm, opt = full()
    load(net, opt, os.path.join(outdir, "dcp1"), ours=True)
    out["full_from_zero_equal"] = same(whole(net, opt),
                                       gathered(torch.load(os.path.join(outdir, "ref1.pt"))))


def third(out: dict, rank: int, outdir: str) -> None:
    """2 ranks: each loads its own 3-rank checkpoint; one step each."""
    ours, theirs = full(), plain()
    load(ours[0], ours[2], os.path.join(outdir, "full2"), ours=True)
    load(theirs[0], theirs[2], os.path.join(outdir, "fsdp2"), ours=False)
    out["full_reloaded_as_plain"] = same(whole(ours[0], ours[2]), whole(theirs[0], theirs[2]))
    train(*ours, range(4, 5), rank)
    train(*theirs, range(4, 5), rank)
    out["full_restepped_as_plain"] = same(whole(ours[0], ours[2]),
                                          whole(theirs[0], theirs[2]))
    mid_window(out, rank, outdir, lambda _: full(), whole, same, "full")
    async_saved(out, rank, outdir, lambda _: full(), whole, same, "full")
