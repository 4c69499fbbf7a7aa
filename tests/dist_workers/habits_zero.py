"""Rank program: the habits of ZeroRedundancyOptimizer scripts on ``data_parallel(model,
shard=True)`` + ``ShardedOptimizer``, next to DDP (+ ZeroRedundancyOptimizer where the habit is
its own): ZeRO's checkpoint, learning-rate schedulers, ``torch.amp.GradScaler``, a closure
(``opt.step(closure)``). Every rank
pickles what the parent checks to ``OUTDIR/rank{RANK}.pkl`` after each scenario.

``HABITS_ZERO`` names the scenarios to run, in order (comma-separated).
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import ShardedOptimizer, data_parallel

from .outcomes import raised

LR = 1e-2
STEPS = 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).square().mean()


def params_of(net: nn.Module) -> list:
    return [p.detach().clone() for p in net.parameters()]



def sides(rank: int, zero: bool, **kw):
    """DDP with ``torch.optim.Adam`` (under ZeroRedundancyOptimizer where ``zero``), and
    gradmgr's sharded path with a ShardedOptimizer over Adam: ``(nets, opts, steps)``, where
    ``steps[i](x)`` runs side i's forward and backward."""
    theirs, ours = model(), model()
    ddp = DDP(theirs)
    if zero:
        ref = ZeroRedundancyOptimizer(theirs.parameters(), torch.optim.Adam, lr=LR, **kw)
    else:
        ref = torch.optim.Adam(theirs.parameters(), lr=LR, **kw)
    gm = data_parallel(ours, shard=True, bucket_bytes=400)
    opt = ShardedOptimizer(gm, torch.optim.Adam, lr=LR, **kw)

    def ddp_step(x, scale=lambda loss: loss):
        loss = loss_of(ddp, x)
        scale(loss).backward()
        return loss

    def gm_step(x, scale=lambda loss: loss):
        with gm:
            loss = loss_of(ours, x)
            gm.backward(scale(loss))
        return loss
    return (theirs, ours), (ref, opt), (ddp_step, gm_step)


def plain(state: dict) -> dict:
    """A state dict's values as plain tensors and numbers, for pickling and comparing."""
    return {"state": {int(i): {k: torch.as_tensor(v).clone() for k, v in s.items()}
                      for i, s in state["state"].items()},
            "param_groups": repr(state["param_groups"])}


# ---------------------------------------------------------------------- scenarios
def consolidate(out: dict, rank: int) -> None:
    """ZeRO's checkpoint: ``opt.consolidate_state_dict(to=0)`` on every rank, then rank 0's
    ``state_dict()``: ZeroRedundancyOptimizer's (over Adam) on both sides; the other rank's
    ``state_dict()`` raises there, on both sides; after another step, ``state_dict()`` on
    every rank is the ShardedOptimizer's collective one again, the new state."""
    nets, opts, steps = sides(rank, zero=True)
    for step in range(STEPS):
        for opt, run in zip(opts, steps):
            run(batch(step, rank))
            opt.step()
            opt.zero_grad()
    for opt in opts:
        opt.consolidate_state_dict(to=0)
    if rank == 0:
        out["consolidated"] = [plain(opt.state_dict()) for opt in opts]
    else:
        out["consolidated"] = [raised(opt.state_dict) for opt in opts]
    out["params"] = [params_of(net) for net in nets]
    out["bad_to"] = raised(lambda: opts[1].consolidate_state_dict(to=2))
    steps[1](batch(STEPS, rank))
    opts[1].step()
    out["after_step"] = plain(opts[1].state_dict())
    opts[1].consolidate_state_dict(to=1)
    out["to_1"] = plain(opts[1].state_dict()) if rank == 1 else raised(opts[1].state_dict)
    dist.barrier()


def scheduler(out: dict, rank: int) -> None:
    """``StepLR(opt, 1, gamma=0.5)`` over the ShardedOptimizer, stepped after each step, next
    to DDP + Adam + the same scheduler: the learning rates, the parameters, the scheduler's and
    the optimizer's state dicts; then a LambdaLR made over the optimizer after training, and
    the torch Optimizer methods that cannot work on a sharded optimizer."""
    nets, opts, steps = sides(rank, zero=False)
    scheds = [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) for opt in opts]
    out["is_optimizer"] = isinstance(opts[1], torch.optim.Optimizer)
    out["lrs"] = [[], []]
    for step in range(STEPS):
        for i, (opt, run, sched) in enumerate(zip(opts, steps, scheds)):
            run(batch(step, rank))
            opt.step()
            opt.zero_grad()
            sched.step()
            out["lrs"][i].append(sched.get_last_lr())
    out["params"] = [params_of(net) for net in nets]
    out["sched_state"] = [repr(sched.state_dict()) for sched in scheds]
    out["opt_state"] = [plain(opt.state_dict()) for opt in opts]
    lam = [torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (epoch + 1))
           for opt in opts]
    for opt, run, sched in zip(opts, steps, lam):
        run(batch(STEPS, rank))
        opt.step()
        sched.step()
    out["lambda_lr"] = [[g["lr"] for g in opt.param_groups] for opt in opts]
    out["params_after_lambda"] = [params_of(net) for net in nets]
    out["refused"] = [raised(lambda: opts[1].add_param_group({"params": []})),
                      raised(lambda: opts[1].register_step_pre_hook(print)),
                      raised(lambda: opts[1].state)]


def scaler(out: dict, rank: int) -> None:
    """``torch.amp.GradScaler("cpu", init_scale=1024)``: ``scale(loss)``, backward,
    ``unscale_(opt)``, ``step(opt)``, ``update()``, next to DDP + Adam + the same scaler. At step
    2 a hook on the first weight puts an inf into its gradient's first element on every rank
    (before the reduction, in both): the reduced gradient is non-finite there only, in one
    rank's slice, and every rank must skip the step and halve the scale, as under DDP. Step 3
    leaves ``unscale_`` to ``scaler.step``."""
    nets, opts, steps = sides(rank, zero=False)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in opts]
    poison = {"on": False}

    def hook(grad):
        if not poison["on"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad
    for net in nets:
        net[0].weight.register_hook(hook)
    out["scales"], out["params"] = [[], []], [[], []]
    for step in range(4):
        poison["on"] = step == 2
        for i, (opt, run, sc) in enumerate(zip(opts, steps, scalers)):
            run(batch(step, rank), scale=sc.scale)
            if step != 3:
                sc.unscale_(opt)
                out.setdefault(f"norms {step}", []).append(
                    [torch.linalg.vector_norm(p.grad) for p in nets[i].parameters()])
            sc.step(opt)
            sc.update()
            opt.zero_grad()
            out["scales"][i].append(sc.get_scale())
            out["params"][i].append(params_of(nets[i]))


def closure(out: dict, rank: int) -> None:
    """``loss = opt.step(closure)``, the closure zeroing the gradients and running the step's
    forward and backward (inside ``with gm:`` on ours), next to DDP + Adam: the losses it
    returned, the parameters, the optimizer's state dicts. Then optimizers whose step is not
    elementwise, made over a sharded model's manager on every rank (``refused``), and an
    elementwise one made after them (``made_after``: the ranks still in step)."""
    nets, opts, steps = sides(rank, zero=False)
    out["losses"] = [[], []]
    for step in range(STEPS):
        x = batch(step, rank)
        for i, (opt, run) in enumerate(zip(opts, steps)):
            def closure(opt=opt, run=run, x=x):
                opt.zero_grad()
                return run(x)
            out["losses"][i].append(opt.step(closure).detach().clone())
    out["params"] = [params_of(net) for net in nets]
    out["opt_state"] = [plain(opt.state_dict()) for opt in opts]
    gm = data_parallel(model(), shard=True)
    out["refused"] = [raised(lambda cls=cls: ShardedOptimizer(gm, cls, lr=LR))
                      for cls in (torch.optim.Adafactor, torch.optim.LBFGS)]
    out["made_after"] = raised(lambda: ShardedOptimizer(gm, torch.optim.SGD, lr=LR))


SCENARIOS = {"consolidate": consolidate, "scheduler": scheduler, "scaler": scaler,
             "closure": closure}


def main(rank: int, world: int, outdir: str) -> None:
    torch.set_num_threads(1)
    out: dict = {}
    for name in os.environ["HABITS_ZERO"].split(","):
        SCENARIOS[name](out, rank)
        out[f"{name}_done"] = True
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
