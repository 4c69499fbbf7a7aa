"""Issue 25, items 1, 2 and 6 on 2 gloo ranks, on torch's reducer path, gradmgr's buckets and
the sharded path (dist_workers/habits_entry.py, one spawn per path):

1. a DDP wrapper kept next to ``data_parallel`` (``data_parallel(DDP(model))``, or a DDP
   wrapper made around the module before or after, trained through): a clear error on every
   rank, before any gradient is written (on the old code: every gradient twice DDP's on the
   reducer path, silently);
2. ``with gm:`` forgotten (``model(x, y).backward()``): a clear error on every rank, no
   gradient written; evaluation forwards work (on the old code: silent, ranks diverge);
6. evaluation after training: every rank's outputs and buffers equal DDP's bit for bit (on the
   old code rank 1's outputs differ).

Tolerances: none, bit for bit against DDP (the same kernels, the same sums on 2 ranks).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)


from ranks import spawn_scenarios  # noqa: E402

WORLD = 2

SCENARIOS = ["ddp_wrapper_given", "ddp_around_after", "ddp_around_before", "ddp_inside",
             "forgotten_recording", "another_models_step", "evaluation_after_training"]
PATHS = {"native": {"GRADMGR_NATIVE_REDUCER": "1"}, "python": {"GRADMGR_NATIVE_REDUCER": "0"},
         "shard": {"HABITS_SHARD": "1"}}


@pytest.fixture(scope="module", params=list(PATHS))
def ranks(request, tmp_path_factory):
    outdir = tmp_path_factory.mktemp(f"entry_{request.param}")
    spawned = spawn_scenarios("habits_entry", outdir, SCENARIOS, **PATHS[request.param])
    spawned.path = request.param
    return spawned


def group_still_works(out: dict, name: str) -> None:
    np.testing.assert_array_equal(out[f"{name}_group"], [3.0])


# ---------------------------------------------------------------- item 1
def test_data_parallel_refuses_a_ddp_wrapper(ranks):
    for rank, out in enumerate(ranks.scenario("ddp_wrapper_given")):
        message = str(out["given_error"])
        assert message.startswith("TypeError") and "DistributedDataParallel" in message, (
            rank, message)
        assert "net.module" in message, message
        group_still_works(out, "given")


@pytest.mark.parametrize("order", ["after", "before"])
def test_a_forward_through_a_ddp_wrapper_is_refused(ranks, order):
    for rank, out in enumerate(ranks.scenario(f"ddp_around_{order}")):
        message = str(out[f"around_{order}_error"])
        assert message.startswith("RuntimeError") and "inside a DistributedDataParallel" in (
            message), (rank, message)
        assert "Drop the DDP wrapper" in message, message
        assert bool(out[f"around_{order}_no_grad"]), f"rank {rank}: gradients were written"
        assert np.isfinite(out[f"around_{order}_eval"]).all()
        group_still_works(out, f"around_{order}")


def test_a_ddp_wrapper_around_a_submodule_is_refused(ranks):
    """``model.mlp = DDP(model.mlp)`` before ``data_parallel(model)``: TypeError; after it:
    RuntimeError at the forward, no gradient written (old code: that submodule's gradients
    were twice DDP's, silently); unwrapped again, the next step is DDP's, bit for bit."""
    for rank, out in enumerate(ranks.scenario("ddp_inside")):
        given, after = str(out["inside_given_error"]), str(out["inside_after_error"])
        assert given.startswith("TypeError") and "at submodule 'mlp'" in given, (rank, given)
        assert after.startswith("RuntimeError") and (
            "now holds a DistributedDataParallel at submodule 'mlp'" in after), (rank, after)
        assert "its .module" in after, (rank, after)
        assert bool(out["inside_after_no_grad"]), f"rank {rank}: gradients were written"
        for i in range(8):
            gm, ddp = out.get(f"inside_next_gm{i}"), out.get(f"inside_next_ddp{i}")
            assert (gm is None) == (ddp is None), i
            if gm is not None:
                np.testing.assert_array_equal(gm, ddp, err_msg=f"param {i}")
        group_still_works(out, "inside")


# ---------------------------------------------------------------- item 2
def test_backward_without_recording_is_refused_and_evaluation_works(ranks):
    outs = ranks.scenario("forgotten_recording")
    for rank, out in enumerate(outs):
        message = str(out["forgot_error"])
        assert message.startswith("RuntimeError") and "outside `with gm:`" in message, (
            rank, message)
        for idiom in ("torch.no_grad()", "torch.autograd.grad", "as under DDP"):
            assert idiom in message, (rank, idiom, message)  # PyTorch's words, on every path
        assert bool(out["forgot_no_grad"]), f"rank {rank}: gradients were written"
        assert np.isfinite(out["forgot_eval"]).all()
        group_still_works(out, "forgot")
        if ranks.path != "shard":  # then the step after equals DDP's
            for i in range(8):
                gm, ddp = out.get(f"forgot_after_gm{i}"), out.get(f"forgot_after_ddp{i}")
                assert (gm is None) == (ddp is None), i
                if gm is not None:
                    np.testing.assert_array_equal(gm, ddp, err_msg=f"param {i}")


def test_another_managers_backward_through_the_model_is_legal(ranks):
    for rank, out in enumerate(ranks.scenario("another_models_step")):
        assert str(out["gan_error"]) == "no error", (rank, str(out["gan_error"]))
        assert bool(out["gan_disc_no_grad"]) and bool(out["gan_disc_grad"]), rank
        group_still_works(out, "gan")


# ---------------------------------------------------------------- item 6
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_evaluation_after_training_equals_ddp(ranks, mode):
    outs = ranks.scenario("evaluation_after_training")
    for rank, out in enumerate(outs):
        for i in range(2):
            np.testing.assert_array_equal(out[f"eval_{mode}{i}_gm"], out[f"eval_{mode}{i}_ddp"],
                                          err_msg=f"rank {rank} forward {i}")
        for i in range(3):  # running mean, running var, batches tracked
            np.testing.assert_array_equal(out[f"eval_{mode}_buf_gm{i}"],
                                          out[f"eval_{mode}_buf_ddp{i}"],
                                          err_msg=f"rank {rank} buffer {i}")
        group_still_works(out, "eval")


def test_evaluation_on_rank_0_alone_and_the_next_step_equal_ddp(ranks):
    outs = ranks.scenario("evaluation_after_training")
    np.testing.assert_array_equal(outs[0]["eval_alone_gm"], outs[0]["eval_alone_ddp"])
    if ranks.path == "shard":
        return
    for rank, out in enumerate(outs):
        for i in range(4):
            np.testing.assert_array_equal(out[f"eval_next_gm{i}"], out[f"eval_next_ddp{i}"],
                                          err_msg=f"rank {rank} param {i}")
