"""Probe (not a test): does SyncBatchNorm on 2 MegEngine ranks over gloo, through gradmgr's
transport, give the input's gradient the one-process reference gives, every time?

Runs tests/dist_workers/megengine_names.py (the worker of
``tests/test_edges.py::test_megengine_distributed_names_imported_before_the_ranks_started``;
its ranks run MegEngine synchronously, ``async_level = 0``) ``N`` times and prints, per run,
the largest |difference| from the reference (``test_edges._sync_bn_reference``: SyncBatchNorm
over both ranks' batches in one process, MegEngine's own GradManager) for each of the worker's
``SYNC_BN_RUNS`` SyncBatchNorm steps, per rank: the input's gradient, the weight's, the output.

The cause (2026-11-29, bench/RESULTS.md "wt/syncbn"): MegEngine's ``sync_batch_norm``, whose
"subgraph" operators' backward on a CPU now and then gives a wrong gradient (garbage, 1e12 to
1e38, or off by 0.2 to 5; the output right), in the synchronous mode too. The gradient
entering gradmgr's ``_AllReduceSum.backward`` is already wrong, with MegEngine's own
GradManager as with gradmgr's, and in ONE process with no collective and no gradmgr 33 of
1,500 steps went wrong. gradmgr now runs its own ``sync_batch_norm`` (ordinary operators,
``gradmgr/backends/megengine/sync_bn.py``) on such ranks. Side by side on a loaded 2-core
machine, 30 steps a run: before, 7 of 8 runs (17 of 240 steps) wrong; after, 0 of 8 runs
(0 of 240 steps).

    python bench/probe_megengine_syncbn_ranks.py [N]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS)

import megengine  # noqa: E402

megengine.config.async_level = 0

import test_edges  # noqa: E402
from dist_workers import megengine_names as job  # noqa: E402
from ranks import rank_env, wait_all  # noqa: E402


def main(runs: int) -> int:
    data = [job.rank_data(r) for r in range(2)]
    ref = test_edges._sync_bn_reference(data)
    wrong = 0
    for trial in range(runs):
        outdir = tempfile.mkdtemp(prefix="syncbn-probe-")
        with open(os.path.join(outdir, "log"), "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "dist_workers.megengine_names", outdir],
                                    cwd=TESTS, env=rank_env(), stdout=log,
                                    stderr=subprocess.STDOUT)
            wait_all([proc], 240)
        cells, bad = [], False
        for rank in range(2):
            out = dict(np.load(os.path.join(outdir, f"rank{rank}.npz"), allow_pickle=True))
            part = slice(rank * 2, rank * 2 + 2)
            for key, want in (("bn_x_grad", ref["x_grad"][part]),
                              ("bn_weight_grad", ref["weight_grad"][rank]),
                              ("bn_out", ref["out"][part])):
                diffs = [float(np.abs(step - want).max()) for step in out[key]]
                bad |= max(diffs) > 1e-4
                cells.append(f"rank {rank} {key[3:]} " + ",".join(f"{d:.1e}" for d in diffs))
        wrong += bad
        print(f"run {trial}: exit {proc.returncode}{'  WRONG' if bad else ''} | "
              + " | ".join(cells), flush=True)
    print(f"{wrong} of {runs} runs had a step off the reference by more than 1e-4")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10))
