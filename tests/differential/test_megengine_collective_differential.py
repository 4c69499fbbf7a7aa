"""Collectives inside the recording (issue 29 item 6): generated MegEngine programs with
``all_reduce_sum`` between their ops, on 2 CPU ranks started by gradmgr's launcher, against
both ranks' programs in one process under MegEngine's own ``GradManager``
(:mod:`diff_collective`; MegEngine's own collectives need a GPU, so no native 2-rank run).
The same ``None``s; values within rtol 1e-5, atol 1e-6 (the sums over ranks are added in
another order than the one-process engine adds them)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.megengine

N_PROGRAMS = int(os.environ.get("GRADMGR_DIFF_EXAMPLES") or 40)
SEED = int(os.environ.get("GRADMGR_DIFF_SEED") or 29)


def test_collectives_in_the_recording_match_the_one_process_reference(tmp_path):
    pytest.importorskip("torch.distributed")
    import diff_collective as job
    from ranks import TESTS, rank_env, wait_all

    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "differential.diff_collective",
                                 str(tmp_path), str(N_PROGRAMS), str(SEED)], cwd=TESTS,
                                env=rank_env(), stdout=f, stderr=subprocess.STDOUT)
        wait_all([proc], 300)
    if proc.returncode != 0:
        pytest.fail(f"the job failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
    outs = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    failures = []
    for index, program in enumerate(job.programs(N_PROGRAMS, SEED)):
        ref = job.reference(program, index)
        for rank, out in enumerate(outs):
            for k, want in enumerate(ref[rank]):
                got = None if out[f"p{index}_a{k}_none"] else out[f"p{index}_a{k}"]
                if (got is None) != (want is None) or (
                        got is not None and not np.allclose(got, want, 1e-5, 1e-6)):
                    failures.append(f"program {index}, rank {rank}, attached #{k}: got {got}, "
                                    f"want {want}\n{program.pretty()}")
    assert not failures, "\n\n".join(failures[:3])
