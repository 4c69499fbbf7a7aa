"""Rank program for issue 25, items 1, 2 and 6: a DDP wrapper kept next to ``data_parallel``,
``with gm:`` forgotten, and evaluation after training, next to DDP.

``HABITS_SCENARIOS`` names the scenarios, in order; ``HABITS_SHARD=1`` builds every manager
with ``data_parallel(..., shard=True)`` (``GRADMGR_NATIVE_REDUCER`` picks the unsharded path).
After each scenario the rank saves what it has to ``rank{rank}.npz`` with ``{name}_done``.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import data_parallel, no_sync

from .scenarios import run_named
from .torch_suite import Net, grads, local_batch, save

SHARD = os.environ.get("HABITS_SHARD") == "1"


def error_text(fn) -> np.ndarray:
    """``fn()``'s error as text (its type first), or "no error"."""
    try:
        fn()
    except Exception as exc:
        return np.array(f"{type(exc).__name__}: {exc}")
    return np.array("no error")


def make_gm(model: nn.Module):
    return data_parallel(model, shard=SHARD)


def group_works(out: dict, name: str, rank: int) -> None:
    """The process group still pairs collectives: 1 + 2 on every rank."""
    check = torch.ones(1) * (rank + 1)
    dist.all_reduce(check)
    out[f"{name}_group"] = check.numpy()


def ddp_reference_grads(out: dict, name: str, x, y) -> None:
    ddp = DDP(Net(), find_unused_parameters=True)  # (extra and never are unused)
    ddp(x, y).backward()
    save(out, f"{name}_ddp", grads(ddp.module))


# ---------------------------------------------------------------- item 1: two reducers
def ddp_wrapper_given(out: dict, rank: int, world: int) -> None:
    """``net = DDP(model); gm = data_parallel(net)``: refused at once, before any collective."""
    net = DDP(Net())
    out["given_error"] = error_text(lambda: make_gm(net))
    group_works(out, "given", rank)


def _through_ddp(out: dict, name: str, rank: int, world: int, ddp_first: bool) -> None:
    """A DDP wrapper around the data-parallel module, trained through: refused at the forward
    on every rank; no gradient written."""
    model = Net()
    if ddp_first:
        net = DDP(model)
        gm = make_gm(model)  # the inner module, as a user who keeps DDP might
    else:
        gm = make_gm(model)
        net = DDP(model)
    x, y = local_batch(0, rank, world)
    with torch.no_grad():  # an evaluation through the wrapper: nothing to reduce, fine
        out[f"{name}_eval"] = net(x, y).numpy()

    def step() -> None:
        with gm:
            gm.backward(net(x, y))

    out[f"{name}_error"] = error_text(step)
    save(out, f"{name}_g", grads(model))
    out[f"{name}_no_grad"] = np.array(all(p.grad is None for p in model.parameters()))
    group_works(out, name, rank)


def ddp_around_after(out: dict, rank: int, world: int) -> None:
    _through_ddp(out, "around_after", rank, world, ddp_first=False)


def ddp_around_before(out: dict, rank: int, world: int) -> None:
    _through_ddp(out, "around_before", rank, world, ddp_first=True)


def ddp_inside(out: dict, rank: int, world: int) -> None:
    """A DDP wrapper around a submodule (``model.mlp = DDP(model.mlp)``): given to
    ``data_parallel``, refused at once (``inside_given_error``); put in after it, refused at
    the forward (``inside_after_error``), no gradient written. (Old code: that submodule's
    gradients were twice DDP's, silently.) Unwrapped again, a step equals DDP's."""
    model = Net()
    model.mlp = DDP(model.mlp)
    out["inside_given_error"] = error_text(lambda: make_gm(model))
    model.mlp = model.mlp.module
    gm = make_gm(model)
    model.mlp = DDP(model.mlp)
    x, y = local_batch(0, rank, world)

    def step() -> None:
        with gm:
            gm.backward(model(x, y))

    out["inside_after_error"] = error_text(step)
    out["inside_after_no_grad"] = np.array(all(p.grad is None for p in model.parameters()))
    model.mlp = model.mlp.module
    step()
    if not SHARD:  # (sharded: .grad holds no values after the step)
        save(out, "inside_next_gm", grads(model))
        ddp_reference_grads(out, "inside_next", x, y)
    group_works(out, "inside", rank)


# ---------------------------------------------------------------- item 2: `with gm:` forgotten
def forgotten_recording(out: dict, rank: int, world: int) -> None:
    """``loss = model(x); loss.backward()`` without ``with gm:`` raises on every rank and
    writes no gradient; evaluation forwards (no_grad, or grad enabled and never backwarded)
    work; a correct step afterwards equals DDP's."""
    model = Net()
    gm = make_gm(model)
    x, y = local_batch(0, rank, world)
    with torch.no_grad():
        out["forgot_eval"] = model(x, y).numpy()
    model(x, y)  # with gradients, never backwarded: legal

    def habit() -> None:
        model(x, y).backward()

    out["forgot_error"] = error_text(habit)
    out["forgot_no_grad"] = np.array(all(p.grad is None for p in model.parameters()))
    model.zero_grad(set_to_none=True)
    with gm:
        gm.backward(model(x, y))
    if not SHARD:
        save(out, "forgot_after_gm", grads(model))
        ddp_reference_grads(out, "forgot_after", x, y)
    group_works(out, "forgot", rank)


def another_models_step(out: dict, rank: int, world: int) -> None:
    """A GAN's generator step: ``gen``'s manager backwards through ``disc``'s forward, which
    ran outside ``disc``'s recording. Legal: that backward computes no gradient of ``disc``'s
    parameters. Then ``disc``'s own step works."""
    torch.manual_seed(3)
    gen, disc = nn.Linear(6, 4), nn.Linear(4, 1)
    gm_gen, gm_disc = make_gm(gen), make_gm(disc)
    x, _ = local_batch(0, rank, world)

    def gen_step() -> None:
        with gm_gen:
            gm_gen.backward(disc(gen(x)).mean())

    out["gan_error"] = error_text(gen_step)
    out["gan_disc_no_grad"] = np.array(all(p.grad is None for p in disc.parameters()))
    with gm_disc:
        gm_disc.backward(disc(gen(x).detach()).mean())
    out["gan_disc_grad"] = np.array(all(p.grad is not None for p in disc.parameters())
                                    or SHARD)
    group_works(out, "gan", rank)


# ---------------------------------------------------------------- item 6: evaluation
class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(),
                                  nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def evaluation_after_training(out: dict, rank: int, world: int) -> None:
    """Three SGD steps (the second a no_sync micro-batch), then evaluation: every rank's
    outputs and buffers equal DDP's bit for bit; eval mode and train mode under no_grad, on
    every rank, then on rank 0 alone (DDP: ``ddp.module``), then one more training step."""
    ours, theirs = BNNet(), BNNet()
    gm = make_gm(ours)
    ddp = DDP(theirs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(4):
        x, y = local_batch(step, rank, world)
        with no_sync(gm) if step == 1 else _Null(), gm:
            gm.backward(((ours(x) - y) ** 2).mean())
        with ddp.no_sync() if step == 1 else _Null():
            ((ddp(x) - y) ** 2).mean().backward()
        if step != 1:
            if SHARD:  # the shards hold the reduced gradients; compare parameters instead
                for p in ours.parameters():
                    p.grad = None
                opts[0].zero_grad()
            for opt in opts[1:] if SHARD else opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
        if SHARD:
            with torch.no_grad():  # keep the two models' parameters equal: buffers are tested
                for mine, ref in zip(ours.parameters(), theirs.parameters()):
                    mine.copy_(ref)
    x, y = local_batch(5, rank, world)
    for mode in ("eval", "train"):
        for m in (ours, ddp):
            m.train(mode == "train")
        with torch.no_grad():
            for i in range(2):  # two forwards: DDP syncs at the first only
                out[f"eval_{mode}{i}_gm"] = ours(x).numpy()
                out[f"eval_{mode}{i}_ddp"] = ddp(x).numpy()
        save(out, f"eval_{mode}_buf_gm", [b.numpy().copy() for b in ours.buffers()])
        save(out, f"eval_{mode}_buf_ddp", [b.numpy().copy() for b in theirs.buffers()])
    ours.eval()
    theirs.eval()
    if rank == 0:  # rank 0 alone: DDP users call ddp.module there, which takes no collective
        with torch.no_grad():
            out["eval_alone_gm"] = ours(x).numpy()
            out["eval_alone_ddp"] = ddp.module(x).numpy()
    ours.train()
    ddp.train()
    x, y = local_batch(6, rank, world)
    with gm:
        gm.backward(((ours(x) - y) ** 2).mean())
    ((ddp(x) - y) ** 2).mean().backward()
    if not SHARD:
        save(out, "eval_next_gm", grads(ours))
        save(out, "eval_next_ddp", grads(theirs))
    group_works(out, "eval", rank)


SCENARIOS = {f.__name__: f for f in (
    ddp_wrapper_given, ddp_around_after, ddp_around_before, ddp_inside, forgotten_recording,
    another_models_step, evaluation_after_training,
)}


def main(rank: int, world: int, outdir: str) -> None:
    run_named(SCENARIOS, rank, world, outdir)
