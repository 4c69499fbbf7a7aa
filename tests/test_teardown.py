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
import time

import pytest

pytest.importorskip("torch")

from ranks import TESTS, rank_env, rendezvous  # noqa: E402

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



def test_every_teardown_order_terminates_on_every_path(tmp_path) -> None:
    """Two ranks tear down 30 groups (10 per data-parallel path), most as the habit of
    destroying the group before dropping the manager; every round's step is checked against
    DDP's. A deadlock (torch 2.13's, in ``~ProcessGroupGloo``: see backends/torch/teardown.py)
    shows as ranks that print nothing more for 40 s (a round takes under a second; all of
    them about 20 s on 2 busy cores): they are killed and the test fails."""
    world = 2
    logs = [tmp_path / f"log{r}.txt" for r in range(world)]
    procs = []
    with rendezvous(world) as (port, held):
        for r in range(world):
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "dist_workers.teardown_orders", str(r), str(world),
                     str(port)], cwd=TESTS, env=rank_env(**held), stdout=log,
                    stderr=subprocess.STDOUT))
        stalled = _wait_while_printing(procs, logs, stall=40.0, cap=90.0)
    outputs = [log.read_text() for log in logs]
    report = "\n".join(f"--- rank {r} (exit {p.returncode}), last round "
                       f"{_last_round(outputs[r])!r}:\n{outputs[r][-2000:]}"
                       for r, p in enumerate(procs))
    assert not stalled, f"the ranks hung ({stalled}) and were killed:\n{report}"
    assert [p.returncode for p in procs] == [0] * world, f"a rank failed:\n{report}"
    assert all(out.rstrip().endswith("done") for out in outputs), report


def _wait_while_printing(procs: list, logs: list, stall: float, cap: float) -> str:
    """Wait for ``procs`` while their ``logs`` grow; kill them all once none has grown for
    ``stall`` seconds or ``cap`` have passed, and say which (``""``: they all ended)."""
    start = last = time.monotonic()
    sizes: list = []
    why = ""
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        current = [log.stat().st_size for log in logs]
        if current != sizes:
            sizes, last = current, now
        if now - last > stall or now - start > cap:
            why = (f"no output for {stall:.0f} s" if now - last > stall
                   else f"still running after {cap:.0f} s")
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return why


def _last_round(output: str) -> str:
    rounds = [line for line in output.splitlines() if "#" in line]
    return rounds[-1] if rounds else "none"
