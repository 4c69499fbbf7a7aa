"""Rank program: ``data_parallel(model, shard="full")`` next to plain FSDP2 (``fully_shard`` on
the same blocks, then the root, and ``loss.backward()``), 10 AdamW steps on the same data (SGD
in the scaled scenario: Adam's step hardly changes when every gradient is scaled; blocks with
activation checkpointing or a custom autograd Function inside, and the forward under bf16
autocast, in the scenarios so named);
every rank pickles, per scenario, whether each parameter shard and each step's loss equal
FSDP2's bit for bit, to ``OUTDIR/rank{RANK}.pkl``. ``FULL_SHARD_SCENARIOS`` picks scenarios
(comma-separated; all by default)."""

from __future__ import annotations

import contextlib
import os
import pickle

import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr import UnsupportedGraphError
from gradmgr.distributed import RankMismatchError, data_parallel, no_sync

STEPS, LR, SCALE = 10, 1e-2, 0.25


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class CheckpointedBlock(Block):
    """Activation checkpointing inside the block (``use_reentrant=True``, the older kind)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.fc1(t)), x,
                                                  use_reentrant=True)
        return x + self.fc2(inner)


class _Linear(torch.autograd.Function):
    """``x @ w.T + b`` with a backward of its own."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, g.sum(0)


class FunctionBlock(Block):
    """A custom autograd Function inside the block's forward, over its own parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(_Linear.apply(x, self.fc1.weight, self.fc1.bias)))


BLOCKS = {"checkpoint_inside": CheckpointedBlock, "custom_function": FunctionBlock}


def model(block: type = Block) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), block(16), block(16), nn.Linear(16, 3))


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * step + 10 * micro
                                                                      + rank))


def plain_fsdp2(reshard: bool, mp: MixedPrecisionPolicy, block: type = Block) -> nn.Module:
    """FSDP2 as it averages correctly over gloo: a sum, then divided (its average over gloo
    is the sum on torch 2.8; see :func:`against_ddp`)."""
    net = model(block)
    blocks = [m for m in net.modules() if isinstance(m, Block)]
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(net, reshard_after_forward=reshard, mp_policy=mp)
    for wrapped in [*blocks, net]:
        wrapped.set_force_sum_reduction_for_comms(True)
    return net


def against_ddp(rank: int) -> dict:
    """One backward's gradients under full sharding, gathered, against DDP's (the mean over
    the ranks): bit for bit on 2 ranks (a sum halved is the halves summed)."""
    ours, ref = model(), DDP(model())
    gm = data_parallel(ours, shard="full", blocks=[Block])
    x = batch(0, 0, rank)
    with gm:
        gm.backward(ours(x).square().mean())
    ref(x).square().mean().backward()
    return {"equal": [torch.equal(a.grad.full_tensor(), b.grad)
                      for a, b in zip(ours.parameters(), ref.module.parameters())],
            "ratio": [float(a.grad.full_tensor().abs().sum() / b.grad.abs().sum())
                      for a, b in zip(ours.parameters(), ref.module.parameters())]}


def gradient_penalty(rank: int) -> dict:
    """WGAN-GP's step inside the recording, both ways users write it: an inner manager's
    backward for the input gradient (``manager``) and ``torch.autograd.grad(...,
    create_graph=True)`` (``autograd``). Each: the error (FSDP2 frees the gathered parameters
    in a backward, so a backward through its graph cannot be right); then a plain step, whose
    parameters' gradients must be DDP's (``equal``): the refusal left FSDP2 as it was."""
    from gradmgr import GradManager

    ours, ref = model(), DDP(model())
    gm = data_parallel(ours, shard="full", blocks=[nn.Linear])
    found: dict = {}
    for way in ("manager", "autograd"):
        x, x_hat = batch(0, 0, rank), batch(0, 1, rank).requires_grad_()
        try:
            with gm:
                if way == "manager":
                    inner = GradManager().attach(x_hat)
                    with inner:
                        inner.backward(ours(x_hat).sum())
                    slope = x_hat.grad
                else:
                    slope, = torch.autograd.grad(ours(x_hat).sum(), x_hat, create_graph=True)
                gm.backward(ours(x).mean() + (slope.norm(2, dim=1) - 1).square().mean())
        except Exception as error:  # noqa: BLE001 - the test reads it
            found[way] = f"{type(error).__name__}: {error}"
    x = batch(1, 0, rank)
    with gm:
        gm.backward(ours(x).mean())
    ref(x).mean().backward()
    found["equal"] = [a.grad is not None and torch.equal(a.grad.full_tensor(), b.grad)
                      for a, b in zip(ours.parameters(), ref.module.parameters())]
    return found


def attached_activations(rank: int) -> dict:
    """The input and two activations attached inside the recording (one with a callback
    that doubles its gradient): their ``.grad`` after ``gm.backward`` against plain FSDP2's
    with ``retain_grad()`` (twice it for the doubled one; exact in binary), and the gradient
    shards. Old code: the activations' ``.grad`` None, silently (only the leaves' written)."""
    found: dict = {}
    for side, net in (("gm", model()), ("fsdp2", plain_fsdp2(True, MixedPrecisionPolicy()))):
        gm = data_parallel(net, shard="full", blocks=[Block]) if side == "gm" else None
        kept: list = []
        for module in (net[0], net[1].fc1):  # not wrapped apart: their outputs flow on as is
            module.register_forward_hook(lambda m, i, out, kept=kept: kept.append(out))
        x = batch(0, 0, rank).requires_grad_()
        with gm if gm is not None else contextlib.nullcontext():
            loss = net(x).square().mean()
            if gm is not None:
                gm.attach([x, kept[0]])
                gm.attach(kept[1], callbacks=[lambda t, g: g * 2])
                gm.backward(loss)
            else:
                for h in kept:
                    h.retain_grad()
                loss.backward()
        found[side] = [x.grad, *(h.grad for h in kept),
                       *(p.grad.to_local() for p in net.parameters())]
    ours, theirs = found["gm"], found["fsdp2"]
    theirs[2] = theirs[2] * 2
    return {"equal": [a is not None and torch.equal(a, b) for a, b in zip(ours, theirs)]}


def after_a_refusal(rank: int) -> dict:
    """With ``reshard_after_forward=False``, each refusal (the recording's forward gathered
    the parameters, and no backward resharded them), then a step with a hook on a weight
    registered before it: the modules hold their sharded parameters again after each refusal
    (``types``), and the step's gradient shards are plain FSDP2's, which never ran the refused
    recordings (``equal``; there the hook is on the shard, which the engine never reaches).
    Old code: the modules held the gathered parameters, the hook landed on one and scaled
    that step's gradient, silently."""
    from gradmgr import GradManager

    ours, theirs = model(), plain_fsdp2(False, MixedPrecisionPolicy())
    gm = data_parallel(ours, shard="full", blocks=[Block], reshard_after_forward=False)
    found: dict = {"types": []}
    for way in ("split", "manager", "autograd"):
        x = batch(0, 0, rank).requires_grad_()
        try:
            with gm:
                if way == "split":
                    gm.attach(x)
                    gm.backward_split(ours(x).sum(), first=[x])
                elif way == "manager":
                    inner = GradManager().attach(x)
                    with inner:
                        inner.backward(ours(x).sum())
                else:
                    torch.autograd.grad(ours(x).sum(), x, create_graph=True)
        except Exception:  # noqa: BLE001 - refused, as test_full_shard.py checks
            pass
        found["types"].append(sorted({type(p).__name__ for p in ours.parameters()}))
    x = batch(1, 0, rank)
    for net in (ours, theirs):
        handle = net[0].weight.register_hook(lambda g: g * 3)
        with gm if net is ours else contextlib.nullcontext():
            loss = net(x).mean()
            gm.backward(loss) if net is ours else loss.backward()
        handle.remove()
    found["equal"] = [torch.equal(a.grad.to_local(), b.grad.to_local())
                      for a, b in zip(ours.parameters(), theirs.parameters())]
    return found


def optimizer(net: nn.Module, scale: float) -> torch.optim.Optimizer:
    if scale != 1.0:
        return torch.optim.SGD(net.parameters(), lr=LR)
    return torch.optim.AdamW(net.parameters(), lr=LR)


def loss_of(net: nn.Module, step: int, micro: int, rank: int, autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = net(batch(step, micro, rank))
    return (out.float() if autocast else out).square().mean()


def train_fsdp2(net: nn.Module, rank: int, micros: int, scale: float,
                autocast: bool = False) -> list:
    opt, losses = optimizer(net, scale), []
    for step in range(STEPS):
        for micro in range(micros):
            net.set_requires_gradient_sync(micro == micros - 1)
            loss = loss_of(net, step, micro, rank, autocast)
            loss.backward()
            losses.append(loss.detach().float().clone())
        if scale != 1.0:
            for p in net.parameters():
                p.grad = p.grad * scale
        opt.step()
        opt.zero_grad()
    return losses


def train_gradmgr(net: nn.Module, gm, rank: int, micros: int, scale: float,
                  autocast: bool = False) -> list:
    opt, losses = optimizer(net, scale), []
    for step in range(STEPS):
        for micro in range(micros):
            paused = no_sync(gm) if micro < micros - 1 else contextlib.nullcontext()
            with paused, gm:
                loss = loss_of(net, step, micro, rank, autocast)
                gm.backward(loss)
            losses.append(loss.detach().float().clone())
        opt.step()
        opt.zero_grad()
    return losses


def compare(ours: nn.Module, theirs: nn.Module, our_losses: list, their_losses: list) -> dict:
    shards = [torch.equal(a.to_local(), b.to_local())
              for a, b in zip(ours.parameters(), theirs.parameters())]
    losses = [torch.equal(a, b) for a, b in zip(our_losses, their_losses)]
    moved = any(not torch.equal(a.full_tensor(), b)  # (a collective, in order on every rank)
                for a, b in zip(ours.parameters(), model(type(ours[1])).parameters()))
    return {"shards": shards, "losses": losses, "moved": moved,
            "types": sorted({type(p).__name__ for p in ours.parameters()})}


def scenario(name: str, rank: int) -> dict:
    reshard = name != "reshard_off"
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if name in ("mixed_precision", "autocast_mixed_precision") else MixedPrecisionPolicy())
    micros = 2 if name == "no_sync" else 1
    scale = SCALE if name == "scaled" else 1.0
    autocast, block = name == "autocast_mixed_precision", BLOCKS.get(name, Block)
    ours = model(block)
    gm = data_parallel(ours, shard="full", blocks=[Block], reshard_after_forward=reshard,
                       mp_policy=mp)
    seen = []
    if scale != 1.0:
        def scaled(tensor, grad):
            seen.append((type(tensor).__name__, type(grad).__name__,
                         tuple(grad.to_local().shape) == tuple(tensor.to_local().shape)))
            return grad * scale
        gm.attach(list(ours.parameters()), callbacks=[scaled])
    our_losses = train_gradmgr(ours, gm, rank, micros, scale, autocast)
    theirs = plain_fsdp2(reshard, mp, block)
    their_losses = train_fsdp2(theirs, rank, micros, scale, autocast)
    result = compare(ours, theirs, our_losses, their_losses)
    result["seen"] = sorted(set(seen))
    return result


def refusals(rank: int) -> dict:
    """Bad input on every rank: a blocks= list naming nothing, ranks that shard differently,
    Join (DDP's and ZeRO-2's, not FSDP2's), a split backward, a model already wrapped."""
    found = {}
    try:
        data_parallel(model(), shard="full", blocks=[nn.Conv2d])
    except ValueError as error:
        found["nothing"] = str(error)
    try:
        data_parallel(model(), shard="full" if rank == 0 else True)
    except RankMismatchError as error:
        found["mixed"] = str(error)
    net = model()
    gm = data_parallel(net, shard="full")
    for name, make in (("join", gm.join), ("Join", lambda: Join([gm]))):
        try:
            make()
        except NotImplementedError as error:
            found[name] = str(error)
    x = batch(0, 0, rank).requires_grad_()
    with gm:
        gm.attach(x)
        try:
            gm.backward_split(net(x).sum(), first=[x]).finish()
        except UnsupportedGraphError as error:
            found["split"] = str(error)
    wrapped = model()
    fully_shard(wrapped)
    try:
        data_parallel(wrapped, shard="full")
    except TypeError as error:
        found["wrapped"] = str(error)
    return found


ALL = ["against_ddp", "reshard_on", "reshard_off", "no_sync", "scaled", "mixed_precision",
       "autocast_mixed_precision", "checkpoint_inside", "custom_function", "refusals",
       "gradient_penalty", "attached_activations", "after_a_refusal"]
SPECIAL = {"refusals": refusals, "against_ddp": against_ddp, "gradient_penalty": gradient_penalty,
           "attached_activations": attached_activations, "after_a_refusal": after_a_refusal}


def main(rank: int, world: int, outdir: str) -> None:
    chosen = os.environ.get("FULL_SHARD_SCENARIOS") or ",".join(ALL)
    out = {}
    for name in chosen.split(","):
        out[name] = SPECIAL[name](rank) if name in SPECIAL else scenario(name, rank)
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
