"""The data-parallel contract, the same scenarios (``dp_scenarios.py``) on every backend: the
pure-Python fake one (ranks are threads, its transport is in-process: no framework at all),
PyTorch and MegEngine (ranks are processes over torch.distributed gloo), and Paddle (ranks
started by ``spawn_local`` over Paddle's own collectives; only where Paddle is installed, in
.venv-paddle). Where a backend cannot take a path (a split backward on the fake backend and
MegEngine, sharding on Paddle), each scenario of that path must be refused on every rank with
a clear error, and that is tested too.

Tolerances: against references computed without data parallelism from every rank's data,
``rtol=2e-6, atol=1e-7`` (float32 summed in another order; the fake framework computes in
float64); across ranks, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from dp_scenarios import run_all
from fake_distributed import run_ranks
from frameworks import make_framework
from ranks import spawn, spawn_local_ranks

WORLD = 2
REL, ABS = 2e-6, 1e-7


def close(got, want, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what}[{i}]: expected no gradient, got {g}"
        else:
            assert g is not None, f"{what}[{i}]: expected a gradient, got None"
            np.testing.assert_allclose(g, w, rtol=REL, atol=ABS, err_msg=f"{what}[{i}]")


def same_on_every_rank(results, scenario: str, key: str = "got") -> None:
    first = results[0][scenario][key]
    for rank, out in enumerate(results[1:], 1):
        for i, (a, b) in enumerate(zip(first, out[scenario][key])):
            assert (a is None) == (b is None), f"{scenario} {key}[{i}] rank {rank}"
            if a is not None:
                np.testing.assert_array_equal(a, b, err_msg=f"{scenario} {key}[{i}] rank {rank}")


def as_wanted_on_every_rank(results, scenario: str, name: str) -> None:
    """Each rank's ``got`` is close to its ``want``, and the ranks' are equal bit for bit."""
    for rank, out in enumerate(results):
        close(out[scenario]["got"], out[scenario]["want"], f"{name} rank {rank}")
    same_on_every_rank(results, scenario)


@pytest.fixture(scope="module", params=["fake", "torch", "megengine", "paddle"])
def backend(request, tmp_path_factory):
    """Every rank's results of every scenario, for one backend."""
    name = request.param
    if name == "fake":
        fw = make_framework("fake")
        return name, run_ranks(WORLD, lambda rank, world: run_all(fw, rank, WORLD))
    pytest.importorskip(name, reason=f"{name} is not installed in this environment")
    out = tmp_path_factory.mktemp(f"contract_{name}")
    if name == "paddle":
        return name, spawn_local_ranks("contract_suite", "paddle_main", out, "Paddle",
                                       world=WORLD)
    pytest.importorskip("torch", reason="the ranks talk over torch.distributed (gloo)")
    return name, spawn("contract_suite", out, WORLD, GRADMGR_CONTRACT_FRAMEWORK=name)


def test_the_mean_over_ranks_whatever_the_buckets(backend):
    name, results = backend
    for out in results:
        close(out["mean_in_buckets"]["got"], out["mean_in_buckets"]["want"], name)
        assert out["mean_in_buckets"]["buckets"] >= 2
        close(out["summed"]["got"], out["summed"]["want"], f"{name} sum")
    same_on_every_rank(results, "mean_in_buckets")
    same_on_every_rank(results, "summed")


def test_no_sync_accumulates_and_the_synced_step_reduces_it_all(backend):
    name, results = backend
    as_wanted_on_every_rank(results, "accumulated_without_sync", name)


def test_the_first_recording_broadcasts_rank_0s_values(backend):
    name, results = backend
    for out in results:
        scenario = out["broadcast_first"]
        for got, want in zip(scenario["got_values"], scenario["want_values"]):
            np.testing.assert_array_equal(got, want, err_msg=name)
        close(scenario["got"], scenario["want"], name)


def test_tensors_unused_on_some_or_all_ranks(backend):
    name, results = backend
    as_wanted_on_every_rank(results, "unused_tensors", name)


def test_ranks_that_attach_different_tensors_fail_on_every_rank(backend):
    name, results = backend
    for rank, out in enumerate(results):
        scenario = out["ranks_that_differ"]
        assert len(scenario["errors"]) == 1, f"{name} rank {rank}: no RankMismatchError"
        assert "planned different tensors" in scenario["errors"][0]
        assert scenario["refused"] == [None, None, None]
        close(scenario["got"], scenario["want"], f"{name} after the mismatch")


def test_a_rank_whose_backward_raises_fails_the_step_everywhere(backend):
    name, results = backend
    assert [out["a_failing_rank"]["raised"] for out in results] == [
        ["RankFailedError"], ["ValueError"]]
    for out in results:
        scenario = out["a_failing_rank"]
        assert scenario["kept"] == [None, None, None], name
        close(scenario["got"], scenario["want"], f"{name} the next step")


def can_freeze(backend, scenario: str) -> bool:
    """False on MegEngine, whose tensors have no requires_grad flag to freeze (after checking
    that the freezing scenario did not run there)."""
    name, results = backend
    if name == "megengine":
        assert all(scenario not in out for out in results)
        return False
    return True


def test_frozen_tensors_are_left_out_and_a_freeze_on_one_rank_is_refused(backend):
    name, results = backend
    if not can_freeze(backend, "frozen_tensors"):
        return
    for out in results:
        frozen = out["frozen_tensors"]
        assert frozen["frozen"][1] is None, name
        close(frozen["frozen"][::2], frozen["want_frozen"], f"{name} frozen")
        close(frozen["got"], frozen["want"], f"{name} unfrozen")
        alone = out["frozen_on_one_rank"]
        assert len(alone["errors"]) == 1 and "difference is at position 1" in alone["errors"][0]
        assert alone["refused"] == [None, None, None]


def test_a_tensor_frozen_inside_a_no_sync_window_is_reduced_at_its_synced_step(backend):
    """Old code: left out of the synced step, the tensor kept each rank's own window gradient
    (the ranks' .grad differed, silently). Now its window gradient is reduced at the synced
    step, as DDP with find_unused_parameters does."""
    name, results = backend
    if not can_freeze(backend, "frozen_in_window"):
        return
    for out in results:
        window = out["frozen_in_window"]
        close(window["got"], window["want"], f"{name} frozen inside the window")


def test_a_tensor_used_twice_is_reduced_once_with_both_uses(backend):
    name, results = backend
    as_wanted_on_every_rank(results, "used_twice", name)


def test_ranks_that_disagree_about_no_sync_fail_on_every_rank(backend):
    """Rank 0 alone inside no_sync: RankMismatchError on every rank, no gradient kept, and
    the next agreed step is the mean."""
    name, results = backend
    for rank, out in enumerate(results):
        scenario = out["no_sync_on_one_rank"]
        assert len(scenario["errors"]) == 1, f"{name} rank {rank}: no RankMismatchError"
        assert scenario["errors"][0].startswith("the ranks disagree about no_sync"), (
            name, rank, scenario["errors"][0])
        assert scenario["refused"] == [None, None, None], (name, rank)
    as_wanted_on_every_rank(results, "no_sync_on_one_rank", f"{name} after the refusal")


SPLITS = {"torch": True, "paddle": True, "fake": False, "megengine": False}  # capabilities


def test_split_backward_steps_are_the_mean_or_refused_on_every_rank(backend):
    """Under no_sync then synced, with a tensor used on rank 0 only and one on none: the
    parameters' mean over ranks, the input's own gradient; where the engine cannot split,
    ``UnsupportedGraphError`` on every rank before any gradient is written."""
    split_as_wanted(backend, "split_steps", [None, None, None])


def test_a_no_sync_split_finished_after_the_synced_one_raises_on_every_rank(backend):
    """The no_sync micro-batch's ``finish()`` after the synced one's (old code: its local
    gradients added after the reduction, each rank's .grad its own, no error): it raises on
    every rank, accumulating nothing, and .grad keeps the synced micro-batch's mean."""
    split_as_wanted(backend, "split_out_of_order", [None, None, None])
    overtaken_on_every_rank(backend, "split_out_of_order")


def test_a_split_dropped_on_one_rank_fails_its_step_on_every_rank(backend):
    """Rank 1 drops a synced split backward unfinished: rank 0's ``finish()`` raises
    RankFailedError once rank 1 records again (old code: it waited for buckets rank 1 never
    sent, and rank 1's next plan check gave up, naming a skipped batch), neither rank keeps a
    gradient of that step, and the next step is the mean on every rank."""
    dropped_fails_its_step(backend, "split_dropped_on_one_rank", [None, None, None])
    name, results = backend
    if SPLITS[name]:
        kept = [out["split_dropped_on_one_rank"]["kept"] for out in results]
        assert all(k is None for k_rank in kept for k in k_rank), (name, kept)


def dropped_fails_its_step(backend, scenario: str, untouched) -> None:
    """:func:`split_as_wanted`, and only rank 0 (whose ``finish()`` ran) raised
    RankFailedError, where the engine can split."""
    split_as_wanted(backend, scenario, untouched)
    name, results = backend
    if SPLITS[name]:
        raised = [out[scenario]["raised"] for out in results]
        assert raised == [["RankFailedError"], []], (name, raised)


def test_a_split_dropped_on_one_rank_fails_its_step_on_the_sharded_path(backend):
    """The same with a ShardedOptimizer, whose ``step()`` right after the drop is rank 1's next
    collective (old code: its parameter gather paired with rank 0's buckets, gloo timed
    out): that step changes nothing on every rank, the next is SGD's first."""
    if not can_shard(backend, "sharded_split_dropped"):
        return
    dropped_fails_its_step(backend, "sharded_split_dropped", None)
    name, results = backend
    if SPLITS[name]:
        for rank, out in enumerate(results):
            dropped = out["sharded_split_dropped"]
            close(dropped["kept"], dropped["want_kept"], f"{name} rank {rank} kept")


def test_a_split_dropped_on_one_rank_fails_its_step_before_the_optimizers_other_collectives(
        backend):
    """The same before state_dict(), consolidate_state_dict() and making a new
    ShardedOptimizer, each rank 1's next collective after a drop (old code: it met rank 0
    still waiting in ``finish()``, both ranks' state_dict() raised after half the process
    group's timeout, and every later step was out of step): each time rank 0 alone raised
    RankFailedError, the state is the one the step before left (bit for bit), and the new
    optimizer, loaded with it, takes SGD-with-momentum's second step."""
    scenario = "sharded_split_dropped_between_steps"
    if not can_shard(backend, scenario):
        return
    name, results = backend
    if not SPLITS[name]:
        for out in results:
            assert out[scenario]["refused"].startswith(
                f"UnsupportedGraphError: the {name} backend cannot split a backward"), name
        return
    for rank, out in enumerate(results):
        got = out[scenario]
        assert got["raised"] == [["RankFailedError"] if rank == 0 else []] * 3, (rank, got)
        assert len(got["states"]) == (2 if rank == 0 else 1), rank
        for state in got["states"]:
            assert sorted(state) == sorted(got["want_state"]), rank
            for index, kept in got["want_state"].items():
                for key, value in kept.items():
                    np.testing.assert_array_equal(state[index][key], value, err_msg=key)
    as_wanted_on_every_rank(results, scenario, f"{name} {scenario}")


def test_the_same_on_the_sharded_path(backend):
    """There the no_sync one's finish() met the reduced gradients' stand-in (old code:
    "TensorBase.add_ on the .grad of a parameter that data_parallel(model, shard=True)
    reduced"); now the same error, and SGD's values on the synced micro-batch's mean."""
    if not can_shard(backend, "sharded_split_out_of_order"):
        return
    split_as_wanted(backend, "sharded_split_out_of_order", None)
    overtaken_on_every_rank(backend, "sharded_split_out_of_order")


def overtaken_on_every_rank(backend, scenario: str) -> None:
    name, results = backend
    for rank, out in enumerate(results):
        if SPLITS[name]:
            said = out[scenario].get("overtaken", "no error")
            assert "recorded inside no_sync(gm) came after a micro-batch recorded later" in said \
                and "nothing of this finish() was accumulated" in said, (name, rank, said)


def split_as_wanted(backend, scenario: str, untouched) -> None:
    """``scenario`` (a split backward's) as wanted on every rank, with each input's own
    gradient; or, where the backend cannot split, refused on every rank, the parameters'
    ``got`` left ``untouched``."""
    name, results = backend
    for rank, out in enumerate(results):
        split = out[scenario]
        if not SPLITS[name]:
            assert split["refused"].startswith(
                f"UnsupportedGraphError: the {name} backend cannot split a backward"), (
                name, rank, split["refused"])
            if untouched is None:  # the values the scenario started from
                untouched = split["want"]
            for got, want in zip(split["got"], untouched):
                assert (got is None) == (want is None), (name, rank)
                if got is not None:
                    np.testing.assert_array_equal(got, want, err_msg=f"{name} rank {rank}")
            continue
        assert "refused" not in split, (name, rank, split.get("refused"))
        close(split["got_inputs"], split["want_inputs"], f"{name} input rank {rank}")
    if SPLITS[name]:
        as_wanted_on_every_rank(results, scenario, f"{name} {scenario}")


# ---------------------------------------------------------------------- sharded (ZeRO-2)
def can_shard(backend, scenario: str) -> bool:
    """False on Paddle, which gradmgr shards in no way yet, after checking that every rank
    refused the scenario with the error saying so."""
    name, results = backend
    if name != "paddle":
        return True
    for rank, out in enumerate(results):
        refused = out[scenario]["refused"]
        assert refused is not None and refused.startswith(
            "NotImplementedError: gradmgr shards Paddle models in no way yet"), (
            scenario, rank, refused)
    return False


def test_sharded_steps_give_every_rank_sgds_values_on_the_mean_gradient(backend):
    """One bucket of 10 float32 elements: each of the 2 ranks holds a chunk of 5 (20 bytes)."""
    name, results = backend
    if not can_shard(backend, "sharded_steps"):
        return
    for out in results:
        scenario = out["sharded_steps"]
        close(scenario["got_first"], scenario["want_first"], f"{name} first step")
        held = [None] * 3 if name != "torch" else ["stand-in"] * 3
        assert scenario["grads"] == held, name
        assert scenario["memory"]["gradients"] == 4 * 10 // WORLD, name
    same_on_every_rank(results, "sharded_steps", "got_first")
    as_wanted_on_every_rank(results, "sharded_steps", f"{name} second step")


def test_sharded_no_sync_accumulates_and_the_synced_steps_reduce_scatter_it_all(backend):
    name, results = backend
    if not can_shard(backend, "sharded_without_sync"):
        return
    as_wanted_on_every_rank(results, "sharded_without_sync", name)


def test_sharded_tensors_unused_on_some_or_all_ranks(backend):
    name, results = backend
    if not can_shard(backend, "sharded_unused"):
        return
    as_wanted_on_every_rank(results, "sharded_unused", name)


def test_sharded_segments_start_from_the_broadcast_values(backend):
    name, results = backend
    if not can_shard(backend, "sharded_broadcast_first"):
        return
    as_wanted_on_every_rank(results, "sharded_broadcast_first", name)


def test_a_rank_whose_backward_raises_fails_the_sharded_step_everywhere(backend):
    name, results = backend
    if not can_shard(backend, "sharded_failing_rank"):
        return
    assert [out["sharded_failing_rank"]["raised"] for out in results] == [
        ["RankFailedError"], ["ValueError"]], name
    for out in results:
        scenario = out["sharded_failing_rank"]
        for kept, start in zip(scenario["kept"], scenario["want_kept"]):
            np.testing.assert_array_equal(kept, start, err_msg=f"{name}: a shard was kept")
    as_wanted_on_every_rank(results, "sharded_failing_rank", f"{name} the next step")


def test_the_consolidated_state_is_the_unsharded_optimizers_even_from_a_rank_with_none(backend):
    """PyTorch's and the fake SGD make a momentum buffer only for ``a`` (rank 0 holds none of
    it: it must still take part in every collective of state_dict); MegEngine's makes one for
    every parameter at once (zeros for ``b`` and ``c``)."""
    name, results = backend
    if not can_shard(backend, "sharded_state_dict"):
        return
    for rank, out in enumerate(results):
        got, want = out["sharded_state_dict"]["got"], out["sharded_state_dict"]["want"]
        assert sorted(got) == sorted(want) == ([0, 1, 2] if name == "megengine" else [0]), name
        for index, state in want.items():
            assert sorted(got[index]) == sorted(state) == ["momentum_buffer"], name
            np.testing.assert_allclose(got[index]["momentum_buffer"], state["momentum_buffer"],
                                       rtol=REL, atol=ABS, err_msg=f"{name} rank {rank}")
    for out in results[1:]:
        for index, state in results[0]["sharded_state_dict"]["got"].items():
            np.testing.assert_array_equal(out["sharded_state_dict"]["got"][index]
                                          ["momentum_buffer"], state["momentum_buffer"])


def test_a_frozen_tensor_is_left_out_of_the_shards_and_keeps_its_value(backend):
    name, results = backend
    if not can_shard(backend, "sharded_frozen"):
        return
    if not can_freeze(backend, "sharded_frozen"):
        return
    for out in results:
        scenario = out["sharded_frozen"]
        np.testing.assert_array_equal(scenario["got"][1], scenario["want"][1], err_msg=name)
        assert scenario["memory"]["gradients"] == 4 * (4 + 2) // WORLD, name  # a and c
    as_wanted_on_every_rank(results, "sharded_frozen", name)


def test_sharded_split_backward_steps_or_refused_on_every_rank(backend):
    """:func:`test_split_backward_steps_are_the_mean_or_refused_on_every_rank` on the sharded
    path, then SGD: plain SGD's values on the mean gradient; refused, the start values."""
    if not can_shard(backend, "sharded_split"):
        return
    split_as_wanted(backend, "sharded_split", None)


class _Model:
    """What ``data_parallel`` asks of a module, on the fake framework's tensors."""

    def __init__(self, weight) -> None:
        self.weight = weight

    def parameters(self) -> list:
        return [self.weight]

    def named_parameters(self) -> list:
        return [("weight", self.weight)]

    def buffers(self) -> list:
        return []


def test_a_backend_naming_no_idioms_refuses_a_forgotten_with_gm_in_no_frameworks_words(
        monkeypatch):
    """The refusal of a backward after a forward outside ``with gm:`` is the core's, in the
    words the backend's ``TensorOps.idioms()`` gives. A backend that watches forwards but
    names no idioms (here the fake one, whose watch only keeps the refusal) gets the
    contract's neutral words, no PyTorch name (on the old code the core's message named
    ``torch.no_grad()``, ``torch.autograd.grad`` and DDP to every backend)."""
    from fake_distributed import FAKE_OPS

    from gradmgr.distributed import data_parallel

    fw = make_framework("fake")
    refusals: list = []
    monkeypatch.setattr(FAKE_OPS, "watch_forwards",
                        lambda module, refusal: refusals.append(refusal))

    def rank_main(rank, world):
        gm = data_parallel(_Model(fw.tensor([1.0, 2.0])))
        outside = refusals[0]()
        with gm:
            inside = refusals[0]()
        return outside, inside

    [(outside, inside)] = run_ranks(1, rank_main)
    assert inside is None  # a forward inside the recording is the manager's
    assert outside.startswith("data_parallel(): a backward writes the model's .grad after a "
                              "forward that ran with gradients enabled outside `with gm:`")
    for word in ("torch", "paddle", "megengine", "DDP", "DataParallel"):
        assert word not in outside, (word, outside)
    from gradmgr.distributed.contract import NEUTRAL_IDIOMS

    assert f"typed by habit after dropping {NEUTRAL_IDIOMS.wrapper}?" in outside, outside
    assert f"under {NEUTRAL_IDIOMS.no_grad}, or simply never backwarded" in outside, outside
    assert f"so is {NEUTRAL_IDIOMS.grad_call}, which writes no .grad" in outside, outside
