"""MegEngine's own data-parallel recipe under gradmgr's launcher (issue 19 item 1c).

``python -m dist_workers.habits_megengine OUTDIR`` starts 2 ranks with
``gradmgr.distributed.spawn_local``; each initialises torch.distributed (gloo: MegEngine's own
collectives need a GPU) and runs the data-parallel lines of MegEngine/Models'
``official/vision/classification/resnet/train.py`` (``worker()``): the world-size gate, the
parameter and buffer broadcast, ``make_allreduce_cb("mean")``, the learning rate scaled by the
world size, ``F.distributed.all_reduce_sum`` for the logged loss. Only the GradManager import
differs from MegEngine's script. Each rank starts from its own weights (``weights(rank)``), so
a rank that skips the broadcast trains another model. Saves ``OUTDIR/rank{rank}.npz``.
"""

from __future__ import annotations

import datetime
import importlib
import os
import sys

import numpy as np

from .data import SIZES, batch, shard, weights

BASE_LR, STEPS = 0.02, 3


def build_model(seed: int):
    """The MLP of data.py as a MegEngine module (``fc1``-``fc3``), weights ``weights(seed)``."""
    import megengine.functional as F
    import megengine.module as M

    class MLP(M.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = M.Linear(SIZES[0], SIZES[1])
            self.fc2 = M.Linear(SIZES[1], SIZES[2])
            self.fc3 = M.Linear(SIZES[2], SIZES[3])

        def forward(self, x):
            return self.fc3(F.tanh(self.fc2(F.tanh(self.fc1(x)))))

    model = MLP()
    w = weights(seed)
    model.load_state_dict({f"fc{i + 1}.{kind}": w[2 * i + j]
                           for i in range(3) for j, kind in enumerate(("weight", "bias"))})
    return model


def train(model, batches, base_lr: float, dist, gm_class):
    """MegEngine/Models resnet/train.py ``worker()``, its data-parallel lines: returns the local
    and the logged (all-reduced) loss of each step."""
    import megengine
    import megengine.functional as F
    import megengine.optimizer as optim

    if dist.get_world_size() > 1:
        dist.bcast_list_(model.parameters())
        dist.bcast_list_(model.buffers())
    gm = gm_class().attach(
        model.parameters(),
        callbacks=dist.make_allreduce_cb("mean") if dist.get_world_size() > 1 else None,
    )
    opt = optim.SGD(model.parameters(), lr=base_lr * dist.get_world_size(), momentum=0.9)
    local, logged = [], []
    for x, y in batches:
        x, y = megengine.tensor(x), megengine.tensor(y)
        with gm:
            loss = F.mean((model(x) - y) ** 2)
            gm.backward(loss)
            opt.step().clear_grad()
        local.append(loss.numpy())
        if dist.get_world_size() > 1:  # valid_step's mean of a metric over ranks
            loss = F.distributed.all_reduce_sum(loss) / dist.get_world_size()
        logged.append(loss.numpy())
    return np.array(local), np.array(logged)


def rank_main(rank: int, world: int, port: int, outdir: str) -> None:
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world, timeout=datetime.timedelta(seconds=60))
    import megengine.distributed as dist

    from gradmgr import GradManager  # the one line changed in MegEngine's script

    batches = [tuple(shard(a, rank, world) for a in batch(step)) for step in range(STEPS)]
    model = build_model(seed=rank)
    local, logged = train(model, batches, BASE_LR, dist, GradManager)
    out = {f"p{i}": p.numpy() for i, p in enumerate(model.parameters())}
    out.update(world_size=np.array(dist.get_world_size()), rank=np.array(dist.get_rank()),
               local_loss=local, logged_loss=logged)
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **out)
    tdist.barrier()
    tdist.destroy_process_group()


class _OneProcess:
    """``megengine.distributed`` as a single process sees it (nothing to reduce)."""

    @staticmethod
    def get_world_size() -> int:
        return 1


def reference(world: int) -> list:
    """Single-process training on the whole batch from rank 0's weights, at the learning rate
    the script uses for ``world`` ranks (each rank's batch times ``world``)."""
    import megengine.autodiff

    model = build_model(seed=0)
    train(model, [batch(step) for step in range(STEPS)], BASE_LR * world, _OneProcess,
          megengine.autodiff.GradManager)
    return [p.numpy() for p in model.parameters()]


def main(argv: list) -> int:
    from gradmgr.distributed import spawn_local

    # by module name, so that the spawned ranks import it as this module
    job = importlib.import_module("dist_workers.habits_megengine")
    return spawn_local(job.rank_main, 2, argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
