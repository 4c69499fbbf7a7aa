"""Probe (not a test): MegEngine's ``sync_batch_norm`` in ONE process, with no collective and
no gradmgr: does its backward give the same gradient every step?

MegEngine's distributed path of ``sync_batch_norm`` (``is_distributed()`` made true, its
``all_reduce_sum`` replaced by ``stat * 2``: "the other rank" holds the same numbers) runs
``STEPS`` identical steps under MegEngine's own GradManager with ``async_level = 0`` and counts
the steps whose input or weight gradient differs from the most common one. Variants:
``megengine`` (MegEngine's subgraph operators), ``gradmgr`` (gradmgr's ``sync_bn`` in ordinary
operators, what ranks over gloo run), ``batchnorm2d`` (``M.BatchNorm2d``, no sum over ranks).

2026-11-29, 2-core machine under load, 5 processes of 300 steps each, side by side:
``megengine`` 33 of 1,500 steps wrong (11, 6, 4, 1, 11), ``gradmgr`` 0 of 1,500,
``batchnorm2d`` 0 of 1,500.

    python bench/probe_megengine_syncbn_subgraph.py [STEPS] [VARIANT]
"""

from __future__ import annotations

import collections
import sys

import megengine
import megengine.functional as F
import megengine.functional.distributed as fdist
import megengine.functional.nn as fnn
import megengine.module as M
import numpy as np
from megengine.autodiff import GradManager


def main(steps: int, variant: str) -> int:
    megengine.config.async_level = 0
    fnn.is_distributed = lambda: True  # MegEngine's distributed path, in one process
    fnn.all_reduce_sum = fdist.all_reduce_sum = lambda stat, group=None: stat * 2
    if variant == "gradmgr":
        from gradmgr.backends.megengine import sync_bn

        sync_bn.install()
    rng = np.random.RandomState(100)
    x0, c = rng.randn(2, 3, 2, 2).astype("float32"), rng.randn(2, 3, 2, 2).astype("float32")
    grads = []
    for _ in range(steps):
        bn = M.BatchNorm2d(3) if variant == "batchnorm2d" else M.SyncBatchNorm(3)
        x = megengine.tensor(x0)
        gm = GradManager().attach([x, bn.weight])
        with gm:
            gm.backward(F.sum(bn(x) * megengine.tensor(c)))
        grads.append(x.grad.numpy().tobytes() + bn.weight.grad.numpy().tobytes())
    common = collections.Counter(grads).most_common(1)[0][0]
    wrong = [step for step, g in enumerate(grads) if g != common]
    print(f"{variant}: {len(wrong)} of {steps} steps differ from the most common gradient "
          f"(steps {wrong[:20]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300,
                  sys.argv[2] if len(sys.argv) > 2 else "megengine"))
