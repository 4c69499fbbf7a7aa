"""Habits where the script itself is wrong for data parallelism (issue 25's items 1-3 and
7-9, habit_cases.py runs them): a second wrapper, a bypassed recording, ranks that disagree,
a model converted after wrapping, a group destroyed first. Each must raise, or do what the
user meant (item 8: train the converted model; item 9: end).
"""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

from gradmgr import GradManager
from gradmgr.distributed import data_parallel

from .habit_sides import STEPS, Side, batch, loss_fn, make_model, state, train


# ---------------------------------------------------------------- issue 25's items 1-3, 7-9
def ddp_then_data_parallel(kind, rank, world):
    """Issue 25 item 1: ``net = DDP(model)`` kept, then ``gm = data_parallel(net)``; training
    through ``net`` with ``with gm: gm.backward(loss)``."""
    model = make_model(rank)
    net = nn.parallel.DistributedDataParallel(model)
    side = Side(kind, rank, model=net)
    return train(side)


def data_parallel_then_ddp(kind, rank, world):
    """Issue 25 item 1: ``gm = data_parallel(model)``, then ``net = DDP(model)``; training
    through ``net`` with ``with gm: gm.backward(loss)``."""
    side = Side(kind, rank)
    net = nn.parallel.DistributedDataParallel(side.model)
    return train(side, forward=net)


def forgotten_with(kind, rank, world):
    """Issue 25 item 2: ``gm = data_parallel(model)``, but the DDP loop kept: a plain
    ``loss.backward()``, no ``with gm:``."""
    return _typed_backward(Side(kind, rank), rank, inside_with=False)


def _typed_backward(side, rank, inside_with: bool) -> dict:
    """The loop with ``loss.backward()`` typed, inside ``with gm:`` or with none (the
    references inside it: their own step)."""
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        x, y = batch(rank, step)
        with side.recording() if inside_with else contextlib.nullcontext():
            loss = loss_fn(side.net(x), y)
            side.backward(loss) if inside_with and side.gm is None else loss.backward()
        out[f"loss {step}"] = np.float32(loss.item())
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out


def forward_outside_with(kind, rank, world):
    """The forward before ``with gm:``, only ``gm.backward(loss)`` inside."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = loss_fn(side.net(x), y)
        with side.recording():
            side.backward(loss)
        out[f"loss {step}"] = np.float32(loss.item())
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out


def backward_inside_with(kind, rank, world):
    """``loss.backward()`` typed inside ``with gm:``, on every rank (the references: DDP's and
    FSDP2's own step)."""
    return _typed_backward(Side(kind, rank), rank, inside_with=True)


def second_data_parallel(kind, rank, world):
    """A second ``data_parallel(model)`` on the same model, the first manager kept."""
    side = Side(kind, rank)
    data_parallel(side.model, **side.dp_options())
    return train(side)


class _Halve:
    """A gradient callback: the documented result is half the gradient."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, tensor, grad):
        self.calls += 1
        return grad * 0.5


def backward_inside_with_single(kind, rank, world):
    """Issue 25 item 3, in one process (no data parallel): ``loss.backward()`` inside
    ``with gm:`` of a manager with a callback. The reference is ``gm.backward(loss)``."""
    model = make_model(0)
    cb = _Halve()
    gm = GradManager().attach(model.parameters(), callbacks=[cb])
    x, y = batch(rank, 0)
    with gm:
        loss = loss_fn(model(x), y)
        loss.backward() if kind != "ddp" else gm.backward(loss)
    out = {f"grad {n}": p.grad.numpy() for n, p in model.named_parameters()}
    out["callback calls"] = np.array(cb.calls)
    return out


def no_sync_on_rank0_only(kind, rank, world):
    """Issue 25 item 7: only rank 0 wraps the first micro-batch in ``no_sync``."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(2):
        for micro in range(2):
            out[f"loss {step}.{micro}"] = np.float32(
                side.step(*batch(rank, step, micro), pause=micro == 0 and rank == 0))
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out


def double_after_wrap(kind, rank, world):
    """Issue 25 item 8: ``model.double()`` after ``data_parallel(model)``. After ``DDP``
    every rank keeps its own gradient, silently: the reference is DDP wrapping the model
    converted first, what the user meant."""
    if kind in ("ddp", "fsdp2"):
        side = Side(kind, rank, model=make_model(rank).double())
    else:
        side = Side(kind, rank)
        side.model.double()
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        x, y = batch(rank, step)
        out[f"loss {step}"] = np.float32(side.step(x.double(), y))
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out


def rank_skips_silently(kind, rank, world):
    """Rank 1 skips step 1 before its forward (``continue``), the other rank trains on. No
    reference runs (DDP hangs), so the final state is not compared and not taken: under full
    sharding taking it is collectives (FSDP2's gathers) that the rank a step ahead, which
    raises, never makes."""
    return _skip_a_step(Side(kind, rank), rank, lambda side, opt: contextlib.nullcontext(),
                        final_state=False)


def rank_skips_in_join(kind, rank, world):
    """The same, inside torch's ``Join`` (uneven inputs): DDP's ``Join([model])``, gradmgr's
    ``Join([gm])`` (``Join([gm, opt])`` sharded). Rank 1 joins a step early; its last step
    is shadowed."""
    def join(side, opt):
        if side.gm is None:
            return Join([side.net])
        return Join([side.gm] + ([opt] if side.sharded else []))

    return _skip_a_step(Side(kind, rank), rank, join)


def _skip_a_step(side, rank, context, final_state=True):
    opt, out = side.optimizer(), {}
    with context(side, opt):
        for step in range(STEPS):
            if step == 1 and rank == 1:
                continue
            out[f"loss {step}"] = np.float32(side.step(*batch(rank, step)))
            opt.step()
            opt.zero_grad()
    if final_state:
        out.update(state(side))
    return out


def destroy_then_del(kind, rank, world):
    """Issue 25 item 9: one step, ``dist.destroy_process_group()``, then ``del gm`` (and
    ``del model``): the harness starts a new group afterwards. DDP's reference frees its
    wrapper first, the documented order: freed after its group, DDP itself hung here once on
    torch 2.13 (in ``~ProcessGroupGloo``, as gradmgr does in issue 25 item 9)."""
    side = Side(kind, rank)
    out = train(side, steps=1)
    if kind in ("ddp", "fsdp2"):
        del side
        gc.collect()
    dist.destroy_process_group()
    side = None  # gradmgr: the manager freed after its group
    gc.collect()  # what the process would free at exit, freed inside the case
    return out


