"""Rank program for issue 19's data-parallel habits (items 1 and 5b), next to DDP.

``HABITS_SCENARIOS`` names the scenarios to run, in order. After each one the rank saves all
it has so far to ``rank{rank}.npz`` with ``{name}_done`` set, so a scenario that crashes a rank
on today's code (a gloo abort) costs only itself and the ones after it: the parent reports
which scenario did not complete. Scenarios that may crash go last.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr import GradManager
from gradmgr.distributed import RankFailedError, data_parallel, make_allreduce_cb, no_sync

from .scenarios import run_named
from .torch_suite import Net, ddp_step_and_save, grads, local_batch, save


def error_text(fn) -> np.ndarray:
    """``fn()``'s RuntimeError as text (its type first), or "no error"."""
    try:
        fn()
    except RuntimeError as exc:
        return np.array(f"{type(exc).__name__}: {exc}")
    return np.array("no error")


# ---------------------------------------------------------------- 1a: loss.backward() by habit
def _habit_then_steps(out: dict, name: str, rank: int, world: int, make_gm) -> None:
    """``loss.backward()`` inside a data-parallel recording, then two correct steps next to
    DDP: the error text, the habit's local gradients, then both models' gradients."""
    net, ddp = Net(), DDP(Net(), find_unused_parameters=True)
    gm = make_gm(net)
    x, y = local_batch(0, rank, world)

    def habit() -> None:
        with gm:
            net(x, y).backward()  # typed by habit: nothing reduced

    out[f"{name}_error"] = error_text(habit)
    save(out, f"{name}_habit_g", grads(net))
    net.zero_grad(set_to_none=True)
    for step in range(2):
        x, y = local_batch(step, rank, world)
        with gm:
            gm.backward(net(x, y))
        ddp_step_and_save(out, f"{name}_after{step}", net, ddp, x, y)


def habit_backward_cb(out: dict, rank: int, world: int) -> None:
    _habit_then_steps(out, "habit_cb", rank, world, lambda net: GradManager().attach(
        net.parameters(), callbacks=[make_allreduce_cb("mean")]))


def habit_backward_dp(out: dict, rank: int, world: int) -> None:
    _habit_then_steps(out, "habit_dp", rank, world, data_parallel)


# ---------------------------------------------------------------- 1b: no_sync nested inside
def nested_no_sync(out: dict, rank: int, world: int) -> None:
    """``with gm, no_sync(gm):`` (and ``cb.no_sync()``) entered while recording: refused at
    once; nothing accumulated; a following step equals DDP's."""
    net, ddp = Net(), DDP(Net(), find_unused_parameters=True)
    cb = make_allreduce_cb("mean")
    gm = GradManager().attach(net.parameters(), callbacks=[cb])
    x, y = local_batch(0, rank, world)
    for form, pause in (("function", lambda: no_sync(gm)), ("method", cb.no_sync)):
        def nested(pause=pause) -> None:
            with gm, pause():
                gm.backward(net(x, y))

        out[f"nested_{form}_error"] = error_text(nested)
        out[f"nested_{form}_grad_none"] = np.array(all(p.grad is None for p in net.parameters()))
        save(out, f"nested_{form}_g", grads(net))
        net.zero_grad(set_to_none=True)
    with gm:
        gm.backward(net(x, y))
    ddp_step_and_save(out, "nested_after", net, ddp, x, y)


# ---------------------------------------------------------------- 1d: models that differ
class Two(nn.Module):
    """Named layers (``fc1``, ``fc2``), an optional buffer ``stats``; seeded per rank."""

    def __init__(self, seed: int, hidden: int = 8, stats: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, hidden)
        if stats:
            self.register_buffer("stats", torch.full((hidden,), float(seed)))


def _wrap(out: dict, name: str, model: nn.Module) -> None:
    before = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]

    def wrap() -> None:
        data_parallel(model)

    out[f"{name}_error"] = error_text(wrap)
    after = [*model.parameters(), *model.buffers()]
    # refused before any broadcast: this rank's own values are untouched
    out[f"{name}_untouched"] = np.array(
        len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before)))


def wrap_other_layer_size(out: dict, rank: int, world: int) -> None:
    _wrap(out, "wrap_size", Two(10 + rank, hidden=8 if rank == 0 else 9, stats=False))


def wrap_missing_buffer(out: dict, rank: int, world: int) -> None:
    _wrap(out, "wrap_buffer", Two(10 + rank, stats=rank == 0))
    check = torch.ones(1) * (rank + 1)
    dist.all_reduce(check)  # the process group still works: 1 + 2
    out["wrap_after"] = check.numpy()


def step_mismatch_names(out: dict, rank: int, world: int) -> None:
    """Under data_parallel, rank 1 alone freezes ``mlp.2.bias`` after a step: the step's
    RankMismatchError names the parameter, not only its position."""
    net = Net()
    gm = data_parallel(net)
    x, y = local_batch(0, rank, world)
    with gm:
        gm.backward(net(x, y))
    net.mlp[2].bias.requires_grad_(rank == 0)

    def step() -> None:
        with gm:
            gm.backward(net(x, y))

    out["named_error"] = error_text(step)
    out["named_is_mismatch"] = np.array("RankMismatchError" in str(out["named_error"]))


# ---------------------------------------------------------------- 5b: skipping a bad batch
def skip_batch(out: dict, rank: int, world: int) -> None:
    """Rank 1 raises in its forward at step 1 (a bad sample), catches it and goes on: its
    ``with gm:`` exits with its own error, rank 0's backward raises RankFailedError, both skip
    the step, and the steps after equal DDP's skipping the same batch on both ranks."""
    net, net_ddp = Net(), Net()
    ddp = DDP(net_ddp, find_unused_parameters=True)
    gm = GradManager().attach(net.parameters(), callbacks=[make_allreduce_cb("mean")])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, net_ddp)]
    outcomes = []
    for step in range(4):
        x, y = local_batch(step, rank, world)
        try:
            with gm:
                if step == 1 and rank == 1:
                    raise ValueError("bad sample")
                gm.backward(net(x, y))
            outcomes.append("none")
        except ValueError:
            outcomes.append("own")
        except RankFailedError:
            outcomes.append("RankFailedError")
        out["skip_outcomes"] = np.array(outcomes)
        if step == 1:  # the loop skips the batch on every rank, as DDP must to compare
            net.zero_grad(set_to_none=True)
            continue
        ddp(x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    save(out, "skip_gm_p", [p.detach().numpy().copy() for p in net.parameters()])
    save(out, "skip_ddp_p", [p.detach().numpy().copy() for p in net_ddp.parameters()])


SCENARIOS = {f.__name__: f for f in (
    habit_backward_cb, habit_backward_dp, nested_no_sync, step_mismatch_names, skip_batch,
    wrap_other_layer_size, wrap_missing_buffer,
)}


def main(rank: int, world: int, outdir: str) -> None:
    run_named(SCENARIOS, rank, world, outdir)

