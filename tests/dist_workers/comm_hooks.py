"""Rank program for DDP communication hooks (issue 26, item 3): gradmgr with ``comm_hook=``
next to DDP with ``register_comm_hook``, the same hook, several SGD steps.

A scenario is ``{hook}_{path}_{buckets}``: ``hook`` one of :data:`HOOKS`, ``path`` ``native``
(torch's C++ reducer) or ``python`` (gradmgr's buckets), ``buckets`` ``one`` (DDP's default
cap: one bucket) or ``two`` (a cap that makes two). Each saves, after every step, both models'
parameters (``{name}_s{step}_gm{i}``, ``..._ddp{i}``) and, for PowerSGD, plain DDP's
(``..._ref{i}``); ``probe_{path}`` saves what a hook saw of each bucket on both sides.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr import GradManager
from gradmgr.distributed import RankMismatchError, data_parallel, make_allreduce_cb, no_sync
from gradmgr.manager import callback_chains

from .data import batch, shard
from .scenarios import run_named

STEPS = 6
TWO_BUCKETS_BYTES = 200  # without the unused layer: out and hidden.bias, then hidden.weight


class HookNet(nn.Module):
    """A frozen first layer, two trained ones with biases, and (``unused``) a layer never
    used."""

    def __init__(self, unused: bool = True) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.frozen = nn.Linear(6, 16)
        self.hidden = nn.Linear(16, 12)
        self.out = nn.Linear(12, 3)
        if unused:
            self.unused = nn.Linear(5, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(torch.tanh(self.frozen(x))))
        return ((self.out(h) - y) ** 2).mean()


def bf16_renamed(state, bucket):
    """torch's bf16_compress_hook under another name: DDP refuses the hook by its name where
    NCCL is missing (gloo), though gloo reduces bf16."""
    return default_hooks.bf16_compress_hook(state, bucket)


def quantize_hook(state, bucket):
    """A user's hook: each rank's gradients rounded to multiples of 2**-8, averaged; the
    result is a tensor of its own (not the bucket's memory)."""
    world = dist.get_world_size()
    quantized = torch.round(bucket.buffer() * 256) / 256 / world
    return dist.all_reduce(quantized, async_op=True).get_future().then(lambda f: f.value()[0])


def int8_hook(state, bucket):
    """A user's hook that scales by the bucket's largest value (8-bit quantization): a flag
    of gradmgr's in the buffer (a 1) would change the scale, and so every gradient."""
    world = dist.get_world_size()
    buffer = bucket.buffer()
    scale = buffer.abs().max().clamp_min(1e-30) / 127
    quantized = torch.round(buffer / scale) * scale / world
    return dist.all_reduce(quantized, async_op=True).get_future().then(lambda f: f.value()[0])


def powersgd_state() -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, random_seed=0)


HOOKS = {  # name: (gradmgr's hook, DDP's hook, a fresh state)
    "allreduce": (default_hooks.allreduce_hook, default_hooks.allreduce_hook, lambda: None),
    "fp16": (default_hooks.fp16_compress_hook, default_hooks.fp16_compress_hook,
             lambda: None),
    "bf16": (default_hooks.bf16_compress_hook, bf16_renamed, lambda: None),
    "quantize": (quantize_hook, quantize_hook, lambda: None),
    "int8": (int8_hook, int8_hook, lambda: None),
    "powersgd": (powerSGD_hook.powerSGD_hook, powerSGD_hook.powerSGD_hook, powersgd_state),
}


def local_batch(step: int, rank: int, world: int) -> tuple:
    x, y = batch(step)
    return torch.from_numpy(shard(x, rank, world)), torch.from_numpy(shard(y, rank, world))


def params(module: nn.Module) -> list:
    return [p.detach().numpy().copy() for p in module.parameters()]


def save(out: dict, prefix: str, values: list) -> None:
    for i, v in enumerate(values):
        out[f"{prefix}{i}"] = v


def sgd_step(module: nn.Module, opt: torch.optim.Optimizer, backward, x, y) -> np.ndarray:
    """One step; which parameters had no ``.grad`` (the frozen and the unused layer's)."""
    backward(module(x, y))
    none = np.array([p.grad is None for p in module.parameters()])
    opt.step()
    opt.zero_grad(set_to_none=True)
    return none


def ddp_options(unused: bool, cap) -> dict:
    return dict(find_unused_parameters=unused,
                bucket_cap_mb=None if cap is None else cap / 2**20)


def train(out: dict, rank: int, world: int, name: str, path: str, buckets: str) -> None:
    """``STEPS`` SGD steps of gradmgr and DDP with the hook ``name`` (and plain DDP for
    PowerSGD); parameters saved after each.

    PowerSGD runs without the unused layer, and DDP without ``find_unused_parameters``: with
    it, DDP launches its used-parameters allreduce while PowerSGD's future callbacks launch
    theirs, and over gloo the two ranks pair them differently (a gloo abort, DDP's own)."""
    ours, theirs, state = HOOKS[name]
    cap = TWO_BUCKETS_BYTES if buckets == "two" else None
    unused = name != "powersgd"
    net, net_ddp, net_ref = HookNet(unused), HookNet(unused), HookNet(unused)
    gm = data_parallel(net, comm_hook=ours, comm_state=state(), native=path == "native",
                       bucket_bytes=cap)
    ddp = DDP(net_ddp, **ddp_options(unused, cap))
    ddp.register_comm_hook(state(), theirs)
    ref = DDP(net_ref, **ddp_options(unused, cap)) if name == "powersgd" else None
    sides = [(net, gm)] + [(m, None) for m in (ddp, ref) if m is not None]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m, _ in sides]

    for step in range(STEPS):
        x, y = local_batch(step, rank, world)
        prefix = f"{name}_{path}_{buckets}_s{step}"
        with gm:
            out[f"{prefix}_none_gm"] = sgd_step(net, opts[0], gm.backward, x, y)
        for (module, _), opt, side in zip(sides[1:], opts[1:], ("ddp", "ref")):
            out[f"{prefix}_none_{side}"] = sgd_step(module, opt, lambda loss: loss.backward(),
                                                    x, y)
        save(out, f"{prefix}_gm", params(net))
        save(out, f"{prefix}_ddp", params(net_ddp))
        if ref is not None:
            save(out, f"{prefix}_ref", params(net_ref))
    cb = next(chain[0] for _, chain in callback_chains(gm) if chain)
    out[f"{name}_{path}_{buckets}_path"] = np.array(str(cb.path(gm)))


def powersgd_mlp(out: dict, rank: int, world: int, path: str) -> None:
    """Issue 38: PowerSGD on a 16-32-32-4 MLP, 10 steps, against DDP with it (one bucket, as
    DDP's). On the reducer path the hook's view of the last bucket began after the used
    flags, 28 bytes off the 64-byte alignment of DDP's buffer, and torch.matmul rounded
    differently there: 3e-8 apart after 10 steps."""
    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                             nn.Linear(32, 4))

    model, reference = mlp(), mlp()
    gm = data_parallel(model, comm_hook=powerSGD_hook.powerSGD_hook,
                       comm_state=powersgd_state(), native=path == "native")
    ddp = DDP(reference)
    ddp.register_comm_hook(powersgd_state(), powerSGD_hook.powerSGD_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(10):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        with gm:
            gm.backward(nn.functional.mse_loss(model(x), y))
        nn.functional.mse_loss(ddp(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    save(out, f"powersgd_mlp_{path}_gm", params(model))
    save(out, f"powersgd_mlp_{path}_ddp", params(reference))
    del gm, ddp


def probe_hook(names: dict, seen: list):
    """A hook that records what it sees of each bucket, then averages it."""

    def probe(state, bucket):
        shapes = [tuple(g.shape) for g in bucket.gradients()]
        members = [names[id(p)] for p in bucket.parameters()]
        seen.append(f"{bucket.index()} last={bucket.is_last()} grads={shapes} "
                    f"params={members} numel={bucket.buffer().numel()}")
        return default_hooks.allreduce_hook(state, bucket)

    return probe


def probe(out: dict, rank: int, world: int, path: str) -> None:
    """What a hook sees of each bucket, gradmgr's and DDP's (by default: buckets re-formed in
    the order gradients arrived, after the first step), at three steps."""
    for buckets, cap in (("one", None), ("two", TWO_BUCKETS_BYTES)):
        net, net_ddp = HookNet(False), HookNet(False)
        ours, theirs = [], []
        gm = data_parallel(net, native=path == "native", bucket_bytes=cap, comm_hook=probe_hook(
            {id(p): n for n, p in net.named_parameters()}, ours))
        ddp = DDP(net_ddp, **ddp_options(False, cap))
        ddp.register_comm_hook(None, probe_hook(
            {id(p): n for n, p in net_ddp.named_parameters()}, theirs))
        for step in range(3):
            x, y = local_batch(step, rank, world)
            with gm:
                gm.backward(net(x, y))
            ddp(x, y).backward()
        out[f"probe_{path}_{buckets}_gm"] = np.array(ours)
        out[f"probe_{path}_{buckets}_ddp"] = np.array(theirs)


def accumulate(out: dict, rank: int, world: int, path: str) -> None:
    """Gradient accumulation with fp16_compress_hook: a ``no_sync`` micro-batch, then a
    synced one (the hook sees both summed), three times; DDP's ``no_sync`` next to it."""
    hook = default_hooks.fp16_compress_hook
    net, net_ddp = HookNet(), HookNet()
    gm = data_parallel(net, comm_hook=hook, native=path == "native")
    ddp = DDP(net_ddp, find_unused_parameters=True)
    ddp.register_comm_hook(None, hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (net, net_ddp)]
    for step in range(3):
        for micro in range(2):
            x, y = local_batch(2 * step + micro, rank, world)
            if micro == 0:
                with no_sync(gm), gm:
                    gm.backward(net(x, y))
                with ddp.no_sync():
                    ddp(x, y).backward()
            else:
                with gm:
                    gm.backward(net(x, y))
                ddp(x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        save(out, f"accumulate_{path}_s{step}_gm", params(net))
        save(out, f"accumulate_{path}_s{step}_ddp", params(net_ddp))


def raising(out: dict, rank: int, world: int, path: str) -> None:
    """A hook that raises at its second call, returns no future at its third and a future of
    a tensor of the wrong shape at its fourth: each of those backwards raises, on every rank;
    the ranks stay paired, and the next steps (the hook then right) equal DDP's."""
    calls = []

    def hook(state, bucket):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("the hook failed")
        if len(calls) == 3:
            return bucket.buffer()
        future = default_hooks.allreduce_hook(state, bucket)
        return future.then(lambda f: f.value()[:1]) if len(calls) == 4 else future

    net, net_ddp = HookNet(), HookNet()
    gm = data_parallel(net, comm_hook=hook, native=path == "native")
    ddp = DDP(net_ddp, find_unused_parameters=True)
    errors = []
    for step in range(6):
        x, y = local_batch(step, rank, world)
        try:
            with gm:
                gm.backward(net(x, y))
        except Exception as error:  # noqa: BLE001 - what the step raised, kept as text
            errors.append(f"{step}: {type(error).__name__}: {error}"[:300])
            net.zero_grad(set_to_none=True)
            continue
        ddp(x, y).backward()
        save(out, f"raising_{path}_s{step}_gm", [p.grad.numpy().copy() for p in
                                                 net.parameters() if p.grad is not None])
        save(out, f"raising_{path}_s{step}_ddp", [p.grad.numpy().copy() for p in
                                                  net_ddp.parameters() if p.grad is not None])
        for m in (net, net_ddp):
            m.zero_grad(set_to_none=True)
    out[f"raising_{path}_errors"] = np.array(errors)


def one_rank(out: dict, rank: int, world: int, path: str, buckets: str = "one") -> None:
    """Issue 38: a hook whose future's ``.then()`` callback raises on rank 0 only (at step 1),
    then one that raises on rank 0 only after launching its allreduce (at step 2), on the
    bucket of index 0 (with ``buckets="two"``, not the one that holds the used-flags on the
    reducer's path): on rank 0 the backward raises the hook's error, on rank 1
    RankFailedError; the ranks stay paired and the next steps equal DDP's. Each step's hook
    calls are counted (a hook that raises is called once per bucket)."""
    calls, now = [], [0]

    def hook(state, bucket):
        calls.append(1)
        future = default_hooks.allreduce_hook(state, bucket)
        if rank == 0 and bucket.index() == 0 and now[0] == 1:
            def fail(_):
                raise ValueError("the callback failed")
            return future.then(fail)
        if rank == 0 and bucket.index() == 0 and now[0] == 2:
            raise ValueError("the hook failed")
        return future

    # no unused layer: the bucket goes out during the backward (where a hook that raised used
    # to be called again, for the failed step's collectives)
    name = f"one_rank_{path}" if buckets == "one" else f"one_rank_{buckets}_{path}"
    cap = TWO_BUCKETS_BYTES if buckets == "two" else None
    net, net_ddp = HookNet(False), HookNet(False)
    gm = data_parallel(net, comm_hook=hook, native=path == "native", bucket_bytes=cap)
    ddp = DDP(net_ddp, **ddp_options(False, cap))
    errors, counts, cleared = [], [], []
    for step in range(5):
        x, y = local_batch(step, rank, world)
        before, now[0] = len(calls), step
        try:
            with gm:
                gm.backward(net(x, y))
            save(out, f"{name}_s{step}_gm", [p.grad.numpy().copy() for p in
                                             net.parameters() if p.grad is not None])
        except Exception as error:  # noqa: BLE001 - what the step raised, kept as text
            errors.append(f"{step}: {type(error).__name__}: {error}"[:300])
            cleared.append(all(p.grad is None for p in net.parameters()))
        counts.append(len(calls) - before)
        now[0] = -1  # DDP's steps: the hook is not registered there; kept out all the same
        ddp(x, y).backward()  # on every rank at every step: DDP's collectives stay paired
        save(out, f"{name}_s{step}_ddp", [p.grad.numpy().copy() for p in
                                          net_ddp.parameters() if p.grad is not None])
        for m in (net, net_ddp):
            m.zero_grad(set_to_none=True)
    out[f"{name}_cleared"] = np.array(cleared)
    out[f"{name}_errors"] = np.array(errors)
    out[f"{name}_calls"] = np.array(counts)


def racing(out: dict, rank: int, world: int, path: str) -> None:
    """PowerSGD over gloo with two buckets (DDP hangs there): ValueError on every rank, at
    every step, instead of an abort inside gloo."""
    net = HookNet(False)
    cb = make_allreduce_cb("mean", comm_hook=powerSGD_hook.powerSGD_hook,
                           comm_state=powersgd_state(), native=path == "native",
                           bucket_bytes=TWO_BUCKETS_BYTES)
    gm = GradManager().attach(net.parameters(), callbacks=[cb])
    errors = []
    for step in range(2):
        x, y = local_batch(step, rank, world)
        try:
            with gm:
                gm.backward(net(x, y))
            errors.append("no error")
        except ValueError as error:
            errors.append(str(error))
        net.zero_grad(set_to_none=True)
    out[f"racing_{path}_errors"] = np.array(errors)


def mismatch(out: dict, rank: int, world: int, path: str) -> None:
    """Rank 0 with fp16_compress_hook, rank 1 with allreduce_hook: their collectives would not
    pair; every rank raises RankMismatchError at the first step, naming the hooks."""
    hook = default_hooks.fp16_compress_hook if rank == 0 else default_hooks.allreduce_hook
    net = HookNet()
    gm = data_parallel(net, comm_hook=hook, native=path == "native")
    x, y = local_batch(0, rank, world)
    try:
        with gm:
            gm.backward(net(x, y))
        out[f"mismatch_{path}_error"] = np.array("no error")
    except RankMismatchError as error:
        out[f"mismatch_{path}_error"] = np.array(str(error))


def scenarios() -> dict:
    table = {}
    for name in HOOKS:
        for path in ("native", "python"):
            for buckets in ("one", "two"):  # (PowerSGD on two: see the test)
                table[f"{name}_{path}_{buckets}"] = (
                    lambda out, rank, world, n=name, p=path, b=buckets:
                    train(out, rank, world, n, p, b))
    for path in ("native", "python"):
        for kind, run in (("probe", probe), ("accumulate", accumulate), ("raising", raising),
                          ("mismatch", mismatch), ("racing", racing),
                          ("powersgd_mlp", powersgd_mlp), ("one_rank", one_rank)):
            table[f"{kind}_{path}"] = (lambda out, rank, world, p=path, run=run:
                                      run(out, rank, world, p))
        table[f"one_rank_two_{path}"] = (lambda out, rank, world, p=path:
                                         one_rank(out, rank, world, p, "two"))
    return table


def main(rank: int, world: int, outdir: str) -> None:
    run_named(scenarios(), rank, world, outdir)
