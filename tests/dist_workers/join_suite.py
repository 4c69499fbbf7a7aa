"""Uneven inputs (issue 26 item 2): each rank trains on its own number of batches inside
torch's ``Join``, with DDP (the reference: DDP + Join, the unsharded optimizer) and with
``data_parallel`` on one path ("native": torch's reducer, "buckets": ``native=False``,
"sharded": ``shard=True`` and a ShardedOptimizer, ``Join([gm, opt])``). Every scenario saves
each side's parameters and buffers (and any error) for tests/test_join.py to compare bit for
bit. ``JOIN_CASES``: ``scenario:path`` items, comma-separated."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import ShardedOptimizer, data_parallel, no_sync

COUNTS = {2: [5, 3], 3: [4, 6, 3]}  # batches per rank


def make_model(rank: int) -> nn.Module:
    torch.manual_seed(100 + rank)  # different on each rank: the wrap broadcasts rank 0's
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def batches(rank: int, world: int) -> list:
    g = torch.Generator().manual_seed(1000 * rank + 7)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g))
            for _ in range(COUNTS[world][rank])]


def loss_of(net, x, y):
    return nn.functional.mse_loss(net(x), y)


class Side:
    """DDP (``kind`` "ddp") or data_parallel on a path; ``joinables`` go into Join."""

    def __init__(self, kind: str, rank: int) -> None:
        self.kind, self.model = kind, make_model(rank)
        self.gm = None
        if kind == "ddp":
            self.net = DDP(self.model)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
            self.joinables = [self.net]
            return
        self.net = self.model
        self.gm = data_parallel(self.model, native=kind == "native", shard=kind == "sharded")
        if kind == "sharded":
            self.opt = ShardedOptimizer(self.gm, torch.optim.SGD, lr=0.1, momentum=0.9)
            self.joinables = [self.gm, self.opt]
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
            self.joinables = [self.gm]

    def paused(self, pause: bool):
        if not pause:
            return contextlib.nullcontext()
        return self.net.no_sync() if self.kind == "ddp" else no_sync(self.gm)

    def step(self, x, y, pause: bool = False) -> None:
        if self.kind == "ddp":
            with self.paused(pause):
                loss_of(self.net, x, y).backward()
            return
        with self.paused(pause), self.gm:
            self.gm.backward(loss_of(self.net, x, y))

    def state(self) -> dict:
        return {name: t.detach().numpy().copy() for name, t in
                [*self.model.named_parameters(), *self.model.named_buffers()]}


def plain(side: Side, rank: int, world: int, **join) -> None:
    with Join(side.joinables, **join):
        for x, y in batches(rank, world):
            side.step(x, y)
            side.opt.step()
            side.opt.zero_grad()


def accumulate(side: Side, rank: int, world: int) -> None:
    """Two micro-batches per optimizer step, the first under no_sync."""
    with Join(side.joinables):
        for i, (x, y) in enumerate(batches(rank, world)):
            side.step(x, y, pause=i % 2 == 0)
            if i % 2 == 1:
                side.opt.step()
                side.opt.zero_grad()


def join_method(side: Side, rank: int, world: int) -> None:
    """DDP's spelling: ``model.join()`` (gradmgr: ``gm.join()``)."""
    if side.kind == "sharded":
        return plain(side, rank, world)
    owner = side.net if side.kind == "ddp" else side.gm
    with owner.join():
        for x, y in batches(rank, world):
            side.step(x, y)
            side.opt.step()
            side.opt.zero_grad()


def throw(side: Side, rank: int, world: int) -> None:
    plain(side, rank, world, throw_on_early_termination=True)


def empty(side: Side, rank: int, world: int) -> None:
    """The last rank has no batch at all: it joins before its first step (native: before
    torch's reducer was ever built; every path: before the first plan check)."""
    with Join(side.joinables):
        for x, y in batches(rank, world)[:0 if rank == world - 1 else None]:
            side.step(x, y)
            side.opt.step()
            side.opt.zero_grad()


def failed(side: Side, rank: int, world: int) -> None:
    """Rank 0's batch 3 fails in its forward after rank 1 joined: rank 0 catches and skips
    it, rank 1 shadows the failed step and goes on (DDP: the batch left out, see
    ``skipped``)."""
    with Join(side.joinables):
        for i, (x, y) in enumerate(batches(rank, world)):
            try:
                with side.gm:
                    if rank == 0 and i == 3:
                        raise ValueError("a bad batch")
                    side.gm.backward(loss_of(side.net, x, y))
            except ValueError:
                continue
            side.opt.step()
            side.opt.zero_grad()


def skipped(side: Side, rank: int, world: int) -> None:
    """DDP's equal of ``failed``: rank 0 never has batch 3."""
    with Join(side.joinables):
        for i, (x, y) in enumerate(batches(rank, world)):
            if rank == 0 and i == 3:
                continue
            side.step(x, y)
            side.opt.step()
            side.opt.zero_grad()


def clip(side: Side, rank: int, world: int) -> None:
    """Clipping every step: on the sharded path a collective a joined rank cannot take part
    in (ShardedOptimizer.clip_grad_norm_ and torch's clip_grad_norm_ through the stand-ins)."""
    with Join(side.joinables):
        for i, (x, y) in enumerate(batches(rank, world)):
            side.step(x, y)
            if side.kind != "sharded":
                nn.utils.clip_grad_norm_(side.model.parameters(), 0.5)
            elif i % 2:
                side.opt.clip_grad_norm_(0.5)
            else:
                nn.utils.clip_grad_norm_(side.model.parameters(), 0.5)
            side.opt.step()
            side.opt.zero_grad()


SCENARIOS = {"plain": plain, "accumulate": accumulate, "join_method": join_method,
             "throw": throw, "clip": clip, "empty": empty}


def failed_or_skipped(side: Side, rank: int, world: int) -> None:
    (skipped if side.kind == "ddp" else failed)(side, rank, world)


SCENARIOS["failed"] = failed_or_skipped


def run(scenario: str, kind: str, rank: int, world: int) -> dict:
    side = Side(kind, rank)
    out = {}
    try:
        SCENARIOS[scenario](side, rank, world)
    except Exception as error:  # noqa: BLE001 - the error is the result compared
        out["error"] = np.array(f"{type(error).__name__}: {error}")
    out.update(side.state())
    return out


def main(rank: int, world: int, outdir: str) -> None:
    out: dict = {}
    path = os.path.join(outdir, f"rank{rank}.npz")
    for case in os.environ["JOIN_CASES"].split(","):
        scenario, kind = case.split(":")
        for side in ("ddp", kind):
            for key, value in run(scenario, side, rank, world).items():
                out[f"{case}/{side}/{key}"] = value
            dist.barrier()
        out[f"{case}_done"] = np.array(True)
        np.savez(path, **out)

