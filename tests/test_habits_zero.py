"""The habits of ZeroRedundancyOptimizer scripts on the sharded path (``data_parallel(model,
shard=True)`` + ``ShardedOptimizer``), on 2 gloo ranks (dist_workers/habits_zero.py): ZeRO's
checkpoint (``consolidate_state_dict``), learning-rate schedulers, ``torch.amp.GradScaler``.

Tolerances: none; parameters and optimizer state equal DDP's (+ ZeroRedundancyOptimizer's)
bit for bit (2 ranks sum the same two numbers; Adam is elementwise).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from ranks import spawn  # noqa: E402


def run(tmp_path, *scenarios: str, timeout: float = 120) -> list:
    return spawn("habits_zero", tmp_path, 2, timeout=timeout, HABITS_ZERO=",".join(scenarios))


def same(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: {i} differs by {(x - y).abs().max()}"


def same_state(a: dict, b: dict, what: str) -> None:
    assert a["param_groups"] == b["param_groups"], what
    assert sorted(a["state"]) == sorted(b["state"]), what
    for i in a["state"]:
        assert sorted(a["state"][i]) == sorted(b["state"][i]), (what, i)
        for key in a["state"][i]:
            same([a["state"][i][key]], [b["state"][i][key]], f"{what}: state {i} {key}")


def test_zeros_checkpoint_consolidate_state_dict_to_0(tmp_path):
    """``opt.consolidate_state_dict(to=0)`` on every rank, then rank 0's ``state_dict()``:
    ZeroRedundancyOptimizer's whole state (Adam's moments and steps, the groups), bit for bit;
    rank 1's ``state_dict()`` raises RuntimeError on both, ours saying what to write. After the
    next step ``state_dict()`` is collective again (the new state on every rank); ``to=1``
    consolidates on rank 1. On old code: AttributeError (no consolidate_state_dict)."""
    outs = run(tmp_path, "consolidate")
    ref, ours = outs[0]["consolidated"]
    same_state(ours, ref, "rank 0's consolidated state")
    assert ours["state"][0]["exp_avg"].abs().sum() > 0  # Adam's moments, not zeros
    theirs, mine = outs[1]["consolidated"]
    assert theirs[0] == mine[0] == "RuntimeError"
    assert "only rank 0 holds the consolidated state" in mine[1]
    assert "if rank == 0: torch.save(opt.state_dict(), path)" in mine[1]
    for out in outs:
        same(out["params"][1], out["params"][0], "parameters")
        assert out["bad_to"][0] == "ValueError" and "to=2" in out["bad_to"][1]
    same_state(outs[0]["after_step"], outs[1]["after_step"], "state_dict() after a step")
    with pytest.raises(AssertionError):  # the step changed the state
        same_state(outs[0]["after_step"], ref, "the state before the step")
    same_state(outs[1]["to_1"], outs[0]["after_step"], "consolidated on rank 1")
    assert outs[0]["to_1"][0] == "RuntimeError" and "only rank 1 holds" in outs[0]["to_1"][1]
