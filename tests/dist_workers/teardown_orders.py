"""Rank program: many process groups in one process, each torn down in a user's order.

``python -m dist_workers.teardown_orders RANK WORLD PORT``: over one TCPStore (the test holds
it on PORT, every rank a client: tests/ranks.py's ``rendezvous``), a fresh gloo
group per round (``init_process_group`` on a ``PrefixStore``); each round makes a manager on
one data-parallel path, takes one SGD step, checks every rank's weights against the step
computed here from every rank's batch (exactly: both sides divide a sum of two float32 values
by 2), and tears down in one of the orders below. It prints each round as it starts, so that
a rank that hangs shows where. On torch 2.13 the order ``destroy_process_group()`` then
``del gm`` deadlocked on torch's reducer path within a few rounds (backends/torch/teardown.py).
"""

from __future__ import annotations

import datetime
import gc
import sys
import weakref

import torch
import torch.distributed as dist

from gradmgr.distributed import ShardedOptimizer, data_parallel

LR = 0.1
PATHS = {"native": {}, "buckets": {"native": False}, "sharded": {"shard": True}}
# (order, rounds per path): the habit of the issue many times, the documented orders twice
ORDERS = [("destroy, del", 6), ("del, destroy", 2), ("del, barrier, destroy", 2)]
TIMEOUT = datetime.timedelta(seconds=60)


def batch(rank: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))


def expected_weights(model: torch.nn.Module, world: int) -> list:
    """One SGD step over the mean of every rank's gradient, as DDP takes it."""
    grads = []
    for r in range(world):
        model.zero_grad()
        model(batch(r)).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return [p.detach() - LR * (sum(gs[1:], gs[0]) / world)
            for p, gs in zip(model.parameters(), zip(*grads))]


def one_step(path: str, rank: int, world: int) -> tuple:
    """The manager (and its optimizer) after one step on ``path``, weights checked."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    expected = expected_weights(model, world)
    gm = data_parallel(model, **PATHS[path])
    opt = (ShardedOptimizer(gm, torch.optim.SGD, lr=LR) if path == "sharded"
           else torch.optim.SGD(model.parameters(), lr=LR))
    with gm:
        gm.backward(model(batch(rank)).square().mean())
    opt.step()
    for got, want in zip(model.parameters(), expected):
        if not torch.equal(got.detach(), want):
            raise AssertionError(f"{path}: weights {got.tolist()} after one step, DDP's "
                                 f"{want.tolist()}")
    return gm, opt


def round_(path: str, order: str, rank: int, world: int, store: object, name: str) -> None:
    dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=rank,
                            world_size=world, timeout=TIMEOUT)
    gm, opt = one_step(path, rank, world)
    ref = weakref.ref(gm)
    if order == "destroy, del":  # the habit: the manager (and torch's reducer) outlive it
        dist.destroy_process_group()
        del gm, opt
    else:
        del gm, opt
        if order == "del, barrier, destroy":
            dist.barrier()
        dist.destroy_process_group()
    if ref() is not None:  # held by a cycle: freed here, as gradmgr's exit collection would
        gc.collect()


def main(argv: list) -> None:
    rank, world, port = (int(a) for a in argv)
    torch.set_num_threads(1)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # the first optimizer's frame
    # stays in a cycle on torch 2.13 (backends/torch/teardown.py): not one of the rounds'
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
    for path in PATHS:
        for order, rounds in ORDERS:
            for i in range(rounds):
                print(f"{path}: {order} #{i}", flush=True)
                round_(path, order, rank, world, store, f"{path}/{order}/{i}")
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
