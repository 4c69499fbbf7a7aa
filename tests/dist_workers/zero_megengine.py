"""Rank program: MegEngine's sharded path (reduce-scattered gradients over torch.distributed
gloo, ``ShardedOptimizer`` wrapping MegEngine's own optimizers) next to MegEngine's own
single-process training on the whole batch (every rank's rows concatenated), computed on each
rank; every rank pickles numpy values to ``OUTDIR/rank{RANK}.pkl`` for the parent to compare.

``GRADMGR_ZERO_PART`` picks the scenarios: ``main`` (2 ranks: AdamW through ``data_parallel``
with accumulation under ``no_sync``, clipping and a frozen layer, a checkpoint written to
OUTDIR; SGD with momentum and two parameter groups through a callback attached by hand, the
frozen layer not attached; AdamW over every parameter, the frozen layer not attached) or
``reload`` (another world size: the checkpoint loaded, into an optimizer made before the
model's weights were loaded, and trained on).
"""

from __future__ import annotations

import contextlib
import os
import pickle

import megengine as mge
import megengine.functional as F
import megengine.module as M
import numpy as np
from megengine.autodiff import GradManager as NativeGradManager
from megengine.optimizer import SGD, AdamW, clip_grad_norm

from gradmgr import GradManager
from gradmgr.distributed import (
    ShardedOptimizer,
    data_parallel,
    make_reduce_scatter_cb,
    no_sync,
)

from .outcomes import raised

LR, WEIGHT_DECAY = 1e-2, 0.05
ROWS = 4  # each rank's micro-batch
BUCKET_BYTES = 400  # small buckets: layers cross the ranks' chunk borders


class Net(M.Module):
    """Three Linear layers; the middle one is frozen. MegEngine tensors have no
    ``requires_grad`` flag: with ``detach_frozen`` its weights are detached in the forward (the
    layer is attached but no rank ever gives it a gradient), otherwise it is simply not
    attached (MegEngine's usual way)."""

    def __init__(self, detach_frozen: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = M.Linear(8, 16), M.Linear(16, 16), M.Linear(16, 3)
        self.detach_frozen = detach_frozen
        rng = np.random.default_rng(0)
        for _, p in sorted(self.named_parameters()):
            p._reset(mge.Tensor((0.3 * rng.standard_normal(p.shape)).astype("float32")))

    def forward(self, x):
        h = F.tanh(self.fc1(x))
        if self.detach_frozen:
            h = F.linear(h, self.fc2.weight.detach(), self.fc2.bias.detach())
        else:
            h = self.fc2(h)
        return self.fc3(F.tanh(h))

    def trainable(self) -> list:
        return [*self.fc1.parameters(), *self.fc3.parameters()]


def batch(step: int, micro: int, world: int) -> tuple:
    """The whole batch of one micro-batch: ``ROWS`` rows per rank."""
    rng = np.random.default_rng(1000 * step + micro)
    x = rng.standard_normal((world * ROWS, 8)).astype("float32")
    y = rng.standard_normal((world * ROWS, 3)).astype("float32")
    return x, y


def rows(array: np.ndarray, rank: int) -> mge.Tensor:
    return mge.Tensor(array[rank * ROWS:(rank + 1) * ROWS])


def loss_of(net: Net, x, y):
    return F.mean((net(x) - y) ** 2)


def values(net: Net) -> dict:
    return {name: p.numpy().copy() for name, p in net.named_parameters()}


def numpy_state(state: dict) -> dict:
    """An optimizer state_dict with every tensor as numpy (MegEngine's own format)."""
    return {"param_groups": state["param_groups"],
            "state": {i: {k: np.asarray(v.numpy() if isinstance(v, mge.Tensor) else v)
                          for k, v in s.items()}
                      for i, s in state["state"].items()}}


def train(sharded: tuple, native: tuple, rank: int, world: int, steps, max_norm: float,
          micro_batches: int = 2) -> dict:
    """Steps of ``micro_batches`` micro-batches, all but the last under ``no_sync``; clipped.
    ``sharded`` = (net, gm, opt) on this rank's rows, ``native`` = (net, gm, opt, params) of
    MegEngine's own training on the whole batch. The values of both after every step."""
    net, gm, opt = sharded
    ref, ref_gm, ref_opt, ref_params = native
    out = {"ours": [], "native": [], "norms": []}
    for step in steps:
        for micro in range(micro_batches):
            x, y = batch(step, micro, world)
            last = micro == micro_batches - 1
            with no_sync(gm) if not last else contextlib.nullcontext(), gm:
                gm.backward(loss_of(net, rows(x, rank), rows(y, rank)))
            with ref_gm:
                ref_gm.backward(loss_of(ref, mge.Tensor(x), mge.Tensor(y)))
        norm = opt.clip_grad_norm_(max_norm)
        ref_norm = float(clip_grad_norm(ref_params, max_norm).numpy())
        out["norms"].append((norm, ref_norm))
        out["memory"] = opt.memory()  # with this step's gradient shards
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.clear_grad()
        out["ours"].append(values(net))
        out["native"].append(values(ref))
    return out


def adamw_data_parallel(out: dict, rank: int, world: int, outdir: str, max_norm: float,
                        name: str) -> None:
    """data_parallel(net, shard=True) + AdamW; the frozen layer detached in the forward."""
    net, ref = Net(detach_frozen=True), Net(detach_frozen=True)
    gm = data_parallel(net, shard=True, bucket_bytes=BUCKET_BYTES)
    opt = ShardedOptimizer(gm, AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_gm = NativeGradManager().attach(ref.parameters())
    ref_opt = AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    out[name] = train((net, gm, opt), (ref, ref_gm, ref_opt, list(ref.parameters())), rank,
                      world, range(3), max_norm)
    state = opt.state_dict()  # on every rank: it communicates
    out[name]["state"] = numpy_state(state)
    out[name]["native_state"] = numpy_state(ref_opt.state_dict())
    if rank == 0 and outdir:
        with open(os.path.join(outdir, "checkpoint.pkl"), "wb") as f:
            pickle.dump({"params": values(net), "optimizer": state,
                         "native_optimizer": ref_opt.state_dict()}, f)


def sgd_groups(net: Net) -> list:
    weights = [net.fc1.weight, net.fc3.weight]
    biases = [net.fc1.bias, net.fc3.bias]
    return [{"params": weights, "weight_decay": 1e-2}, {"params": biases, "weight_decay": 0.0}]


def sgd_by_hand(out: dict, rank: int, world: int) -> None:
    """A reduce-scatter callback attached by hand to the trainable layers (the frozen one is
    not attached), SGD with momentum over two parameter groups."""
    net, ref = Net(detach_frozen=False), Net(detach_frozen=False)
    gm = GradManager().attach(net.trainable(), callbacks=[
        make_reduce_scatter_cb("mean", bucket_bytes=BUCKET_BYTES)])
    opt = ShardedOptimizer(gm, SGD, sgd_groups(net), lr=0.05, momentum=0.9)
    ref_gm = NativeGradManager().attach(ref.trainable())
    ref_opt = SGD(sgd_groups(ref), lr=0.05, momentum=0.9)
    out["sgd"] = train((net, gm, opt), (ref, ref_gm, ref_opt, ref.trainable()), rank, world,
                       range(3), max_norm=0.5, micro_batches=3)
    out["sgd"]["state"] = numpy_state(opt.state_dict())
    out["sgd"]["native_state"] = numpy_state(ref_opt.state_dict())


def adamw_not_attached(out: dict, rank: int, world: int) -> None:
    """AdamW over every parameter (``params=``), through a callback attached by hand to the
    trainable layers only (the frozen one not attached, MegEngine's way): the frozen layer is
    numbered, sliced over the ranks and never stepped, so the state dict is MegEngine's own
    AdamW's over all of them (the frozen layer's as MegEngine made it: zeros, step 0)."""
    net, ref = Net(detach_frozen=False), Net(detach_frozen=False)
    gm = GradManager().attach(net.trainable(), callbacks=[
        make_reduce_scatter_cb("mean", bucket_bytes=BUCKET_BYTES)])
    opt = ShardedOptimizer(gm, AdamW, list(net.parameters()), lr=LR, weight_decay=WEIGHT_DECAY)
    ref_gm = NativeGradManager().attach(ref.trainable())
    ref_opt = AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    out["not_attached"] = train((net, gm, opt), (ref, ref_gm, ref_opt, ref.trainable()), rank,
                                world, range(2), max_norm=1e6)
    out["not_attached"]["state"] = numpy_state(opt.state_dict())
    out["not_attached"]["native_state"] = numpy_state(ref_opt.state_dict())


def reload(out: dict, rank: int, world: int, outdir: str) -> None:
    """The 2-rank checkpoint on this world size. The optimizer is made before the model's
    weights are loaded (build everything, then resume): its segments must follow the loaded
    weights. MegEngine's own AdamW loads the same dict and trains on the whole batch."""
    with open(os.path.join(outdir, "checkpoint.pkl"), "rb") as f:
        saved = pickle.load(f)
    net, ref = Net(detach_frozen=True), Net(detach_frozen=True)
    gm = data_parallel(net, shard=True, bucket_bytes=BUCKET_BYTES)
    opt = ShardedOptimizer(gm, AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    net.load_state_dict(saved["params"])
    ref.load_state_dict(saved["params"])
    opt.load_state_dict(saved["optimizer"])
    ref_opt = AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    ref_opt.load_state_dict(saved["optimizer"])
    out["saved"] = numpy_state(saved["optimizer"])
    out["saved_native"] = numpy_state(saved["native_optimizer"])
    out["reload_state"] = numpy_state(opt.state_dict())
    # MegEngine's own optimizer's state_dict (numpy arrays) loads as well
    other = ShardedOptimizer(gm, AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    other.load_state_dict(saved["native_optimizer"])
    out["from_native_state"] = numpy_state(other.state_dict())
    ref_gm = NativeGradManager().attach(ref.parameters())
    out["reload"] = train((net, gm, opt), (ref, ref_gm, ref_opt, list(ref.parameters())), rank,
                          world, range(5, 7), max_norm=1e6)


def habits(out: dict, rank: int, world: int) -> None:
    """Issue 25 items 5c and 5b on MegEngine: ranks that build ShardedOptimizer with other
    groups (rank 0 one group with weight_decay=0.01, the others two with 0.5 and 0.0) raise
    RankMismatchError on every rank; ``if rank == 0: opt.state_dict()`` then a barrier raises
    on rank 0 once the group's timeout (5 s here) has passed, and training goes on, equal to
    MegEngine's own on the whole batch."""
    import datetime

    import torch.distributed as dist

    c10d = dist.distributed_c10d
    c10d._get_process_group_store(c10d._get_default_group()).set_timeout(
        datetime.timedelta(seconds=5))
    net, ref = Net(detach_frozen=True), Net(detach_frozen=True)
    gm = data_parallel(net, shard=True, bucket_bytes=BUCKET_BYTES)
    if rank == 0:
        out["groups_differ"] = raised(lambda: ShardedOptimizer(gm, AdamW, lr=LR,
                                                               weight_decay=0.01))
    else:
        params = list(net.parameters())  # the frozen layer is attached: every parameter
        groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.5},
                  {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0}]
        out["groups_differ"] = raised(lambda: ShardedOptimizer(gm, AdamW, groups, lr=LR))
    opt = ShardedOptimizer(gm, AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    ref_gm = NativeGradManager().attach(ref.parameters())
    ref_opt = AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sharded, native = (net, gm, opt), (ref, ref_gm, ref_opt, list(ref.parameters()))
    out["before"] = train(sharded, native, rank, world, range(2), max_norm=1e6)
    out["lone_state_dict"] = raised(opt.state_dict) if rank == 0 else None
    dist.barrier()
    out["after"] = train(sharded, native, rank, world, range(2, 4), max_norm=1e6)
    out["state"] = numpy_state(opt.state_dict())
    out["native_state"] = numpy_state(ref_opt.state_dict())


def main(rank: int, world: int, outdir: str) -> None:
    out: dict = {"world": world, "start": values(Net(detach_frozen=True))}
    if os.environ.get("GRADMGR_ZERO_PART") == "habits":
        habits(out, rank, world)
    elif os.environ.get("GRADMGR_ZERO_PART", "main") == "main":
        adamw_data_parallel(out, rank, world, outdir, max_norm=1e6, name="adamw")
        adamw_data_parallel(out, rank, world, "", max_norm=0.05, name="clipped")
        sgd_by_hand(out, rank, world)
        adamw_not_attached(out, rank, world)
    else:
        reload(out, rank, world, outdir)
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
