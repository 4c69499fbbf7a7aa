"""The habit harness's training script, written once for both sides of a comparison: torch's
DDP (the reference; for full sharding, FSDP2 alone) and gradmgr on one of its data-parallel
paths.

A :class:`Side` hides what switching changes (the wrapper, the step, ``no_sync``, the
optimizer, clipping); a habit (habit_cases.py) is the documented script with one habit typed
in, and records what it returns (losses, norms) and each rank's parameters and buffers.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import ShardedOptimizer, data_parallel, no_sync

PATHS = ("native", "buckets", "sharded", "full")  # gradmgr's paths
REFERENCE = {"full": "fsdp2"}  # each path's reference; "ddp" where not named
LR, MOMENTUM, STEPS = 0.1, 0.9, 3


class Model(nn.Module):
    """Two Linear layers around a BatchNorm (a buffer DDP broadcasts at every forward)."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)
        self.extra = nn.Linear(3, 3) if extra else None  # never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def make_model(rank: int, **kw) -> Model:
    torch.manual_seed(rank)  # each rank its own weights: the first broadcast matters
    return Model(**kw)


def batch(rank: int, step: int, micro: int = 0) -> tuple:
    """Rank ``rank``'s own data."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


class Side:
    """One side of a comparison: ``kind`` "ddp" (DDP) or "fsdp2" (FSDP2 alone), or a gradmgr
    path: "native" (torch's reducer, the default), "buckets" (``native=False``), "sharded"
    (``shard=True`` and a :class:`ShardedOptimizer`) or "full" (``shard="full"``, FSDP2 on
    each Linear and the root). ``net`` is what the script calls; ``model`` the module."""

    def __init__(self, kind: str, rank: int, model: nn.Module = None, ddp: dict = None,
                 dp: dict = None) -> None:
        self.kind, self.rank = kind, rank
        self.model = make_model(rank) if model is None else model
        self.gm, self._synced = None, True
        if kind == "ddp":
            self.net = DDP(self.model, **(ddp or {}))
        elif kind == "fsdp2":
            self.net = self.model
            self._buffers = (ddp or {}).get("broadcast_buffers", True)
            fsdp2(self.model)
        else:
            self.net = self.model
            self.gm = data_parallel(self.model, **self.dp_options(), **(dp or {}))

    def dp_options(self) -> dict:
        if self.kind == "sharded":
            return {"shard": True}
        if self.kind == "full":
            return {"shard": "full", "blocks": [nn.Linear]}
        return {"native": self.kind == "native"}

    @property
    def sharded(self) -> bool:
        return self.kind == "sharded"

    def optimizer(self, cls=torch.optim.SGD, params=None, **kw):
        """``cls`` over the parameters (``params``: groups), as the DDP script builds it."""
        kw = kw or {"lr": LR, "momentum": MOMENTUM}
        if self.sharded:
            return ShardedOptimizer(self.gm, cls, params, **kw)
        return cls(self.model.parameters() if params is None else params, **kw)

    def paused(self, pause: bool = True):
        """DDP's ``no_sync()``, or gradmgr's ``no_sync(gm)``, when ``pause``."""
        if not pause:
            return contextlib.nullcontext()
        if self.kind == "fsdp2":
            return self._fsdp2_no_sync()
        return self.net.no_sync() if self.gm is None else no_sync(self.gm)

    @contextlib.contextmanager
    def _fsdp2_no_sync(self):
        self.model.set_requires_gradient_sync(False)
        self._synced = False
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
            self._synced = True

    def recording(self):
        return contextlib.nullcontext() if self.gm is None else self.gm

    def backward(self, loss: torch.Tensor) -> None:
        if self.gm is None:
            loss.backward()
            if self.kind == "fsdp2" and self._synced and self._buffers:
                for buffer in self.model.buffers():  # as gradmgr does: rank 0's, after the step
                    torch.distributed.broadcast(buffer, 0)
        else:
            self.gm.backward(loss)

    def step(self, x, y, pause: bool = False, scale=None, forward=None) -> float:
        """The documented step: forward and backward, DDP's way or gradmgr's."""
        forward = forward or self.net
        with self.paused(pause), self.recording():
            loss = loss_fn(forward(x), y)
            self.backward(loss if scale is None else scale(loss))
        return loss.item()

    def clip(self, opt, max_norm: float = 1.0) -> float:
        """The documented clipping: torch's, or the ShardedOptimizer's own."""
        if self.sharded:
            return float(opt.clip_grad_norm_(max_norm))
        return float(whole(nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)))


def fsdp2(model: nn.Module) -> None:
    """FSDP2 as its users set it up, on every rank: rank 0's parameters and buffers (FSDP2
    broadcasts nothing itself), ``fully_shard`` on each Linear and then the root, summing over
    gloo and dividing (its own average there is the sum on torch 2.8)."""
    from torch.distributed.fsdp import fully_shard

    for tensor in [*model.parameters(), *model.buffers()]:
        torch.distributed.broadcast(tensor.detach(), 0)
    blocks = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    for wrapped in [*blocks, model]:
        wrapped.set_force_sum_reduction_for_comms(True)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), another tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def state(side: Side) -> dict:
    """Every parameter and buffer of the side's model, by name, as arrays, after one evaluation
    forward (``eval()``, ``no_grad``) through what the script calls, and that forward's output.

    Buffers are compared as the next forward computes with them: DDP broadcasts rank 0's
    buffers at a forward that follows a synced step (this one), gradmgr when the synced step
    ends; between the two, DDP's other ranks still hold their own, which its next forward
    overwrites before using them (docs/switching-from-ddp.md, "Habits, checked")."""
    model = side.model
    training = model.training
    first = next(model.parameters())
    probe = torch.randn(4, 6, generator=torch.Generator().manual_seed(7)).to(first.dtype)
    model.eval()
    with torch.no_grad():
        output = side.net(probe)
    model.train(training)
    out = {f"param {n}": whole(p.detach()).numpy().copy() for n, p in model.named_parameters()}
    out.update({f"buffer {n}": b.detach().numpy().copy() for n, b in model.named_buffers()})
    out["evaluation output"] = output.detach().float().numpy().copy()
    return out


def train(side: Side, steps: int = STEPS, opt=None, **step_kw) -> dict:
    """The plain loop: ``steps`` steps of SGD with momentum; the losses and the final state."""
    opt = opt or side.optimizer()
    out = {}
    for step in range(steps):
        out[f"loss {step}"] = np.float32(side.step(*batch(side.rank, step), **step_kw))
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out


def train_on(side: Side, loss_of, steps: int = STEPS) -> dict:
    """The plain loop with ``loss_of(step)``, computed inside the recording, as each step's
    loss (the forwards and what else the loss needs); the losses and the final state."""
    opt, out = side.optimizer(), {}
    for step in range(steps):
        with side.recording():
            loss = loss_of(step)
            side.backward(loss)
        out[f"loss {step}"] = np.float32(loss.item())
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out


def loop(side: Side, opt, zero=None, after_step=None, steps: int = STEPS) -> dict:
    """The plain loop over ``opt``; ``zero`` instead of ``opt.zero_grad``, ``after_step(step,
    out)`` after each step."""
    out = {}
    for step in range(steps):
        out[f"loss {step}"] = np.float32(side.step(*batch(side.rank, step)))
        opt.step()
        (zero or opt.zero_grad)()
        if after_step:
            after_step(step, out)
    out.update(state(side))
    return out


def train_through(side, forward, steps: int = STEPS) -> dict:
    """Train with ``forward`` as the model's forward (set on the model, so that the script
    calls ``net(x)`` as usual: on DDP the wrapper, whose forward prepares its reducer; on
    gradmgr the model, whose forward hooks run)."""
    side.model.forward = forward
    opt, out = side.optimizer(), {}
    for step in range(steps):
        out[f"loss {step}"] = np.float32(side.step(*batch(side.rank, step)))
        opt.step()
        opt.zero_grad()
    out.update(state(side))
    return out
