"""Probe (not a test): after a comm hook's error on the reducer path, ``del gm`` and
``data_parallel(model)`` again, N times on one gloo rank; counts the re-wraps refused because
the dropped manager was still alive.

2026-11-29, torch 2.13, 2-core machine with a busy loop beside it: 2 of 200 refused before
``wrap._refuse_second_manager`` waited (``tests/test_issue38_errors.py::
test_a_hook_future_of_the_wrong_shape_raises_value_error[_after_short_hook-True]`` failed once
that way in a fresh-clone ``make test``); 0 of 200 with its patience. The dropped manager was
freed a moment later each time; what held it was not found.

    python bench/probe_rewrap_after_hook_error.py [N]
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
import test_issue38_errors as cases  # noqa: E402

from gradmgr.distributed import data_parallel  # noqa: E402


def main(runs: int) -> int:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    refused = 0
    for _ in range(runs):
        model, x = cases._model(), torch.randn(5, 3)
        gm = data_parallel(model, comm_hook=cases._after_short_hook, native=True)
        with contextlib.suppress(ValueError):  # the hook's error, as the test expects
            cases._step(gm, model, x)
        del gm
        try:
            data_parallel(model, native=True)  # dropped at once: the next round wraps anew
        except RuntimeError:
            refused += 1
    print(f"{refused} of {runs} re-wraps refused")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
