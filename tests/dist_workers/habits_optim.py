"""Habits of the optimizer (habit_cases.py runs them): zeroing, Adam, schedulers, torch's
clipping, checkpoints (DDP's and ZeRO's), parameter groups, mixed precision, a closure, an
EMA of the model, an optimizer that is not elementwise."""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .habit_sides import LR, MOMENTUM, STEPS, Side, batch, loop, state, whole


# ---------------------------------------------------------------- optimizer habits
def zero_grad_keep(kind, rank, world):
    """``opt.zero_grad(set_to_none=False)``: zeroed ``.grad`` tensors kept."""
    side = Side(kind, rank)
    opt = side.optimizer()
    return loop(side, opt, zero=lambda: opt.zero_grad(set_to_none=False))


def zero_grad_keep_unused(kind, rank, world):
    """``opt.zero_grad(set_to_none=False)`` with a layer used at the first step only (on every
    rank): its zeroed ``.grad`` is kept, so SGD's momentum goes on moving it."""
    from .habit_sides import make_model

    side = Side(kind, rank, model=make_model(rank, extra=True),
                ddp={"find_unused_parameters": True})
    model, first = side.model, [True]

    def forward(x):
        h = model.fc2(torch.tanh(model.bn(model.fc1(x))))
        return model.extra(h) if first[0] else h

    model.forward = forward
    opt = side.optimizer()

    def after_step(step, out):
        first[0] = False

    return loop(side, opt, zero=lambda: opt.zero_grad(set_to_none=False), after_step=after_step)


def model_zero_grad(kind, rank, world):
    """``model.zero_grad()`` instead of the optimizer's."""
    side = Side(kind, rank)
    return loop(side, side.optimizer(), zero=side.model.zero_grad)


def adam(kind, rank, world):
    """``torch.optim.Adam`` instead of SGD."""
    side = Side(kind, rank)
    return loop(side, side.optimizer(torch.optim.Adam, lr=0.01))


def adam_groups(kind, rank, world):
    """Adam over two parameter groups: the first layer's with its own ``lr``,
    ``weight_decay`` and ``betas``, the rest with the defaults."""
    side = Side(kind, rank)
    first = list(side.model.fc1.parameters())
    rest = [p for n, p in side.model.named_parameters() if not n.startswith("fc1.")]
    groups = [{"params": first, "lr": 0.05, "weight_decay": 0.1, "betas": (0.8, 0.95)},
              {"params": rest}]
    return loop(side, side.optimizer(torch.optim.Adam, groups, lr=0.01))


def plateau(kind, rank, world):
    """``ReduceLROnPlateau(opt, patience=0, factor=0.5)`` stepped after each step with a
    validation metric that never improves (1.0): it halves the rate after every step but
    the first."""
    side = Side(kind, rank)
    opt = side.optimizer()
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    out = loop(side, opt, after_step=lambda step, out: sched.step(1.0), steps=4)
    out["learning rate"] = np.float64(opt.param_groups[0]["lr"])
    return out


def one_cycle(kind, rank, world):
    """``OneCycleLR`` over Adam: it sets ``lr`` and cycles ``betas`` at every step."""
    side = Side(kind, rank)
    opt = side.optimizer(torch.optim.Adam, lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
    out = loop(side, opt, after_step=lambda step, out: sched.step(), steps=4)
    out["betas"] = np.asarray(opt.param_groups[0]["betas"])
    return out


def closure_step(kind, rank, world):
    """``loss = opt.step(closure)``, the closure zeroing the gradients and running the
    forward and backward (gradmgr's inside ``with gm:``)."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        x, y = batch(rank, step)

        def closure(x=x, y=y):
            opt.zero_grad()
            return side.step(x, y)
        out[f"loss {step}"] = np.float32(opt.step(closure))
    out.update(state(side))
    return out


def ema_model(kind, rank, world):
    """An EMA of the model, ``torch.optim.swa_utils.AveragedModel``, updated after each
    step; its parameters."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    side = Side(kind, rank)
    average = AveragedModel(side.model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    out = loop(side, side.optimizer(),
               after_step=lambda step, out: average.update_parameters(side.model))
    out.update({f"EMA {n}": p.detach().numpy().copy()
                for n, p in average.module.named_parameters()})
    return out


def adafactor(kind, rank, world):
    """torch's ``Adafactor`` (its step scaled by each whole parameter's root mean square)."""
    side = Side(kind, rank)
    return loop(side, side.optimizer(torch.optim.Adafactor, lr=0.01))


def lr_scheduler(kind, rank, world):
    """``StepLR(opt, 1, gamma=0.5)`` over the optimizer, stepped after each ``opt.step()``."""
    side = Side(kind, rank)
    opt = side.optimizer()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    return loop(side, opt, after_step=lambda step, out: sched.step())


def clip_torch(kind, rank, world):
    """Issue 25 item 5: torch's ``clip_grad_norm_(model.parameters(), ...)`` after the
    backward (on a ShardedOptimizer too); its norm is recorded."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        side.step(*batch(rank, step))
        out[f"norm {step}"] = np.float32(whole(
            nn.utils.clip_grad_norm_(side.model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out


def grad_metadata(kind, rank, world):
    """Issue 39 item 5: memory accounting and logging read each ``.grad``'s metadata after
    the backward (``numel() * element_size()`` summed, shape, dtype, strides), as DDP and FSDP2
    scripts do (a sharded step's ``.grad`` is a stand-in: it answers the whole gradient's)."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        out[f"loss {step}"] = np.float32(side.step(*batch(rank, step)))
        grads = [p.grad for p in side.model.parameters() if p.grad is not None]
        out[f"grad bytes {step}"] = np.int64(sum(g.numel() * g.element_size() for g in grads))
        out[f"grad metadata {step}"] = np.array(repr([
            (tuple(g.shape), str(g.dtype), g.stride(), g.is_floating_point(), g.nbytes)
            for g in grads]))
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out


def optimizer_state(opt) -> dict:
    """An optimizer's ``state_dict()`` as arrays (groups and per-parameter state; of a
    DTensor, this rank's shard, what ``torch.save`` writes under FSDP2)."""
    saved = opt.state_dict()
    out = {"param_groups": np.array(repr(saved["param_groups"]))}
    for i, entry in saved["state"].items():
        out.update({f"state {i} {k}": torch.as_tensor(_local(v)).numpy()
                    for k, v in entry.items()})
    return out


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def checkpoint_rank0(kind, rank, world):
    """Issue 25 item 5: ``if rank == 0: torch.save(opt.state_dict(), path)``, every DDP
    script's checkpoint, then ``dist.barrier()``."""
    side = Side(kind, rank)
    opt = side.optimizer()
    out = loop(side, opt)
    try:
        if rank == 0:
            out.update(optimizer_state(opt))
    finally:  # where rank 0 raised, the program goes on: the group must still work
        dist.barrier()
    return out


def model_checkpoint_rank0(kind, rank, world):
    """``if rank == 0: torch.save(model.state_dict(), path)`` after every step (under DDP,
    the module's, ``model.module.state_dict()``)."""
    side = Side(kind, rank)

    def save(step, out):
        if rank == 0:
            saved = side.model.state_dict()
            torch.save(saved, io.BytesIO())
            out[f"saved entries {step}"] = np.array(len(saved))
    return loop(side, side.optimizer(), after_step=save)


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
    return loop(side, side.optimizer(params=groups, lr=0.1))


# ---------------------------------------------------------------- mixed precision
def grad_scaler(kind, rank, world):
    """``torch.amp.GradScaler("cpu")``: ``scale(loss)``, ``unscale_`` and torch's clipping,
    ``scaler.step(opt)``, ``update()``."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    if not scaler.is_enabled():  # then this row would check nothing: say so
        raise RuntimeError("torch.amp.GradScaler('cpu') is disabled in this torch")
    for step in range(STEPS):
        side.step(*batch(rank, step), scale=scaler.scale)
        scaler.unscale_(opt)
        out[f"norm {step}"] = np.float32(whole(
            nn.utils.clip_grad_norm_(side.model.parameters(), 1.0)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out[f"scale {step}"] = np.float32(scaler.get_scale())
    out.update(state(side))
    return out


def cuda_grad_scaler(kind, rank, world):
    """``torch.cuda.amp.GradScaler()`` kept from a GPU script, on a CPU-only machine (torch
    disables it with a warning)."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    scaler = _cuda_scaler()
    out["scaler enabled"] = np.array(scaler.is_enabled())  # False: no CUDA (CUDA_VISIBLE_DEVICES)
    for step in range(STEPS):
        side.step(*batch(rank, step), scale=scaler.scale)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    out.update(state(side))
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
    out.update(state(side))
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
    out = loop(side, opt)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        out.update(optimizer_state(opt))
    dist.barrier()
    return out




# ---------------------------------------------------------------- in place on .grad
CLIP_VALUE = 0.05  # below the largest gradients of the habit script: some elements clip


def on_grads(side: Side, change, micro_batches: int = 1) -> dict:
    """The plain loop (``micro_batches`` per step, all but the last under ``no_sync``) with
    ``change(params, step)`` after each synced backward, before the step."""
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        for micro in range(micro_batches):
            x, y = batch(rank=side.rank, step=step, micro=micro)
            out[f"loss {step}.{micro}"] = np.float32(
                side.step(x, y, pause=micro < micro_batches - 1))
        change([p for p in side.model.parameters() if p.grad is not None], step)
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out


def grad_div_(kind, rank, world):
    """Manual averaging over accumulation: 2 micro-batches (the first under ``no_sync``),
    then ``p.grad.div_(2)`` on each parameter."""
    def change(params, step):
        for p in params:
            p.grad.div_(2)
    return on_grads(Side(kind, rank), change, micro_batches=2)


def grad_itruediv(kind, rank, world):
    """The same averaging written ``p.grad /= n``, ``n`` a 0-dim tensor."""
    def change(params, step):
        n = torch.tensor(2.0)
        for p in params:
            grad = p.grad
            grad /= n
    return on_grads(Side(kind, rank), change, micro_batches=2)


def clip_value(kind, rank, world):
    """torch's ``clip_grad_value_(model.parameters(), 0.05)``, its default at even steps and
    ``foreach=True`` at odd ones; how many elements of each step's gradients it changes."""
    counts = {}

    def change(params, step):
        if kind in ("ddp", "fsdp2"):  # counted on the reference side, which holds values
            counts[step] = sum(int((whole(p.grad).abs() > CLIP_VALUE).sum()) for p in params)
        nn.utils.clip_grad_value_(params, CLIP_VALUE, foreach=True if step % 2 else None)
    out = on_grads(Side(kind, rank), change)
    out["clipped"] = np.array([c > 0 for c in counts.values()] or [True] * STEPS)
    return out


def dp_noise(kind, rank, world):
    """DP-SGD's noise: ``p.grad.add_(noise)``, the noise of each gradient's shape drawn from a
    seed all ranks share (under full sharding the noise is a DTensor laid out as the
    gradient, as FSDP2 requires)."""
    def change(params, step):
        for i, p in enumerate(params):
            g = torch.Generator().manual_seed(100 * step + i)
            noise = torch.randn(p.shape, generator=g) * 0.01
            p.grad.add_(as_grad(noise, p.grad))
    return on_grads(Side(kind, rank), change)


def as_grad(tensor: torch.Tensor, grad) -> torch.Tensor:
    """``tensor`` (the same on every rank) laid out as ``grad``: a DTensor's shard of it."""
    if not hasattr(grad, "device_mesh"):
        return tensor
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(tensor, grad.device_mesh, grad.placements)


def nan_to_num(kind, rank, world):
    """``p.grad.nan_to_num_(nan=0.0, posinf=1.0, neginf=-1.0)`` on each parameter's ``.grad``
    (a no-op on these finite gradients: the row checks that it runs and changes nothing)."""
    def change(params, step):
        for p in params:
            p.grad.nan_to_num_(nan=0.0, posinf=1.0, neginf=-1.0)
    return on_grads(Side(kind, rank), change)


def clamp_min_max(kind, rank, world):
    """``p.grad.clamp_min_(-0.05).clamp_max_(0.05)`` on each parameter's ``.grad``."""
    def change(params, step):
        for p in params:
            p.grad.clamp_min_(-CLIP_VALUE).clamp_max_(CLIP_VALUE)
    return on_grads(Side(kind, rank), change)
