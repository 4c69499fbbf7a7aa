"""The ``gradmgr`` logger: silent by default; at INFO (standard logging configuration, or
``GRADMGR_LOG=info``) it reports each decision once (the bucket plan, the steps' path), not
once per step."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _decisions(records) -> list:
    return [r.getMessage().split(":")[0] for r in records if r.name.startswith("gradmgr")]


@pytest.mark.torch
def test_each_decision_is_logged_once_not_per_step(gloo_one_rank, caplog):
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    from gradmgr.distributed import data_parallel

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with caplog.at_level(logging.INFO, logger="gradmgr"):
        gm = data_parallel(model)
        for _ in range(3):
            with gm:
                gm.backward(model(torch.ones(2, 4)).sum())
        assert _decisions(caplog.records) == ["bucket plan", "the steps' path"]
        plan = caplog.records[0].getMessage()
        assert "4 trainable tensors in 1 buckets" in plan, plan
        assert "the framework's own reducer" in caplog.records[1].getMessage()
        caplog.clear()
        model[0].requires_grad_(False)  # a new plan: logged once more
        for _ in range(2):
            with gm:
                gm.backward(model(torch.ones(2, 4)).sum())
        assert _decisions(caplog.records) == ["bucket plan", "the steps' path"]
        assert "2 trainable tensors" in caplog.records[0].getMessage()
    del gm


@pytest.mark.torch
def test_silent_by_default(gloo_one_rank, capfd):
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    from gradmgr.distributed import data_parallel

    assert not logging.getLogger("gradmgr").isEnabledFor(logging.INFO)
    model = torch.nn.Linear(4, 1)
    gm = data_parallel(model)
    with gm:
        gm.backward(model(torch.ones(2, 4)).sum())
    del gm
    assert "gradmgr" not in capfd.readouterr().err


@pytest.mark.parametrize("value, shown", [("info", True), ("", False), ("DEBUG", True),
                                          ("loud", False)])
def test_gradmgr_log_in_the_environment(value, shown):
    """``GRADMGR_LOG=info`` gives the logger a stderr handler; unset, nothing; a value that
    is no level warns once and logs nothing (the import still works)."""
    script = ("import logging, gradmgr; "
              "logging.getLogger('gradmgr.distributed.synchronizer').info('bucket plan: x')")
    env = dict(os.environ, GRADMGR_LOG=value, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert ("gradmgr INFO [gradmgr.distributed.synchronizer] bucket plan: x" in done.stderr) \
        == shown, done.stderr
    assert ("is not a logging level" in done.stderr) == (value == "loud"), done.stderr


_TWO_RANKS = '''
import sys
import torch
import torch.distributed as dist
from gradmgr.distributed import data_parallel, spawn_local


def rank_main(rank, world, port, gradmgr):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model = torch.nn.Linear(4, 1)
    if gradmgr:
        gm = data_parallel(model)
        for _ in range(2):
            with gm:
                gm.backward(model(torch.ones(2, 4)).sum())
        del gm
    else:
        dist.all_reduce(torch.ones(1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(spawn_local(rank_main, 2, sys.argv[1] == "gradmgr"))
'''


@pytest.mark.torch
@pytest.mark.slow
def test_the_check_group_is_logged_and_doubles_gloos_connected_lines(tmp_path):
    """docs/data-parallel.md: on 2 ranks the plan check's group is logged once per rank, and
    gloo's ``[Gloo] ... connected`` lines (torch 2.8 prints them, 2.13 not) come twice as
    often as for a plain gloo program: once for the user's group, once for the check's."""
    pytest.importorskip("torch", reason="torch is not installed in this environment")
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS, encoding="utf-8")
    runs = {}
    for mode in ("plain", "gradmgr"):
        env = dict(os.environ, GRADMGR_LOG="info", PYTHONPATH=ROOT)
        done = subprocess.run([sys.executable, str(script), mode], env=env, cwd=str(tmp_path),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        runs[mode] = done
    gloo = {mode: (done.stdout + done.stderr).count("[Gloo] Rank") for mode, done in runs.items()}
    assert gloo["gradmgr"] == 2 * gloo["plain"], gloo
    assert gloo["plain"] in (0, 2), gloo  # one line per rank, or none
    assert runs["gradmgr"].stderr.count("plan check group: a gloo group of its own") == 2
    assert "gradmgr INFO" not in runs["plain"].stderr
