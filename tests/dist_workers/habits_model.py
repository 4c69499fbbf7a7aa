"""Habits of the model and its graph (habit_cases.py runs them): evaluation and buffers,
hooks, freezing, unused and tied layers, custom autograd Functions, checkpointing,
accumulation, a failed batch."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import torch
from torch import nn

from gradmgr import GradManager
from gradmgr.distributed import RankFailedError

from .habit_sides import (
    STEPS,
    Side,
    batch,
    loop,
    loss_fn,
    make_model,
    state,
    train,
    train_on,
    train_through,
)


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
    out.update(state(side))
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
    out.update(state(side))
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
    out.update(state(side))
    return out


def broadcast_buffers_false(kind, rank, world):
    """``DDP(model, broadcast_buffers=False)``: ``data_parallel(model, broadcast_buffers=
    False)``; each rank keeps its own running statistics."""
    side = Side(kind, rank, ddp={"broadcast_buffers": False}, dp={"broadcast_buffers": False})
    return train(side)


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
    return loop(side, opt, after_step=freeze)


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
    out.update(state(side))
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

    return train_through(side, forward)


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
    return train_through(side, forward)


def shared_parameter(kind, rank, world):
    """A parameter shared by two layers: a second head whose weight is ``fc2``'s
    (``head.weight = fc2.weight``), both heads summed."""
    model = make_model(rank)
    model.head = nn.Linear(16, 3)
    model.head.weight = model.fc2.weight
    side = Side(kind, rank, model=model)
    m = side.model

    def forward(x):
        h = torch.tanh(m.bn(m.fc1(x)))
        return m.fc2(h) + m.head(h)
    return train_through(side, forward)


def freeze_before_wrapping(kind, rank, world):
    """``model.fc1.requires_grad_(False)`` before wrapping (a frozen layer, fine-tuning)."""
    model = make_model(rank)
    model.fc1.requires_grad_(False)
    return train(Side(kind, rank, model=model))


def deepcopy_model(kind, rank, world):
    """``copy.deepcopy(model)`` after the steps (an EMA or evaluation copy), and the copy's
    evaluation forward."""
    side = Side(kind, rank)
    out = train(side)
    twin = copy.deepcopy(side.model).eval()
    with torch.no_grad():
        out["copy's evaluation output"] = twin(batch(rank, 99)[0]).numpy()
    return out


def checkpointed(kind, rank, world):
    """Activation checkpointing, ``torch.utils.checkpoint.checkpoint(..., use_reentrant=
    False)``, around the first block."""
    side = Side(kind, rank)
    m = side.model

    def forward(x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(m.bn(m.fc1(t))), x,
                                              use_reentrant=False)
        return m.fc2(h)
    return train_through(side, forward)


def two_forwards(kind, rank, world):
    """Two forwards (two halves of the batch), one backward of the summed losses, with
    ``broadcast_buffers=False`` (DDP's broadcast at the second forward would overwrite the
    BatchNorm statistics the first one saved for the backward: torch refuses it)."""
    side = Side(kind, rank, ddp={"broadcast_buffers": False}, dp={"broadcast_buffers": False})

    def loss_of(step):
        x, y = batch(rank, step)
        return loss_fn(side.net(x[:2]), y[:2]) + loss_fn(side.net(x[2:]), y[2:])
    return train_on(side, loss_of)


def split_1f1b(kind, rank, world):
    """A pipeline stage's split backward in 1F1B order, one accumulation window per step:
    micro-batch 0 (inside ``no_sync``), then 1, each input's gradient now
    (``backward_split(loss, first=[x])``), then both weight halves in order. DDP: one
    ``loss.backward()`` per micro-batch in the same window; the inputs' gradients compared
    too."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        rests = []
        for micro in range(2):
            x, y = batch(rank, step, micro)
            x.requires_grad_()
            with side.paused(micro == 0), side.recording():
                loss = loss_fn(side.net(x), y)
                if side.gm is None:
                    side.backward(loss)
                else:
                    side.gm.attach(x)
                    rests.append(side.gm.backward_split(loss, first=[x]))
            out[f"input grad {step} {micro}"] = x.grad.numpy().copy()
        for rest in rests:
            rest.finish()
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out


def gradient_penalty(kind, rank, world):
    """WGAN-GP's penalty: the input gradient of the model's output inside the recording, its
    norm in the loss; gradmgr by an inner manager (``with inner: inner.backward(...)``, which
    the data-parallel manager records), DDP by ``torch.autograd.grad(create_graph=True)``.
    Two forwards per step: ``broadcast_buffers=False``, as :func:`two_forwards`."""
    side = Side(kind, rank, ddp={"broadcast_buffers": False}, dp={"broadcast_buffers": False})

    def loss_of(step):
        x, x_hat = batch(rank, step)[0], batch(rank, step, 1)[0].requires_grad_()
        if side.gm is None:
            slope, = torch.autograd.grad(side.net(x_hat).sum(), x_hat, create_graph=True)
        else:
            inner = GradManager().attach(x_hat)
            with inner:
                inner.backward(side.net(x_hat).sum())
            slope = x_hat.grad
        return side.net(x).mean() + (slope.norm(2, dim=1) - 1).square().mean()
    return train_on(side, loss_of)


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
    out.update(state(side))
    return out




def autograd_grad_outside(kind, rank, world):
    """Issue 38: after each step, a forward outside the step (``eval()``, gradients enabled)
    and ``torch.autograd.grad`` of its loss for the input (a saliency map) and for the
    parameters (this rank's gradient norms): no ``.grad`` written, nothing reduced, as with
    DDP."""
    side = Side(kind, rank)
    opt, out = side.optimizer(), {}
    for step in range(STEPS):
        x, y = batch(rank, step)
        out[f"loss {step}"] = np.float32(side.step(x, y))
        opt.step()
        opt.zero_grad()
        side.model.eval()
        x = x.clone().requires_grad_(True)
        grads = torch.autograd.grad(loss_fn(side.net(x), y), [x, *side.model.parameters()])
        side.model.train()
        out[f"norms {step}"] = np.array([g.norm().item() for g in grads], dtype=np.float32)
    out.update(state(side))
    return out
