"""Rank program: ShardedOptimizer's checkpoints across a freeze and an unfreeze, next to DDP +
``AdamW(model.parameters())`` given the same state dicts, and state dicts that do not fit the
parameters refused on every rank; every rank pickles what the parent checks to
``OUTDIR/rank{RANK}.pkl``.

One model and one manager throughout (``data_parallel(shard=True)`` replans at each freeze);
each phase makes a new ShardedOptimizer, which loads the last phase's ``state_dict()`` (the
docstring's recipe), and a new DDP + AdamW over a copy of the weights, which loads the same
dict. Small buckets, so that layers cross the ranks' chunk borders.
"""

from __future__ import annotations

import copy
import os
import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import ShardedOptimizer, data_parallel

LR, WEIGHT_DECAY = 1e-2, 0.05
# (name, the parameters frozen in it, its steps): layer 0's bias is frozen from the start
# (never stepped), the middle layer from the second phase on; in the third everything trains:
# the middle layer takes back the state saved before its freeze, layer 0's bias starts afresh.
PHASES = [("start", {"0.bias"}, range(0, 2)),
          ("frozen", {"0.bias", "2.weight", "2.bias"}, range(2, 4)),
          ("unfrozen", set(), range(4, 6))]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def freeze(net: nn.Module, frozen: set) -> None:
    for name, p in net.named_parameters():
        p.requires_grad_(name not in frozen)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).square().mean()


def params_of(net: nn.Module) -> list:
    return [p.detach().clone() for p in net.parameters()]


def differences(ours: dict, theirs: dict) -> list:
    """Where two optimizer state dicts differ (nothing: equal, every tensor bit for bit)."""
    found = []
    if ours["param_groups"] != theirs["param_groups"]:
        found.append(f"param_groups {ours['param_groups']} != {theirs['param_groups']}")
    if sorted(ours["state"]) != sorted(theirs["state"]):
        found.append(f"indices {sorted(ours['state'])} != {sorted(theirs['state'])}")
    for i, state in theirs["state"].items():
        mine = ours["state"].get(i, {})
        if sorted(mine) != sorted(state):
            found.append(f"{i}: keys {sorted(mine)} != {sorted(state)}")
        found += [f"{i}: {k} differs" for k, v in state.items()
                  if k in mine and not torch.equal(mine[k], v)]
    return found


def reference(weights: dict, frozen: set, saved) -> tuple:
    """DDP + AdamW(model.parameters()) from ``weights``, ``frozen`` frozen, given ``saved``."""
    net = model()
    net.load_state_dict(weights)
    freeze(net, frozen)
    ddp = DDP(net)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    if saved is not None:
        opt.load_state_dict(copy.deepcopy(saved))  # AdamW adds to the loaded step in place
    return net, ddp, opt


def train(ours: nn.Module, gm, opt, ddp, ref, rank: int, steps) -> None:
    for step in steps:
        x = batch(step, rank)
        with gm:
            gm.backward(loss_of(ours, x))
        loss_of(ddp, x).backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()


def freeze_and_unfreeze(out: dict, rank: int) -> None:
    ours = model()
    freeze(ours, PHASES[0][1])
    gm = data_parallel(ours, shard=True, bucket_bytes=400)
    saved = None
    for name, frozen, steps in PHASES:
        freeze(ours, frozen)  # on every rank alike
        opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
        phase = out[name] = {}
        if saved is not None:
            opt.load_state_dict(saved)
            # A collective: before the fix, the ranks holding a segment given another
            # parameter's state raised here, and the others waited (until gloo's timeout).
            phase["loaded"] = opt.state_dict()
        theirs, ddp, ref = reference(ours.state_dict(), frozen, saved)
        if saved is not None:
            phase["loaded_vs_saved"] = differences(phase["loaded"], saved)
            phase["loaded_vs_ddp"] = differences(phase.pop("loaded"), ref.state_dict())
        train(ours, gm, opt, ddp, ref, rank, steps)
        saved = opt.state_dict()
        phase.update(ours=params_of(ours), ddp=params_of(theirs), indices=sorted(saved["state"]),
                     state_vs_ddp=differences(saved, ref.state_dict()))


def one_step(rank: int) -> tuple:
    """The model sharded, with AdamW after one step."""
    ours = model()
    gm = data_parallel(ours, shard=True, bucket_bytes=400)
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR)
    with gm:
        gm.backward(loss_of(ours, batch(0, rank)))
    opt.step()
    return ours, gm, opt


def refused(out: dict, rank: int) -> None:
    """State dicts that do not fit: each raises ValueError on every rank and leaves the
    optimizer as it was; the ranks then go on together (a state_dict, a step)."""
    ours, gm, opt = one_step(rank)
    good = opt.state_dict()
    errors = {}
    for name, bad in wrong_dicts(good).items():
        try:
            opt.load_state_dict(bad)
        except ValueError as error:
            errors[name] = str(error)
        else:
            errors[name] = None
    after = opt.state_dict()
    with gm:
        gm.backward(loss_of(ours, batch(1, rank)))
    opt.step()
    out["refused"] = {"errors": errors, "unchanged": differences(after, good),
                      "stepped": params_of(ours)}


def unconsolidable(out: dict, rank: int) -> None:
    """Rank 1's wrapped optimizer alone holds a state entry that is neither elementwise nor one
    value: state_dict() raises on both ranks (rank 1 says why, rank 0 that another rank
    cannot), none waits in a collective; once it is gone, the ranks consolidate together."""
    ours, gm, opt = one_step(rank)
    segment = opt.optimizer.param_groups[0]["params"][0]
    if rank == 1:
        opt.optimizer.state[segment]["odd"] = torch.zeros(segment.numel() + 1)
    try:
        opt.state_dict()
    except ValueError as error:
        raised = str(error)
    else:
        raised = None
    opt.optimizer.state[segment].pop("odd", None)
    out["unconsolidable"] = {"raised": raised, "then": sorted(opt.state_dict()["state"])}


def wrong_dicts(good: dict) -> dict:
    # what the optimizer saved before the fix with the middle layer frozen: numbered over the
    # trainable parameters only (4 of 6)
    trainable = copy.deepcopy(good)
    trainable["param_groups"][0]["params"] = [0, 1, 2, 3]
    trainable["state"] = {new: trainable["state"][old] for new, old in enumerate([0, 1, 4, 5])}
    swapped = copy.deepcopy(good)  # the middle layer's weight (16, 16) and the last's (3, 16)
    swapped["state"][2], swapped["state"][4] = swapped["state"][4], swapped["state"][2]
    unlisted = copy.deepcopy(good)
    unlisted["state"][6] = copy.deepcopy(good["state"][5])
    groups = copy.deepcopy(good)
    groups["param_groups"] = [{**g, "params": p} for g in good["param_groups"]
                              for p in ([0, 1, 2], [3, 4, 5])]
    return {"trainable": trainable, "swapped": swapped, "unlisted": unlisted, "groups": groups}


def main(rank: int, world: int, outdir: str) -> None:
    torch.set_num_threads(1)
    out: dict = {}
    freeze_and_unfreeze(out, rank)
    refused(out, rank)
    unconsolidable(out, rank)
    dist.barrier()
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
