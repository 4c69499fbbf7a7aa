"""Ranks with different numbers of steps outside ``Join`` (issue 25's last habit row), on 2 gloo
ranks, on every data-parallel path: torch's reducer, gradmgr's buckets, sharded, full sharding
(FSDP2), and MegEngine through torch's gloo; and, under full sharding, ranks that disagree
about ``no_sync``.

A rank skips a batch (``continue``); each rank's k-th step meets the others' k-th, and the rank
with a step more starts a step nobody else starts. Before, its plan check met the others'
next collective on the user's group, and gloo aborted a process (``op.preamble.length <=
op.nbytes``). Now that rank raises ``RanksOutOfStepError`` after half the process group's
timeout (dist_workers/out_of_step.py: 10 s, so 5 s), saying what to write, and launches
nothing more: the others' next allreduce meets its next one. Its later checks raise at once
(the message says to start a new process group), and a rank waiting for them gives up alike.
A rank waiting in a collective the others never call (``if rank == 0: dcp.save(...)``) is
named by the rank that trains on, and the same save on that rank meets it.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from dist_workers.out_of_step import TIMEOUT_S  # noqa: E402
from ranks import spawn  # noqa: E402

TORCH_PATHS = ["native", "buckets", "sharded"]


def _frameworks() -> list:
    wanted = os.environ.get("GRADMGR_FRAMEWORKS", "torch,megengine").split(",")
    return TORCH_PATHS + (["megengine"] if "megengine" in wanted else [])


def _skipping() -> list:
    return _frameworks() + ["full"]  # full sharding too (FSDP2's collectives, issue 39)


# First, untimed, steps in step: the first case's first steps on each rank would otherwise also
# carry the process's one-off work (lazy imports, the first reducer), which makes the ranks'
# lag largest where every check must still find the other rank within the patience.
CASES = (["even:native:-1"] + [f"skip:{p}:1" for p in _skipping()] + ["skip:buckets:0"]
         + [f"idle:{p}:1" for p in TORCH_PATHS] + [f"left:{p}:1" for p in TORCH_PATHS]
         + ["nosync:full:0", "skip:handbuilt:1", "save0:sharded:0"])


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    if "megengine" in _frameworks():
        pytest.importorskip("megengine", reason="GRADMGR_FRAMEWORKS names megengine")
    outdir = tmp_path_factory.mktemp("out_of_step")
    ranks = spawn("out_of_step", outdir, timeout=420, OUT_OF_STEP_CASES=",".join(CASES))
    return {case: [r[case] for r in ranks] for case in CASES}


def _clear(outcome: dict, *phrases: str) -> None:
    assert outcome["error"] == "RanksOutOfStepError", outcome
    for phrase in phrases:
        assert phrase in outcome["message"], (phrase, outcome["message"])


STARTED = {"full": "not every rank started this recording"}  # checked at every recording
REMEDY = {"full": ("full sharding has no Join", "DistributedSampler(..., drop_last=True)"),
          # MegEngine has no Join in gradmgr (TensorOps.join_support): the empty step alone
          "megengine": ("Take every step on every rank", "with gm: gm.backward()",
                        "this framework has no Join")}


def _started(path: str) -> str:
    return STARTED.get(path, "not every rank started this synced step")


@pytest.mark.parametrize("path", _skipping())
def test_the_rank_with_a_step_more_raises_and_the_group_stays_in_step(seen, path):
    ahead, skipper = seen[f"skip:{path}:1"]
    _clear(ahead["loop"], _started(path),
           *REMEDY.get(path, ("Join([gm])", "with gm: gm.backward()")))
    if path == "full":  # neither Join nor an empty step on one rank works there
        assert "take every step on every rank" not in ahead["loop"]["message"]
    if path == "megengine":  # Join([gm]) would raise there (on the old code it was advised)
        assert "Join([gm])" not in ahead["loop"]["message"], ahead["loop"]["message"]
    # after half the timeout (its patience), within the timeout
    assert TIMEOUT_S / 2 - 0.5 <= ahead["loop"]["seconds"] < TIMEOUT_S, ahead["loop"]
    assert skipper["loop"]["error"] is None  # it ran out of batches: its loop ended
    assert ahead["in_step"] and skipper["in_step"]


@pytest.mark.parametrize("path", _skipping())
def test_training_again_in_that_group_raises_on_every_rank(seen, path):
    ahead, skipper = seen[f"skip:{path}:1"]
    _clear(ahead["again"], "Start a new process group")
    # at once (well within a patience): its check group is known to be broken
    assert ahead["again"]["seconds"] < TIMEOUT_S / 4, ahead["again"]
    _clear(skipper["again"], _started(path))


def test_full_sharding_ranks_that_disagree_about_no_sync(seen):
    """Rank 0 alone takes step 1's first micro-batch inside ``no_sync`` under full sharding:
    every rank raises RankMismatchError at that recording, before FSDP2 gathers anything, and
    the group stays in step. (Before, FSDP2's gathers and reduce-scatters paired across the
    micro-batches: gloo's timeout inside them on both ranks, and the group out of step.)"""
    for rank, outcome in enumerate(seen["nosync:full:0"]):
        loop = outcome["loop"]
        assert loop["error"] == "RankMismatchError", (rank, loop)
        assert "disagree about no_sync" in loop["message"], loop["message"]
        assert ("at this recording rank 0 records inside no_sync; rank 1 starts a synced "
                "recording after 0 recording(s)") in loop["message"], loop["message"]
        # what full sharding offers (no allreduce callback there, so no cb.no_sync())
        assert "Enter no_sync(gm) for the same recordings" in loop["message"]
        assert "cb.no_sync" not in loop["message"] and "record empty ones" not in loop["message"]
        assert "Nothing was gathered or reduced at this recording" in loop["message"]
        assert loop["seconds"] < TIMEOUT_S / 2, loop  # told by the check, not a timeout
        assert outcome["in_step"], rank


def test_a_dcp_save_on_one_rank_is_named_by_the_rank_that_trains_on(seen):
    """Rank 0 alone calls dcp.save after a step (a collective: it waits there); rank 1's next
    step raises after its patience, naming that habit besides a skipped batch, and its own
    dcp.save then meets rank 0's: both go on, in step. (Plain DDP, probed: both ranks in
    gloo's timeout, 20 s of 20; plain FSDP2: a gloo abort at once.)"""
    saver, other = seen["save0:sharded:0"]
    _clear(other["loop"], "not every rank started this synced step",
           "another rank waits in a collective that this one never called",
           "`if rank == 0: dcp.save(...)`")
    assert TIMEOUT_S / 2 - 0.5 <= other["loop"]["seconds"] < TIMEOUT_S, other["loop"]
    assert saver["loop"]["error"] is None, saver["loop"]  # its dcp.save returned
    assert saver["in_step"] and other["in_step"]


def test_either_rank_may_be_the_one_ahead(seen):
    skipper, ahead = seen["skip:buckets:0"]
    _clear(ahead["loop"], "Join([gm])")
    assert skipper["loop"]["error"] is None
    assert ahead["in_step"] and skipper["in_step"]


@pytest.mark.parametrize("path", TORCH_PATHS)
def test_a_rank_without_a_single_batch(seen, path):
    ahead, idle = seen[f"idle:{path}:1"]
    _clear(ahead["loop"], "Join([gm])")
    assert idle["loop"]["error"] is None
    assert ahead["in_step"] and idle["in_step"]


@pytest.fixture(scope="module")
def seen_cuda(tmp_path_factory):
    """The model on the GPU (both ranks on cuda:0, gloo): the check's vector is on the host."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA: no CUDA device visible")
    cases = ["even:cuda:-1", "skip:cuda:1"]
    ranks = spawn("out_of_step", tmp_path_factory.mktemp("out_of_step_cuda"), timeout=240,
                  OUT_OF_STEP_CASES=",".join(cases))
    return {case: [r[case] for r in ranks] for case in cases}


def test_cuda_tensors_check_on_the_host_and_train_alike(seen_cuda):
    import numpy as np

    first, second = seen_cuda["even:cuda:-1"]
    assert first["loop"]["error"] is None and second["loop"]["error"] is None
    for a, b in zip(first["params"], second["params"]):
        np.testing.assert_array_equal(a, b)  # the ranks in step: the same sums, bit for bit
    ahead, skipper = seen_cuda["skip:cuda:1"]
    _clear(ahead["loop"], "Join([gm])")
    assert skipper["loop"]["error"] is None and ahead["in_step"] and skipper["in_step"]


@pytest.mark.parametrize("path", TORCH_PATHS)
def test_a_rank_that_left_is_named_at_once(seen, path):
    ahead, skipper = seen[f"left:{path}:1"]
    _clear(ahead["loop"], "another rank left the checks meanwhile", "Join([gm])")
    assert ahead["loop"]["seconds"] < TIMEOUT_S / 2, ahead["loop"]  # not a timeout
    assert skipper["loop"]["error"] is None


# ---------------------------------------------------------------- making the check group
@pytest.mark.parametrize("failure, out_of_step", [
    ("Connection refused", False),  # gloo cannot reach the ranks: say so, as it is
    ("Wait timeout", True),  # the others never came to make it: their first step is missing
])
def test_a_check_group_that_cannot_be_made(gloo_one_rank, monkeypatch, failure, out_of_step):
    from gradmgr.backends.torch import control
    from gradmgr.distributed import RanksOutOfStepError

    def refuse(*args, **kwargs):
        raise RuntimeError(failure)

    monkeypatch.setattr(control.dist, "new_group", refuse)
    with pytest.raises(RuntimeError) as first:
        control.check_group(None)
    assert isinstance(first.value, RanksOutOfStepError) == out_of_step, first.value
    assert first.value.__cause__.args == (failure,)
    assert ("GLOO_SOCKET_IFNAME" in str(first.value)) != out_of_step
    with pytest.raises(type(first.value)) as later:  # every later check: the same error
        control.check_group(None).start_sum(torch.zeros(1))
    assert ("making it failed" in str(later.value)) != out_of_step


def test_a_manager_built_by_hand_is_not_told_to_join(seen):
    """A manager built with make_allreduce_cb() is no joinable of torch's Join (Join([gm])
    raises TypeError there): its ranks-out-of-step error says what it can do instead (old
    code: it advised ``with Join([gm]):``)."""
    ahead, skipper = seen["skip:handbuilt:1"]
    _clear(ahead["loop"], _started("handbuilt"), "Take every step on every rank",
           "with gm: gm.backward()", "gm = data_parallel(model)")
    assert "Join([gm])" not in ahead["loop"]["message"], ahead["loop"]["message"]
    assert skipper["loop"]["error"] is None and ahead["in_step"] and skipper["in_step"]
