"""MegEngine's sharded path (ZeRO-2) against MegEngine's own training: 2 ranks over
torch.distributed gloo (``dist_workers/zero_megengine.py``) train with reduce-scattered
gradients and ``ShardedOptimizer`` wrapping MegEngine's AdamW and SGD (momentum, two parameter
groups), with accumulation under ``no_sync``, global-norm clipping and a frozen layer; each
rank also trains the same model in one process with ``megengine.autodiff.GradManager`` on the
whole batch (every rank's rows), ``megengine.optimizer.clip_grad_norm`` and the same optimizer.
The checkpoint then resumes on 3 ranks.

Tolerances: against MegEngine's own training, ``rtol=1e-5, atol=1e-6`` on the parameters.
The two sides compute the same float32 arithmetic except for the order of the sums: the
gradient of the mean loss over the whole batch is one matmul over 8 rows on MegEngine's side,
and two halves scaled by 1/2 and summed by gloo on ours, so gradients differ by a few float32
roundings (relative ~1e-7); AdamW's update divides by the root of its second moment, so the
update keeps that relative error, times lr=1e-2: a few 1e-8 on parameters of size ~0.3
(measured: at most 3e-8). Norms: ``rel=1e-6`` (float32 on MegEngine's side, a float64 sum of
float32 squares on ours). Optimizer moments: ``rtol=1e-5`` with ``atol`` 1e-6 of the largest
element (small moments carry the absolute error of the large ones). Across ranks, and a
checkpoint read back: bit for bit (every rank assigns the same gathered buffer; a state sliced
and gathered again is summed with zeros only).
"""

from __future__ import annotations

import numpy as np
import pytest
from ranks import spawn

pytestmark = pytest.mark.megengine

REL, ABS = 1e-5, 1e-6
FROZEN = ("fc2.weight", "fc2.bias")
ELEMENTS = {"fc1": 8 * 16 + 16, "fc2": 16 * 16 + 16, "fc3": 16 * 3 + 3}


@pytest.fixture(scope="module")
def megengine_zero_outdir(tmp_path_factory):
    pytest.importorskip("megengine", reason="megengine is not installed in this environment")
    return tmp_path_factory.mktemp("zero_megengine")


@pytest.fixture(scope="module")
def megengine_zero_main(megengine_zero_outdir):
    """2 ranks; rank 0 writes the checkpoint."""
    return spawn("zero_megengine", megengine_zero_outdir, 2, timeout=60, GRADMGR_ZERO_PART="main")


@pytest.fixture(scope="module")
def megengine_zero_reload(megengine_zero_main, megengine_zero_outdir):
    """3 ranks resuming from the 2-rank checkpoint."""
    return spawn("zero_megengine", megengine_zero_outdir, 3, timeout=60,
                 GRADMGR_ZERO_PART="reload")


def close_every_step(run: dict, what: str) -> None:
    assert len(run["ours"]) == len(run["native"]) >= 2, what
    for step, (ours, native) in enumerate(zip(run["ours"], run["native"])):
        assert sorted(ours) == sorted(native), what
        for name in native:
            np.testing.assert_allclose(ours[name], native[name], rtol=REL, atol=ABS,
                                       err_msg=f"{what}: step {step}, {name}")


def same_on_every_rank(results: list, run: str) -> None:
    for rank, out in enumerate(results[1:], 1):
        for step, (mine, first) in enumerate(zip(out[run]["ours"], results[0][run]["ours"])):
            for name in first:
                np.testing.assert_array_equal(mine[name], first[name],
                                              err_msg=f"{run}: rank {rank}, step {step}, {name}")


def norms_match(run: dict, what: str) -> None:
    for ours, native in run["norms"]:
        assert ours == pytest.approx(native, rel=1e-6), what


def frozen_kept(out: dict, run: str) -> None:
    for step in out[run]["ours"]:
        for name in FROZEN:
            np.testing.assert_array_equal(step[name], out["start"][name], err_msg=name)


def states_close(ours: dict, theirs: dict, what: str, exact: bool = False) -> None:
    assert sorted(ours["state"]) == sorted(theirs["state"]), what
    for index, state in theirs["state"].items():
        assert sorted(ours["state"][index]) == sorted(state), f"{what}: parameter {index}"
        for key, want in state.items():
            got = ours["state"][index][key]
            assert got.shape == want.shape, f"{what}: parameter {index}, {key}"
            if exact or key == "step":
                np.testing.assert_array_equal(got, want, err_msg=f"{what}: {index}, {key}")
            else:
                np.testing.assert_allclose(got, want, rtol=REL, atol=1e-6 * np.abs(want).max(),
                                           err_msg=f"{what}: parameter {index}, {key}")


def test_adamw_through_data_parallel_equals_megengines_own_training(megengine_zero_main):
    """Accumulation under no_sync, a frozen layer (detached in the forward: attached, but no
    rank gives it a gradient), clipping that does not scale."""
    main = megengine_zero_main
    for rank, out in enumerate(main):
        close_every_step(out["adamw"], f"rank {rank}")
        norms_match(out["adamw"], f"rank {rank}")
        frozen_kept(out, "adamw")
    same_on_every_rank(main, "adamw")


def test_clipping_that_scales_equals_megengines_clip_grad_norm(megengine_zero_main):
    main = megengine_zero_main
    for rank, out in enumerate(main):
        assert all(ours > 20 * 0.05 for ours, _ in out["clipped"]["norms"])  # it did scale
        norms_match(out["clipped"], f"rank {rank}")
        close_every_step(out["clipped"], f"rank {rank} clipped")
        frozen_kept(out, "clipped")
    same_on_every_rank(main, "clipped")
    scaled = main[0]["clipped"]["ours"][-1]["fc1.weight"]
    assert not np.allclose(scaled, main[0]["adamw"]["ours"][-1]["fc1.weight"], rtol=1e-3)


def test_sgd_with_momentum_and_groups_on_a_callback_attached_by_hand(megengine_zero_main):
    """The frozen layer is not attached (MegEngine's usual way); 3 micro-batches a step."""
    main = megengine_zero_main
    for rank, out in enumerate(main):
        close_every_step(out["sgd"], f"rank {rank} sgd")
        norms_match(out["sgd"], f"rank {rank} sgd")
        assert all(ours > 0.5 for ours, _ in out["sgd"]["norms"])  # clipped to 0.5
        frozen_kept(out, "sgd")
    same_on_every_rank(main, "sgd")


def test_the_consolidated_state_is_megengines_own(megengine_zero_main):
    main = megengine_zero_main
    for rank, out in enumerate(main):
        for run in ("adamw", "clipped", "sgd"):
            ours, theirs = out[run]["state"], out[run]["native_state"]
            assert ours["param_groups"] == theirs["param_groups"], run
            states_close(ours, theirs, f"rank {rank} {run}")
        steps = [s["step"] for s in out["adamw"]["state"]["state"].values()]
        assert sorted(float(s) for s in steps).count(0.0) == 2  # fc2: never stepped


def test_a_layer_not_attached_is_numbered_as_megengines_own_optimizer_numbers_it(
        megengine_zero_main):
    """params= names every layer, the frozen one not attached: it is numbered (its state
    sliced over the ranks, never stepped) and the state dict is MegEngine's own AdamW's."""
    for rank, out in enumerate(megengine_zero_main):
        run = out["not_attached"]
        close_every_step(run, f"rank {rank} not attached")
        frozen_kept(out, "not_attached")
        assert run["state"]["param_groups"] == run["native_state"]["param_groups"]
        assert sorted(run["state"]["state"]) == list(range(6))
        states_close(run["state"], run["native_state"], f"rank {rank} not attached")
    same_on_every_rank(megengine_zero_main, "not_attached")


def test_each_rank_holds_half_of_the_gradients_and_the_optimizer_state(megengine_zero_main):
    main = megengine_zero_main
    attached = sum(ELEMENTS.values())  # data_parallel attaches fc2 too (detached in forward)
    adam = [out["adamw"]["memory"] for out in main]
    grads = [m["gradients"] for m in adam]
    assert sum(grads) >= 4 * attached and max(grads) <= 4 * attached * 0.55, grads
    state = [m["optimizer"] for m in adam]  # two float32 moments, and a step per segment
    assert 2 * 4 * attached < sum(state) < 2 * 4 * attached + 4 * 20, state
    assert max(state) <= 2 * 4 * attached * 0.55, state
    trainable = ELEMENTS["fc1"] + ELEMENTS["fc3"]  # SGD's momentum buffers; fc2 not attached
    sgd = [out["sgd"]["memory"]["optimizer"] for out in main]
    assert sum(sgd) == 4 * trainable and max(sgd) <= 4 * trainable * 0.55, sgd


def test_a_checkpoint_resumes_on_3_ranks_into_an_optimizer_made_before_the_weights_loaded(
        megengine_zero_reload):
    reload = megengine_zero_reload
    for rank, out in enumerate(reload):
        assert out["world"] == 3
        states_close(out["reload_state"], out["saved"], f"rank {rank} read back", exact=True)
        states_close(out["from_native_state"], out["saved_native"],
                     f"rank {rank} MegEngine's own state_dict read back", exact=True)
        close_every_step(out["reload"], f"rank {rank} resumed")
        frozen_kept(out, "reload")
    same_on_every_rank(reload, "reload")
    state = [out["reload"]["memory"]["optimizer"] for out in reload]
    assert max(state) <= 2 * 4 * sum(ELEMENTS.values()) * 0.4, state


# ---------------------------------------------------------------------- in one process
@pytest.fixture
def mge_modules():
    pytest.importorskip("megengine", reason="megengine is not installed in this environment")
    import megengine
    from megengine.autodiff import GradManager as NativeGradManager
    from megengine.optimizer import AdamW

    return megengine, NativeGradManager, AdamW


def test_resuming_from_megengines_own_state_dict_into_an_optimizer_made_first(mge_modules):
    """One rank (every collective the identity): MegEngine's AdamW trains a step and saves
    its state_dict (numpy arrays); a ShardedOptimizer made before the weights are loaded
    takes both and steps exactly as MegEngine's AdamW resumed from them (same engine, same
    elementwise arithmetic, a mean over one rank is exact: bit for bit). ``b`` has shape
    (3, 1): its flat segment (3,) would broadcast with a saved moment of shape (3, 1)."""
    megengine, NativeGradManager, AdamW = mge_modules
    from fake_distributed import OneRank

    from gradmgr import GradManager
    from gradmgr.distributed import ShardedOptimizer, make_reduce_scatter_cb

    rng = np.random.default_rng(3)
    start = [rng.standard_normal(s).astype("float32") for s in ((2, 4), (3, 1))]
    x = megengine.Tensor(rng.standard_normal((5, 4)).astype("float32"))

    def loss(w, b):
        return ((megengine.functional.matmul(x, w, transpose_b=True) ** 2).mean()
                + (b * b * 1.5).sum())

    theirs = [megengine.Parameter(v) for v in start]
    native_gm = NativeGradManager().attach(theirs)
    native = AdamW(theirs, lr=0.1)
    ours = [megengine.Parameter(np.zeros_like(v)) for v in start]
    cb = make_reduce_scatter_cb(transport=OneRank(), broadcast=False)
    gm = GradManager().attach(ours, callbacks=[cb])
    opt = ShardedOptimizer(gm, AdamW, lr=0.1)
    for step in range(3):
        if step == 1:  # resume: the weights and MegEngine's own state_dict
            for p, q in zip(ours, theirs):
                p._reset(megengine.Tensor(q.numpy()))
            opt.load_state_dict(native.state_dict())
        with native_gm:
            native_gm.backward(loss(*theirs))
        native.step()
        native.clear_grad()
        with gm:
            gm.backward(loss(*ours))
        opt.step()
        opt.zero_grad()
    for p, q in zip(ours, theirs):
        assert p.shape == q.shape
        np.testing.assert_array_equal(p.numpy(), q.numpy())


def test_master_copies_follow_weights_loaded_after_the_optimizer_was_made(mge_modules):
    """float16 parameters stepped through float32 masters (one rank, MegEngine's SGD): the
    master takes the parameter's value where the parameter no longer holds the master's
    rounded value (weights loaded since), and keeps its precision elsewhere; against the
    same arithmetic by hand in numpy (float32 master minus lr * grad, rounded to float16)."""
    megengine, _, _ = mge_modules
    from fake_distributed import OneRank
    from megengine.optimizer import SGD

    from gradmgr import GradManager
    from gradmgr.distributed import ShardedOptimizer, make_reduce_scatter_cb

    w = megengine.Parameter(np.linspace(-1.0, 1.0, 6).astype("float16"))
    cb = make_reduce_scatter_cb(transport=OneRank(), broadcast=False)
    gm = GradManager().attach(w, callbacks=[cb])
    opt = ShardedOptimizer(gm, SGD, master_dtype="float32", lr=0.01)
    master = w.numpy().astype("float32")
    for step in range(3):
        if step == 1:  # resume: the weights change outside the optimizer
            w._reset(megengine.Tensor(np.linspace(2.0, 3.0, 6).astype("float16")))
            master = w.numpy().astype("float32")
        with gm:
            gm.backward((w.astype("float32") ** 2).sum())
        master = master - np.float32(0.01) * (np.float32(2) * w.numpy().astype("float32"))
        opt.step()
        opt.zero_grad()
        assert w.dtype == np.float16
        np.testing.assert_array_equal(w.numpy(), master.astype("float16"), err_msg=str(step))
    assert not np.array_equal(master, master.astype("float16").astype("float32"))


def _adamw_pair(megengine, NativeGradManager, AdamW, start, attached):
    """Ours (a 1-rank reduce-scatter manager attaching ``attached`` of the parameters) and
    MegEngine's own (GradManager attaching the same), each with AdamW over all of them."""
    from fake_distributed import OneRank

    from gradmgr import GradManager
    from gradmgr.distributed import ShardedOptimizer, make_reduce_scatter_cb

    ours = [megengine.Parameter(v) for v in start]
    theirs = [megengine.Parameter(v) for v in start]
    cb = make_reduce_scatter_cb(transport=OneRank(), broadcast=False)
    gm = GradManager().attach([ours[i] for i in attached], callbacks=[cb])
    native_gm = NativeGradManager().attach([theirs[i] for i in attached])
    return (ours, gm, ShardedOptimizer(gm, AdamW, ours, lr=0.1, weight_decay=0.01),
            theirs, native_gm, AdamW(theirs, lr=0.1, weight_decay=0.01))


def _numpy(state_dict):
    return {i: {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v) for k, v in s.items()}
            for i, s in state_dict["state"].items()}


def _same_state(ours, theirs):
    assert ours["param_groups"] == theirs["param_groups"]
    mine, want = _numpy(ours), _numpy(theirs)
    assert sorted(mine) == sorted(want)
    for i, state in want.items():
        assert sorted(mine[i]) == sorted(state), i
        for k, v in state.items():
            np.testing.assert_array_equal(mine[i][k], v, err_msg=f"{i} {k}")


def test_a_parameter_not_attached_is_numbered_as_megengines_own_optimizer_numbers_it(mge_modules):
    """MegEngine freezes a parameter by not attaching it; ``params=`` names all three, the
    manager reduces two. One rank: the state dict is MegEngine's own AdamW's over the same
    params, bit for bit, the unattached one numbered (1) with the state MegEngine makes when
    built (zeros, step 0). Then every parameter attached (unfrozen): a new ShardedOptimizer
    loads the dict and trains as MegEngine's AdamW loaded from its own."""
    megengine, NativeGradManager, AdamW = mge_modules
    rng = np.random.default_rng(5)
    start = [rng.standard_normal(s).astype("float32") for s in ((2, 4), (4, 4), (3, 1))]
    x = megengine.Tensor(rng.standard_normal((5, 4)).astype("float32"))

    def loss(w, v, b):
        h = megengine.functional.matmul(megengine.functional.matmul(x, v), w, transpose_b=True)
        return (h ** 2).mean() + (b * b * 1.5).sum()

    def train(pair, steps):
        ours, gm, opt, theirs, native_gm, native = pair
        for _ in range(steps):
            with gm:
                gm.backward(loss(*ours))
            with native_gm:
                native_gm.backward(loss(*theirs))
            opt.step()
            opt.zero_grad()
            native.step()
            native.clear_grad()
        for p, q in zip(ours, theirs):
            np.testing.assert_array_equal(p.numpy(), q.numpy())

    first = _adamw_pair(megengine, NativeGradManager, AdamW, start, attached=(0, 2))
    train(first, 2)
    saved, native_saved = first[2].state_dict(), first[5].state_dict()
    _same_state(saved, native_saved)
    assert float(np.asarray(_numpy(saved)[1]["step"])) == 0.0
    weights = [p.numpy() for p in first[0]]
    second = _adamw_pair(megengine, NativeGradManager, AdamW, weights, attached=(0, 1, 2))
    second[2].load_state_dict(saved)
    second[5].load_state_dict(native_saved)
    _same_state(second[2].state_dict(), second[5].state_dict())
    train(second, 2)
    _same_state(second[2].state_dict(), second[5].state_dict())


def test_megengines_own_dict_with_a_state_of_another_shape_is_refused(mge_modules):
    """Two parameters' states swapped in MegEngine's own state dict (numpy arrays): ValueError,
    decided from the dict, and the optimizer's state is unchanged."""
    megengine, NativeGradManager, AdamW = mge_modules
    start = [np.ones((2, 4), "float32"), np.ones((3,), "float32")]
    ours, gm, opt, theirs, native_gm, native = _adamw_pair(
        megengine, NativeGradManager, AdamW, start, attached=(0, 1))
    before = opt.state_dict()
    bad = native.state_dict()
    bad["state"][0], bad["state"][1] = bad["state"][1], bad["state"][0]
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(bad)
    _same_state(opt.state_dict(), before)


def test_a_parameter_without_saved_state_gets_megengines_initial_state(mge_modules):
    """MegEngine's optimizers make every parameter's state when built and expect it at every
    step: a parameter that the loaded dict holds no state for gets that initial state again
    (zeros, step 0), not none, and the next step runs."""
    megengine, NativeGradManager, AdamW = mge_modules
    start = [np.ones((2, 4), "float32"), np.ones((3,), "float32")]
    ours, gm, opt, *_ = _adamw_pair(megengine, NativeGradManager, AdamW, start, attached=(0, 1))

    def step():
        with gm:
            gm.backward((ours[0] * ours[0]).sum() + (ours[1] * 3).sum())
        opt.step()
        opt.zero_grad()

    step()
    saved = opt.state_dict()
    del saved["state"][1]
    opt.load_state_dict(saved)
    state = _numpy(opt.state_dict())
    assert float(state[1]["step"]) == 0.0 and not state[1]["exp_avg"].any()
    np.testing.assert_array_equal(state[0]["exp_avg"], _numpy(saved)[0]["exp_avg"])
    step()
    assert float(_numpy(opt.state_dict())[1]["step"]) == 1.0


@pytest.fixture(scope="module")
def megengine_zero_habits(tmp_path_factory):
    """2 ranks: issue 25 items 5c and 5b (dist_workers/zero_megengine.py, ``habits``)."""
    pytest.importorskip("megengine", reason="megengine is not installed in this environment")
    return spawn("zero_megengine", tmp_path_factory.mktemp("zero_habits"), 2, timeout=90,
                 GRADMGR_ZERO_PART="habits")


def test_ranks_that_build_the_optimizer_differently_raise_on_every_rank(megengine_zero_habits):
    """Rank 0 one group with weight_decay=0.01, rank 1 two groups (0.5, 0.0): RankMismatchError
    on every rank at construction, naming the group, the option and each rank's value (on
    old code no rank raised)."""
    for out in megengine_zero_habits:
        kind, message = out["groups_differ"]
        assert kind == "RankMismatchError"
        assert "parameter group 0's weight_decay (rank 0: 0.01; rank 1: 0.5)" in message


def test_a_checkpoint_taken_on_rank_0_alone_raises_there_and_training_goes_on(
        megengine_zero_habits):
    """``if rank == 0: opt.state_dict()``, then a barrier: rank 0 raises a RuntimeError that
    says what to write (after the group's timeout, 5 s here) and nothing was communicated, so
    both ranks train on equal to MegEngine's own training, and the documented checkpoint is
    its optimizer's state (on old code both ranks waited in mismatched collectives until
    gloo's timeout)."""
    outs = megengine_zero_habits
    kind, message = outs[0]["lone_state_dict"]
    assert kind == "RuntimeError" and "on every rank" in message
    assert outs[1]["lone_state_dict"] is None
    for out in outs:
        close_every_step(out["before"], "before")
        close_every_step(out["after"], "after")
        states_close(out["state"], out["native_state"], "the checkpoint after")


def test_step_returns_the_optimizer_for_megengines_step_clear_grad_chain(mge_modules):
    """Issue 38: MegEngine's ``opt.step().clear_grad()`` (its optimizer's step returns
    itself) works on a ShardedOptimizer: ``step()`` returns the ShardedOptimizer, whose
    ``clear_grad()`` drops the shards; one rank, bit for bit MegEngine's own AdamW chained the
    same way (see the test above)."""
    megengine, NativeGradManager, AdamW = mge_modules
    from fake_distributed import OneRank

    from gradmgr import GradManager
    from gradmgr.distributed import ShardedOptimizer, make_reduce_scatter_cb

    rng = np.random.default_rng(4)
    start = rng.standard_normal((2, 4)).astype("float32")
    x = megengine.Tensor(rng.standard_normal((5, 4)).astype("float32"))
    theirs, ours = megengine.Parameter(start), megengine.Parameter(start)
    native_gm = NativeGradManager().attach([theirs])
    native = AdamW([theirs], lr=0.1)
    cb = make_reduce_scatter_cb(transport=OneRank(), broadcast=False)
    gm = GradManager().attach([ours], callbacks=[cb])
    opt = ShardedOptimizer(gm, AdamW, lr=0.1)
    for _ in range(2):
        with native_gm:
            native_gm.backward((megengine.functional.matmul(x, theirs, transpose_b=True)
                                ** 2).mean())
        native.step().clear_grad()
        with gm:
            gm.backward((megengine.functional.matmul(x, ours, transpose_b=True) ** 2).mean())
        opt.step().clear_grad()
        assert ours.grad is None
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
