"""Sharded data parallelism (ZeRO-2): reduce-scattered gradients and ShardedOptimizer, on 2
gloo ranks next to DDP with the same optimizer (dist_workers/zero_suite.py), and a checkpoint
reloaded on 3 ranks.

Tolerances: bit for bit against DDP on 2 ranks (both sum the same two numbers, and AdamW is
elementwise); with clipping that scales, the clip coefficient comes from a norm summed in
another order, so ``rtol=1e-5, atol=1e-7``; on 3 ranks, gloo sums three numbers in an order
that depends on their place in the buffer, so ``rtol=1e-5, atol=1e-6`` against DDP, while the
reloaded optimizer state must be exactly what was saved. bf16 parameters without master copies
under RMSprop or Adam with weight_decay: within 1/128 of the step's largest change (see
``test_bf16_parameters_without_masters_against_ddp``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
from ranks import spawn  # noqa: E402

from gradmgr import GradManager  # noqa: E402
from gradmgr.distributed import (  # noqa: E402
    ShardedOptimizer,
    make_allreduce_cb,
    make_reduce_scatter_cb,
)


@pytest.fixture(scope="module")
def zero_ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("zero")
    main = spawn("zero_suite", outdir, 2, GRADMGR_ZERO_PART="main")
    reload = spawn("zero_suite", outdir, 3, GRADMGR_ZERO_PART="reload")
    return main, reload


def same(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: parameter {i} differs by {(x - y).abs().max()}"


def test_training_with_accumulation_and_a_frozen_layer_equals_ddp(zero_ranks):
    main, _ = zero_ranks
    for rank, out in enumerate(main):
        run = out["checkpoint_train"]
        same(run["ours"], run["ddp"], f"rank {rank}")
        assert torch.equal(run["ours"][2], run["frozen_start"])  # the frozen weight stayed
        assert all(ours == pytest.approx(theirs, rel=1e-6) for ours, theirs in run["norms"])
    same(main[0]["checkpoint_train"]["ours"], main[1]["checkpoint_train"]["ours"], "ranks")


def test_clipping_that_scales_matches_ddp_to_rounding(zero_ranks):
    main, _ = zero_ranks
    for out in main:
        run = out["clipped"]
        assert all(ours > 0.05 for ours, _ in run["norms"])  # the clipping did scale
        for ours, theirs in zip(run["ours"], run["ddp"]):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    same(main[0]["clipped"]["ours"], main[1]["clipped"]["ours"], "ranks")


def test_the_consolidated_state_is_ddps_adamw_state(zero_ranks):
    main, _ = zero_ranks
    for out in main:
        keys_ours, keys_theirs = out["state_keys"]
        assert keys_ours == keys_theirs and out["state_equal"] and all(out["state_equal"])


def test_each_rank_holds_a_share_of_gradients_and_state(zero_ranks):
    main, _ = zero_ranks
    trainable = 8 * 16 + 16 + 16 * 3 + 3  # the frozen layer has no optimizer state
    total = sum(out["checkpoint_train"]["memory"]["optimizer"] for out in main)
    per_rank = [out["checkpoint_train"]["memory"]["optimizer"] for out in main]
    # AdamW: two float32 moments per element, and a step per segment
    assert total >= 2 * 4 * trainable and max(per_rank) < 2 * 4 * trainable * 0.6


def test_bf16_parameters_with_fp32_master_shards(zero_ranks):
    main, _ = zero_ranks
    for out in main:
        assert out["bf16"]["dtypes"] == ["torch.bfloat16"]
        same(out["bf16"]["ours"], out["bf16"]["ddp"], "bf16")


def test_bf16_parameters_without_masters_against_ddp(zero_ranks):
    """bf16 parameters stepped as they are: AdamW bit for bit DDP's after 3 steps; an
    optimizer whose weight_decay adds the parameter to the gradient (Adam, RMSprop) within
    1/128 (one bf16 epsilon) of the step's largest change after the first step. torch's CPU
    kernel of ``grad.add(param, alpha=)`` rounds the last elements of a 16-bit tensor (the
    loop's remainder after its vector width) otherwise than the rest, and a rank's slice of
    the weight ends where DDP's whole weight does not (docs/sharded.md, bf16 parameters)."""
    main, _ = zero_ranks
    for rank, out in enumerate(main):
        assert out["bf16_plain_AdamW"] == {"ulps": 0, "differ": 0, "of_step": 0.0}, rank
        for name in ("RMSprop", "Adam"):
            run = out[f"bf16_plain_{name}"]
            assert run["of_step"] <= 2**-7, (rank, name, run)
            assert run["differ"] <= 64, (rank, name, run)  # the slices' last elements only


@pytest.mark.parametrize("dtype, direct", [
    ("torch.float32", [True, True]),
    ("torch.bfloat16", [True, False]),  # the 2nd bucket's segments average < 256 KiB in bf16
])
def test_wide_layers_gathered_by_broadcasts_equal_ddp(zero_ranks, dtype, direct):
    """Buckets of a few large segments: the updated parameters are broadcast by their owners
    straight into the parameters (a non-contiguous one through a temporary), other buckets
    all-gathered in the same step; bf16 through fp32 masters. Bit for bit DDP's on 2 ranks."""
    main, _ = zero_ranks
    for rank, out in enumerate(main):
        run = out[f"wide_{dtype}"]
        assert run["direct"] == direct and not run["contiguous"], run["direct"]
        assert run["buffers_kept"] == [False, False]  # the bucket buffers go with the backward
        same(run["ours"], run["ddp"], f"rank {rank}")
    same(main[0][f"wide_{dtype}"]["ours"], main[1][f"wide_{dtype}"]["ours"], "ranks")


def test_one_bucket_buffer_serves_a_backward_of_equal_buckets(zero_ranks):
    """The bucket in flight hands its buffer to the next one (issue 27): the pool offers its
    buffer to every bucket after the first, where before the second bucket found none (two
    were then alive together with the engine's newest gradient: the step's peak, one buffer
    higher). Whether the offered buffer is taken also depends on gloo's worker having dropped
    the finished collective's reference to it (``storage_unshared``), which is timing: usually
    one buffer serves the step, under load two, and in one fresh-clone run on the 2-core
    machine three (2026-11-28; this test asserted at most two then and failed). So what is
    asserted is the offer (deterministic) and at most one buffer per bucket over both steps
    (the second step reuses the first's). Results bit for bit DDP's."""
    main, _ = zero_ranks
    for rank, out in enumerate(main):
        run = out["one_buffer"]
        assert run["buckets"] == 4 and run["allocated"] == 8  # 4 buckets, 2 steps
        assert run["offered"] == [False, True, True, True], run["offered"]
        assert run["buffers"] <= run["buckets"], run["buffers"]
        same(run["ours"], run["ddp"], f"rank {rank}")


def test_a_failing_rank_fails_the_step_everywhere_and_training_goes_on(zero_ranks):
    main, _ = zero_ranks
    assert [out["failing"]["raised"] for out in main] == [["RankFailedError"], ["ValueError"]]
    for out in main:
        same(out["failing"]["ours"], out["failing"]["ddp"], "after the failed step")


def test_a_checkpoint_reloads_on_another_world_size(zero_ranks):
    _, reload = zero_ranks
    for out in reload:
        assert out["reload_equal"] and all(out["reload_equal"])
        assert out["reload_step"]["world"] == 3
        for ours, theirs in zip(out["reload_step"]["ours"], out["reload_step"]["ddp"]):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    same(reload[0]["reload_step"]["ours"], reload[2]["reload_step"]["ours"], "ranks")


# ---------------------------------------------------------------------- in one process
class _Sum:
    """A 1-rank transport without reduce-scatter."""

    def world_size(self):
        return 1

    def allreduce_async(self, flat):
        class Done:
            def wait(self):
                return flat
        return Done()


def test_a_transport_without_reduce_scatter_says_what_is_missing():
    w = torch.ones(3, requires_grad=True)
    gm = GradManager().attach(w, callbacks=[make_reduce_scatter_cb(transport=_Sum(),
                                                                   broadcast=False)])
    with pytest.raises(TypeError, match="reduce_scatter_async"), gm:
        gm.backward((w * 2).sum())


def test_a_sharded_optimizer_needs_a_reduce_scatter_callback():
    w = torch.ones(3, requires_grad=True)
    gm = GradManager().attach(w, callbacks=[make_allreduce_cb(transport=_Sum())])
    with pytest.raises(ValueError, match="shard=True"):
        ShardedOptimizer(gm, torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("first", ["parameters", "parameter list", "model"])
def test_zero_redundancy_optimizers_argument_order_is_named(first):
    """``ZeroRedundancyOptimizer(params, optimizer_class, ...)`` written as a ShardedOptimizer:
    a TypeError naming the order (it was ``'generator' object has no attribute
    '_attached'``)."""
    model = torch.nn.Linear(2, 1)
    given = {"parameters": model.parameters(), "parameter list": list(model.parameters()),
             "model": model}[first]
    with pytest.raises(TypeError, match=r"takes the manager first.*ShardedOptimizer\(gm, "):
        ShardedOptimizer(given, torch.optim.AdamW, lr=0.1)


def test_copied_segments_follow_weights_loaded_after_the_optimizer_was_made():
    """A parameter that is not contiguous is stepped through a copy of its slice: the weights
    loaded into the model afterwards (resuming) are what the step starts from, as for the
    contiguous one (a view). One rank: SGD's update 0.25 * 2w is exact."""
    from fake_distributed import OneRank

    w = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4).t())
    b = torch.nn.Parameter(torch.ones(4))
    cb = make_reduce_scatter_cb(transport=OneRank(), broadcast=False)
    gm = GradManager().attach([w, b], callbacks=[cb])
    opt = ShardedOptimizer(gm, torch.optim.SGD, lr=0.25)
    loaded = torch.linspace(-1.0, 2.0, 12).reshape(4, 3)
    with torch.no_grad():
        w.copy_(loaded)
        b.fill_(3.0)
    with gm:
        gm.backward((w * w).sum() + (b * b).sum())
    opt.step()
    assert not w.is_contiguous() and torch.equal(w, loaded * 0.5)
    assert torch.equal(b, torch.full((4,), 1.5))


def test_master_copies_follow_weights_loaded_after_the_optimizer_was_made():
    """bf16 parameters stepped through fp32 masters: where the parameter no longer holds its
    master's rounded value (weights loaded since), the master takes the parameter's value;
    elsewhere it keeps its extra precision. One rank, SGD: against the same arithmetic by
    hand (fp32 master minus lr * grad, rounded to bf16)."""
    from fake_distributed import OneRank

    w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6, dtype=torch.bfloat16))
    cb = make_reduce_scatter_cb(transport=OneRank(), broadcast=False)
    gm = GradManager().attach(w, callbacks=[cb])
    opt = ShardedOptimizer(gm, torch.optim.SGD, master_dtype="float32", lr=0.01)
    master = w.detach().float()
    for step in range(3):
        if step == 1:  # resume: the weights change outside the optimizer
            with torch.no_grad():
                w.copy_(torch.linspace(2.0, 3.0, 6, dtype=torch.bfloat16))
            master = w.detach().float()
        with gm:
            gm.backward((w.float() ** 2).sum())
        master = master - 0.01 * (2 * w.detach().float())
        opt.step()
        opt.zero_grad()
        assert torch.equal(w, master.to(torch.bfloat16)), step
    assert not torch.equal(master, master.to(torch.bfloat16).float())  # precision kept


def test_zero_grad_takes_set_to_none_as_torch_optimizers_do():
    """A DDP loop's ``opt.zero_grad(set_to_none=...)`` works unchanged; either way the next
    step sees only its own gradient (one rank, SGD: w - lr * 2w each step)."""
    from fake_distributed import OneRank

    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 4.0]))
    cb = make_reduce_scatter_cb(transport=OneRank(), broadcast=False)
    gm = GradManager().attach(w, callbacks=[cb])
    opt = ShardedOptimizer(gm, torch.optim.SGD, lr=0.25)
    for set_to_none in (False, True, False):
        want = w.detach() - 0.25 * 2 * w.detach()
        with gm:
            gm.backward((w ** 2).sum())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        assert torch.equal(w.detach(), want), set_to_none


def test_reduce_scatter_callback_options_are_checked():
    with pytest.raises(ValueError, match="reduce"):
        make_reduce_scatter_cb("max")
    assert make_reduce_scatter_cb().native is False


if __name__ == "__main__":  # pragma: no cover
    pytest.main([os.path.abspath(__file__)])


def test_a_scheduler_on_the_wrapped_optimizer_is_refused_not_lost(gloo_one_rank):
    """``StepLR(opt.optimizer, ...)``: the step copies the program's groups (``opt``'s) into
    the wrapped optimizer's, so the scheduler's rate was overwritten at every step and the
    model trained at a constant rate, silently (seen by issue 28's newcomer probe). Now the
    step raises, saying to build the scheduler on ``opt``; on ``opt`` it schedules (the rates
    halve, exactly). One rank: the rule is local."""
    from gradmgr.distributed import ShardedOptimizer, data_parallel

    for target, expected in (("opt", [0.05, 0.025, 0.0125]), ("inner", None)):
        model = torch.nn.Linear(3, 2)
        gm = data_parallel(model, shard=True)
        opt = ShardedOptimizer(gm, torch.optim.SGD, lr=0.1)
        scheduled = opt if target == "opt" else opt.optimizer
        sched = torch.optim.lr_scheduler.StepLR(scheduled, 1, gamma=0.5)
        rates = []

        def train(steps, gm=gm, model=model, opt=opt, sched=sched, rates=rates):
            for _ in range(steps):
                with gm:
                    gm.backward(model(torch.ones(4, 3)).sum())
                opt.step()
                opt.zero_grad()
                sched.step()
                rates.append(opt.param_groups[0]["lr"])

        if expected is not None:
            train(3)
            assert rates == expected
        else:
            train(1)  # the first step cannot know: nothing changed behind it yet
            with pytest.raises(RuntimeError, match=r"Build schedulers on the Sharded"):
                train(1)
        del gm, opt
