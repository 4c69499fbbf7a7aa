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


def test_a_learning_rate_scheduler_over_the_sharded_optimizer(tmp_path):
    """``StepLR(opt, 1, gamma=0.5)`` over the ShardedOptimizer (on torch a
    ``torch.optim.Optimizer``): the learning rates, parameters, the scheduler's state dict and
    the optimizer's (``initial_lr`` in the groups) equal DDP + Adam + StepLR's, bit for bit;
    so does a LambdaLR made after training; add_param_group, step hooks and ``.state`` raise
    saying why. On old code: TypeError "ShardedOptimizer is not an Optimizer"."""
    for out in run(tmp_path, "scheduler"):
        assert out["is_optimizer"]
        assert out["lrs"][1] == out["lrs"][0] == [[LR / 2], [LR / 4], [LR / 8]]
        same(out["params"][1], out["params"][0], "parameters")
        assert out["sched_state"][1] == out["sched_state"][0]
        same_state(out["opt_state"][1], out["opt_state"][0], "the optimizer's state dict")
        assert "'initial_lr': 0.01" in out["opt_state"][1]["param_groups"]
        assert out["lambda_lr"][1] == out["lambda_lr"][0] == [LR / 2]  # from initial_lr
        same(out["params_after_lambda"][1], out["params_after_lambda"][0], "after LambdaLR")
        (k1, m1), (k2, m2), (k3, m3) = out["refused"]
        assert k1 == "NotImplementedError" and "make a new ShardedOptimizer" in m1
        assert k2 == "NotImplementedError" and "register_step_pre_hook" in m2
        assert k3 == "AttributeError" and "opt.optimizer.state" in m3


def test_torch_amp_grad_scaler_over_the_sharded_optimizer(tmp_path):
    """``torch.amp.GradScaler("cpu")`` with a ShardedOptimizer: ``unscale_`` unscales each rank's
    slices through the parameters' stand-in ``.grad`` (``opt.param_groups`` hold the model's
    parameters), and a non-finite value in one rank's slice makes every rank skip the step
    and halve the scale, as DDP + Adam + GradScaler do: scales and parameters after every step
    equal DDP's bit for bit. On old code: torch's AssertionError "No inf checks were
    recorded"."""
    for out in run(tmp_path, "scaler"):
        assert out["scales"][1] == out["scales"][0] == [1024.0, 1024.0, 512.0, 512.0]
        for step, (ours, ddp) in enumerate(zip(out["params"][1], out["params"][0])):
            same(ours, ddp, f"parameters after step {step}")
        same(out["params"][1][2], out["params"][1][1], "the skipped step 2")


def test_the_norm_of_a_stand_in_whole_on_one_rank_is_torchs_own(tmp_path):
    """``torch.linalg.vector_norm(p.grad)`` (what torch's ``clip_grad_norm_`` asks) of a stand-in
    whose gradient one rank holds whole is torch's norm of that gradient, bit for bit (the
    scaler scenario's per-parameter norms after ``unscale_``). On old code (the root of
    float32 squares summed) fc2.weight's norm differed by 1.5e-8 at step 1."""
    for out in run(tmp_path, "scaler"):
        for step in (0, 1):
            ddp, ours = out[f"norms {step}"]
            same(ours, ddp, f"per-parameter norms, step {step}")


def test_a_closure_and_the_optimizers_that_are_not_elementwise(tmp_path):
    """``loss = opt.step(closure)`` with the closure's forward and backward inside ``with gm:``:
    the losses it returns, the parameters and Adam's state equal DDP + Adam's with the same
    closure, bit for bit (old code: TypeError, step() took no closure). torch's Adafactor
    (per-parameter root mean squares, factored moments) and LBFGS (dot products over every
    parameter) raise ValueError on every rank when the ShardedOptimizer is made, saying why
    and what to use (old code: none; over the slices Adafactor's parameters were 4.5e-3 from
    DDP + Adafactor's after 3 steps of the habit harness's script, silently), and an elementwise
    optimizer made after them works (the ranks still in step)."""
    for out in run(tmp_path, "closure"):
        ddp, ours = out["losses"]
        same(ours, ddp, "the losses step(closure) returned")
        same(out["params"][1], out["params"][0], "parameters")
        same_state(out["opt_state"][1], out["opt_state"][0], "the optimizer's state dict")
        assert out["opt_state"][1]["state"][0]["step"] == STEPS
        (kind, adafactor), (kind_lbfgs, lbfgs) = out["refused"]
        assert kind == kind_lbfgs == "ValueError"
        assert "torch.optim.Adafactor scales each parameter's step" in adafactor
        assert "torch.optim.LBFGS steps from dot products" in lbfgs
        assert "Shard with an elementwise optimizer (SGD, Adam, AdamW, ...)" in adafactor
        assert out["made_after"] is None


STEPS = 3
LR = 1e-2


@pytest.mark.megengine
def test_megengines_scheduler_and_zeros_checkpoint(tmp_path):
    """MegEngine: ``MultiStepLR(opt, [1, 2], gamma=0.5)`` over the ShardedOptimizer (a
    ``megengine.optimizer.Optimizer`` there), next to MegEngine's own AdamW + MultiStepLR on
    the whole batch: the same learning rates (exactly) and parameters (``rtol=1e-5,
    atol=1e-6``, the tolerance of test_megengine_sharded.py: the batch's sum is split over
    the ranks); ``consolidate_state_dict(to=0)`` then rank 0's ``state_dict()`` is AdamW's own
    state (moments ``rtol=1e-5``, steps exactly), rank 1's raises, naming ``megengine.save``.
    On old code: MegEngine's scheduler raised TypeError (not an Optimizer); later, rank 1's
    error named ``torch.save``."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("megengine", reason="megengine is not installed in this environment")
    outs = spawn("habits_zero_megengine", tmp_path, 2, timeout=90)
    for rank, out in enumerate(outs):
        assert out["is_optimizer"]
        assert out["lrs"][0] == out["lrs"][1] == [[LR / 2], [LR / 4], [LR / 4]]
        for step in range(3):
            run = out[f"step {step}"]
            for name, want in run["native"][0].items():
                np.testing.assert_allclose(run["ours"][0][name], want, rtol=1e-5, atol=1e-6,
                                           err_msg=f"rank {rank}, step {step}, {name}")
    theirs, ours = outs[0]["native_state"], outs[0]["state"]
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for index, state in theirs["state"].items():
        for key, want in state.items():
            got = ours["state"][index][key]
            if key == "step":
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert outs[1]["state"][0] == "RuntimeError"
    assert "only rank 0 holds" in outs[1]["state"][1]
    # in MegEngine's words (TensorOps.idioms; on the old code: torch.save)
    assert "`if rank == 0: megengine.save(opt.state_dict(), path)`" in outs[1]["state"][1]
    assert "torch" not in outs[1]["state"][1], outs[1]["state"][1]
