"""Rank program for issue 25's items 4, 7 and 8, next to DDP, on one data-parallel path.

``HABITS_PATH`` picks the path: ``native`` (torch's C++ Reducer, the default), ``python``
(gradmgr's buckets, ``native=False``) or ``shard`` (``shard=True`` with a ShardedOptimizer,
compared by the parameters after each SGD step, as the gradients live in shards there).
``HABITS_SCENARIOS`` names the scenarios, in order; after each one the rank saves all it has
so far to ``rank{rank}.npz`` with ``{name}_done`` set (see habits_suite.py), so a scenario
that breaks the process group on today's code costs only itself and the ones after it.

* ``none_all`` / ``none_one``: a custom ``autograd.Function`` returns None for an attached
  weight, on every rank / on rank 0 only, at synced steps, after a step that left ``.grad``
  set, and after a ``no_sync`` micro-step that gave it a gradient; against
  ``DDP(find_unused_parameters=True)``.
* ``double``: ``model.double()`` after ``data_parallel``, against DDP built on the double
  model; ``double_one_rank``: rank 1 alone converts, every rank must raise RankMismatchError.
* ``disagree_first`` / ``disagree_later`` / ``disagree_buffers``: only rank 0 wraps a
  micro-batch in ``no_sync`` (at the very first recording; after a synced step; with a
  BatchNorm whose buffers data_parallel broadcasts): every rank must raise RankMismatchError,
  and once the ranks agree again a step equals DDP's. ``uneven_padded``: rank 1 has one
  micro-batch fewer and records an empty one inside ``no_sync``, as the error advises.
* ``input_one_rank``: rank 0 alone attaches its input inside the recording.
* ``activation_attached``: rank 0 alone attaches an activation inside the recording.
* ``post_hook_one_rank``: rank 0 alone registers a post-accumulate-grad hook on a weight.
* ``freeze_in_window``: every rank freezes a layer inside a ``no_sync`` window.
* ``input_callback_one_rank``: rank 0 alone attaches its input with a callback inside the
  recording.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import ShardedOptimizer, data_parallel, no_sync

from .scenarios import run_named

LR = 0.1
PATH = os.environ.get("HABITS_PATH", "native")
SHARD = PATH == "shard"


def wrap(net: nn.Module) -> object:
    return data_parallel(net, native=PATH == "native", shard=SHARD)


def error_text(fn) -> np.ndarray:
    """``fn()``'s error as text (its type first), or "no error"."""
    try:
        fn()
    except RuntimeError as exc:
        return np.array(f"{type(exc).__name__}: {exc}")
    return np.array("no error")


def batch(step: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 3, generator=g).to(dtype)


def values(tensors) -> list:
    return [None if t is None else t.detach().numpy().copy() for t in tensors]


def save(out: dict, prefix: str, arrays: list) -> None:
    for i, a in enumerate(arrays):
        if a is not None:
            out[f"{prefix}{i}"] = a
    out[f"{prefix}n"] = np.array(len(arrays))


class Side:
    """One side of a comparison (gradmgr's manager or DDP) over its own copy of a model, with
    an SGD step after each synced step where the path is sharded (ShardedOptimizer for
    gradmgr, torch's SGD for DDP); saves gradients (unsharded paths) or parameters."""

    def __init__(self, net: nn.Module, gm=None, ddp: bool = False, opt=None,
                 **ddp_options) -> None:
        self.net, self.gm = net, gm
        self.ddp = DDP(net, **ddp_options) if ddp else None
        self.opt = opt
        if SHARD and opt is None:
            self.opt = (torch.optim.SGD(net.parameters(), lr=LR) if ddp
                        else ShardedOptimizer(gm, torch.optim.SGD, lr=LR))

    def step(self, x: torch.Tensor, sync: bool = True, **kwargs) -> None:
        if self.ddp is not None:
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                self.ddp(x, **kwargs).backward()
            return
        with contextlib.nullcontext() if sync else no_sync(self.gm), self.gm:
            self.gm.backward(self.net(x, **kwargs))

    def after_sync(self, out: dict, name: str, zero: bool = True) -> None:
        """Save what this side holds after a synced step (``{name}``), then (sharded: step
        and) drop the gradients unless ``zero`` is False."""
        if SHARD:
            self.opt.step()
            self.opt.zero_grad()
            save(out, name, values(self.net.parameters()))
            return
        save(out, name, values(p.grad for p in self.net.parameters()))
        if zero:
            self.net.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- 4: backward returns None
class ScaleNoneFor(torch.autograd.Function):
    """``x * w``, whose backward gives ``w`` no gradient (None) where told."""

    @staticmethod
    def forward(ctx, x, w, none: bool):
        ctx.save_for_backward(x, w)
        ctx.none = none
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, None if ctx.none else (g * x).sum(0), None


class Gated(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.to(dtype)

    def forward(self, x: torch.Tensor, none: bool = False) -> torch.Tensor:
        return torch.tanh(self.head(torch.tanh(ScaleNoneFor.apply(self.lin(x), self.w,
                                                                  none)))).pow(2).mean()


def _none_grad(out: dict, name: str, rank: int, none_on) -> None:
    """Five recordings, the same on both sides: synced steps 0-2 (no zero_grad after step 1,
    so step 2 starts with ``.grad`` set; sharded: always zeroed), a ``no_sync`` micro-step 3
    that gives ``w`` a gradient (none=False), and synced step 4."""
    net = Gated()
    ours = Side(net, gm=wrap(net))
    theirs = Side(Gated(), ddp=True, find_unused_parameters=True)
    for step in range(5):
        x, none = batch(step, rank), none_on(rank, step)
        for side in (ours, theirs):
            side.step(x, sync=step != 3, none=none)
            if step != 3:
                side.after_sync(out, f"{name}_{'gm' if side is ours else 'ddp'}{step}_",
                                zero=step != 1)


def none_all(out: dict, rank: int, world: int) -> None:
    _none_grad(out, "none_all", rank, lambda r, step: step != 3)


def none_one(out: dict, rank: int, world: int) -> None:
    _none_grad(out, "none_one", rank, lambda r, step: r == 0 and step != 3)


# ---------------------------------------------------------------- 8: model.double() after
class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, keep: Optional[list] = None) -> torch.Tensor:
        hidden = torch.tanh(self.fc1(x))
        if keep is not None:  # the activation, for its own gradient
            keep.append(hidden)
        return torch.tanh(self.fc2(hidden)).pow(2).mean()


def double(out: dict, rank: int, world: int) -> None:
    """A float32 step, then ``model.double()`` on every rank and two steps: gradients (or
    the parameters after SGD) equal DDP's on a model made double before wrapping. Sharded,
    the ShardedOptimizer made before the change refuses to step; a new one is made."""
    net = Plain()
    gm = wrap(net)
    opt = ShardedOptimizer(gm, torch.optim.SGD, lr=LR) if SHARD else None
    with gm:
        gm.backward(net(batch(0, rank)))
    if SHARD:
        opt.step()
        opt.zero_grad()
    net.zero_grad(set_to_none=True)
    fresh = Plain()
    fresh.load_state_dict(net.state_dict())
    net.double()
    if SHARD:
        out["double_old_opt_error"] = error_text(lambda: _step_old(gm, net, opt, rank))
        opt.zero_grad()
    ours = Side(net, gm=gm)  # sharded: a new ShardedOptimizer
    theirs = Side(fresh.double(), ddp=True)
    for step in range(1, 3):
        x = batch(step, rank, torch.float64)
        for side, label in ((ours, "gm"), (theirs, "ddp")):
            side.step(x)
            side.after_sync(out, f"double_{label}{step}_")
    out["double_dtypes"] = np.array(sorted({str(p.dtype) for p in net.parameters()}))


def _step_old(gm, net, opt, rank: int) -> None:
    with gm:
        gm.backward(net(batch(9, rank, torch.float64)))
    opt.step()


def double_one_rank(out: dict, rank: int, world: int) -> None:
    """Rank 1 alone converts: the next step raises RankMismatchError on every rank, naming
    the parameter and both dtypes."""
    net = Plain()
    gm = wrap(net)
    with gm:
        gm.backward(net(batch(0, rank)))
    net.zero_grad(set_to_none=True)  # as between steps (sharded: .double() refuses a stand-in)
    if rank == 1:
        net.double()
    dtype = torch.float64 if rank == 1 else torch.float32

    def step() -> None:
        with gm:
            gm.backward(net(batch(1, rank, dtype)))

    out["double_one_error"] = error_text(step)


# ---------------------------------------------------------------- 7: no_sync on one rank
def _disagree(out: dict, name: str, rank: int, net: nn.Module, ref: nn.Module,
              warm: bool) -> None:
    """(After a synced warm-up step where ``warm``), rank 0 wraps micro-batch 0 in no_sync
    and rank 1 does not: the error on every rank; then both drop what they accumulated and
    take an agreeing synced step, against DDP's same step."""
    gm = wrap(net)
    opt = ShardedOptimizer(gm, torch.optim.SGD, lr=LR) if SHARD else None
    if warm:
        with gm:
            gm.backward(net(batch(0, rank)))
        if SHARD:
            opt.step()
            opt.zero_grad()
        net.zero_grad(set_to_none=True)

    def accumulate() -> None:
        for micro in range(2):
            pause = rank == 0 and micro == 0
            with no_sync(gm) if pause else contextlib.nullcontext(), gm:
                gm.backward(net(batch(10 + micro, rank)))

    out[f"{name}_error"] = error_text(accumulate)
    if SHARD:
        opt.zero_grad()
    net.zero_grad(set_to_none=True)
    ref.load_state_dict(net.state_dict())
    ours = Side(net, gm=gm, opt=opt)
    theirs = Side(ref, ddp=True)
    x = batch(20, rank)
    for side, label in ((ours, "gm"), (theirs, "ddp")):
        side.step(x)
        side.after_sync(out, f"{name}_after_{label}")


def disagree_first(out: dict, rank: int, world: int) -> None:
    _disagree(out, "disagree_first", rank, Plain(), Plain(), warm=False)


def disagree_later(out: dict, rank: int, world: int) -> None:
    _disagree(out, "disagree_later", rank, Plain(), Plain(), warm=True)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.bn, self.fc2 = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(self.bn(self.fc1(x)))).pow(2).mean()


def disagree_buffers(out: dict, rank: int, world: int) -> None:
    _disagree(out, "disagree_buffers", rank, Normed(), Normed(), warm=True)


def uneven_padded(out: dict, rank: int, world: int) -> None:
    """Rank 0 accumulates two micro-batches before its synced one, rank 1 one: rank 1 pads
    with an empty recording inside no_sync. DDP, where rank 1 simply has one fewer no_sync
    micro-batch, gives the same gradients."""
    net = Plain()
    ours = Side(net, gm=wrap(net))
    theirs = Side(Plain(), ddp=True)
    micro = [0, 1] if rank == 0 else [1]
    for side in (ours, theirs):
        if side is ours and rank == 1:
            with no_sync(ours.gm), ours.gm:
                ours.gm.backward()
        for m in micro:
            side.step(batch(30 + m, rank), sync=False)
        side.step(batch(40, rank))
        side.after_sync(out, f"uneven_{'gm' if side is ours else 'ddp'}")


# ---------------------------------------------------------------- an input on one rank
def input_one_rank(out: dict, rank: int, world: int) -> None:
    """Rank 0 alone attaches its input (``requires_grad``, no callback: a saliency map)
    inside the recording, at two synced steps: the parameters' gradients (sharded: the
    parameters) equal DDP's, and rank 0's input gets its own gradient, as under DDP."""
    _input_on_rank0(out, rank, "input", 50, doubled=False)


def _input_on_rank0(out: dict, rank: int, prefix: str, seed: int, doubled: bool) -> None:
    """Rank 0 alone attaches its input inside the recording, at two synced steps (where
    ``doubled``, with a callback doubling its gradient; DDP's side: a tensor hook)."""
    net = Plain()
    ours = Side(net, gm=wrap(net))
    theirs = Side(Plain(), ddp=True)
    callbacks = [lambda t, g: g * 2] if doubled else None
    for step in range(2):
        for side in (ours, theirs):
            name = f"{prefix}_{'gm' if side is ours else 'ddp'}{step}_"
            x = batch(seed + step, rank).requires_grad_(True)
            if side is theirs:
                if rank == 0 and doubled:
                    x.register_hook(lambda g: g * 2)
                side.step(x)
            else:
                with ours.gm:
                    if rank == 0:
                        ours.gm.attach(x, callbacks=callbacks)
                    ours.gm.backward(net(x))
            if rank == 0:  # (under DDP every rank's input gets one; here rank 0 asked)
                save(out, f"{name}x", values([x.grad]))
            side.after_sync(out, name)


def activation_attached(out: dict, rank: int, world: int) -> None:
    """An activation attached inside the recording for its own gradient, by rank 0 alone, at
    two synced steps, on every path (on torch's reducer, rank 0's step used to leave the
    reducer for gradmgr's buckets, and gloo aborted a rank). The parameters' gradients
    (sharded: the parameters) equal DDP's, and the activation's ``.grad`` the one DDP's
    backward retains. Then rank 0 alone takes ``torch.autograd.grad`` of the activation
    inside the recording instead: the same."""
    net = Plain()
    ours = Side(net, gm=wrap(net))
    theirs = Side(Plain(), ddp=True)
    attaching = rank == 0
    for step in range(2):
        for side in (ours, theirs):
            name = f"act_{'gm' if side is ours else 'ddp'}{step}_"
            x, keep = batch(60 + step, rank), []
            if side is theirs:
                loss = side.ddp(x, keep=keep)
                keep[0].retain_grad()
                loss.backward()
            else:
                with ours.gm:
                    loss = net(x, keep=keep)
                    if attaching:
                        ours.gm.attach(keep[0])
                    ours.gm.backward(loss)
            if attaching:
                save(out, f"{name}h", values([keep[0].grad]))
            side.after_sync(out, name)
    # The other way, on every path: rank 0 alone takes torch.autograd.grad of the activation
    # inside the recording (no attach), then the step goes on as the others'.
    for step in range(2):
        x, keep = batch(70 + step, rank), []
        loss = theirs.ddp(x, keep=keep)
        keep[0].retain_grad()
        loss.backward()
        save(out, f"act_grad_ddp{step}_h", values([keep[0].grad]))
        theirs.after_sync(out, f"act_grad_ddp{step}_")
        keep = []
        with ours.gm:
            loss = net(x, keep=keep)
            if rank == 0:
                save(out, f"act_grad_gm{step}_h",
                     values(torch.autograd.grad(loss, keep[0], retain_graph=True)))
            ours.gm.backward(loss)
        ours.after_sync(out, f"act_grad_gm{step}_")
    _activations_of_one_node(out, rank)


class Chunked(nn.Module):
    """Two activations that are outputs of one node (a chunk), and one off the loss's path."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, keep: list) -> torch.Tensor:
        hidden = torch.tanh(self.fc1(x))
        a, b = hidden.chunk(2, dim=1)
        keep.extend([a, b, hidden * 3])
        return torch.tanh(self.fc2(torch.cat([a, b * 2], 1))).pow(2).mean()


def _activations_of_one_node(out: dict, rank: int) -> None:
    """Rank 0 alone attaches both outputs of a chunk (the second with a callback that
    doubles what its ``.grad`` gets) and an activation the loss does not reach, and doubles
    the first chunk's gradient with a hook of its own registered after the attach: each
    ``.grad`` the one DDP's backward retains (the hooked one doubled, the second doubled
    after the backward, the unreached one None), the parameters' DDP's."""
    net = Chunked()
    ours, theirs = Side(net, gm=wrap(net)), Side(Chunked(), ddp=True)
    for step in range(2):
        x = batch(80 + step, rank)
        for side in (ours, theirs):
            name, keep = f"act_node_{'gm' if side is ours else 'ddp'}{step}_", []
            if side is theirs:
                loss = side.ddp(x, keep=keep)
                if rank == 0:
                    keep[0].register_hook(lambda g: g * 2)
                    for h in keep:
                        h.retain_grad()
                loss.backward()
                if rank == 0:
                    keep[1].grad = keep[1].grad * 2
            else:
                with ours.gm:
                    loss = net(x, keep=keep)
                    if rank == 0:
                        ours.gm.attach([keep[0], keep[2]])
                        ours.gm.attach(keep[1], callbacks=[lambda t, g: g * 2])
                        keep[0].register_hook(lambda g: g * 2)
                    ours.gm.backward(loss)
            if rank == 0:
                save(out, f"{name}h", values([h.grad for h in keep]))
            side.after_sync(out, name)


# ---------------------------------------------------------------- a post-accumulate hook
def post_hook_one_rank(out: dict, rank: int, world: int) -> None:
    """Rank 0 alone registers a post-accumulate-grad hook on ``fc1.weight`` (a logger) after a
    first step, on both sides. Saves each step's error (gradmgr's side) and what each side
    holds after it; the hook is removed at the end."""
    net = Plain()
    ours, theirs = Side(net, gm=wrap(net)), Side(Plain(), ddp=True)
    handles = []
    for step in range(2):
        if step == 1 and rank == 0:
            handles = [side.net.fc1.weight.register_post_accumulate_grad_hook(lambda p: None)
                       for side in (ours, theirs)]
        x = batch(100 + step, rank)
        out[f"post_hook_error{step}"] = error_text(functools.partial(ours.step, x))
        theirs.step(x)
        for side, label in ((ours, "gm"), (theirs, "ddp")):
            side.after_sync(out, f"post_hook_{label}{step}_")
    for handle in handles:
        handle.remove()


# ---------------------------------------------------------------- a freeze inside no_sync
def freeze_in_window(out: dict, rank: int, world: int) -> None:
    """Every rank freezes ``fc1`` between a ``no_sync`` micro-batch and the synced one (found
    by tests/differential/test_torch_dp_differential.py). DDP (``find_unused_parameters``)
    reduces the gradient ``fc1`` accumulated in the window: every rank ends with the mean
    (sharded: the parameters after the optimizer made before the freeze steps). Then a
    synced step with ``fc1`` still frozen: left out, as any frozen tensor."""
    net = Plain()
    ours = Side(net, gm=wrap(net))
    theirs = Side(Plain(), ddp=True, find_unused_parameters=True)
    for side, label in ((ours, "gm"), (theirs, "ddp")):
        side.step(batch(90, rank), sync=False)
        side.net.fc1.requires_grad_(False)
        side.step(batch(91, rank))
        side.after_sync(out, f"window_{label}")
        if SHARD and side is ours:  # (a freeze changes the plan: a new optimizer, as documented)
            side.opt = ShardedOptimizer(ours.gm, torch.optim.SGD, lr=LR)
        side.step(batch(92, rank))
        side.after_sync(out, f"window_after_{label}")


# ---------------------------------------------------------------- an input's callback
def input_callback_one_rank(out: dict, rank: int, world: int) -> None:
    """Rank 0 alone attaches its input with a callback that doubles its gradient, inside the
    recording, at two synced steps (DDP's side: ``x.register_hook(lambda g: g * 2)``). On
    torch's reducer path rank 0's step leaves the reducer (a callback other than the
    allreduce's) while rank 1's stays: gloo aborts a rank."""
    _input_on_rank0(out, rank, "input_cb", 95, doubled=True)


SCENARIOS = {f.__name__: f for f in (
    none_all, none_one, double, double_one_rank, uneven_padded, disagree_first,
    disagree_later, disagree_buffers, input_one_rank, activation_attached,
    post_hook_one_rank, freeze_in_window, input_callback_one_rank,
)}


def main(rank: int, world: int, outdir: str) -> None:
    run_named(SCENARIOS, rank, world, outdir)
