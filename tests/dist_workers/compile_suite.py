"""Rank program for issue 26 item 1: data parallel under ``torch.compile`` and compiled
autograd, next to DDP compiled the same way, on one data-parallel path.

``HABITS_PATH`` picks the path: ``native`` (torch's C++ Reducer, the default), ``python``
(gradmgr's buckets, ``native=False``) or ``shard`` (``shard=True`` with a ShardedOptimizer).
Every scenario saves, after each step, the gradients (not on the sharded path, where they live
in shards) and the parameters after an SGD step, for gradmgr (``{name}_gm{step}_{i}``) and DDP
(``{name}_ddp{step}_{i}``). ``COMPILE_BACKEND`` (default ``aot_eager``) is the compiler.

* ``compiled_model``: ``torch.compile(model)`` under ``data_parallel`` against
  ``torch.compile(DDP(model))`` (torch's C++ reducer, DDPOptimizer), three steps.
* ``ca_steps``: compiled autograd on (its ``_enable`` context around each recording, and the
  compiled model): no exception, against DDP in its ``python_reducer`` mode compiled the same
  way; the graph breaks counted
  (``torch._dynamo.utils.counters``) during each side's backwards (``{name}_breaks_gm``,
  ``{name}_breaks_ddp``) and the compiled autograd captures (``{name}_captures_gm``).
* ``ca_no_sync``: the same, two micro-batches accumulated inside ``no_sync`` before a synced one.
* ``ca_unused``: a layer that only rank 0 uses, under compiled autograd; against eager
  ``DDP(find_unused_parameters=True)`` (DDP's python reducer only reduces a parameter on the
  ranks that computed its gradient, so its collectives pair wrongly or hang there).
* ``ca_one_rank``: rank 0 alone under compiled autograd; ``ca_late``: compiled autograd entered
  between the recording's start and the backward; ``ca_switch``: eager, compiled autograd,
  eager steps; ``ca_skip``: rank 0 skips a batch (see there).
* ``ca_config``: ``torch._dynamo.config.compiled_autograd = True`` and compiled step functions
  (torch's documented way) on both sides, against DDP's python reducer.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import (
    RankFailedError,
    RankMismatchError,
    ShardedOptimizer,
    data_parallel,
    no_sync,
)

from .scenarios import run_named

LR = 0.1
STEPS = 3
PATH = os.environ.get("HABITS_PATH", "native")
SHARD = PATH == "shard"
BACKEND = os.environ.get("COMPILE_BACKEND", "aot_eager")


class Net(nn.Module):
    """An MLP of four parameters, and with ``extra`` a layer of two more that the forward uses
    only where ``use_extra``."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4) if extra else None

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        y = self.fc2(h)
        return y + self.extra(h) if use_extra else y


def make(extra: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(extra)


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g)


def save(out: dict, prefix: str, tensors) -> None:
    for i, t in enumerate(tensors):
        if t is not None:
            out[f"{prefix}_{i}"] = t.detach().numpy().copy()


def breaks() -> int:
    return sum(counters["graph_break"].values())


class Side:
    """gradmgr's manager or DDP over a fresh copy of the model, with the optimizer each uses
    (SGD; the sharded path: ShardedOptimizer over SGD)."""

    def __init__(self, name: str, ddp: bool, extra: bool = False, **ddp_options) -> None:
        self.name, self.net = name, make(extra)
        self.gm = self.ddp = None
        if ddp:
            self.ddp = DDP(self.net, **ddp_options)
            self.opt = torch.optim.SGD(self.net.parameters(), lr=LR)
        else:
            self.gm = data_parallel(self.net, native=PATH == "native", shard=SHARD)
            self.opt = (ShardedOptimizer(self.gm, torch.optim.SGD, lr=LR) if SHARD
                        else torch.optim.SGD(self.net.parameters(), lr=LR))
        self.tag = "ddp" if ddp else "gm"
        self.breaks = 0

    def module(self) -> nn.Module:
        return self.net if self.ddp is None else self.ddp

    def backward(self, loss: torch.Tensor) -> None:
        """The step's backward, with the graph breaks counted during it."""
        before = breaks()
        if self.gm is None:
            loss.backward()
        else:
            self.gm.backward(loss)
        self.breaks += breaks() - before

    def context(self, sync: bool):
        if self.gm is None:
            return contextlib.nullcontext() if sync else self.ddp.no_sync()
        stack = contextlib.ExitStack()
        if not sync:
            stack.enter_context(no_sync(self.gm))
        stack.enter_context(self.gm)
        return stack

    def after_sync(self, out: dict, step: int) -> None:
        prefix = f"{self.name}_{self.tag}{step}"
        if not SHARD:
            save(out, f"{prefix}_grad", (p.grad for p in self.net.parameters()))
        self.opt.step()
        self.opt.zero_grad()
        save(out, f"{prefix}_param", self.net.parameters())


# ---------------------------------------------------------------- torch.compile(model)
def compiled_model(out: dict, rank: int, world: int) -> None:
    for side in (Side("compiled_model", ddp=False), Side("compiled_model", ddp=True)):
        model = torch.compile(side.module(), backend=BACKEND)
        for step in range(STEPS):
            with side.context(True):
                side.backward(model(batch(step, rank)).square().sum())
            side.after_sync(out, step)


# ---------------------------------------------------------------- compiled autograd
def _ca_run(out: dict, rank: int, name: str, micro: int) -> None:
    """``micro`` micro-batches per step (all but the last inside no_sync), each recorded and
    backwarded under compiled autograd (its ``_enable`` context, entered before the
    recording): gradmgr's steps, then DDP's in its python-reducer mode, compiled alike."""
    sides = [Side(name, ddp=False)]
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        sides.append(Side(name, ddp=True))
        for side in sides:
            model = torch.compile(side.module(), backend=BACKEND)
            compiler = torch.compile(backend=BACKEND)
            counters.clear()
            for step in range(STEPS):
                for m in range(micro):
                    x, sync = batch(10 * step + m, rank), m == micro - 1
                    with torch._dynamo.compiled_autograd._enable(compiler), \
                            side.context(sync):
                        side.backward(model(x).square().sum())
                side.after_sync(out, step)
            out[f"{name}_breaks_{side.tag}"] = np.array(side.breaks)
            out[f"{name}_captures_{side.tag}"] = np.array(
                counters["compiled_autograd"]["captures"])
            torch._dynamo.reset()


def ca_config(out: dict, rank: int, world: int) -> None:
    """``torch._dynamo.config.compiled_autograd = True`` and a compiled step function (the way
    torch documents): gradmgr's step against DDP's (python reducer) written the same way."""
    name = "ca_config"
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        gm_side, ddp_side = Side(name, ddp=False), Side(name, ddp=True)
        gm, gm_model = gm_side.gm, torch.compile(gm_side.net, backend=BACKEND)
        ddp_model = torch.compile(ddp_side.ddp, backend=BACKEND)

        @torch.compile(backend=BACKEND)
        def gm_step(x: torch.Tensor) -> None:
            with gm:
                gm.backward(gm_model(x).square().sum())

        @torch.compile(backend=BACKEND)
        def ddp_step(x: torch.Tensor) -> None:
            ddp_model(x).square().sum().backward()

        with torch._dynamo.config.patch(compiled_autograd=True):
            for side, train in ((gm_side, gm_step), (ddp_side, ddp_step)):
                for step in range(STEPS):
                    train(batch(step, rank))
                    side.after_sync(out, step)
    torch._dynamo.reset()


def ca_steps(out: dict, rank: int, world: int) -> None:
    _ca_run(out, rank, "ca_steps", micro=1)


def ca_no_sync(out: dict, rank: int, world: int) -> None:
    _ca_run(out, rank, "ca_no_sync", micro=3)


def ca_unused(out: dict, rank: int, world: int) -> None:
    """``extra`` only on rank 0, at steps 0 and 2; against eager DDP that finds unused
    parameters."""
    name = "ca_unused"
    gm_side = Side(name, ddp=False, extra=True)
    ddp_side = Side(name, ddp=True, extra=True, find_unused_parameters=True)
    model = torch.compile(gm_side.net, backend=BACKEND)
    compiler = torch.compile(backend=BACKEND)
    counters.clear()
    for step in range(STEPS):
        x, use = batch(step, rank), rank == 0 and step != 1
        with torch._dynamo.compiled_autograd._enable(compiler), gm_side.context(True):
            gm_side.backward(model(x, use_extra=use).square().sum())
        gm_side.after_sync(out, step)
        ddp_side.backward(ddp_side.ddp(x, use_extra=use).square().sum())
        ddp_side.after_sync(out, step)
    out[f"{name}_breaks_gm"] = np.array(gm_side.breaks)
    out[f"{name}_captures_gm"] = np.array(counters["compiled_autograd"]["captures"])


def _against_eager_ddp(out: dict, rank: int, name: str, enter, error_type) -> None:
    """Three steps of gradmgr, each recording and backwarding inside what
    ``enter(rank, step, compiler)`` gives (a context around the recording, and one inside it
    around the backward): a step that
    raises ``error_type`` saves its message (``{name}_error{step}``). Where every step raised,
    one more step taken eagerly follows. The steps that passed are compared with eager DDP's."""
    gm_side, ddp_side = Side(name, ddp=False), Side(name, ddp=True)
    model = torch.compile(gm_side.net, backend=BACKEND)
    compiler = torch.compile(backend=BACKEND)
    done = 0
    for step in range(STEPS):
        around, inside = enter(rank, step, compiler)
        try:
            with around, gm_side.context(True):
                loss = model(batch(step, rank)).square().sum()
                with inside:
                    gm_side.backward(loss)
        except error_type as error:
            out[f"{name}_error{step}"] = np.array(f"{type(error).__name__}: {error}")
            gm_side.net.zero_grad(set_to_none=True)
            continue
        gm_side.after_sync(out, done)
        done += 1
    if done == 0:  # the ranks step together again, eagerly
        with gm_side.context(True):
            gm_side.backward(model(batch(0, rank)).square().sum())
        gm_side.after_sync(out, 0)
        done = 1
    for step in range(done):
        ddp_side.backward(ddp_side.ddp(batch(step, rank)).square().sum())
        ddp_side.after_sync(out, step)


def ca_one_rank(out: dict, rank: int, world: int) -> None:
    """Rank 0 records and backwards under compiled autograd, rank 1 without. On gradmgr's
    buckets the two ranks' paths reduce alike: DDP's (eager) result. On the reducer path rank
    1 would reduce with torch's reducer and rank 0 with gradmgr's buckets: every rank raises
    RankMismatchError, and a step both take eagerly afterwards is DDP's first."""

    def enter(rank: int, step: int, compiler) -> tuple:
        ca = (torch._dynamo.compiled_autograd._enable(compiler) if rank == 0
              else contextlib.nullcontext())
        return ca, contextlib.nullcontext()

    _against_eager_ddp(out, rank, "ca_one_rank", enter, RankMismatchError)


def ca_late(out: dict, rank: int, world: int) -> None:
    """Compiled autograd entered after the recording began, around gm.backward only. The
    per-tensor path runs under it (with its graph breaks): DDP's result; the reducer path,
    which compiled autograd refuses, raises RuntimeError saying to enter it first, on every
    rank, and the next step taken alike is DDP's first."""

    def enter(rank: int, step: int, compiler) -> tuple:
        return contextlib.nullcontext(), torch._dynamo.compiled_autograd._enable(compiler)

    _against_eager_ddp(out, rank, "ca_late", enter, RuntimeError)


def ca_switch(out: dict, rank: int, world: int) -> None:
    """An eager step (on the reducer path: torch's reducer is built, its hooks on the
    parameters), a step under compiled autograd, an eager one again: DDP's three steps."""

    def enter(rank: int, step: int, compiler) -> tuple:
        ca = (torch._dynamo.compiled_autograd._enable(compiler) if step == 1
              else contextlib.nullcontext())
        return ca, contextlib.nullcontext()

    _against_eager_ddp(out, rank, "ca_switch", enter, ())


class SkipBatch(Exception):
    pass


def ca_skip(out: dict, rank: int, world: int) -> None:
    """Under compiled autograd, rank 0 skips a batch (its recording ends without a backward):
    rank 1's step raises RankFailedError, ``.grad`` stays None on both, and the next step is
    DDP's first."""
    name = "ca_skip"
    gm_side, ddp_side = Side(name, ddp=False), Side(name, ddp=True)
    model = torch.compile(gm_side.net, backend=BACKEND)
    compiler = torch.compile(backend=BACKEND)
    with torch._dynamo.compiled_autograd._enable(compiler):
        try:
            with gm_side.context(True):
                loss = model(batch(5, rank)).square().sum()
                if rank == 0:
                    raise SkipBatch()
                gm_side.backward(loss)
        except (SkipBatch, RankFailedError) as error:
            out[f"{name}_error"] = np.array(type(error).__name__)
        out[f"{name}_grads_none"] = np.array(all(p.grad is None
                                                 for p in gm_side.net.parameters()))
        with gm_side.context(True):
            gm_side.backward(model(batch(0, rank)).square().sum())
    gm_side.after_sync(out, 0)
    ddp_side.backward(ddp_side.ddp(batch(0, rank)).square().sum())
    ddp_side.after_sync(out, 0)


SCENARIOS = {f.__name__: f for f in (compiled_model, ca_steps, ca_no_sync, ca_unused,
                                      ca_config, ca_one_rank, ca_late, ca_switch, ca_skip)}


def main(rank: int, world: int, outdir: str) -> None:
    run_named(SCENARIOS, rank, world, outdir)
