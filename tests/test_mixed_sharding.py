"""Ranks that disagree about sharding (issue 42): ``data_parallel(model, shard=True)`` and a
``ShardedOptimizer`` on some ranks, ``data_parallel(model)`` and a plain optimizer on the
others, each rank on each side, on 2 and 3 gloo ranks (dist_workers/mixed_sharding.py).

Before, the sharded ranks waited in the optimizer's comparison on the user's group until
gloo's timeout, and the plain ones raised ``RanksOutOfStepError`` (about skipped batches)
after half of it. Now ``data_parallel()`` compares ``shard=`` with the modules: every rank
raises ``RankMismatchError`` saying which ranks shard, at once, and the group stays in step.
With the callbacks attached by hand (``hand:``), the optimizer's comparison, a plan check in
the checks' group, meets the plain ranks' first step check: every rank raises it there.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from dist_workers.mixed_sharding import TIMEOUT_S  # noqa: E402
from ranks import spawn  # noqa: E402

PROMPT_S = TIMEOUT_S / 4  # "within a few seconds": a rank out of step gives up at TIMEOUT_S / 2


def _megengine_wanted() -> bool:
    return "megengine" in os.environ.get("GRADMGR_FRAMEWORKS", "torch,megengine").split(",")


CASES = {2: ["torch:0", "torch:1", "hand:0", "hand:1"]
         + (["megengine:0", "megengine:1"] if _megengine_wanted() else []),
         3: ["torch:0", "torch:1", "torch:2", "torch:1+2", "torch:0+2", "torch:0+1",
             "hand:0", "hand:1+2"]}


@pytest.fixture(scope="module", params=sorted(CASES))
def seen(request, tmp_path_factory):
    world = request.param
    if any(c.startswith("megengine") for c in CASES[world]):
        pytest.importorskip("megengine", reason="GRADMGR_FRAMEWORKS names megengine")
    ranks = spawn("mixed_sharding", tmp_path_factory.mktemp(f"mixed{world}"), world=world,
                  timeout=300, MIXED_CASES=",".join(CASES[world]))
    return world, {case: [r[case] for r in ranks] for case in CASES[world]}


def _sides(case: str, world: int) -> tuple:
    sharded = [int(r) for r in case.split(":")[1].split("+")]
    return sharded, [r for r in range(world) if r not in sharded]


def test_every_rank_raises_rank_mismatch_naming_the_sharded_ranks(seen):
    world, cases = seen
    for case, per_rank in cases.items():
        if case.startswith("hand"):
            continue
        sharded = [int(r) for r in case.split(":")[1].split("+")]
        plain = [r for r in range(world) if r not in sharded]
        for rank, outcome in enumerate(per_rank):
            first = outcome["first"]
            assert first["error"] == "RankMismatchError", (case, rank, first)
            message = first["message"]
            assert "shard=True" in message, (case, rank, message)
            for what, ranks in (("sharded", sharded), ("plain", plain)):
                named = ", ".join(str(r) for r in ranks)
                assert f"{what} on rank{'s' if len(ranks) > 1 else ''} {named}" in message, (
                    case, rank, what, message)
            assert "Join" not in message and "skipped" not in message, message
            assert first["seconds"] < PROMPT_S, (case, rank, first)


def test_the_process_group_still_works_after_it(seen):
    world, cases = seen
    for case, per_rank in cases.items():
        assert all(outcome["in_step"] for outcome in per_rank), case
        params = [outcome["params"] for outcome in per_rank]
        assert all(isinstance(p, list) for p in params), (case, params)
        for other in params[1:]:  # a step on every rank: the same parameters, bit for bit
            for a, b in zip(params[0], other):
                np.testing.assert_array_equal(a, b)


def test_by_hand_every_rank_raises_at_the_optimizer_or_the_first_step(seen):
    world, cases = seen
    for case in [c for c in cases if c.startswith("hand")]:
        sharded, plain = _sides(case, world)
        for rank, outcome in enumerate(cases[case]):
            first = outcome["first"]
            assert first["error"] == "RankMismatchError", (case, rank, first)
            message = first["message"]
            assert "the ranks disagree about sharding" in message, message
            for r in sharded:
                assert f"rank {r} makes a ShardedOptimizer" in message, (case, message)
            for r in plain:
                assert f"rank {r} starts a synced step" in message, (case, message)
            assert first["seconds"] < PROMPT_S, (case, rank, first)
