"""Rank program: the in-place habits of DDP scripts on ``.grad`` after a sharded backward
(``data_parallel(model, shard=True)``): each rank applies them to its slices of the stand-in
``.grad``; next to DDP doing the same to its ``.grad`` in the same ranks. Each rank pickles,
per habit, the parameters after two SGD steps (ours and DDP's) or the error, and the errors of
the calls that must still raise, to ``OUTDIR/rank{RANK}.pkl``.
"""

from __future__ import annotations

import copy
import os
import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import ShardedOptimizer, data_parallel

from .outcomes import raised
from .shard_grad_metadata import backward_both, loss_of, model

VALUE = 0.02  # clips part of the gradients: the parent checks that DDP's clamps change some


def same_noise(grad: torch.Tensor, step: int, i: int) -> torch.Tensor:
    """The same noise of the gradient's shape on every rank (a shared seed), as DP-SGD adds."""
    g = torch.Generator().manual_seed(100 * step + i)
    return torch.randn(grad.shape, generator=g, dtype=torch.float64).to(grad.dtype) * 0.01


def poisoned(grad: torch.Tensor, step: int, i: int) -> torch.Tensor:
    noise = same_noise(grad, step, i).flatten()
    noise[::3], noise[1::7], noise[2::11] = float("nan"), float("inf"), float("-inf")
    return noise.reshape(grad.shape)


def each(change):
    """A habit that calls ``change(grad, step, i)`` on every parameter's ``.grad``."""
    def habit(params, step):
        for i, p in enumerate(params):
            change(p.grad, step, i)
    return habit


def divide_in_place(grad, step, i):
    grad /= torch.tensor(3.0)


def augmented(grad, step, i):
    grad *= 3
    grad += same_noise(grad, step, i)
    grad -= 0.001


def foreach_forms(params, step):
    grads = [p.grad for p in params]
    torch._foreach_mul_(grads, [0.5 + i for i in range(len(grads))])
    torch._foreach_sub_(grads, [same_noise(g, step, i) for i, g in enumerate(grads)], alpha=0.5)
    torch._foreach_clamp_max_(grads, VALUE)


def own_noise(grad, step, i):
    """Noise drawn from each rank's own seed: DDP's ranks then drift apart."""
    grad.add_(same_noise(grad, step + 10 * dist.get_rank(), i))


def foreach_add_noise(params, step):
    grads = [p.grad for p in params]
    torch._foreach_add_(grads, [same_noise(g, step, i) for i, g in enumerate(grads)])


# Habit name -> fn(params, step), applied after the synced backward, before the step.
HABITS = {
    "div_(3)": each(lambda g, step, i: g.div_(3)),
    "/= 0-dim tensor": each(divide_in_place),
    "clip_grad_value_": lambda params, step: nn.utils.clip_grad_value_(params, VALUE),
    "clip_grad_value_ foreach": lambda params, step: nn.utils.clip_grad_value_(
        params, VALUE, foreach=True),
    "clamp_min_ clamp_max_": each(lambda g, step, i: g.clamp_min_(-VALUE).clamp_max_(VALUE)),
    "clip_": each(lambda g, step, i: g.clip_(-VALUE, VALUE)),
    "add_ noise": each(lambda g, step, i: g.add_(same_noise(g, step, i))),
    "sub_ noise alpha": each(lambda g, step, i: g.sub_(same_noise(g, step, i), alpha=0.5)),
    "_foreach_add_ noise": foreach_add_noise,
    "_foreach_div_": lambda params, step: torch._foreach_div_([p.grad for p in params], 4.0),
    "*= += -=": each(augmented),
    "_foreach_mul_ _sub_ _clamp_max_": foreach_forms,
    "_foreach_zero_": lambda params, step: torch._foreach_zero_([p.grad for p in params]),
    "mul_ mask": each(lambda g, step, i: g.mul_(same_noise(g, step, i) > 0)),
    "nan_to_num_": each(lambda g, step, i: g.add_(poisoned(g, step, i)).nan_to_num_(
        nan=0.0, posinf=1.0, neginf=-1.0)),
}


def clipped(params) -> int:
    """How many elements of DDP's gradients clip_grad_value_ at VALUE changes."""
    return int(sum((p.grad.abs() > VALUE).sum() for p in params))


def run(habit, rank: int) -> dict:
    net, theirs = model(), model()
    gm = data_parallel(net, shard=True, bucket_bytes=300)
    opt = ShardedOptimizer(gm, torch.optim.SGD, lr=0.1, momentum=0.9)
    ddp = DDP(theirs)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    out: dict = {"clipped": []}
    for step in range(2):
        backward_both(gm, net, ddp, step, rank)
        out["clipped"].append(clipped(list(theirs.parameters())))
        habit(list(theirs.parameters()), step)
        error = raised(lambda step=step: habit(list(net.parameters()), step))
        if error is not None:
            out["error"] = error
            break
        for o in (opt, ref):
            o.step()
            o.zero_grad()
    out["params"] = ([p.detach().clone() for p in net.parameters()],
                     [p.detach().clone() for p in theirs.parameters()])
    del opt, gm
    return out


def refused(rank: int) -> dict:
    """Calls a slice cannot answer as DDP's .grad would: still a clear error on every rank."""
    net = model()
    gm = data_parallel(net, shard=True, bucket_bytes=300)
    opt = ShardedOptimizer(gm, torch.optim.SGD, lr=0.1)
    with gm:
        gm.backward(loss_of(net, torch.randn(5, 8)))
    first, second = (p.grad for p in list(net.parameters())[:2])
    out = {
        "another .grad": raised(lambda: first.add_(first)),
        "into a plain tensor": raised(lambda: torch.zeros(16, 8).add_(first)),
        "wrong shape": raised(lambda: first.add_(torch.ones(5))),
        "foreach wrong shape": raised(lambda: torch._foreach_add_([first, second],
                                                                  [torch.ones(5)] * 2)),
        "abs_()": raised(lambda: first.abs_()),
        "copy_()": raised(lambda: first.copy_(torch.zeros(16, 8))),
    }
    opt.zero_grad()
    del opt, gm
    return out


SIXTEEN_BIT = ("div_(3)", "/= 0-dim tensor", "clip_grad_value_", "add_ noise", "mul_ mask",
               "nan_to_num_", "_foreach_div_", "_foreach_add_ noise")


def sixteen_bit(rank: int) -> dict:
    """bfloat16 gradients: each rank's slices (``to_local()``) after each habit of SIXTEEN_BIT,
    next to DDP's ``.grad``'s elements there; then what stays refused (an ``alpha``)."""
    out: dict = {}
    for name in SIXTEEN_BIT:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.bfloat16)
        theirs = DDP(copy.deepcopy(net))
        gm = data_parallel(net, shard=True, bucket_bytes=300)
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        with gm:
            gm.backward(loss_of(net, x))
        loss_of(theirs, x).backward()
        HABITS[name](list(theirs.parameters()), 0)
        out[name] = raised(lambda name=name, net=net: HABITS[name](list(net.parameters()), 0)) or [
            (p.grad.to_local().clone(), q.grad.flatten()[slice(*p.grad.local_range())].clone())
            for p, q in zip(net.parameters(), theirs.parameters())]
    grads = [p.grad for p in net.parameters()]
    noise = [same_noise(g, 0, i) for i, g in enumerate(grads)]
    out["alpha"] = raised(lambda: grads[0].add_(noise[0], alpha=0.5))
    out["foreach alpha"] = raised(lambda: torch._foreach_sub_(grads, noise, alpha=0.5))
    del gm
    return out


def main(rank: int, world: int, outdir: str) -> None:
    out = {name: run(habit, rank) for name, habit in HABITS.items()}
    out["own noise"] = run(each(own_noise), rank)
    out["refused"] = refused(rank)
    out["16-bit"] = sixteen_bit(rank)
    dist.barrier()
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
