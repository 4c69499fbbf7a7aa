"""The habits of the habit harness (issue 25): each is the documented training script of
habit_sides.py with one habit a DDP or ZeroRedundancyOptimizer user brings typed in, as a
function ``habit(kind, rank, world) -> dict`` run once on DDP (``kind`` "ddp") and once per
gradmgr path. What it returns (losses, norms, parameters, buffers) is compared bit for bit.

:data:`HABITS` lists them in the order they run. ``ddp=False``: DDP itself is silently wrong
(or hangs) with this habit, so it is not run; gradmgr must raise. ``accept``: an exception
that is not gradmgr's but counts as clear, ``(type name, text it contains)``. ``risky``: may
hang or crash a rank on today's code, so it runs after the others (the parent spawns again).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gradmgr import GradManager
from gradmgr.distributed import RankFailedError

from .habit_sides import LR, MOMENTUM, PATHS, STEPS, Side, batch, loss_fn, make_model, state, train

ALL, UNSHARDED, SHARDED = PATHS, PATHS[:2], PATHS[2:]


@dataclass(frozen=True)
class Habit:
    name: str
    fn: Callable
    title: str  # its row in docs/switching-from-ddp.md
    paths: Tuple[str, ...] = ALL
    ddp: bool = True
    accept: Optional[Tuple[str, str]] = None
    risky: bool = False
    teardown: bool = False


# ---------------------------------------------------------------- the plain script, and views
def documented(kind, rank, world):
    """No habit: the documented script (checks the harness itself)."""
    return train(Side(kind, rank))


def module_attribute(kind, rank, world):
    """``model.module.state_dict()`` for the checkpoint, as after ``model = DDP(model)``."""
    side = Side(kind, rank)
    out = train(side)
    out.update({k: v.numpy() for k, v in side.net.module.state_dict().items()})
    return out


def train_eval_switch(kind, rank, world):
    """``model.eval()`` for a validation forward under ``no_grad`` between steps, then
    ``model.train()``: outputs, buffers and the steps after."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        side.step(*batch(rank, step))
        opt.step()
        opt.zero_grad()
        side.model.eval()
        with torch.no_grad():
            out[f"eval {step}"] = side.net(batch(rank, 100 + step)[0]).numpy()
        side.model.train()
    out.update(state(side.model))
    return out


def eval_after_training(kind, rank, world):
    """Issue 25 item 6: ``model.eval()`` and a validation pass under ``no_grad`` after
    training (BatchNorm's running statistics are buffers)."""
    side = Side(kind, rank)
    out = train(side)
    side.model.eval()
    with torch.no_grad():
        x, y = batch(rank, 100)
        out["validation loss"] = loss_fn(side.net(x), y).numpy()
    out.update(state(side.model))
    return out


def no_grad_in_train_mode(kind, rank, world):
    """A forward under ``torch.no_grad()`` between steps with the model left in train mode
    (BatchNorm updates its running statistics)."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        with torch.no_grad():
            out[f"probe {step}"] = side.net(batch(rank, 100 + step)[0]).numpy()
        side.step(*batch(rank, step))
        opt.step()
        opt.zero_grad()
    out.update(state(side.model))
    return out


def broadcast_buffers_false(kind, rank, world):
    """``DDP(model, broadcast_buffers=False)``: ``data_parallel(model, broadcast_buffers=
    False)``; each rank keeps its own running statistics."""
    side = Side(kind, rank, ddp={"broadcast_buffers": False}, dp={"broadcast_buffers": False})
    return train(side)


# ---------------------------------------------------------------- optimizer habits
def _loop(side, opt, zero=None, after_step=None, steps=STEPS) -> dict:
    out = {}
    for step in range(steps):
        out[f"loss {step}"] = np.float32(side.step(*batch(side.rank, step)))
        opt.step()
        (zero or opt.zero_grad)()
        if after_step:
            after_step(step, out)
    out.update(state(side.model))
    return out


def zero_grad_keep(kind, rank, world):
    """``opt.zero_grad(set_to_none=False)``: zeroed ``.grad`` tensors kept."""
    side = Side(kind, rank)
    opt = side.optimizer()
    return _loop(side, opt, zero=lambda: opt.zero_grad(set_to_none=False))


def model_zero_grad(kind, rank, world):
    """``model.zero_grad()`` instead of the optimizer's."""
    side = Side(kind, rank)
    return _loop(side, side.optimizer(), zero=side.model.zero_grad)


def adam(kind, rank, world):
    """``torch.optim.Adam`` instead of SGD."""
    side = Side(kind, rank)
    return _loop(side, side.optimizer(torch.optim.Adam, lr=0.01))


def lr_scheduler(kind, rank, world):
    """``StepLR(opt, 1, gamma=0.5)`` over the optimizer, stepped after each ``opt.step()``."""
    side = Side(kind, rank)
    opt = side.optimizer()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    return _loop(side, opt, after_step=lambda step, out: sched.step())


def clip_torch(kind, rank, world):
    """Issue 25 item 5: torch's ``clip_grad_norm_(model.parameters(), ...)`` after the
    backward (on a ShardedOptimizer too); its norm is recorded."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        side.step(*batch(rank, step))
        out[f"norm {step}"] = np.float32(nn.utils.clip_grad_norm_(side.model.parameters(), 0.5))
        opt.step()
        opt.zero_grad()
    out.update(state(side.model))
    return out


def optimizer_state(opt) -> dict:
    """An optimizer's ``state_dict()`` as arrays (groups and per-parameter state)."""
    saved = opt.state_dict()
    out = {"param_groups": np.array(repr(saved["param_groups"]))}
    for i, entry in saved["state"].items():
        out.update({f"state {i} {k}": torch.as_tensor(v).numpy() for k, v in entry.items()})
    return out


def checkpoint_rank0(kind, rank, world):
    """Issue 25 item 5: ``if rank == 0: torch.save(opt.state_dict(), path)``, every DDP
    script's checkpoint, then ``dist.barrier()``."""
    side = Side(kind, rank)
    opt = side.optimizer()
    out = _loop(side, opt)
    if rank == 0:
        out.update(optimizer_state(opt))
    dist.barrier()
    return out


def sharded_groups_differ(kind, rank, world):
    """Issue 25 item 5: the ranks build ``ShardedOptimizer`` with other parameter groups or
    hyperparameters (rank 0 one group with ``weight_decay=0.01``, rank 1 two groups)."""
    side = Side(kind, rank)
    m = side.model
    if rank == 0:
        groups = [{"params": list(m.parameters()), "weight_decay": 0.01}]
    else:
        groups = [{"params": list(m.fc1.parameters()), "weight_decay": 0.5},
                  {"params": [*m.bn.parameters(), *m.fc2.parameters()], "weight_decay": 0.0}]
    return _loop(side, side.optimizer(params=groups, lr=0.1))


# ---------------------------------------------------------------- mixed precision
def grad_scaler(kind, rank, world):
    """``torch.amp.GradScaler("cpu")``: ``scale(loss)``, ``unscale_`` and torch's clipping,
    ``scaler.step(opt)``, ``update()``."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(STEPS):
        side.step(*batch(rank, step), scale=scaler.scale)
        scaler.unscale_(opt)
        out[f"norm {step}"] = np.float32(nn.utils.clip_grad_norm_(side.model.parameters(), 1.0))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out[f"scale {step}"] = np.float32(scaler.get_scale())
    out.update(state(side.model))
    return out


def cuda_grad_scaler(kind, rank, world):
    """``torch.cuda.amp.GradScaler()`` kept from a GPU script, on a CPU-only machine (torch
    disables it with a warning)."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    scaler = _cuda_scaler()
    for step in range(STEPS):
        side.step(*batch(rank, step), scale=scaler.scale)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    out.update(state(side.model))
    return out


def _cuda_scaler():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated, and disabled without CUDA: both said
        return torch.cuda.amp.GradScaler()


def autocast_bf16(kind, rank, world):
    """The forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        def forward(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return side.net(x)
        out[f"loss {step}"] = np.float32(side.step(*batch(rank, step), forward=forward))
        opt.step()
        opt.zero_grad()
    out.update(state(side.model))
    return out


# ---------------------------------------------------------------- the graph
def parameter_hook(kind, rank, world):
    """``model.fc1.weight.register_hook(lambda g: g * 0.5)`` before training."""
    side = Side(kind, rank)
    side.model.fc1.weight.register_hook(lambda g: g * 0.5)
    return train(side)


def freeze_mid_training(kind, rank, world):
    """``model.fc1.requires_grad_(False)`` on every rank after the first step (DDP with
    ``find_unused_parameters=True``)."""
    side = Side(kind, rank, ddp={"find_unused_parameters": True})
    opt = side.optimizer()

    def freeze(step, out):
        if step == 0:
            side.model.fc1.requires_grad_(False)
    return _loop(side, opt, after_step=freeze)


def unused_layer(kind, rank, world):
    """A layer the forward never uses (DDP with ``find_unused_parameters=True``)."""
    side = Side(kind, rank, model=make_model(rank, extra=True),
                ddp={"find_unused_parameters": True})
    return train(side)


def accumulate_no_sync(kind, rank, world):
    """Gradient accumulation: 2 micro-batches per step, the first under ``no_sync``."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        for micro in range(2):
            x, y = batch(rank, step, micro)
            out[f"loss {step}.{micro}"] = np.float32(side.step(x, y, pause=micro == 0))
        opt.step()
        opt.zero_grad()
    out.update(state(side.model))
    return out


class _HalfFor(torch.autograd.Function):
    """``x @ w.T``, whose backward returns None for ``w`` where ``drop``."""

    @staticmethod
    def forward(ctx, x, w, drop):
        ctx.save_for_backward(x, w)
        ctx.drop = drop
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, None if ctx.drop else g.t() @ x, None


def _custom_function(kind, rank, drop: bool) -> dict:
    side = Side(kind, rank, ddp={"find_unused_parameters": True})
    m = side.model

    def forward(x):  # fc1 through the custom Function (its weight maybe without gradient)
        h = _HalfFor.apply(x, m.fc1.weight, drop) + m.fc1.bias
        return m.fc2(torch.tanh(m.bn(h)))

    return _train_through(side, forward)


def _train_through(side, forward, steps: int = STEPS) -> dict:
    """Train with ``forward`` as the model's forward: on DDP through the wrapper (whose
    forward prepares its reducer), on gradmgr called as it is."""
    if side.gm is None:
        side.model.forward = forward
        forward = side.net
    opt, out = side.optimizer(), {}
    for step in range(steps):
        out[f"loss {step}"] = np.float32(side.step(*batch(side.rank, step), forward=forward))
        opt.step()
        opt.zero_grad()
    out.update(state(side.model))
    return out


def custom_function_none_all(kind, rank, world):
    """Issue 25 item 4: a custom ``autograd.Function`` whose backward returns ``None`` for an
    attached weight, on every rank (DDP with ``find_unused_parameters=True``)."""
    return _custom_function(kind, rank, drop=True)


def custom_function_none_one(kind, rank, world):
    """Issue 25 item 4: the same, on rank 1 only."""
    return _custom_function(kind, rank, drop=rank == 1)


def tied_weight(kind, rank, world):
    """A layer used twice in the forward (a tied weight)."""
    side = Side(kind, rank)
    m = side.model

    def forward(x):
        h = torch.tanh(m.bn(m.fc1(x)))
        return m.fc2(h) + m.fc2(torch.tanh(h))
    return _train_through(side, forward)


def checkpointed(kind, rank, world):
    """Activation checkpointing, ``torch.utils.checkpoint.checkpoint(..., use_reentrant=
    False)``, around the first block."""
    side = Side(kind, rank)
    m = side.model

    def forward(x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(m.bn(m.fc1(t))), x,
                                              use_reentrant=False)
        return m.fc2(h)
    return _train_through(side, forward)


def two_forwards(kind, rank, world):
    """Two forwards (two halves of the batch), one backward of the summed losses, with
    ``broadcast_buffers=False`` (DDP's broadcast at the second forward would overwrite the
    BatchNorm statistics the first one saved for the backward: torch refuses it)."""
    side = Side(kind, rank, ddp={"broadcast_buffers": False}, dp={"broadcast_buffers": False})
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        x, y = batch(rank, step)
        with side.recording():
            loss = loss_fn(side.net(x[:2]), y[:2]) + loss_fn(side.net(x[2:]), y[2:])
            side.backward(loss)
        out[f"loss {step}"] = np.float32(loss.item())
        opt.step()
        opt.zero_grad()
    out.update(state(side.model))
    return out


def zero_checkpoint(kind, rank, world):
    """A ZeroRedundancyOptimizer script's checkpoint on a ShardedOptimizer:
    ``opt.consolidate_state_dict(to=0)`` on every rank, then ``if rank == 0:
    opt.state_dict()`` (the reference: DDP with ZeroRedundancyOptimizer over SGD)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    side = Side(kind, rank)
    if side.gm is None:
        opt = ZeroRedundancyOptimizer(side.model.parameters(), torch.optim.SGD, lr=LR,
                                      momentum=MOMENTUM)
    else:
        opt = side.optimizer()
    out = _loop(side, opt)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        out.update(optimizer_state(opt))
    dist.barrier()
    return out


def skip_failed_batch(kind, rank, world):
    """A rank's forward raises at step 1 (a bad sample) inside ``with gm:``; every rank
    catches its error (the other rank gets RankFailedError) and skips that batch. DDP would
    wait for the failed rank until its timeout: its reference skips the batch on every rank
    after rank 0's forward (whose BatchNorm statistics saw the batch, as with gradmgr)."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS + 1):
        x, y = batch(rank, step)
        try:
            if step == 1 and side.gm is None:
                if rank == 0:
                    side.model(x)
                raise ValueError("DDP's reference: skip the batch on every rank")
            with side.gm or contextlib.nullcontext():
                if step == 1 and rank == 1:
                    raise ValueError("bad sample")
                loss = loss_fn(side.net(x), y)
                side.backward(loss)
        except (ValueError, RankFailedError):  # the habit: catch, log, skip the batch
            out[f"skipped {step}"] = np.array(True)
            opt.zero_grad()
            continue
        out[f"loss {step}"] = np.float32(loss.item())
        opt.step()
        opt.zero_grad()
    out.update(state(side.model))
    return out


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
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        loss = loss_fn(side.net(batch(rank, step)[0]), batch(rank, step)[1])
        loss.backward()
        out[f"loss {step}"] = np.float32(loss.item())
        opt.step()
        opt.zero_grad()
    out.update(state(side.model))
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
    out.update(state(side.model))
    return out


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
    out.update(state(side.model))
    return out


def double_after_wrap(kind, rank, world):
    """Issue 25 item 8: ``model.double()`` after ``data_parallel(model)``. After ``DDP``
    every rank keeps its own gradient, silently: the reference is DDP wrapping the model
    converted first, what the user meant."""
    if kind == "ddp":
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
    out.update(state(side.model))
    return out


def rank_skips_silently(kind, rank, world):
    """Rank 1 skips step 1 before its forward (``continue``), the other rank trains on."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        if step == 1 and rank == 1:
            continue
        out[f"loss {step}"] = np.float32(side.step(*batch(rank, step)))
        opt.step()
        opt.zero_grad()
    out.update(state(side.model))
    return out


def destroy_then_del(kind, rank, world):
    """Issue 25 item 9: one step, ``dist.destroy_process_group()``, then ``del gm`` (and
    ``del model``): the harness starts a new group afterwards."""
    side = Side(kind, rank)
    out = train(side, steps=1)
    dist.destroy_process_group()
    del side
    gc.collect()  # what the process would free at exit, freed inside the case
    return out


HABITS = [
    Habit("documented", documented,
          'none: the documented script'),
    Habit("module_attribute", module_attribute,
          '`model.module.state_dict()` for the checkpoint',
          accept=("AttributeError", "'module'")),
    Habit("train_eval_switch", train_eval_switch,
          '`model.eval()`, a validation forward under `no_grad`, `model.train()`, between steps'),
    Habit("eval_after_training", eval_after_training,
          'evaluation after training: `model.eval()`, a validation pass (item 6)'),
    Habit("no_grad_in_train_mode", no_grad_in_train_mode,
          'a forward under `torch.no_grad()` between steps, in train mode'),
    Habit("broadcast_buffers_false", broadcast_buffers_false,
          '`broadcast_buffers=False`'),
    Habit("zero_grad_keep", zero_grad_keep,
          '`opt.zero_grad(set_to_none=False)`'),
    Habit("model_zero_grad", model_zero_grad,
          '`model.zero_grad()` instead of `opt.zero_grad()`'),
    Habit("adam", adam,
          '`torch.optim.Adam` instead of SGD'),
    Habit("lr_scheduler", lr_scheduler,
          '`StepLR(opt, 1)` over the optimizer'),
    Habit("clip_torch", clip_torch,
          "torch's `clip_grad_norm_(model.parameters(), ...)` (item 5)"),
    Habit("grad_scaler", grad_scaler,
          '`torch.amp.GradScaler("cpu")`: `scale`, `unscale_`, clip, `step`, `update`'),
    Habit("cuda_grad_scaler", cuda_grad_scaler,
          '`torch.cuda.amp.GradScaler()` on a machine without CUDA'),
    Habit("autocast_bf16", autocast_bf16,
          'the forward under `torch.autocast("cpu", dtype=torch.bfloat16)`'),
    Habit("parameter_hook", parameter_hook,
          '`register_hook` on a parameter'),
    Habit("freeze_mid_training", freeze_mid_training,
          '`requires_grad_(False)` on a layer after a step, every rank'),
    Habit("unused_layer", unused_layer,
          'a layer the forward never uses'),
    Habit("accumulate_no_sync", accumulate_no_sync,
          'gradient accumulation under `no_sync`'),
    Habit("custom_function_none_all", custom_function_none_all,
          'a custom `autograd.Function` returning `None` for a weight (item 4)'),
    Habit("tied_weight", tied_weight,
          'a layer used twice in the forward (tied weights)'),
    Habit("checkpointed", checkpointed,
          'activation checkpointing, `use_reentrant=False`'),
    Habit("two_forwards", two_forwards,
          'two forwards, one backward of the summed losses (`broadcast_buffers=False`)'),
    Habit("zero_checkpoint", zero_checkpoint,
          "ZeRO's checkpoint: `opt.consolidate_state_dict(to=0)`, then rank 0's `state_dict()`",
          paths=SHARDED, risky=True),
    Habit("skip_failed_batch", skip_failed_batch,
          "a rank's batch fails inside the step; every rank catches it and skips the batch"),
    Habit("forward_outside_with", forward_outside_with,
          'the forward before `with gm:`, only the backward inside'),
    Habit("backward_inside_with_single", backward_inside_with_single,
          '`loss.backward()` inside `with gm:`, one process (item 3)',
          paths=("single",)),
    Habit("ddp_then_data_parallel", ddp_then_data_parallel,
          '`net = DDP(model)` kept, then `data_parallel(net)` (item 1)',
          ddp=False),
    Habit("data_parallel_then_ddp", data_parallel_then_ddp,
          '`data_parallel(model)`, then `net = DDP(model)` (item 1)',
          ddp=False),
    Habit("forgotten_with", forgotten_with,
          '`with gm:` forgotten: a plain `loss.backward()` (item 2)',
          ddp=False),
    Habit("double_after_wrap", double_after_wrap,
          '`model.double()` after wrapping (item 8)'),
    Habit("sharded_groups_differ", sharded_groups_differ,
          'ranks give `ShardedOptimizer` different groups (item 5)',
          paths=SHARDED, ddp=False),
    Habit("checkpoint_rank0", checkpoint_rank0,
          '`if rank == 0: torch.save(opt.state_dict(), path)` (item 5)',
          risky=True),
    Habit("custom_function_none_one", custom_function_none_one,
          'a custom `autograd.Function` returning `None` for a weight on one rank (item 4)',
          risky=True),
    Habit("no_sync_on_rank0_only", no_sync_on_rank0_only,
          'only rank 0 wraps a micro-batch in `no_sync` (item 7)',
          ddp=False, risky=True),
    Habit("rank_skips_silently", rank_skips_silently,
          'one rank skips a batch before its forward (`continue`)',
          ddp=False, risky=True),
    Habit("destroy_then_del", destroy_then_del,
          '`dist.destroy_process_group()`, then `del gm` (item 9)',
          teardown=True),
]
BY_NAME = {h.name: h for h in HABITS}
