"""Rank program for the PyTorch checks: gradmgr + allreduce callback next to DDP.

Every scenario writes its gradients into one dict saved as ``rank{rank}.npz``; the parent
test compares them with single-process references, with DDP, and across ranks.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr import GradManager
from gradmgr.distributed import (
    RankFailedError,
    RankMismatchError,
    broadcast,
    data_parallel,
    make_allreduce_cb,
    no_sync,
)

from .data import batch, shard, weights


class Net(nn.Module):
    """The MLP of data.py, plus ``extra`` (used only when asked) and ``never`` (never used)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3)
        )
        with torch.no_grad():
            for p, w in zip(self.mlp.parameters(), weights()):
                p.copy_(torch.from_numpy(w))
        self.extra = nn.Parameter(torch.linspace(-1.0, 1.0, 4))
        self.never = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        loss = ((self.mlp(x) - y) ** 2).mean()
        if use_extra:
            loss = loss + 0.5 * (self.extra**2).sum()
        return loss


def local_batch(step: int, rank: int, world: int) -> tuple:
    x, y = batch(step)
    return torch.from_numpy(shard(x, rank, world)), torch.from_numpy(shard(y, rank, world))


def grads(module: nn.Module) -> list:
    return [None if p.grad is None else p.grad.detach().numpy().copy()
            for p in module.parameters()]


def save(out: dict, prefix: str, values: list) -> None:
    for i, v in enumerate(values):
        if v is not None:
            out[f"{prefix}{i}"] = v


def ddp_step_and_save(out: dict, name: str, net_gm: Net, ddp: DDP, x, y) -> None:
    """DDP's backward of the same batch; both models' gradients saved as ``{name}_gm{i}`` and
    ``{name}_ddp{i}``, then dropped (zero_grad with set_to_none)."""
    ddp(x, y).backward()
    save(out, f"{name}_gm", grads(net_gm))
    save(out, f"{name}_ddp", grads(ddp.module))
    for m in (net_gm, ddp.module):
        m.zero_grad(set_to_none=True)


def gm_step(net: Net, cb, rank: int, world: int, step: int = 0, use_extra: bool = False):
    gm = GradManager().attach(net.parameters(), callbacks=[cb])
    x, y = local_batch(step, rank, world)
    with gm:
        gm.backward(net(x, y, use_extra))
    return gm


def ddp_step(rank: int, world: int, step: int = 0, use_extra: bool = False, **kw) -> list:
    net = Net()
    ddp = DDP(net, **kw)
    x, y = local_batch(step, rank, world)
    ddp(x, y, use_extra).backward()
    return grads(net)


def train(out: dict, rank: int, world: int) -> None:
    """Three SGD steps, gradmgr and DDP side by side; first-step grads and final params."""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    cb = make_allreduce_cb("mean")
    gm = GradManager().attach(net_gm.parameters(), callbacks=[cb])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net_gm, net_ddp)]
    for step in range(3):
        x, y = local_batch(step, rank, world)
        with gm:
            gm.backward(net_gm(x, y))
        ddp(x, y).backward()
        if step == 0:
            # which path reduced: torch's C++ reducer, or gradmgr's buckets
            # (GRADMGR_NATIVE_REDUCER=0, see test_distributed.torch_ranks)
            out["native"] = np.array(cb.path(gm) == "reducer")
            save(out, "mean_g", grads(net_gm))
            save(out, "ddp_g", grads(net_ddp))
            out["mean_dtypes"] = np.array([str(p.grad.dtype) for p in net_gm.parameters()
                                           if p.grad is not None])
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    # on the reducer's path the tape's hooks are gone: not even an empty dict that the engine
    # would call into Python for, per parameter and step
    out["hooks_left"] = np.array(sum(p._backward_hooks is not None for p in net_gm.parameters()))
    save(out, "train_gm_p", [p.detach().numpy().copy() for p in net_gm.parameters()])
    save(out, "train_ddp_p", [p.detach().numpy().copy() for p in net_ddp.parameters()])


def reduce_variants(out: dict, rank: int, world: int) -> None:
    net = Net()
    gm_step(net, make_allreduce_cb("sum"), rank, world)
    save(out, "sum_g", grads(net))
    for name, size in (("small", 200), ("one", 2**30)):
        net, cb = Net(), make_allreduce_cb("mean", bucket_bytes=size)
        gm = gm_step(net, cb, rank, world)
        save(out, f"{name}_g", grads(net))
        out[f"{name}_nbuckets"] = np.array(len(cb.buckets(gm)))
    for comp in ("fp16", "bf16"):
        net = Net()
        gm_step(net, make_allreduce_cb("mean", compression=comp), rank, world)
        save(out, f"{comp}_g", grads(net))


def arrival_order(out: dict, rank: int, world: int) -> None:
    """Ranks build the same terms in opposite orders, so gradients arrive in opposite orders;
    one bucket per tensor makes a launch-order mismatch fail loudly."""
    pa, pb, pc = (torch.linspace(0.1, 1.0, n, requires_grad=True) for n in (5, 7, 3))
    arrived = []
    gm = GradManager().attach(
        [pa, pb, pc],
        callbacks=[lambda t, g: (arrived.append(len(t)), g)[1],
                   make_allreduce_cb("mean", bucket_bytes=1)],
    )
    k = float(rank + 1)
    with gm:
        terms = [lambda: (torch.sin(pa) * k).sum(), lambda: (pb**2 * k).sum(),
                 lambda: (pc * k).sum()]
        values = [f() for f in (terms if rank == 0 else terms[::-1])]
        gm.backward(values[0] + values[1] + values[2])
    out["order_arrived"] = np.array(arrived)
    save(out, "order_g", [pa.grad.numpy(), pb.grad.numpy(), pc.grad.numpy()])
    save(out, "order_p", [pa.detach().numpy(), pb.detach().numpy(), pc.detach().numpy()])


def unused(out: dict, rank: int, world: int) -> None:
    """``extra`` is used on rank 0 only; ``never`` on no rank."""
    for name, size in (("unused", 25 * 2**20), ("unused_small", 1)):
        net = Net()
        gm_step(net, make_allreduce_cb("mean", bucket_bytes=size), rank, world,
                use_extra=rank == 0)
        save(out, f"{name}_g", grads(net))
    save(out, "unused_ddp_g", ddp_step(rank, world, use_extra=rank == 0,
                                        find_unused_parameters=True))
    # A rank with nothing to differentiate still takes part (bind first: cb never ran there).
    net, cb = Net(), make_allreduce_cb("mean")
    gm = GradManager().attach(net.mlp.parameters(), callbacks=[cb])
    x, y = local_batch(0, rank, world)
    if rank == 0:
        with gm:
            gm.backward(net(x, y))
        local = Net()
        local(x, y).backward()
        save(out, "noout_local", grads(local.mlp))
    else:
        cb.bind(gm)
        with gm:
            gm.backward()
    save(out, "noout_g", grads(net.mlp))


def accumulation(out: dict, rank: int, world: int) -> None:
    """Two rounds of 3 micro-batches, the first 2 under no_sync, gradmgr vs DDP.no_sync."""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    cb = make_allreduce_cb("mean", bucket_bytes=300)
    gm = GradManager().attach(net_gm.parameters(), callbacks=[cb])
    for rnd in range(2):
        for micro in range(3):
            x, y = local_batch(3 * rnd + micro, rank, world)
            sync = micro == 2
            with cb.no_sync() if not sync else _null(), gm:
                gm.backward(net_gm(x, y, use_extra=micro == 0))
            with ddp.no_sync() if not sync else _null():
                ddp(x, y, use_extra=micro == 0).backward()
            if rnd == 0 and micro == 0:
                save(out, "nosync_first_gm", grads(net_gm))
                save(out, "nosync_first_ddp", grads(net_ddp))
        save(out, f"nosync_r{rnd}_gm", grads(net_gm))
        save(out, f"nosync_r{rnd}_ddp", grads(net_ddp))
        for m in (net_gm, net_ddp):
            m.zero_grad(set_to_none=True)


def accumulation_manager_switch(out: dict, rank: int, world: int) -> None:
    """The same rounds with the manager-level switch (no handle on the callback) and the
    one-call set-up; .grad must be bit-identical to DDP's on every rank."""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    gm = data_parallel(net_gm, bucket_bytes=300)
    for micro in range(3):
        x, y = local_batch(micro, rank, world)
        with no_sync(gm) if micro < 2 else _null(), gm:
            gm.backward(net_gm(x, y, use_extra=micro == 0))
        with ddp.no_sync() if micro < 2 else _null():
            ddp(x, y, use_extra=micro == 0).backward()
    save(out, "switch_gm", grads(net_gm))
    save(out, "switch_ddp", grads(net_ddp))


def attached_input(out: dict, rank: int, world: int) -> None:
    """An input with requires_grad=True, not a parameter, a new tensor each step, attached to
    data_parallel()'s manager before the recording (step 0) and inside it (step 1), next to
    DDP: the parameters' gradients and the input's (``{name}_gm``/``_ddp``, the input last)."""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    gm = data_parallel(net_gm)
    for step in range(2):
        x, y = local_batch(step, rank, world)
        x_gm, x_ddp = x.clone().requires_grad_(), x.clone().requires_grad_()
        if step == 0:
            gm.attach(x_gm)
        with gm:
            if step == 1:
                gm.attach(x_gm)
            gm.backward(net_gm(x_gm, y))
        ddp(x_ddp, y).backward()
        save(out, f"input{step}_gm", grads(net_gm) + [x_gm.grad.numpy()])
        save(out, f"input{step}_ddp", grads(net_ddp) + [x_ddp.grad.numpy()])
        for m in (net_gm, net_ddp):
            m.zero_grad(set_to_none=True)


def initial_sync(out: dict, rank: int, world: int) -> None:
    """Ranks start from different weights (and BatchNorm statistics): the callback's first
    record() and data_parallel() broadcast rank 0's, as DDP does when it wraps a model; three
    AdamW steps then match DDP bit for bit."""
    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))

    def perturbed_stats(m: nn.Module) -> nn.Module:
        with torch.no_grad():
            m[1].running_mean.add_(rank + 1.0)
        return m

    by_hand, one_call = perturbed_stats(model(100 + rank)), perturbed_stats(model(100 + rank))
    reference = perturbed_stats(model(100 + rank))
    ddp = DDP(reference)
    gm_hand = GradManager().attach(by_hand.parameters(), callbacks=[make_allreduce_cb("mean")])
    broadcast(by_hand.buffers())  # the by-hand recipe broadcasts buffers once itself
    gm_one = data_parallel(one_call)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
            for m in (by_hand, one_call, reference)]
    for step in range(3):
        x, y = local_batch(step, rank, world)
        for m, gm in ((by_hand, gm_hand), (one_call, gm_one)):
            with gm:
                gm.backward(((m(x) - y) ** 2).mean())
        ((ddp(x) - y) ** 2).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for name, m in (("sync_hand", by_hand), ("sync_one", one_call), ("sync_ddp", reference)):
        save(out, f"{name}_p", [p.detach().numpy().copy() for p in m.parameters()])
        save(out, f"{name}_b", [b.detach().numpy().copy() for b in m.buffers()
                                if b.dtype.is_floating_point])


def mismatches(out: dict, rank: int, world: int) -> None:
    """Ranks that attach different tensors get a clear error on every rank, no crash, no hang,
    no swapped gradients; the process group still works afterwards."""
    a, b = torch.ones(4, requires_grad=True), torch.ones(6, requires_grad=True)
    cases = {
        "swapped": lambda: [a, b] if rank == 0 else [b, a],
        "shapes": lambda: list(nn.Linear(4, 4 if rank == 0 else 5).parameters()),
        "freeze": lambda: _frozen_on_rank_1(rank),
        # nothing trainable on rank 1: it took no part in the check, and gloo aborted
        "all_frozen": lambda: [torch.ones(3, requires_grad=rank == 0)],
    }

    def step_error(gm: GradManager, held: list) -> np.ndarray:
        try:
            with gm:
                gm.backward(sum((t * 1.0).sum() for t in held))
            return np.array("no error")
        except RankMismatchError as exc:
            return np.array(str(exc))

    for name, tensors in cases.items():
        held = tensors()  # the manager holds tensors weakly
        gm = GradManager().attach(held, callbacks=[make_allreduce_cb("mean")])
        out[f"mismatch_{name}"] = step_error(gm, held)
    # The same tensors, but rank 0 has an after-backward callback of its own: there the
    # gradients must go through gradmgr's buckets, elsewhere they may go to torch's reducer.
    held = [a, b]
    gm = GradManager().attach(held, callbacks=[make_allreduce_cb("mean")])
    if rank == 0:
        gm.register_after_backward_callback(lambda: None)
    out["mismatch_paths"] = step_error(gm, held)
    # The same tensors, but callbacks made with different options: mean on one rank and sum
    # on the other gave every rank a wrong gradient, fp16 against bf16 summed bit patterns,
    # and different bucket sizes crashed gloo (SIGABRT) on gradmgr's buckets.
    options = {
        "reduce": ({"reduce": "mean"}, {"reduce": "sum"}),
        "compression": ({"compression": "fp16"}, {"compression": "bf16"}),
        "bucket_bytes": ({"bucket_bytes": 2**20, "native": False},
                         {"bucket_bytes": 16, "native": False}),
    }
    for name, per_rank in options.items():
        gm = GradManager().attach(held, callbacks=[make_allreduce_cb(**per_rank[rank % 2])])
        out[f"mismatch_option_{name}"] = step_error(gm, held)
    check = torch.ones(1) * (rank + 1)
    dist.all_reduce(check)
    out["mismatch_after"] = check.numpy()


def hooks_and_split(out: dict, rank: int, world: int) -> None:
    """Steps that need the per-tensor path between plain ones, next to DDP: a split backward
    (step 1), and a post-accumulate-grad hook registered after some steps (optimizer in
    backward), which must see the reduced gradient, as it does after ``loss.backward()``
    under DDP."""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    cb = make_allreduce_cb("mean")
    gm = GradManager().attach(net_gm.parameters(), callbacks=[cb])
    seen = {}
    paths = []
    for step in range(4):
        x, y = local_batch(step, rank, world)
        if step == 2:
            weight = net_gm.mlp[0].weight
            def keep(p: torch.Tensor) -> None:
                seen[len(paths)] = p.grad.detach().clone()

            weight.register_post_accumulate_grad_hook(keep)
        with gm:
            if step == 1:
                x = x.clone()
                gm.attach(x)  # an input, attached without callbacks while recording
                gm.backward_split(net_gm(x, y), first=[x]).finish()
            else:
                gm.backward(net_gm(x, y))
        paths.append(cb.path(gm) == "reducer")
        ddp_step_and_save(out, f"mixed{step}", net_gm, ddp, x, y)
    out["mixed_paths"] = np.array(paths)
    out["mixed_hook_steps"] = np.array(sorted(seen))
    for step, grad in seen.items():
        out[f"mixed_hook{step}"] = grad.numpy()


def kept_gradients(out: dict, rank: int, world: int) -> None:
    """``.grad`` kept between steps (``zero_grad(set_to_none=False)``, and two synced
    backwards per optimizer step) while ``extra`` is used on rank 0 only at step 0 and by no
    rank at step 1: every step bit-identical to DDP's on every rank. (On the reducer's path
    every .grad is a view of one bucket, and views share one version counter: a change to
    one looked like a gradient for all, and the unused tensor's bucket never went out.)"""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    gm = GradManager().attach(net_gm.parameters(), callbacks=[make_allreduce_cb("mean")])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net_gm, net_ddp)]
    for step in range(4):
        for micro in range(2):
            x, y = local_batch(2 * step + micro, rank, world)
            use = step == 0 and rank == 0
            with gm:
                gm.backward(net_gm(x, y, use_extra=use))
            ddp(x, y, use_extra=use).backward()
            save(out, f"kept{step}{micro}_gm", grads(net_gm))
            save(out, f"kept{step}{micro}_ddp", grads(net_ddp))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=False)


def replan_inside_window(out: dict, rank: int, world: int) -> None:
    """The plan changes between no_sync micro-batches (``never`` is frozen on every rank):
    ``extra``, used on rank 0 in the first micro-batch only, must still be reduced."""
    net = Net()
    gm = GradManager().attach(net.parameters(), callbacks=[make_allreduce_cb("mean")])
    for micro in range(3):
        x, y = local_batch(micro, rank, world)
        if micro == 2:
            net.never.requires_grad_(False)
        with no_sync(gm) if micro < 2 else _null(), gm:
            gm.backward(net(x, y, use_extra=micro == 0 and rank == 0))
    out["replan_extra_g"] = net.extra.grad.numpy().copy()


def sparse(out: dict, rank: int, world: int) -> None:
    """A sparse gradient is refused clearly on both paths; dense steps work afterwards."""
    emb = nn.Embedding(10, 4, sparse=True)
    gm = GradManager().attach(emb.parameters(), callbacks=[make_allreduce_cb("mean")])
    try:
        with gm:
            gm.backward(emb(torch.tensor([1, 2, 2])).sum())
        out["sparse_error"] = np.array("no error")
    except TypeError as exc:
        out["sparse_error"] = np.array(f"{type(exc).__name__}: {exc}")
    out["sparse_grad_is_none"] = np.array(emb.weight.grad is None)
    with gm:
        gm.backward(F.embedding(torch.tensor([1, 2, 2]), emb.weight).sum())
    out["sparse_then_dense_g"] = emb.weight.grad.numpy().copy()


def recovery(out: dict, rank: int, world: int) -> None:
    """A backward that raises midway (on every rank) leaves nothing behind: the next steps
    equal DDP's."""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    gm = GradManager().attach(net_gm.parameters(), callbacks=[make_allreduce_cb("mean")])

    def fail(grad):
        raise ValueError("a hook failed")

    handle = net_gm.mlp[0].weight.register_hook(fail)
    x, y = local_batch(0, rank, world)
    try:
        with gm:
            gm.backward(net_gm(x, y))
        out["recovery_raised"] = np.array(False)
    except ValueError:
        out["recovery_raised"] = np.array(True)
    handle.remove()
    net_gm.zero_grad(set_to_none=True)
    for step in range(2):
        x, y = local_batch(step, rank, world)
        with gm:
            gm.backward(net_gm(x, y))
        ddp_step_and_save(out, f"recovery{step}", net_gm, ddp, x, y)


def one_rank_fails(out: dict, rank: int, world: int) -> None:
    """A backward that raises on one rank only, on gradmgr's buckets (small ones, so some go
    out before the failure): that rank launched the step's other buckets marked failed, so
    the other rank raised RankFailedError instead of pairing this step with the failed rank's
    next one (every later gradient silently wrong). Nobody's .grad changed; the steps after
    equal DDP's."""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    cb = make_allreduce_cb("mean", bucket_bytes=64, native=False)
    gm = GradManager().attach(net_gm.parameters(), callbacks=[cb])
    failing = [False]

    def maybe_fail(grad):
        if failing[0]:
            raise ValueError("a hook failed on this rank")
        return grad

    net_gm.mlp[0].weight.register_hook(maybe_fail)  # the first layer: its gradient comes last
    errors, kept = [], True
    for step in range(4):
        failing[0] = step == 1 and rank == 1
        x, y = local_batch(step, rank, world)
        try:
            with gm:
                gm.backward(net_gm(x, y))
            errors.append("none")
        except (ValueError, RankFailedError) as exc:
            errors.append(type(exc).__name__)
            kept = kept and all(p.grad is None for p in net_gm.parameters())
        if step != 1:
            ddp_step_and_save(out, f"onefail{step}", net_gm, ddp, x, y)
    out["onefail_errors"] = np.array(errors)
    out["onefail_grad_kept"] = np.array(kept)


def one_rank_changes_plan(out: dict, rank: int, world: int) -> None:
    """After a step, rank 1 alone freezes a parameter, attaches a new tensor, or registers a
    post-accumulate-grad hook (which takes it off torch's reducer). Its plan check used to be
    a collective on that rank only, which met the other rank's gradient buckets: gloo aborted,
    or gradients were silently wrong. Now the next step raises RankMismatchError on every rank
    and changes no .grad; once the ranks agree again (rank 1 undoes it, or rank 0 does the
    same), the steps equal DDP's."""
    net_gm, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    cb = make_allreduce_cb("mean")
    gm = GradManager().attach(net_gm.parameters(), callbacks=[cb])
    weight = net_gm.mlp[2].weight
    new = torch.ones(5, requires_grad=True)
    hooks: list = []

    def hook() -> None:
        hooks.append(weight.register_post_accumulate_grad_hook(lambda p: None))

    cases = {  # name: (what rank 1 does alone, then what makes the ranks agree again)
        "freeze": (lambda: weight.requires_grad_(False), lambda: weight.requires_grad_(True)),
        "attach": (lambda: gm.attach(new, callbacks=[cb]),
                   lambda: rank == 0 and gm.attach(new, callbacks=[cb])),
        "hook": (hook, lambda: rank == 0 and hook()),
    }
    step = 0
    for name, (change, agree) in cases.items():
        errors = []
        for phase in range(3):
            if phase == 1 and rank == 1:
                change()
            if phase == 2:
                agree()
            x, y = local_batch(step, rank, world)
            step += 1
            try:
                with gm:
                    gm.backward(net_gm(x, y))
                errors.append("none")
            except RankMismatchError as exc:
                errors.append(str(exc))
                out[f"replan_{name}_kept"] = np.array(
                    all(p.grad is None for p in net_gm.parameters()))
                continue
            ddp_step_and_save(out, f"replan_{name}{phase}", net_gm, ddp, x, y)
        out[f"replan_{name}_errors"] = np.array(errors)
    for handle in hooks:
        handle.remove()
    check = torch.ones(1) * (rank + 1)
    dist.all_reduce(check)
    out["replan_after"] = check.numpy()


def first_step_refused(out: dict, rank: int, world: int) -> None:
    """The ranks disagree at the very first step (rank 1 has one more trainable tensor): it is
    refused on both; once they agree, the first broadcast still happens (w starts as 1 on
    rank 0 and 2 on rank 1)."""
    w = torch.full((3,), float(rank + 1), requires_grad=True)
    extra = torch.ones(2, requires_grad=rank == 1)
    gm = GradManager().attach([w, extra], callbacks=[make_allreduce_cb("mean")])
    errors = []
    for _ in range(2):
        try:
            with gm:
                gm.backward((w * w).sum())
            errors.append("none")
        except RankMismatchError:
            errors.append("mismatch")
        extra.requires_grad_(False)
    out["first_refused_errors"] = np.array(errors)
    out["first_refused_w"] = w.detach().numpy().copy()
    out["first_refused_g"] = w.grad.numpy().copy()


class _Fp16Transport:
    """A user's transport that sends fp16 (lossy): the plan check must still pass."""

    def world_size(self) -> int:
        return dist.get_world_size()

    def rank(self) -> int:
        return dist.get_rank()

    def allreduce_async(self, flat):
        half = flat.half()
        work = dist.all_reduce(half, async_op=True)

        class Handle:
            def wait(self_inner):
                work.wait()
                return half.to(flat.dtype)

        return Handle()


def custom_transports(out: dict, rank: int, world: int) -> None:
    net = Net()
    gm = GradManager().attach(net.mlp.parameters(),
                              callbacks=[make_allreduce_cb("mean", transport=_Fp16Transport())])
    x, y = local_batch(0, rank, world)
    with gm:
        gm.backward(net(x, y))
    save(out, "fp16t_g", grads(net.mlp))


def _frozen_on_rank_1(rank: int) -> list:
    net = Net()
    if rank == 1:
        net.mlp[2].weight.requires_grad_(False)
    return list(net.mlp.parameters())


def frozen(out: dict, rank: int, world: int) -> None:
    """A parameter frozen after attaching (on every rank) is left out: no .grad, and AdamW's
    weight decay leaves it alone; unfreezing brings it back in."""
    net = Net()
    gm = GradManager().attach(net.mlp.parameters(), callbacks=[make_allreduce_cb("mean")])
    opt = torch.optim.AdamW(net.mlp.parameters(), lr=0.1, weight_decay=0.5)
    frozen_bias = net.mlp[0].bias
    before = frozen_bias.detach().clone()
    x, y = local_batch(0, rank, world)
    with gm:
        gm.backward(net(x, y))
    frozen_bias.requires_grad_(False)
    opt.zero_grad()
    with gm:
        gm.backward(net(x, y))
    out["frozen_grad_is_none"] = np.array(frozen_bias.grad is None)
    opt.step()
    out["frozen_moved"] = np.array(not torch.equal(frozen_bias.detach(), before))
    frozen_bias.requires_grad_(True)
    opt.zero_grad()
    with gm:
        gm.backward(net(x, y))
    save(out, "unfrozen_g", grads(net.mlp))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(rank: int, world: int, outdir: str) -> None:
    out: dict = {}
    train(out, rank, world)
    reduce_variants(out, rank, world)
    arrival_order(out, rank, world)
    unused(out, rank, world)
    accumulation(out, rank, world)
    accumulation_manager_switch(out, rank, world)
    attached_input(out, rank, world)
    initial_sync(out, rank, world)
    mismatches(out, rank, world)
    recovery(out, rank, world)
    one_rank_fails(out, rank, world)
    one_rank_changes_plan(out, rank, world)
    first_step_refused(out, rank, world)
    kept_gradients(out, rank, world)
    sparse(out, rank, world)
    replan_inside_window(out, rank, world)
    hooks_and_split(out, rank, world)
    frozen(out, rank, world)
    custom_transports(out, rank, world)
    dist.barrier()
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **out)
