"""MegEngine's distributed names under gradmgr's launcher, imported before the ranks started
(issue 29 item 6).

The names a MegEngine training script imports at its top (MegEngine/Models' ResNet train.py:
``make_allreduce_cb``, ``bcast_list_``, ``all_reduce_sum``, ``SyncBatchNorm``) are imported
here at module level: a spawned rank imports this module before gradmgr's launcher tells
MegEngine which rank it is, so they are MegEngine's own objects. Each rank uses them, and the
same names looked up after the start, and saves what it got to ``OUTDIR/rank{rank}.npz``;
``tests/test_edges.py`` compares with the math (MegEngine's own collectives need a GPU, so no
native run is possible here). ``python -m dist_workers.megengine_names OUTDIR``.
"""

from __future__ import annotations

import datetime
import importlib
import os
import sys

import megengine
import megengine.functional as F
import megengine.module as M
import numpy as np
from megengine.distributed import bcast_list_, make_allreduce_cb
from megengine.functional.distributed import all_gather, all_reduce_sum, broadcast

BN_SHAPE = (2, 3, 2, 2)


def rank_data(rank: int) -> dict:
    """Each rank's own numbers (the reference rebuilds them)."""
    rng = np.random.RandomState(100 + rank)
    return {"w0": rng.randn(3).astype("float32"), "x": rng.randn(3).astype("float32"),
            "bn_x": rng.randn(*BN_SHAPE).astype("float32"),
            "bn_c": rng.randn(*BN_SHAPE).astype("float32")}


def _all_reduce_grad(name_lookup, data: dict) -> np.ndarray:
    """``gm.backward(all_reduce_sum(F.sum(w * x)))``: w's gradient."""
    from gradmgr import GradManager

    w = megengine.Parameter(data["w0"])
    gm = GradManager().attach(w)
    with gm:
        gm.backward(name_lookup()(F.sum(w * megengine.tensor(data["x"]))))
    return None if w.grad is None else w.grad.numpy()


SYNC_BN_RUNS = 40
"""SyncBatchNorm's step is run this many times, each bit-identical to the first: MegEngine's own
``sync_batch_norm`` (before gradmgr replaced it on these ranks) gave a wrong gradient in about 7%
of steps on 2 loaded ranks, so that this many catch such a fault in nearly every run
(bench/RESULTS.md, wt/syncbn)."""


def _sync_bn(data: dict) -> dict:
    """SyncBatchNorm (its statistics summed over ranks): gradients of the input and weight of
    ``loss = sum(bn(x) * c)``, with no allreduce callback; ``SYNC_BN_RUNS`` fresh runs, stacked."""
    from gradmgr import GradManager

    runs = []
    for _ in range(SYNC_BN_RUNS):
        bn = M.SyncBatchNorm(BN_SHAPE[1])
        x = megengine.tensor(data["bn_x"])
        gm = GradManager().attach([x, bn.weight])
        with gm:
            gm.backward(F.sum(bn(x) * megengine.tensor(data["bn_c"])))
        runs.append({"bn_out": bn(x).numpy(), "bn_x_grad": x.grad.numpy(),
                     "bn_weight_grad": bn.weight.grad.numpy()})
    return {key: np.stack([run[key] for run in runs]) for key in runs[0]}


def rank_main(rank: int, world: int, port: int, outdir: str) -> None:
    import torch.distributed as tdist

    # Synchronous, as tests/conftest.py runs MegEngine and for the same reason: its asynchronous
    # CPU execution now and then hands a backward garbage (docs/megengine.md)
    megengine.config.async_level = 0

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world, timeout=datetime.timedelta(seconds=60))
    import megengine.distributed as dist

    from gradmgr import GradManager

    data = rank_data(rank)
    out = {}
    # bcast_list_ as imported before the start, then as looked up now
    for tag, bcast in (("early", bcast_list_), ("late", dist.bcast_list_)):
        p = megengine.Parameter(data["w0"] * (rank + 1))
        bcast([p])
        out[f"bcast_{tag}"] = p.numpy()
    # make_allreduce_cb("mean"), both ways: the mean of each rank's gradient x
    for tag, make in (("early", make_allreduce_cb), ("late", dist.make_allreduce_cb)):
        w = megengine.Parameter(data["w0"])
        cb = make("mean")
        gm = GradManager().attach(w, callbacks=cb)
        with gm:
            gm.backward(F.sum(w * megengine.tensor(data["x"])))
        out[f"cb_{tag}"] = w.grad.numpy()
        out[f"cb_{tag}_module"] = np.array(type(cb).__module__)
    # all_reduce_sum inside the recording: differentiated
    out["ar_early"] = _all_reduce_grad(lambda: all_reduce_sum, data)
    out["ar_late"] = _all_reduce_grad(lambda: F.distributed.all_reduce_sum, data)
    out.update(_sync_bn(data))
    # names with no gloo counterpart, imported before the start: a clear error
    for tag, refused in (("all_gather", all_gather), ("broadcast", broadcast)):
        try:
            refused(megengine.tensor(data["x"]))
        except NotImplementedError as error:
            out[f"refused_{tag}"] = np.array(str(error))
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **out)
    tdist.barrier()
    tdist.destroy_process_group()


def main(argv: list) -> int:
    from gradmgr.distributed import spawn_local

    job = importlib.import_module("dist_workers.megengine_names")  # as the ranks import it
    return spawn_local(job.rank_main, 2, argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
