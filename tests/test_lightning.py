"""``gradmgr.integrations.lightning.GradmgrStrategy`` against Lightning Fabric's own
``DDPStrategy``: the same script, seeds and data on 2 gloo ranks (tests/dist_workers/
fabric_suite.py), every loss and parameter compared bit for bit, on each of gradmgr's paths
(torch's reducer, gradmgr's buckets, sharded)."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.torch
pytest.importorskip("torch")
pytest.importorskip("lightning_fabric")

from ranks import TESTS, rank_env, rendezvous, wait_all  # noqa: E402

MISUSES = {  # what each rank raises, and words its message must hold
    "unknown option": ("TypeError", "find_unused_parameters"),
    "two modules waiting": ("RuntimeError", "model=model"),
    "forward outside no_backward_sync": ("RuntimeError", "found no step"),
    "backward without a recording": ("RuntimeError", "found no step"),
    "retain_graph": ("TypeError", "retain_graph"),
    "sharded clip_val": ("NotImplementedError", "max_norm"),
    "sharded optimizer with state": ("ValueError", "already has state"),
    "sharded optimizer of another model": ("ValueError", "exactly one module"),
}
SCENARIOS = ["sgd", "adam", "accumulate", "clip_norm", "clip_val", "frozen_unused", "skipped",
             "skipped_accumulate", "bf16_mixed", "gan", "scheduler"]


def _spawn(outdir, scenarios, timeout: float = 240) -> list:
    """Fabric's own environment variables: it finds its rank in them and launches nothing.
    Its ``init_process_group`` (``env://``) joins the store held here (tests/ranks.py)."""
    with contextlib.ExitStack() as stack:
        port, held = stack.enter_context(rendezvous(2))
        logs = [stack.enter_context(open(os.path.join(outdir, f"log{r}.txt"), "w"))
                for r in range(2)]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "dist_workers.fabric_suite", str(r), str(outdir), *scenarios],
            cwd=TESTS, stdout=logs[r], stderr=subprocess.STDOUT,
            env=rank_env(LOCAL_RANK=str(r), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port), FABRIC_CKPT_DIR=str(outdir), **held))
            for r in range(2)]
        wait_all(procs, timeout)
    if [p.returncode for p in procs] != [0, 0]:
        tails = [_read(os.path.join(outdir, f"log{r}.txt"), "r")[-3000:] for r in range(2)]
        pytest.fail("Fabric ranks failed:\n" + "\n---\n".join(tails))
    return [pickle.loads(_read(os.path.join(outdir, f"rank{r}.pkl"), "rb")) for r in range(2)]


def _read(path: str, mode: str):
    with open(path, mode) as f:
        return f.read()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list:
    return _spawn(tmp_path_factory.mktemp("fabric"), [*SCENARIOS, "misuses"])


def _sides(results, scenario):
    for rank, per_rank in enumerate(results):
        sides = per_rank[scenario]
        errors = {s: r["error"] for s, r in sides.items() if "error" in r}
        assert errors == {}, f"rank {rank}: {errors}"
        yield rank, sides["ddp"], {s: r for s, r in sides.items() if s != "ddp"}


def _params(result, rank):
    """Parameters; buffers on rank 0 only: between steps DDP's other ranks hold their own
    updated buffers where gradmgr's hold rank 0's (docs/data-parallel.md), the same values at
    the next forward."""
    return {k: v for k, v in result["params"].items() if rank == 0 or not k.startswith("buffer")}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "skipped_accumulate"])
def test_same_bits_as_fabric_ddp(results, scenario):
    for rank, ddp, ours in _sides(results, scenario):
        assert set(ours) >= {"native", "buckets"}
        for side, result in ours.items():
            assert result["losses"] == ddp["losses"], (scenario, side, rank)
            ref, got = _params(ddp, rank), _params(result, rank)
            assert sorted(got) == sorted(ref)
            if side == "sharded" and scenario == "clip_norm":
                # ShardedOptimizer.clip_grad_norm_ sums the shards' squares: torch's norm to
                # about 1e-6 on small layers (docs/sharded.md), so the clipped step too.
                np.testing.assert_allclose(result["norms"], ddp["norms"], rtol=1e-6)
                for k in ref:
                    np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-6, err_msg=k)
                continue
            assert result["norms"] == ddp["norms"], (scenario, side, rank)
            assert result["keys"] == ddp["keys"], (scenario, side, rank)  # fabric.save's
            assert len(result["evals"]) == len(ddp["evals"])
            for got_eval, ref_eval in zip(result["evals"], ddp["evals"]):
                assert np.array_equal(got_eval, ref_eval), (scenario, side, rank)
            for k in ref:
                assert np.array_equal(got[k], ref[k]), (scenario, side, rank, k)


@pytest.mark.slow
def test_accumulation_after_a_skipped_forward_is_ddps_to_rounding(results):
    """A forward never backwarded, then a no_backward_sync accumulation: DDP's reducer stays
    armed by the skipped forward and reduces the no_sync micro-batch anyway (mean of the
    micro-batches' means instead of mean of their sum), gradmgr's does not: the same sum, up
    to float rounding (SGD: losses to 1e-6 relative, parameters
    to 1e-6 absolute after 4 steps)."""
    for rank, ddp, ours in _sides(results, "skipped_accumulate"):
        for result in ours.values():
            np.testing.assert_allclose(result["losses"], ddp["losses"], rtol=1e-6)
            assert len(result["evals"]) == len(ddp["evals"]) == 9
            for got_eval, ref_eval in zip(result["evals"], ddp["evals"]):
                np.testing.assert_allclose(got_eval, ref_eval, rtol=0, atol=1e-6)
            ref, got = _params(ddp, rank), _params(result, rank)
            for k in ref:
                np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_every_rank_ends_with_the_same_parameters(results):
    for scenario in SCENARIOS:
        for side, result in results[0][scenario].items():
            other = results[1][scenario][side]
            for k, v in result["params"].items():
                if not k.startswith("buffer"):
                    assert np.array_equal(v, other["params"][k]), (scenario, side, k)


@pytest.mark.slow
def test_misuses_raise_clear_errors_on_every_rank(results):
    for rank in range(2):
        raised = results[rank]["misuses"]
        assert sorted(raised) == sorted(MISUSES)
        for case, (kind, words) in MISUSES.items():
            assert raised[case].startswith(kind + ":") and words in raised[case], (rank, case)


def test_full_sharding_is_fsdp2s_bit_for_bit(tmp_path):
    """GradmgrStrategy(shard="full") against plain FSDP2 on the same data, 4 Adam steps of
    two micro-batches each (the first inside fabric.no_backward_sync), a StepLR made over the
    optimizer before fabric.setup_optimizers halving its rate at every step (as torch's
    StepLR on plain FSDP2's, and no warning from it), clipped by
    fabric.clip_gradients (max_norm= in two steps, clip_val= in two) against torch's
    clip_grad_norm_ and clip_grad_value_ on plain FSDP2 (what Fabric's FSDP2 strategy runs):
    every loss, norm, clipped gradient and parameter shard bit for bit (old code raised
    NotImplementedError at the clip). An optimizer made before the model was set up raises a
    clear error. fabric.save after the steps and fabric.load into a new set-up pair, then two
    steps: every parameter shard and Adam state tensor equals the uninterrupted run's, bit for
    bit, and the metadata comes back (old code raised NotImplementedError at fabric.save)
    (dist_workers/fabric_suite.py's full_shard)."""
    for rank, out in enumerate(_spawn(tmp_path, ["full_shard"])):
        result = out["full_shard"]
        assert result["moved"], rank
        assert len(result["losses"]) == 8 and all(result["losses"]), (rank, result["losses"])
        assert len(result["shards"]) == 6 and all(result["shards"]), (rank, result["shards"])
        assert len(result["clipped"]) == 4, (rank, result["clipped"])
        for same_norm, same_grads, cut in result["clipped"]:
            assert same_norm and same_grads and cut, (rank, result["clipped"])
        assert result["rates"] == [(1e-2 * 0.5 ** k, 1e-2 * 0.5 ** k, []) for k in
                                   range(1, 5)], (rank, result["rates"])  # its 4 steps
        assert result["optimizer made before"].startswith("ValueError:")
        assert "fabric.setup_module(model)" in result["optimizer made before"]
        resumed = result["resumed"]
        assert resumed["count"] == (24, 24), (rank, resumed)  # 6 shards, 3 Adam states each
        assert all(resumed["loaded"]), (rank, resumed)
        assert all(resumed["resumed"]), (rank, resumed)
        assert resumed["step"] == 4 and resumed["remainder"] == [], (rank, resumed)


class _Manager:
    """Just what GradmgrModule asks of a manager, with the calls it got."""

    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name, self.is_recording = calls, name, False

    def record(self) -> None:
        self.is_recording = True

    def release(self) -> None:
        self.is_recording = False
        self.calls.append(self.name)  # (ending a step: a collective on the real path)


def test_a_dropped_module_whose_step_waits_is_given_up_whatever_the_collector_did():
    """Which waiting steps a forward ends (each a collective) must not depend on garbage
    collection: a set-up module dropped in a reference cycle with its recording open is given
    up at the next forward of another module whether or not this rank's collector freed it
    (before, a WeakSet held the modules: one rank gave the step up and the other, whose
    collector had freed the module, did not, and their collectives met inside gloo)."""
    import gc

    import torch

    from gradmgr.integrations.lightning.strategy import GradmgrModule

    calls: list = []
    dropped = GradmgrModule(torch.nn.Linear(2, 2), _Manager(calls, "dropped"), None)
    dropped.cycle = [dropped]  # (not a submodule: a plain attribute)
    dropped(torch.ones(1, 2))  # its recording opens, and waits for a backward
    kept = GradmgrModule(torch.nn.Linear(2, 2), _Manager(calls, "kept"), None)
    del dropped
    gc.collect()
    kept(torch.ones(1, 2))
    assert calls == ["dropped"]
    kept.end_step()
    assert calls == ["dropped", "kept"]
