"""Issue 25, items 4, 7 and 8 on 2 gloo ranks, on torch's C++ Reducer (``native``), gradmgr's
buckets (``python``) and the sharded path (``shard``), next to DDP:

* 4: a custom ``autograd.Function`` whose backward returns None for an attached weight (on
  every rank, or on rank 0 only) gives ``DDP(find_unused_parameters=True)``'s gradients;
* 8: ``model.double()`` after ``data_parallel`` re-plans and gives the gradients of DDP built
  on the double model (sharded: the parameters after SGD, with a new ShardedOptimizer; the old
  one refuses to step); on one rank alone, every rank raises RankMismatchError naming it;
* 7: ranks that disagree about ``no_sync`` raise RankMismatchError on every rank, saying so,
  at once (not gloo's abort or timeout), and an agreeing step after it equals DDP's; a rank
  with fewer micro-batches that pads with an empty ``no_sync`` recording equals DDP.

And an input attached on one rank only, inside the recording (a saliency map): DDP's
gradients on every path (on the reducer's, a rank used to abort inside gloo: that rank took
gradmgr's buckets while the others took the reducer).

The ranks run dist_workers/habits_reducer.py as subprocesses, one spawn per path, gloo's
timeout 60 s and the spawn's 200 s (pytest's is 300 s): a rank that hangs or dies fails its
scenario's tests with every rank's log, never the run. Tolerances: bit for bit against DDP
(2 ranks: both sum the same two numbers; SGD's update is elementwise).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from ranks import Ranks, spawn_scenarios  # noqa: E402

WORLD = 2
# Those that break the process group on the old code last (see the worker's docstring).
SCENARIOS = ["none_all", "none_one", "double", "uneven_padded", "double_one_rank",
             "disagree_first", "disagree_later", "disagree_buffers", "input_one_rank",
             "activation_attached", "post_hook_one_rank", "freeze_in_window",
             "input_callback_one_rank"]


@pytest.fixture(scope="module", params=["native", "python", "shard"])
def ranks(request, tmp_path_factory) -> Ranks:
    return spawn_scenarios("habits_reducer", tmp_path_factory.mktemp(f"reducer_{request.param}"),
                           SCENARIOS, HABITS_PATH=request.param)


def same(out: dict, ours: str, theirs: str) -> None:
    """The arrays saved as ``{ours}{i}`` equal ``{theirs}{i}`` bit for bit (or both absent:
    no gradient on either side)."""
    n = int(out[f"{theirs}n"])
    assert int(out[f"{ours}n"]) == n
    for i in range(n):
        a, b = out.get(f"{ours}{i}"), out.get(f"{theirs}{i}")
        assert (a is None) == (b is None), f"{ours}{i}: one side has no gradient"
        if a is not None:
            assert a.dtype == b.dtype, (ours, i, a.dtype, b.dtype)
            np.testing.assert_array_equal(a, b, err_msg=f"{ours}{i}")


# ---------------------------------------------------------------- 4
@pytest.mark.parametrize("where", ["all", "one"])
def test_backward_returning_none_equals_ddp_find_unused(ranks, where):
    name = f"none_{where}"
    for out in ranks.scenario(name):
        for step in (0, 1, 2, 4):
            same(out, f"{name}_gm{step}_", f"{name}_ddp{step}_")


# ---------------------------------------------------------------- 8
def test_double_after_data_parallel_equals_ddp_on_the_double_model(ranks, request):
    for out in ranks.scenario("double"):
        assert list(out["double_dtypes"]) == ["torch.float64"]
        for step in (1, 2):
            same(out, f"double_gm{step}_", f"double_ddp{step}_")
        if "double_old_opt_error" in out:  # sharded: the optimizer made before refuses
            message = str(out["double_old_opt_error"])
            assert message.startswith("RuntimeError") and "make a new one" in message, message


def test_double_on_one_rank_raises_on_every_rank(ranks):
    for rank, out in enumerate(ranks.scenario("double_one_rank")):
        message = str(out["double_one_error"])
        assert message.startswith("RankMismatchError"), (rank, message)
        assert "float32[" in message and "float64[" in message, (rank, message)
        assert "fc" in message, (rank, message)  # the parameter's name


# ---------------------------------------------------------------- 7
@pytest.mark.parametrize("when", ["first", "later", "buffers"])
def test_ranks_that_disagree_about_no_sync_raise_on_every_rank(ranks, when):
    name = f"disagree_{when}"
    for rank, out in enumerate(ranks.scenario(name)):
        message = str(out[f"{name}_error"])
        assert message.startswith("RankMismatchError"), (rank, message)
        assert "disagree about no_sync" in message and "rank 0" in message, (rank, message)
        assert "with (no_sync(gm) if micro < k - 1" in message, (rank, message)


@pytest.mark.parametrize("when", ["first", "later", "buffers"])
def test_an_agreeing_step_after_the_disagreement_equals_ddp(ranks, when):
    name = f"disagree_{when}"
    for out in ranks.scenario(name):
        same(out, f"{name}_after_gm", f"{name}_after_ddp")


def test_a_rank_padding_with_an_empty_no_sync_recording_equals_ddp(ranks):
    for out in ranks.scenario("uneven_padded"):
        same(out, "uneven_gm", "uneven_ddp")


# ---------------------------------------------------------------- an input on one rank
def test_an_input_attached_on_one_rank_inside_the_recording_equals_ddp(ranks):
    """Rank 0 alone attaches its input (a saliency map) inside ``with gm:``: the ranks still
    agree on what they reduce, so every path must give DDP's gradients (and rank 0's input
    its own). On torch's reducer path rank 0 used to leave the reducer for gradmgr's buckets
    (something was attached since the recording began) and gloo aborted a rank
    (``op.preamble.length <= op.nbytes``)."""
    _input_on_rank0_equals_ddp(ranks, "input_one_rank", "input")


def _input_on_rank0_equals_ddp(ranks, scenario: str, prefix: str) -> None:
    for rank, out in enumerate(ranks.scenario(scenario)):
        for step in (0, 1):
            same(out, f"{prefix}_gm{step}_", f"{prefix}_ddp{step}_")
            if rank == 0:
                assert f"{prefix}_gm{step}_x0" in out, "rank 0's input got no gradient"
                same(out, f"{prefix}_gm{step}_x", f"{prefix}_ddp{step}_x")


def test_an_activation_attached_inside_the_recording_equals_ddp(ranks):
    """An activation attached inside ``with gm:`` for its own gradient, by rank 0 alone, on
    every path (on torch's reducer path, rank 0's step used to leave the reducer for
    gradmgr's buckets, and gloo aborted a rank). DDP's gradients, and the activation's DDP's
    retained one, bit for bit; the same where rank 0 alone takes ``torch.autograd.grad`` of
    the activation inside the recording instead."""
    for rank, out in enumerate(ranks.scenario("activation_attached")):
        for step in (0, 1):
            same(out, f"act_gm{step}_", f"act_ddp{step}_")
            if rank == 0:
                assert f"act_gm{step}_h0" in out, "the activation got no gradient"
                same(out, f"act_gm{step}_h", f"act_ddp{step}_h")
    for rank, out in enumerate(ranks.scenario("activation_attached")):
        for step in (0, 1):  # rank 0 alone: torch.autograd.grad of it inside the recording
            same(out, f"act_grad_gm{step}_", f"act_grad_ddp{step}_")
            if rank == 0:
                same(out, f"act_grad_gm{step}_h", f"act_grad_ddp{step}_h")


def test_activations_of_one_node_attached_by_one_rank_equal_ddp(ranks):
    """Rank 0 alone attaches both outputs of one node (a chunk), one doubled by a hook of the
    user's registered after the attach, the other with a callback that doubles its
    ``.grad``, and an activation off the loss's path: DDP's retained gradients (the doubled
    ones, and None) and DDP's parameter gradients, bit for bit, on every path."""
    for rank, out in enumerate(ranks.scenario("activation_attached")):
        for step in (0, 1):
            same(out, f"act_node_gm{step}_", f"act_node_ddp{step}_")
            if rank == 0:
                assert f"act_node_gm{step}_h0" in out
                assert f"act_node_gm{step}_h2" not in out  # off the path
                same(out, f"act_node_gm{step}_h", f"act_node_ddp{step}_h")


# ---------------------------------------------------------------- a post-accumulate hook
def test_a_post_accumulate_grad_hook_on_one_rank(ranks, request):
    """Rank 0 alone registers a post-accumulate-grad hook on a weight after a first step
    (DDP's side too). On torch's reducer path that rank's steps leave the reducer (the hook
    would see the local gradient there), so the next step raises RankMismatchError on every
    rank, which must name the hook (it used to name only callbacks and options); gradmgr's
    buckets and the sharded path give DDP's gradients (parameters), bit for bit."""
    for out in ranks.scenario("post_hook_one_rank"):
        assert str(out["post_hook_error0"]) == "no error"
        same(out, "post_hook_gm0_", "post_hook_ddp0_")
        message = str(out["post_hook_error1"])
        if request.node.callspec.params["ranks"] != "native":
            assert message == "no error", message
            same(out, "post_hook_gm1_", "post_hook_ddp1_")
            continue
        assert message.startswith("RankMismatchError"), message
        assert "register_post_accumulate_grad_hook" in message, message


# ---------------------------------------------------------------- a freeze inside no_sync
def test_a_layer_frozen_inside_a_no_sync_window_equals_ddp(ranks):
    """Every rank freezes ``fc1`` after a ``no_sync`` micro-batch that gave it a gradient,
    then takes the synced one. Old code: ``fc1`` was left out of that step and kept each
    rank's own accumulated ``.grad`` (the ranks differed, silently). Now, as DDP with
    ``find_unused_parameters=True``: it stays planned until the window's synced step has
    reduced it, so its ``.grad`` (sharded: the parameters after SGD) is the mean on every
    rank; at the next step, still frozen, it is left out as any frozen tensor."""
    for out in ranks.scenario("freeze_in_window"):
        same(out, "window_gm", "window_ddp")
        same(out, "window_after_gm", "window_after_ddp")


# ---------------------------------------------------------------- an input's callback
def test_an_input_attached_with_a_callback_on_one_rank_equals_ddp(ranks):
    """Rank 0 alone attaches its input with a callback (doubling its gradient) inside the
    recording: DDP's parameter gradients (sharded: parameters), and rank 0's input DDP's
    gradient under ``x.register_hook(lambda g: g * 2)``, bit for bit, on every path (on
    torch's reducer path rank 0's step used to leave the reducer for gradmgr's buckets and
    gloo aborted a rank, ``op.preamble.length <= op.nbytes``; found by
    tests/differential/test_torch_dp_differential.py's probes)."""
    _input_on_rank0_equals_ddp(ranks, "input_callback_one_rank", "input_cb")
