"""One rank of :mod:`diff_dp`: each program through ``data_parallel`` on one path and through
DDP (plain FSDP2 on the ``full`` path) on a copy of the model, recording by recording, saving
both sides' results."""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import os
import sys
import traceback
from typing import Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr import GradManager
from gradmgr.distributed import ShardedOptimizer, data_parallel, no_sync

from .diff_dp import LR, Program, Rec, Step, Wrap, batch, make_net, numpy_of, programs_of

NONE = np.array("None")  # a gradient that is None


class Kept(list):
    """The list the forward fills with its activations. A subclass, which torch's pytree
    does not take apart: FSDP2's pre-forward rebuilds the forward's arguments where one
    requires grad (an attached input), so a plain list filled there would be a copy."""


def value(t) -> np.ndarray:
    """``t`` as numpy; a DTensor (full sharding's parameters and ``.grad``): this rank's
    shard, so that no collective runs for it."""
    if t is not None and hasattr(t, "to_local"):
        t = t.to_local()
    return NONE if t is None else numpy_of(t)


def blocks_of(wrap: Wrap) -> list:
    return [nn.Linear] if wrap.blocks else []


def fsdp2(net, wrap: Wrap) -> None:
    """Plain FSDP2 as full sharding wraps: rank 0's parameters broadcast first (FSDP2 does
    not; ``data_parallel`` does, as DDP does), then ``fully_shard`` on each block (in the order
    full_shard.py takes them), then the root; summing, then dividing, over gloo, as full
    sharding has it do there (FSDP2's own average over gloo is the sum on torch 2.8)."""
    from torch.distributed.fsdp import fully_shard

    for p in net.parameters():
        dist.broadcast(p.data, 0)

    chosen = [m for m in net.modules() if m is not net and isinstance(m, tuple(blocks_of(wrap)))]
    for block in [*reversed(chosen), net]:
        fully_shard(block, reshard_after_forward=wrap.reshard_after_forward)
        block.set_force_sum_reduction_for_comms(True)


def set_frozen(net, frozen) -> Tuple[bool, bool]:
    """Freeze exactly the layers ``frozen``; whether a flag changed, and whether one was
    turned on."""
    changed = unfrozen = False
    for name, layer in net.named_children():
        for p in layer.parameters():
            want = name not in frozen
            changed |= p.requires_grad != want
            unfrozen |= want and not p.requires_grad
            p.requires_grad_(want)
    return changed, unfrozen


def extras(rec: Rec, keep: list, attach) -> None:
    """The rank's own doings after the forward: tensor hooks and attaches, in the drawn order."""
    def hook_all() -> None:
        for i, scale in rec.hooks:
            keep[i].register_hook(lambda g, s=scale: g * s)

    def attach_all() -> None:
        for i in rec.attach:
            attach(keep[i])

    first, second = (hook_all, attach_all) if rec.hooks_first else (attach_all, hook_all)
    first()
    second()


class Side:
    """gradmgr's manager on ``path``, or DDP (``ddp``) next to it, over its own copy of the
    model (``path`` "shard": parameters compared, not gradients, on both sides; ``path``
    "full": wrapped as ``wrap`` says, and plain FSDP2 instead of DDP)."""

    def __init__(self, net, path: str, wrap: Wrap, ddp: bool = False) -> None:
        self.net, self.path, self.ddp, self.in_ddp = net, None if ddp else path, None, set()
        self.shard, self.full = path == "shard", path == "full"
        self.renew = False  # a new ShardedOptimizer after this step's optimizer step
        if ddp and self.full:
            fsdp2(net, wrap)
        elif ddp:
            self._rebuild()
        elif self.full:
            self.gm = data_parallel(net, shard="full", blocks=blocks_of(wrap),
                                    reshard_after_forward=wrap.reshard_after_forward)
        else:
            self.gm = data_parallel(net, native=path == "native", shard=self.shard)
        self.opt = self._optimizer()

    def _optimizer(self):
        if self.shard and self.path is not None:
            return ShardedOptimizer(self.gm, torch.optim.SGD, lr=LR)
        return torch.optim.SGD(self.net.parameters(), lr=LR)

    def _rebuild(self) -> None:
        # DDP registers the trainable parameters when made: one unfrozen since needs a new
        # one; a parameter frozen since is unused on every rank (find_unused_parameters).
        self.ddp = None
        gc.collect()
        self.ddp = DDP(self.net, find_unused_parameters=True)
        self.in_ddp = {id(p) for p in self.net.parameters() if p.requires_grad}

    def freeze(self, frozen, in_window: bool) -> None:
        changed, unfrozen = set_frozen(self.net, frozen)
        if self.path is None and not self.full:
            if not {id(p) for p in self.net.parameters() if p.requires_grad} <= self.in_ddp:
                self._rebuild()
        elif changed and self.shard:  # the parameter set is fixed when it is made
            if in_window and not unfrozen:
                # frozen inside a no_sync window: planned until its synced step has reduced
                # it (docs/data-parallel.md), so the plan changes after that step
                self.renew = True
                return
            self.opt = None
            self.opt = self._optimizer()

    def record(self, x, rec: Rec, paused: bool, out: dict, key: str) -> None:
        """One recording (inside ``no_sync`` where ``paused``) of this rank's ``rec``; saves
        the input's and activations' gradients and the ``autograd.grad`` result."""
        keep: list = Kept()
        if rec.attach_input:
            x.requires_grad_(True)
        handle = None
        if rec.param_hook is not None:  # this rank alone, for this recording
            layer, scale = rec.param_hook
            handle = getattr(self.net, layer).weight.register_hook(lambda g, s=scale: g * s)
        try:
            dh = self._ddp_step(x, rec, paused, keep) if self.path is None else \
                self._gm_step(x, rec, paused, keep)
        finally:
            if handle is not None:
                handle.remove()
        if rec.attach_input:
            out[f"{key}/x"] = value(x.grad)
        for i in rec.attach:
            out[f"{key}/h{i}"] = value(keep[i].grad)
        if dh is not None:
            out[f"{key}/dh{rec.grad_of}"] = value(dh)

    def _paused(self, paused: bool):
        """DDP's ``no_sync()`` where ``paused``; FSDP2's switch, for this recording."""
        if self.full:
            self.net.set_requires_gradient_sync(not paused)
            return contextlib.nullcontext()
        return self.ddp.no_sync() if paused else contextlib.nullcontext()

    def _ddp_step(self, x, rec: Rec, paused: bool, keep: list):
        dh = None
        with self._paused(paused):
            loss = (self.net if self.full else self.ddp)(x, keep, rec.skip_side)
            extras(rec, keep, lambda h: None)
            if rec.grad_of is not None:
                dh = torch.autograd.grad(loss, keep[rec.grad_of], retain_graph=True)[0]
            for i in rec.attach:  # after autograd.grad, which writes a retained .grad too
                keep[i].retain_grad()  # (runs after the tensor's hooks wherever made)
            loss.backward()
        return dh

    def _gm_step(self, x, rec: Rec, paused: bool, keep: list):
        dh = None
        with no_sync(self.gm) if paused else contextlib.nullcontext(), self.gm:
            if rec.attach_input:
                self.gm.attach(x)
            loss = self.net(x, keep, rec.skip_side)
            extras(rec, keep, self.gm.attach)
            if rec.grad_of is not None:
                dh = torch.autograd.grad(loss, keep[rec.grad_of], retain_graph=True)[0]
            self.gm.backward(loss)
        return dh

    def refuse(self, kind: str, x, paused: bool) -> str:
        """A recording that full sharding refuses (``REFUSALS[kind]``), written as users
        write it; the error it raised, or "no error"."""
        keep: list = Kept()
        x.requires_grad_(True)
        try:
            with no_sync(self.gm) if paused else contextlib.nullcontext(), self.gm:
                if kind == "split":
                    self.gm.attach(x)
                    self.gm.backward_split(self.net(x, keep), first=[x]).finish()
                    return "no error"
                if kind == "manager":  # WGAN-GP's input gradient by an inner manager
                    inner = GradManager().attach(x)
                    with inner:
                        inner.backward(self.net(x, keep))
                    slope = x.grad
                else:
                    slope, = torch.autograd.grad(self.net(x, keep), x, create_graph=True)
                self.gm.backward(self.net(x.detach(), keep) + slope.square().sum())
        except Exception as exc:  # noqa: BLE001 - the test reads it
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    def after_step(self, zero: str, out: dict, key: str) -> None:
        """Gradients (unsharded), the optimizer's step, the parameters, then ``zero``."""
        named = list(self.net.named_parameters())
        if not self.shard:
            for name, p in named:
                out[f"{key}/grad/{name}"] = value(p.grad)
        self.opt.step()
        if self.renew:
            self.renew, self.opt = False, None
            self.opt = self._optimizer()
        for name, p in named:
            out[f"{key}/param/{name}"] = value(p)
        if zero == "none":
            self.opt.zero_grad()
        elif zero == "zeros":
            self.net.zero_grad(set_to_none=False)

    def close(self) -> None:
        self.opt = self.ddp = None
        if self.path is not None:
            del self.gm  # before the next manager, as with DDP


def run_step(index: int, j: int, step: Step, rank: int, sides: dict, out: dict) -> None:
    for m, rec in enumerate(step.recs[rank]):
        for label, side in sides.items():
            side.freeze(step.frozen[m], in_window=m > 0)
            for n, (at, kind) in enumerate(step.refused):  # gradmgr's side only
                if at == m and side.path is not None:
                    x = batch(index, j, 5 + n, rank, rec.rows)
                    out[f"s{j}/r{n}/refusal"] = np.array(side.refuse(kind, x, m < step.micro))
            key = f"s{j}/m{m}/{label}"
            side.record(batch(index, j, m, rank, rec.rows), rec, m < step.micro, out, key)
    for label, side in sides.items():
        side.after_step(step.zero, out, f"s{j}/{label}")


def run_program(index: int, program: Program, rank: int, path: str, out: dict) -> None:
    wrap = program.wrap or Wrap(False, True)  # (only the full path reads it)
    sides = {"gm": Side(make_net(index, rank), path, wrap=wrap),
             "ddp": Side(make_net(index, rank), path, ddp=True, wrap=wrap)}
    try:
        for j, step in enumerate(program.steps):
            run_step(index, j, step, rank, sides, out)
    finally:
        for side in sides.values():
            side.close()
        del sides
        gc.collect()


def rank_main(rank: int, world: int, port: int, outdir: str, path: str, n: int,
              seed: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    for index, program in enumerate(programs_of(path, n, seed)):
        out: dict = {}
        target = os.path.join(outdir, f"rank{rank}_p{index}.npz")  # one per program: a rank
        try:  # that dies leaves those it did
            run_program(index, program, rank, path, out)
        except Exception as exc:  # a finding: saved, and no program after it (out of step)
            out["error"] = np.array(f"{type(exc).__name__}: {exc}\n"
                                    + traceback.format_exc()[-2000:])
            np.savez(target, **out)
            raise
        out["done"] = np.array(True)
        np.savez(target, **out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list) -> int:
    from gradmgr.distributed import spawn_local

    job = importlib.import_module("differential.diff_dp_run")  # importable by new processes
    return spawn_local(job.rank_main, 2, argv[0], argv[1], int(argv[2]), int(argv[3]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
