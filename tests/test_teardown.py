"""A process group that a reference cycle keeps alive is freed before interpreter shutdown.

On torch 2.13 the frame that first imports ``torch._dynamo`` (building any optimizer does) stays
in a reference cycle, and with it that function's model, DDP and data-parallel manager; DDP is a
cycle by itself. Freed by shutdown's last collection, a gloo group now and then aborts the
process. gradmgr collects cycles at exit once it has built a transport over torch.distributed
(backends/torch/teardown.py); this checks, deterministically, that a manager held only by a
cycle is gone before the interpreter goes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

SCRIPT = textwrap.dedent(
    """
    import atexit, gc, weakref
    import torch
    import torch.distributed as dist
    from gradmgr.distributed import data_parallel

    gc.disable()  # no collection by chance before exit
    refs = []
    # registered first, so it runs after gradmgr's exit handler (atexit runs in reverse)
    atexit.register(lambda: print("freed before shutdown:", refs[0]() is None, flush=True))
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    model = torch.nn.Linear(4, 2)
    gm = data_parallel(model)
    with gm:
        gm.backward(model(torch.randn(3, 4)).sum())
    gm.cycle = gm  # held by a cycle only, as a pinned frame or DDP holds it
    refs.append(weakref.ref(gm))
    del gm
    dist.destroy_process_group()
    """
)


def test_a_manager_held_by_a_cycle_is_freed_before_shutdown(tmp_path) -> None:
    script = tmp_path / "cycle.py"
    script.write_text(SCRIPT, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "freed before shutdown: True" in done.stdout, (done.stdout, done.stderr[-2000:])
