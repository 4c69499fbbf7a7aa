"""Rank program: issue 25 item 5, the habits a DDP user brings to ``data_parallel(model,
shard=True)`` + ``ShardedOptimizer``, next to DDP; every rank pickles what the parent checks to
``OUTDIR/rank{RANK}.pkl`` after each scenario (so that a scenario that kills or hangs the ranks
on old code leaves the earlier ones' results).

``HABITS_SHARDED`` names the scenarios to run, in order (comma-separated).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import pickle
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradmgr
from gradmgr.distributed import ShardedOptimizer, data_parallel, no_sync

from .outcomes import raised

LR = 1e-2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).square().mean()


def params_of(net: nn.Module) -> list:
    return [p.detach().clone() for p in net.parameters()]



# ---------------------------------------------------------------------- scenarios
def no_warnings(out: dict, rank: int) -> None:
    """Item 5e: sharded steps (clip, step, zero_grad, state_dict) warn nothing."""
    net = model()
    gm = data_parallel(net, shard=True, bucket_bytes=400)
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(3):
            with gm:
                gm.backward(loss_of(net, batch(step, rank)))
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        opt.state_dict()
    out["no_warnings"] = [f"{w.category.__name__}: {w.message}" for w in seen]


def groups_differ(out: dict, rank: int) -> None:
    """Item 5c: rank 0 one group with weight_decay=0.01, the others two groups (weights 0.5,
    biases 0.0); then a second try with the same groups but another lr on rank 1; then rank 1
    leaving a parameter out; then the ranks agree and train on, equal to DDP."""
    net = model()
    gm = data_parallel(net, shard=True, bucket_bytes=400)
    weights = [p for p in net.parameters() if p.ndim > 1]
    biases = [p for p in net.parameters() if p.ndim == 1]
    if rank == 0:
        make = lambda: ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, weight_decay=0.01)  # noqa: E731
    else:
        make = lambda: ShardedOptimizer(  # noqa: E731
            gm, torch.optim.AdamW, [{"params": weights, "weight_decay": 0.5},
                                    {"params": biases, "weight_decay": 0.0}], lr=LR)
    out["groups_differ"] = raised(make)
    lr = LR if rank == 0 else 2 * LR
    out["lr_differs"] = raised(lambda: ShardedOptimizer(gm, torch.optim.SGD, lr=lr))
    # rank 1 leaves a reduced parameter out: a ValueError there, before the comparison
    given = list(net.parameters())[:None if rank == 0 else -1]
    out["param_missing"] = raised(lambda: ShardedOptimizer(gm, torch.optim.SGD, given, lr=LR))
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, weight_decay=0.01)
    theirs = model()
    ddp = DDP(theirs)
    ref = torch.optim.AdamW(theirs.parameters(), lr=LR, weight_decay=0.01)
    for step in range(2):
        x = batch(step, rank)
        with gm:
            gm.backward(loss_of(net, x))
        loss_of(ddp, x).backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    out["agreed_after"] = (params_of(net), params_of(theirs))


def norm_accuracy(out: dict, rank: int) -> None:
    """Item 5d: a 1024 x 1024 weight: opt.clip_grad_norm_'s norm, torch's (DDP +
    clip_grad_norm_) and the float64 norm of the same reduced gradient."""
    torch.manual_seed(0)
    ours = nn.Linear(1024, 1024, bias=False)
    theirs = copy.deepcopy(ours)
    gm = data_parallel(ours, shard=True)
    opt = ShardedOptimizer(gm, torch.optim.SGD, lr=LR)
    ddp = DDP(theirs)
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(rank))
    with gm:
        gm.backward(ours(x).square().sum())
    ddp(x).square().sum().backward()
    norm = opt.clip_grad_norm_(1e9)
    exact = float(theirs.weight.grad.double().norm())
    torch_norm = float(nn.utils.clip_grad_norm_(theirs.parameters(), 1e9))
    out["norm_accuracy"] = {"ours": norm, "torch": torch_norm, "float64": exact}


def lone_state_dict(out: dict, rank: int) -> None:
    """Item 5b: ``if rank == 0: torch.save(opt.state_dict(), ...)`` then ``dist.barrier()``;
    rank 0 catches what it raised, and both train on next to DDP, then checkpoint as the docs
    say (every rank calls state_dict). The group's timeout is shortened to 5 s here."""
    c10d = dist.distributed_c10d
    c10d._get_process_group_store(c10d._get_default_group()).set_timeout(
        datetime.timedelta(seconds=5))
    net, theirs = model(), model()
    gm = data_parallel(net, shard=True, bucket_bytes=400)
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR)
    ddp = DDP(theirs)
    ref = torch.optim.AdamW(theirs.parameters(), lr=LR)

    def train(step: int) -> None:
        x = batch(step, rank)
        with gm:
            gm.backward(loss_of(net, x))
        loss_of(ddp, x).backward()
        for o in (opt, ref):
            o.step()
            o.zero_grad()

    train(0)
    path = os.path.join(OUTDIR, "optimizer.pt")
    out["lone_state_dict"] = None
    if rank == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.monotonic()
            out["lone_state_dict"] = raised(lambda: torch.save(opt.state_dict(), path))
        out["lone_warned"] = [str(w.message) for w in caught
                              if issubclass(w.category, gradmgr.GradMgrWarning)]
        out["lone_seconds"] = time.monotonic() - start
    dist.barrier()
    train(1)
    state, theirs_state = opt.state_dict(), ref.state_dict()
    out["lone_after"] = {
        "params": (params_of(net), params_of(theirs)),
        "state_equal": [torch.equal(state["state"][i][k], v)
                        for i, saved in theirs_state["state"].items() for k, v in saved.items()],
    }


def torch_clipping(out: dict, rank: int) -> None:
    """Item 5a: torch's own clip_grad_norm_(model.parameters(), max_norm) after a sharded
    backward, next to DDP + clip_grad_norm_: at a max_norm that scales (0.05) and one that
    does not (1e6), with torch's foreach path too; then what else .grad refuses; then a synced
    backward, a no_sync one and a synced one without zero_grad between (the stand-ins go
    before autograd could accumulate into them)."""
    for name, max_norm, foreach in (("scaled", 0.05, None), ("unscaled", 1e6, None),
                                    ("foreach", 0.05, True)):
        net, theirs = model(), model()
        gm = data_parallel(net, shard=True, bucket_bytes=400)
        opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR)
        ddp = DDP(theirs)
        ref = torch.optim.AdamW(theirs.parameters(), lr=LR)
        norms, steps = [], []
        for step in range(3):
            x = batch(step, rank)
            with gm:
                gm.backward(loss_of(net, x))
            loss_of(ddp, x).backward()
            ours = nn.utils.clip_grad_norm_(net.parameters(), max_norm, foreach=foreach)
            mine = nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, foreach=foreach)
            norms.append((float(ours), float(mine)))
            for o in (opt, ref):
                o.step()
                o.zero_grad()
            steps.append((params_of(net), params_of(theirs)))
        out[f"clip_{name}"] = {"norms": norms, "steps": steps}
    with gm:
        gm.backward(loss_of(net, batch(5, rank)))
    grad = next(net.parameters()).grad
    out["clip_refused"] = {
        "sum": raised(lambda: grad.sum()),
        "norm": raised(lambda: grad.norm()),
        "sgd": raised(lambda: torch.optim.SGD(net.parameters(), lr=0.1).step()),
        "1-norm": raised(lambda: nn.utils.clip_grad_norm_(net.parameters(), 0.1, 1.0)),
        "repr": repr(grad),
        "shape": list(grad.shape),
    }
    opt.zero_grad()
    out["clip_zero_grad"] = [p.grad is None for p in net.parameters()]
    ref.zero_grad()
    for step, synced in enumerate((True, False, True)):
        x = batch(10 + step, rank)
        with contextlib.nullcontext() if synced else no_sync(gm), gm:
            gm.backward(loss_of(net, x))
        with contextlib.nullcontext() if synced else ddp.no_sync():
            loss_of(ddp, x).backward()
    nn.utils.clip_grad_norm_(net.parameters(), 0.05)
    nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
    opt.step()
    ref.step()
    out["clip_accumulated"] = (params_of(net), params_of(theirs))


def model_zero_grad(out: dict, rank: int) -> None:
    """``model.zero_grad()`` (set_to_none=True, or False) instead of ``opt.zero_grad()``, at
    the top of each iteration as many scripts do, next to DDP doing the same."""
    for set_to_none in (True, False):
        net, theirs = model(), model()
        gm = data_parallel(net, shard=True, bucket_bytes=400)
        opt = ShardedOptimizer(gm, torch.optim.SGD, lr=0.1)
        ddp = DDP(theirs)
        ref = torch.optim.SGD(theirs.parameters(), lr=0.1)
        for step in range(3):
            net.zero_grad(set_to_none=set_to_none)
            theirs.zero_grad(set_to_none=set_to_none)
            x = batch(step, rank)
            with gm:
                gm.backward(loss_of(net, x))
            loss_of(ddp, x).backward()
            opt.step()
            ref.step()
        out[f"model_zero_grad_{set_to_none}"] = (params_of(net), params_of(theirs))


SCENARIOS = {f.__name__: f for f in (no_warnings, groups_differ, norm_accuracy, lone_state_dict,
                                     torch_clipping, model_zero_grad)}
OUTDIR = ""


def main(rank: int, world: int, outdir: str) -> None:
    global OUTDIR
    OUTDIR = outdir
    torch.set_num_threads(1)
    out: dict = {}
    for name in os.environ["HABITS_SHARDED"].split(","):
        SCENARIOS[name](out, rank)
        out[f"{name}_done"] = True
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
