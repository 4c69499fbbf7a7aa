"""Rank program: ZeroRedundancyOptimizer scripts' habits on MegEngine's sharded path, next to
MegEngine's own training on the whole batch (the model and loop of zero_megengine.py): a
``MultiStepLR`` over the ShardedOptimizer, and ZeRO's checkpoint (``consolidate_state_dict``).
Every rank pickles its results to ``OUTDIR/rank{RANK}.pkl``."""

from __future__ import annotations

import os
import pickle

from megengine.autodiff import GradManager as NativeGradManager
from megengine.optimizer import AdamW, MultiStepLR, Optimizer

from gradmgr.distributed import ShardedOptimizer, data_parallel

from .zero_megengine import BUCKET_BYTES, LR, WEIGHT_DECAY, Net, numpy_state, raised, train


def main(rank: int, world: int, outdir: str) -> None:
    out: dict = {}
    net, ref = Net(detach_frozen=True), Net(detach_frozen=True)
    gm = data_parallel(net, shard=True, bucket_bytes=BUCKET_BYTES)
    opt = ShardedOptimizer(gm, AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    out["is_optimizer"] = isinstance(opt, Optimizer)
    ref_gm = NativeGradManager().attach(ref.parameters())
    ref_opt = AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheds = [MultiStepLR(o, milestones=[1, 2], gamma=0.5) for o in (opt, ref_opt)]
    sharded, native = (net, gm, opt), (ref, ref_gm, ref_opt, list(ref.parameters()))
    out["lrs"] = [[], []]
    for step in range(3):
        out[f"step {step}"] = train(sharded, native, rank, world, [step], max_norm=1e6)
        for i, sched in enumerate(scheds):
            sched.step()
            out["lrs"][i].append([g["lr"] for g in (opt, ref_opt)[i].param_groups])
    opt.consolidate_state_dict(to=0)
    out["state"] = numpy_state(opt.state_dict()) if rank == 0 else raised(opt.state_dict)
    out["native_state"] = numpy_state(ref_opt.state_dict())
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
