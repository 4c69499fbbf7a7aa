"""Rank program: sharded data parallelism (reduce-scattered gradients, ShardedOptimizer) next to
DDP with the same optimizer, on the ranks' own data; every rank pickles what the parent checks
to ``OUTDIR/rank{RANK}.pkl``.

``GRADMGR_ZERO_PART`` picks the scenarios: ``main`` (2 ranks: training with accumulation, a
frozen layer, clipping, bf16 master weights, a failing rank, wide layers gathered by
broadcasts, and a checkpoint written to OUTDIR/checkpoint.pt) or ``reload`` (another world
size: the checkpoint loaded and trained on).
"""

from __future__ import annotations

import copy
import os
import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import RankFailedError, ShardedOptimizer, data_parallel, no_sync

LR, WEIGHT_DECAY = 1e-2, 0.05


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """An MLP with a frozen middle layer; small buckets so that layers cross chunk borders."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 3)).to(dtype)
    net[2].requires_grad_(False)
    return net


def batch(step: int, micro: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(5, 8, generator=g).to(dtype)


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).float().square().mean()


def params_of(net: nn.Module) -> list:
    return [p.detach().float().clone() for p in net.parameters()]


def pair(dtype: torch.dtype = torch.float32, **options):
    """gradmgr sharded and DDP, from the same weights, each with AdamW."""
    ours, theirs = model(dtype), model(dtype)
    gm = data_parallel(ours, shard=True, bucket_bytes=400, **options)
    ddp = DDP(theirs)
    return ours, gm, theirs, ddp


def train(out: dict, name: str, rank: int, max_norm: float, steps: int = 3) -> tuple:
    """Steps of 2 micro-batches, the first accumulated under no_sync on both sides."""
    ours, gm, theirs, ddp = pair()
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    # As ShardedOptimizer's default params: every parameter, numbered frozen ones included
    # (AdamW skips them: they get no gradient).
    ref = torch.optim.AdamW(theirs.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    norms = []
    for step in range(steps):
        for micro in range(2):
            x = batch(step, micro, rank)
            with no_sync(gm) if micro == 0 else _null(), gm:
                gm.backward(loss_of(ours, x))
            with ddp.no_sync() if micro == 0 else _null():
                loss_of(ddp, x).backward()
        norms.append((opt.clip_grad_norm_(max_norm),
                      float(nn.utils.clip_grad_norm_(theirs.parameters(), max_norm))))
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    out[name] = {"ours": params_of(ours), "ddp": params_of(theirs), "norms": norms,
                 "frozen_start": params_of(model())[2], "memory": opt.memory()}
    return ours, opt, theirs, ref


def _null():
    import contextlib

    return contextlib.nullcontext()


def checkpoint(out: dict, rank: int, outdir: str) -> None:
    """Train, compare the consolidated state with DDP's AdamW, and save both sides."""
    ours, opt, theirs, ref = train(out, "checkpoint_train", rank, max_norm=1e6)
    state = opt.state_dict()
    mine = ref.state_dict()
    out["state_equal"] = [torch.equal(state["state"][i][k], mine["state"][i][k])
                          for i in mine["state"] for k in mine["state"][i]]
    out["state_keys"] = (sorted(state["state"]), sorted(mine["state"]))
    if rank == 0:
        torch.save({"params": ours.state_dict(), "optimizer": state},
                   os.path.join(outdir, "checkpoint.pt"))


def bf16_masters(out: dict, rank: int) -> None:
    """bf16 parameters stepped through fp32 master segments, against DDP on the same bf16
    model whose AdamW steps fp32 copies of the parameters (the same arithmetic, unsharded)."""
    ours, gm, theirs, ddp = pair(torch.bfloat16)
    opt = ShardedOptimizer(gm, torch.optim.AdamW, master_dtype="float32", lr=LR)
    trainable = [p for p in theirs.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in trainable]
    ref = torch.optim.AdamW(masters, lr=LR)
    for step in range(3):
        x = batch(step, 0, rank, torch.bfloat16)
        with gm:
            gm.backward(loss_of(ours, x))
        loss_of(ddp, x).backward()
        for master, p in zip(masters, trainable):
            master.grad = p.grad.float()
            p.grad = None
        opt.step()
        ref.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, trainable):
                p.copy_(master)
    out["bf16"] = {"ours": params_of(ours), "ddp": params_of(theirs),
                   "dtypes": sorted({str(p.dtype) for p in ours.parameters()})}


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between ``a`` and ``b``, elementwise."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -32768 - bits, bits)  # sign and magnitude, in order

    return (ordered(a) - ordered(b)).abs()


def bf16_plain(out: dict, rank: int) -> None:
    """bf16 parameters stepped as they are (no master copies), one bucket whose chunk border
    cuts the 64x64 weight: AdamW for 3 steps, and optimizers whose ``weight_decay`` adds the
    parameter to the gradient (``grad.add(param, alpha=)``) for one step, against DDP with the
    same optimizer. Per optimizer: the largest distance in bf16 ulps, how many differ, and the
    largest difference over the largest change a parameter made (DDP's)."""
    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                             nn.Linear(64, 3)).to(torch.bfloat16)

    runs = {"AdamW": (torch.optim.AdamW, {}, 3),
            "RMSprop": (torch.optim.RMSprop, {"weight_decay": 0.01}, 1),
            "Adam": (torch.optim.Adam, {"weight_decay": 0.01}, 1)}
    for name, (kind, options, steps) in runs.items():
        ours, theirs = mlp(), mlp()
        gm, ddp = data_parallel(ours, shard=True), DDP(theirs)
        start = params_of(theirs)
        opt = ShardedOptimizer(gm, kind, lr=LR, **options)
        ref = kind(theirs.parameters(), lr=LR, **options)
        for step in range(steps):
            x = batch(step, 0, rank, torch.bfloat16)
            with gm:
                gm.backward(loss_of(ours, x))
            loss_of(ddp, x).backward()
            opt.step()
            ref.step()
            opt.zero_grad()
            ref.zero_grad()
        apart = [ulps(a.detach(), b.detach()) for a, b in zip(ours.parameters(),
                                                               theirs.parameters())]
        moved = max(float((a - b).abs().max()) for a, b in zip(params_of(theirs), start))
        gap = max(float((a - b).abs().max()) for a, b in zip(params_of(ours), params_of(theirs)))
        out[f"bf16_plain_{name}"] = {"ulps": max(int(d.max()) for d in apart),
                                     "differ": sum(int((d > 0).sum()) for d in apart),
                                     "of_step": gap / moved}
        del opt, gm


def wide(dtype: torch.dtype) -> nn.Module:
    """Layers of 2 and 4 MiB, the 4 MiB weight not contiguous: at the default bucket size
    both buckets are cut into few large segments, which the optimizer gathers by broadcasts
    (into the parameters, and through a temporary for the weight without a flat view)."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 1024), nn.Tanh(),
                        nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 3)).to(dtype)
    net[4].weight = nn.Parameter(net[4].weight.detach().t().contiguous().t())
    return net


def wide_layers(out: dict, rank: int, dtype: torch.dtype) -> None:
    """The wide model against DDP, 3 steps of 2 micro-batches (the first under no_sync);
    bf16 parameters step through fp32 master segments, against DDP whose AdamW steps fp32
    copies of the parameters."""
    ours, theirs = wide(dtype), wide(dtype)
    gm, ddp = data_parallel(ours, shard=True), DDP(theirs)
    master = {"master_dtype": "float32"} if dtype != torch.float32 else {}
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, **master)
    trainable = list(theirs.parameters())
    copies = [p.detach().float().clone().requires_grad_() for p in trainable]
    ref = torch.optim.AdamW(copies if master else trainable, lr=LR)
    for step in range(3):
        for micro in range(2):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(
                100 * step + 10 * micro + rank)).to(dtype)
            with no_sync(gm) if micro == 0 else _null(), gm:
                gm.backward(loss_of(ours, x))
            with ddp.no_sync() if micro == 0 else _null():
                loss_of(ddp, x).backward()
        if master:
            for copy_, p in zip(copies, trainable):
                copy_.grad, p.grad = p.grad.float(), None
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        if master:
            with torch.no_grad():
                for copy_, p in zip(copies, trainable):
                    p.copy_(copy_)
    # which buckets the optimizer gathered by broadcasts (the path this scenario is for)
    out[f"wide_{dtype}"] = {"ours": params_of(ours), "ddp": params_of(theirs),
                            "direct": list(opt._gather.direct),
                            "buffers_kept": [b.spare is not None for b in opt._plan.buckets],
                            "contiguous": ours[4].weight.is_contiguous()}


def one_bucket_buffer(out: dict, rank: int) -> None:
    """Four layers of 1 MiB, a bucket each: how many bucket buffers a synced backward
    allocates (the bucket in flight hands its buffer to the next, so one serves them all),
    and the parameters against DDP's after 2 steps."""
    from gradmgr.backends.torch import ops as torch_ops
    from gradmgr.distributed.sharded import sharding

    def layers() -> nn.Module:
        torch.manual_seed(2)
        return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])

    ours, theirs = layers(), layers()
    gm, ddp = data_parallel(ours, shard=True, bucket_bytes=2**20), DDP(theirs)
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR)
    ref = torch.optim.AdamW(theirs.parameters(), lr=LR)
    made, allocate = [], torch_ops.TorchBuffer._allocate

    def counting(self):  # a new buffer, or a pool's buffer taken again
        flat = allocate(self)
        made.append(flat.untyped_storage().data_ptr())
        return flat

    offered, lend = [], sharding.BufferPool.lend

    def offering(self, bucket):  # whether the pool had a free buffer for the bucket
        lend(self, bucket)
        offered.append(bucket.spare is not None)

    torch_ops.TorchBuffer._allocate = counting
    sharding.BufferPool.lend = offering
    try:
        for step in range(2):
            x = torch.randn(8, 512, generator=torch.Generator().manual_seed(10 * step + rank))
            with gm:
                gm.backward(ours(x).square().mean())
            ddp(x).square().mean().backward()
            opt.step()
            ref.step()
            opt.zero_grad()
            ref.zero_grad()
    finally:
        torch_ops.TorchBuffer._allocate = allocate
        sharding.BufferPool.lend = lend
    out["one_buffer"] = {"ours": params_of(ours), "ddp": params_of(theirs),
                         "buckets": len(opt._plan.buckets), "buffers": len(set(made[:4])),
                         "allocated": len(made), "offered": offered[:4]}


def failing_rank(out: dict, rank: int) -> None:
    """Rank 1's backward raises in step 1: rank 0 raises RankFailedError; both skip that step
    (no shard kept), as DDP ranks that both skip it; the next steps match DDP's."""
    ours, gm, theirs, ddp = pair()
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR)
    ref = torch.optim.AdamW(theirs.parameters(), lr=LR)
    bad = {"armed": False}

    def fail(tensor, grad):
        if bad["armed"] and rank == 1:
            bad["armed"] = False
            raise ValueError("a bad batch")
        return grad

    gm.attach(list(ours.parameters())[-1], callbacks=[fail])
    raised = []
    for step in range(3):
        x = batch(step, 0, rank)
        bad["armed"] = step == 1
        try:
            with gm:
                gm.backward(loss_of(ours, x))
        except (RankFailedError, ValueError) as error:
            raised.append(type(error).__name__)
            opt.zero_grad()
            continue
        loss_of(ddp, x).backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    out["failing"] = {"raised": raised, "ours": params_of(ours), "ddp": params_of(theirs)}


def reload(out: dict, rank: int, world: int, outdir: str) -> None:
    """The 2-rank checkpoint on this world size: the optimizer state reads back exactly, and
    one more step matches DDP on this world size with AdamW loaded from the same dict."""
    saved = torch.load(os.path.join(outdir, "checkpoint.pt"))
    ours, gm, theirs, ddp = pair()
    ours.load_state_dict(saved["params"])
    theirs.load_state_dict(saved["params"])
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    opt.load_state_dict(copy.deepcopy(saved["optimizer"]))
    back = opt.state_dict()["state"]
    want = saved["optimizer"]["state"]
    out["reload_equal"] = [torch.equal(back[i][k], want[i][k]) for i in want for k in want[i]]
    ref = torch.optim.AdamW(theirs.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    ref.load_state_dict(copy.deepcopy(saved["optimizer"]))
    x = batch(9, 0, rank)
    with gm:
        gm.backward(loss_of(ours, x))
    loss_of(ddp, x).backward()
    opt.step()
    ref.step()
    out["reload_step"] = {"ours": params_of(ours), "ddp": params_of(theirs), "world": world}


def main(rank: int, world: int, outdir: str) -> None:
    torch.set_num_threads(1)
    out: dict = {}
    if os.environ.get("GRADMGR_ZERO_PART", "main") == "main":
        checkpoint(out, rank, outdir)
        train(out, "clipped", rank, max_norm=0.05)
        bf16_masters(out, rank)
        bf16_plain(out, rank)
        failing_rank(out, rank)
        wide_layers(out, rank, torch.float32)
        wide_layers(out, rank, torch.bfloat16)
        one_bucket_buffer(out, rank)
    else:
        reload(out, rank, world, outdir)
    dist.barrier()
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
