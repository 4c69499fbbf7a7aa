"""Data parallelism on Paddle models: ``gradmgr.distributed.data_parallel(model)`` over Paddle's
own collectives (gloo on this CPU machine), 2 ranks started by ``spawn_local`` as a user starts
them (tests/dist_workers/paddle_suite.py), against ``paddle.DataParallel`` running the same
script in the same processes, bit for bit (the same local kernels, and a sum of two addends
then a halving, which no order changes), and against the single-process full-batch gradient
mean (``rtol=1e-5, atol=1e-6``: float32 summed in another order); rows of the habit table
(dist_workers/paddle_habits.py, in the same spawn) against ``paddle.DataParallel`` bit for
bit; habits of a training step (dist_workers/paddle_steps.py) and habits that change what is reduced
(dist_workers/paddle_rank_habits.py), in the same spawn. Plus the frozen
parameter rule of the Paddle backend, in one process.

Runs only where PaddlePaddle is installed (conftest.py: FRAMEWORK_FILES).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from dist_workers import paddle_suite as suite
from dist_workers.paddle_habits import HABITS
from dist_workers.paddle_steps import COMPARED
from ranks import spawn_local_ranks

from gradmgr import GradManager

# by_hand: make_allreduce_cb; skipped: step 1 a recording without backward (its batch
# skipped), .grad kept as zeros (clear_grad()'s default), which must not count as changed
CASES = ("sgd", "adam", "no_sync", "no_sync_4", "frozen", "by_hand", "skipped")
REL, ABS = 1e-5, 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    # generous: two Paddle imports and three gloo groups on a loaded 2-core machine
    return spawn_local_ranks("paddle_suite", "main", tmp_path_factory.mktemp("paddle_dp"),
                             "Paddle", timeout=400)


def full_batch_grads(model, steps) -> list:
    """The gradient of the mean loss over every rank's rows of ``steps``' batches, summed
    over ``steps`` (one process, no data parallelism)."""
    total = None
    for step in steps:
        x, y = (paddle.to_tensor(a) for a in suite.batch(step))
        grads = paddle.grad(suite.loss_of(model, x, y), list(model.parameters()))
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return [g.numpy() for g in total]


def full_batch_sgd(micro: int = 1, frozen: bool = False) -> tuple:
    """Rank 0's starting weights trained on the full batches: each step's gradients and
    parameters."""
    model = suite.net(0)
    grads, params = [], []
    for step in range(suite.STEPS):
        g = full_batch_grads(model, range(step * micro, (step + 1) * micro))
        if frozen:
            g[1] = None
        grads.append(g)
        for p, gi in zip(model.parameters(), g):
            if gi is not None:
                p.set_value(p - 0.1 * paddle.to_tensor(gi))
        params.append([p.numpy() for p in model.parameters()])
    return grads, params


@pytest.mark.parametrize("case", CASES)
def test_equals_paddle_data_parallel_bit_for_bit(ranks, case):
    same_as_paddle([out[case] for out in ranks], case)


def same_as_paddle(sides: list, case: str, ranks_alike: bool = True) -> None:
    """Each rank's ``ours`` equals its ``paddle`` and (``ranks_alike``) rank 0's ``ours``, bit
    for bit (NaN where the other has NaN)."""
    for rank, side in enumerate(sides):
        ours, theirs = side["ours"], side["paddle"]
        assert "skip_error" not in ours, (rank, ours.get("skip_error"))
        for what in ("grads", "params"):
            for step, (a, b) in enumerate(zip(ours[what], theirs[what])):
                for i, (x, y) in enumerate(zip(a, b)):
                    where = f"{case} rank {rank} step {step} {what}[{i}]"
                    assert (x is None) == (y is None), where
                    if x is not None:
                        np.testing.assert_array_equal(x, y, err_msg=where)
                        if ranks_alike:
                            np.testing.assert_array_equal(x, sides[0]["ours"][what][step][i],
                                                          err_msg=f"ranks differ: {where}")


@pytest.mark.parametrize("habit", [h for h in HABITS if h != "recompute_reentrant"])
def test_habits_equal_paddle_data_parallel_bit_for_bit(ranks, habit):
    """Rows of the habit table on a Paddle model (dist_workers/paddle_habits.py): a layer
    unused on every rank and one used on rank 0 at step 0 only, a layer used twice, a
    PyLayer giving a weight no gradient, a layer frozen after a step on every rank, a
    recomputed layer (``use_reentrant=False``; against the same model without
    recomputation: Paddle's own reducer refuses recompute), a ``register_hook`` on a
    parameter, registered after ``data_parallel(model)``."""
    for out in ranks:
        assert out["habits"][habit]["ours"]["error"] is None, out["habits"][habit]["ours"]
    same_as_paddle([out["habits"][habit] for out in ranks], habit)


def test_a_reentrant_recompute_raises_on_every_rank(ranks):
    """Paddle's default ``recompute`` (``use_reentrant=True``) writes the recomputed layer's
    ``.grad`` in its own backward, so data_parallel would leave it this rank's own: each rank
    raises at the first step (no step's gradients kept), naming fc2's weight and
    ``use_reentrant=False``."""
    for rank, out in enumerate(ranks):
        ours = out["habits"]["recompute_reentrant"]["ours"]
        assert ours["grads"] == [], rank
        assert ours["error"] is not None, rank
        assert ours["error"].startswith("UnsupportedGraphError: Paddle's own backward wrote "
                                        f"the .grad of '{ours['fc2_weight']}'"), ours["error"]
        assert "use_reentrant=False" in ours["error"], ours["error"]


def test_a_forgotten_with_gm_raises_on_every_rank(ranks):
    """``loss.backward()`` with no recording after ``data_parallel(model)`` would compute this
    rank's gradients only, and the ranks' models drift apart (silently on the old code). As
    on PyTorch, the forward armed a refusal: the backward raises on every rank before
    writing any ``.grad`` (Paddle wraps a hook's RuntimeError in its OSError), in Paddle's
    names (``PaddleOps.idioms``), no PyTorch name (on the old code, which rewrote the
    torch-worded message, "as under DDP" was left); a deep copy and a pickled copy of the
    model train unwatched (``loss.backward()`` gives them this rank's gradient, ``rtol=1e-5,
    atol=1e-6`` against ``paddle.grad`` in one process); ``paddle.grad`` of a forward outside
    the recording passes; the next step inside ``with gm:`` gives the mean gradient, bit for
    bit rank 0's first ``sgd`` step's."""
    for rank, out in enumerate(ranks):
        got = out["habits"]["forgotten_with"]
        error = got["error"]
        assert error is not None, (
            f"rank {rank}: no error, and the ranks' gradients "
            f"{'agree' if _same_grads(ranks) else 'differ'}")
        assert error.startswith("OSError: (External) RuntimeError: data_parallel(): a "
                                "backward writes the model's .grad after a forward that ran "
                                "with gradients enabled outside `with gm:`"), (rank, error)
        said = error.split("At:")[0]  # Paddle's traceback follows
        for idiom in ("after dropping paddle.DataParallel?", "under paddle.no_grad(),",
                      "so is paddle.grad,", "as under paddle.DataParallel.)"):
            assert idiom in said, (rank, idiom, error)  # Paddle's words (TensorOps.idioms)
        assert "torch" not in said and "DDP" not in said, (rank, error)
        assert got["grads"] == [None] * 4, rank
        start = suite.net(0)  # the copies hold rank 0's weights, broadcast: no step yet
        want = paddle.grad(suite.loss_of(start, *suite.local(0, rank, 2)),
                           list(start.parameters()))
        for copied in got["copies"]:  # unwatched: this rank's own gradient, as in one process
            for i, (x, w) in enumerate(zip(copied, want)):
                np.testing.assert_allclose(x, w.numpy(), rtol=REL, atol=ABS,
                                           err_msg=f"rank {rank} copy [{i}]")
        assert got["grad_error"] is None, (rank, got["grad_error"])
        for i, (x, want) in enumerate(zip(got["step_grads"], ranks[0]["sgd"]["ours"]["grads"][0])):
            np.testing.assert_array_equal(x, want, err_msg=f"rank {rank} [{i}]")


def _same_grads(ranks) -> bool:
    grads = [out["habits"]["forgotten_with"]["grads"] for out in ranks]
    return all(a is None and b is None or np.array_equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("case", ["sgd", "no_sync", "no_sync_4", "frozen", "bf16"])
def test_equals_the_full_batch_gradient_mean(ranks, case):
    """Rank 1 started from other weights (seed 1): rank 0's were broadcast. With no_sync the
    first micro-batch of each step accumulates locally: the sum of two full-batch means (with
    ``no_sync_4`` the first three: the sum of four).
    bf16 on the wire (8 significant bits): within 1 % of the largest gradient, and the
    parameters then within 1e-3."""
    grads, params = full_batch_sgd(micro={"no_sync": 2, "no_sync_4": 4}.get(case, 1),
                                   frozen=case == "frozen")
    rel, tol = (0, 1e-2) if case == "bf16" else (REL, ABS)
    if case == "bf16":  # the sums did go through bf16: step 0 (same weights) is not float32's
        assert not all(np.array_equal(a, b) for a, b in zip(
            ranks[0]["bf16"]["ours"]["grads"][0], ranks[0]["sgd"]["ours"]["grads"][0]))
    for rank, out in enumerate(ranks):
        ours = out[case]["ours"]
        for step in range(suite.STEPS):
            for i, want in enumerate(grads[step]):
                where = f"{case} rank {rank} step {step} [{i}]"
                got = ours["grads"][step][i]
                if want is None:  # the frozen bias: no gradient, its value rank 0's start
                    assert got is None, where
                    np.testing.assert_array_equal(ours["params"][step][i], params[0][i])
                    continue
                atol = tol * np.abs(want).max() if case == "bf16" else tol
                np.testing.assert_allclose(got, want, rtol=rel, atol=atol, err_msg=where)
                np.testing.assert_allclose(ours["params"][step][i], params[step][i], rtol=rel,
                                           atol=1e-3 if case == "bf16" else tol, err_msg=where)


def test_an_attached_input_gets_this_ranks_gradient_as_under_paddle_data_parallel(ranks):
    """An input with ``stop_gradient=False`` that is not a parameter, attached before and
    inside the recording (dist_workers/paddle_suite.py: ``attached_input``): as with PyTorch's
    ``requires_grad=True`` input, its ``.grad`` is this rank's own gradient and the
    parameters' the mean over the ranks: what ``paddle.DataParallel`` gives, bit for bit,
    and this rank's gradient of its own loss in one process (``paddle.grad``)."""
    model = suite.net(0)  # rank 0's weights: the ones both sides broadcast
    for rank, out in enumerate(ranks):
        ours, theirs = out["input"]["ours"], out["input"]["paddle"]
        for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
            for i, (got, want) in enumerate(zip(a, b)):
                where = f"rank {rank} step {step} [{i}]"
                assert got is not None and want is not None, where
                np.testing.assert_array_equal(got, want, err_msg=where)
            x, y = suite.local(step, rank, 2)
            x.stop_gradient = False
            local = paddle.grad(suite.loss_of(model, x, y), [x])[0].numpy()
            np.testing.assert_allclose(a[-1], local, rtol=REL, atol=ABS, err_msg=f"rank {rank}")
        assert not np.array_equal(out["input"]["ours"]["grads"][0][-1],
                                  ranks[1 - rank]["input"]["ours"]["grads"][0][-1])


def test_what_the_paddle_path_cannot_do_raises_on_every_rank(ranks):
    for rank, out in enumerate(ranks):
        errors = out["refusals"]
        assert errors["shard"].startswith("NotImplementedError: gradmgr shards Paddle models "
                                          "in no way yet"), (rank, errors["shard"])
        assert errors["full"] == errors["shard"], rank
        assert errors["fp16"].startswith("ValueError: compression='fp16' on Paddle CPU "
                                         "tensors"), (rank, errors["fp16"])
        assert errors["comm_hook"].startswith("ValueError: comm_hook= takes PyTorch DDP "
                                              "communication hooks, and these tensors are "
                                              "Paddle's"), rank
        assert errors["transport"].startswith(
            "ValueError: unknown transport 'gloo' for paddle tensors; choose one of "
            "['paddle']"), rank
        assert errors["join"].startswith("NotImplementedError: uneven inputs"), rank
        assert errors.get("wrapper", "").startswith(
            "TypeError: data_parallel() was given a paddle.DataParallel wrapper"), (
            rank, errors.get("wrapper", "no error: every gradient reduced twice"))
        assert "(net._layers)" in errors["wrapper"], rank


def test_a_paddle_data_parallel_built_after_data_parallel_is_refused_at_its_forward(ranks):
    """``gm = data_parallel(model); wrapper = paddle.DataParallel(model)``, training through
    the wrapper with a ``register_hook`` on a parameter: on the old code step 0's gradients were
    right and step 1's forward failed inside Paddle's reducer (PreconditionNotMet, on every
    rank). Now the first forward through the wrapper raises gradmgr's refusal on every rank,
    before any ``.grad`` is written, and a step through the model itself is whole: the mean
    gradient of rank 0's ``sgd`` step 0, the hooked weight's doubled (exact), bit for bit."""
    for rank, out in enumerate(ranks):
        got = out["wrapped_after"]
        for step, error in enumerate(got["errors"]):
            assert (error or "").startswith(
                "RuntimeError: data_parallel(): this layer's forward runs inside a "
                "paddle.DataParallel's forward"), (rank, step, error)
        assert "call model(x) itself" in got["errors"][0], rank
        assert got["grads_after"] == [None] * 4, rank
        want = ranks[0]["sgd"]["ours"]["grads"][0]
        for i, (a, b) in enumerate(zip(got["grads"], want)):
            np.testing.assert_array_equal(a, b * 2 if i == 2 else b, err_msg=f"{rank} [{i}]")


AROUND = ("RuntimeError: data_parallel(): this layer's forward runs inside a "
          "paddle.DataParallel's forward")
INSIDE = "RuntimeError: data_parallel(): this layer holds a paddle.DataParallel at sublayer '0'"


@pytest.mark.parametrize("place,refusal", [("subclass_forward", AROUND),
                                           ("subclass_super", AROUND), ("sublayer", INSIDE),
                                           ("holder", AROUND)])
def test_a_paddle_data_parallel_near_the_model_after_data_parallel_is_refused(ranks, place,
                                                                               refusal):
    """After ``data_parallel(model)``, with a ``register_hook`` (x2) on ``0.weight``
    (dist_workers/paddle_wrappers.py): a ``paddle.DataParallel`` subclass whose forward does
    not call ``DataParallel.forward`` (on the old code step 1's forward failed in Paddle's
    reducer, PreconditionNotMet), one whose forward calls it, a wrapper put around the
    sublayer ``0`` (the same failure on the old code), a wrapper around a layer holding the
    model. Each step through it raises the refusal on every rank before any ``.grad`` is
    written; with the model put back, a step is whole: rank 0's ``sgd`` step 0, ``0.weight``'s
    doubled by its hook (exact), bit for bit."""
    want = ranks[0]["sgd"]["ours"]["grads"][0]
    for rank, out in enumerate(ranks):
        got = out["wrappers"][place]
        for step, error in enumerate(got["errors"]):
            assert (error or "").startswith(refusal), (rank, step, error)
            assert "Build no paddle.DataParallel for the model" in error, (rank, step)
        assert got["grads_after"] == [None] * 4, rank
        for i, (a, b) in enumerate(zip(got["grads"], want)):
            np.testing.assert_array_equal(a, b * 2 if i == 0 else b, err_msg=f"{rank} [{i}]")


def test_a_paddle_data_parallel_built_before_data_parallel(ranks):
    """A layer holding a ``paddle.DataParallel`` at sublayer ``0`` given to ``data_parallel``:
    ``TypeError`` naming it (the old code took it, and with a hook on a wrapped parameter the
    second step's forward failed in Paddle's reducer); a subclass given to it: the wrapper's
    ``TypeError``; a ``paddle.DataParallel(model)`` kept aside while ``data_parallel(model)``
    trains the model itself: the step is whole (``0.weight``'s hook x2, bit for bit against
    rank 0's ``sgd`` step 0), a step through the wrapper refused."""
    want = ranks[0]["sgd"]["ours"]["grads"][0]
    for rank, out in enumerate(ranks):
        got = out["wrappers"]["before"]
        assert (got["sublayer"] or "").startswith(
            "TypeError: data_parallel() was given a layer that holds a paddle.DataParallel at "
            "sublayer '0'"), (rank, got["sublayer"])
        assert "its ._layers" in got["sublayer"], rank
        assert (got["subclass"] or "").startswith(
            "TypeError: data_parallel() was given a paddle.DataParallel wrapper"), rank
        for i, (a, b) in enumerate(zip(got["aside_grads"], want)):
            np.testing.assert_array_equal(a, b * 2 if i == 0 else b, err_msg=f"{rank} [{i}]")
        assert (got["aside_wrapper"] or "").startswith(AROUND), (rank, got["aside_wrapper"])


def test_one_output_twice_is_refused_on_every_rank_and_the_next_step_is_whole(ranks):
    """``gm.backward([y, y], ...)`` and ``gm.backward([y, y[:]], ...)`` under
    ``data_parallel``: gradmgr's ``UnsupportedGraphError`` saying what to pass instead on
    every rank (on the old code, Paddle's ``RuntimeError: (AlreadyExists) outputs contain
    duplicate tensor``), no ``.grad`` written, and the next step is rank 0's ``sgd`` step 0,
    bit for bit."""
    want = ranks[0]["sgd"]["ours"]["grads"][0]
    for rank, out in enumerate(ranks):
        got = out["wrappers"]["repeated"]
        same, alias = got["errors"]
        assert (same or "").startswith("UnsupportedGraphError: backward() got one output twice "
                                       "(the same tensor twice)"), (rank, same)
        assert (alias or "").startswith("UnsupportedGraphError: backward() got one output "
                                        "twice (two tensors over one autograd record, as y "
                                        "and y[:] are)"), (rank, alias)
        assert "gm.backward([y], [dy1 + dy2])" in same, rank
        assert got["grads_after"] == [None] * 4, rank
        for i, (a, b) in enumerate(zip(got["grads"], want)):
            np.testing.assert_array_equal(a, b, err_msg=f"{rank} [{i}]")


def test_the_example_of_docs_paddle_md_trains_alike_on_both_ranks(ranks):
    assert [out["example"] for out in ranks] == ["ran", "ran"]  # its fit() asserts the rest


def test_a_rank_whose_forward_fails_makes_the_others_raise_and_the_next_step_is_whole(ranks):
    errors = [out["one_fails"].get("error", "") for out in ranks]
    assert errors[0].startswith("RankFailedError: another rank's backward raised"), errors[0]
    assert errors[1] == "ValueError: rank 1's forward failed", errors[1]
    for rank, out in enumerate(ranks):
        assert out["one_fails"]["grads_after_failure"] == [None] * 4, rank  # as before: none
        for i, (got, want) in enumerate(zip(out["one_fails"]["grads"],
                                            ranks[0]["sgd"]["ours"]["grads"][0])):
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} [{i}]")


def test_ranks_that_disagree_on_the_parameters_fail_on_every_rank(ranks):
    for rank, out in enumerate(ranks):
        assert out["mismatch"].startswith("RankMismatchError: the ranks planned different "
                                          "tensors"), (rank, out["mismatch"])
        assert "rank 1 has 3.weight (float32[3, 3])" in out["mismatch"], rank


def test_a_frozen_parameter_gets_no_gradient():
    """A parameter with ``stop_gradient=True`` is frozen, as in ``loss.backward()`` (and a
    ``torch.nn.Parameter`` with ``requires_grad=False``): attached, it gets no gradient and
    keeps its flag; an attached plain tensor with ``stop_gradient=True`` is an input and
    gets one."""
    model, native = suite.net(0), suite.net(0)
    model[0].bias.stop_gradient = native[0].bias.stop_gradient = True
    x, y = (paddle.to_tensor(a) for a in suite.batch(0))
    inp = paddle.to_tensor(suite.batch(0)[0])  # stop_gradient=True: an input
    gm = GradManager().attach(list(model.parameters()) + [inp])
    with gm:
        gm.backward(suite.loss_of(model, inp, y))
    suite.loss_of(native, x, y).backward()
    assert model[0].bias.grad is None and model[0].bias.stop_gradient
    for ours, theirs in zip(model.parameters(), native.parameters()):
        if theirs.grad is not None:
            np.testing.assert_array_equal(ours.grad.numpy(), theirs.grad.numpy())
    assert inp.grad is not None and inp.stop_gradient


def test_data_parallel_without_paddle_collectives_says_what_to_do():
    """This process never called ``init_parallel_env()``: the first collective (the ranks'
    comparison of their modules) raises, naming what to call and how to start the ranks."""
    from gradmgr.distributed import data_parallel

    assert not paddle.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"(?s)paddle.distributed is not initialised: call "
                                           r"paddle.distributed.init_parallel_env\(\).*spawn_local"):
        data_parallel(suite.net(0))


def test_the_rank_with_a_step_more_raises_and_the_group_stays_in_step(tmp_path):
    """The habit table's "one rank skips a batch before its forward" on Paddle ranks: as on
    every PyTorch path and MegEngine (tests/test_out_of_step.py), the rank with a step more
    raises ``RanksOutOfStepError`` after half the 30 s a Paddle gloo collective waits, and the
    others end their loop, the next allreduce pairing on both (its own spawn: on the old code
    gloo aborts a rank); that rank's next step raises at once."""
    ranks = spawn_local_ranks("paddle_habits", "skip_a_batch", tmp_path, "Paddle", timeout=120)
    error = ranks[0]["error"]
    assert error is not None and error.startswith(
        "RanksOutOfStepError: data parallel: not every rank started this synced step: this "
        "rank waited 15 s (of the 30 s that a Paddle collective waits)"), error
    assert "gradmgr has no Join on Paddle" in error, error
    assert ranks[1]["error"] is None, ranks[1]["error"]
    assert [out["after"] for out in ranks] == [2.0, 2.0]
    again, took = ranks[0]["again"]
    assert again.startswith("RanksOutOfStepError: data parallel: this rank gave up on an earlier "
                            "synced step's plan check"), again
    assert took < 5, took  # no patience again (the machine is loaded: not 0)


@pytest.mark.parametrize("habit", COMPARED)
def test_training_step_habits_equal_paddle_data_parallel_bit_for_bit(ranks, habit):
    """dist_workers/paddle_steps.py, each habit next to ``paddle.DataParallel``: a
    ``GradScaler`` (its kernels run on the CPU) with a batch giving ``inf`` on rank 1 alone at
    step 1: both sides skip that step on every rank and halve the scale; AdamW and Momentum
    with ``L2Decay``, each with ``ClipGradByGlobalNorm``; BatchNorm with a layer frozen from
    the start and an evaluation under ``paddle.no_grad()`` between steps (its outputs too):
    the running statistics are parameters in Paddle (``_mean``, ``_variance``), each rank's
    own on both sides; the model under ``paddle.jit.to_static`` (``paddle.DataParallel``
    around the static layer on its side); two synced backwards per step; a gradient penalty;
    a registered buffer, with ``broadcast_buffers=False`` (each rank's own, as on Paddle's
    side, which broadcasts no buffer after its construction)."""
    sides = [out["steps"][habit] for out in ranks]
    per_rank = habit in ("batchnorm", "buffer_kept")  # BatchNorm's statistics: each rank's
    same_as_paddle(sides, habit, ranks_alike=not per_rank)
    for rank, side in enumerate(sides):
        for what in ("evals", "buffers", "scale"):
            for step, (a, b) in enumerate(zip(side["ours"][what], side["paddle"][what])):
                np.testing.assert_array_equal(a, b, err_msg=f"{habit} {rank} {what} {step}")
    if habit == "scaler":
        for side in sides:  # step 1 skipped (inf on rank 1 only): the parameters as at step 0
            assert side["ours"]["scale"] == [2048.0, 1024.0, 2048.0], side["ours"]["scale"]
            assert not np.isfinite(side["ours"]["grads"][1][0]).all()
            for a, b in zip(side["ours"]["params"][1], side["ours"]["params"][0]):
                np.testing.assert_array_equal(a, b)
    if per_rank:  # the ranks' batches differ: so do their running means
        assert not np.array_equal(sides[0]["ours"]["params"][0][4],
                                  sides[1]["ours"]["params"][0][4]), "bn._mean"
    if habit == "buffer_kept":
        assert [float(side["ours"]["buffers"][-1][0][0]) for side in sides] == [12.0, 24.0]


def test_a_buffer_is_rank_0s_after_each_step_by_default(ranks):
    """The registered buffer of ``buffer_kept`` with ``data_parallel``'s default
    (``broadcast_buffers=True``, DDP's): rank 0's after each synced step on every rank, where
    ``paddle.DataParallel`` leaves each rank its own."""
    for step in range(3):
        seen = [float(out["steps"]["buffer_broadcast"]["buffers"][step][0][0]) for out in ranks]
        assert seen == [4.0 * (step + 1)] * 2, (step, seen)


def test_a_forgotten_with_gm_under_to_static_raises_on_every_rank(ranks):
    for rank, out in enumerate(ranks):
        got = out["steps"]["forgotten_to_static"]
        assert (got["error"] or "").startswith(
            "OSError: (External) RuntimeError: data_parallel(): a backward writes the model's "
            ".grad after a forward that ran with gradients enabled outside `with gm:`"), (
            rank, got["error"])
        assert got["grads"] == [None] * 4, rank


def test_a_model_cast_to_float64_after_data_parallel_gets_the_float64_mean(ranks):
    """``model.to(dtype="float64")`` after ``data_parallel(model)`` and a step (on every rank):
    the next step's ``.grad`` is float64 and bit for bit the mean of the ranks' own float64
    gradients (``paddle.grad``, gathered, summed and halved), as at the float32 step before.
    (``paddle.DataParallel`` raised at that step in a probe: ``InvalidArgument``, float32
    expected.)"""
    for rank, out in enumerate(ranks):
        got = out["steps"]["float64_after"]
        for step, dtype in enumerate(("float32", "float64")):
            for i, (a, b) in enumerate(zip(got["grads"][step], got["means"][step])):
                assert a.dtype == dtype, (rank, step, i, a.dtype)
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} step {step} [{i}]")


def _rank_habit(ranks, habit: str) -> list:
    """Each rank's ``paddle_rank_habits`` result for ``habit``, checked to have left the
    ranks' parameters alike after every step."""
    sides = [out["rank_habits"][habit] for out in ranks]
    for step, (a, b) in enumerate(zip(sides[0]["params"], sides[1]["params"])):
        for i, (x, y) in enumerate(zip(a, b)):
            np.testing.assert_array_equal(x, y, err_msg=f"{habit}: ranks differ, step {step} [{i}]")
    return sides


REFUSED = {
    "no_sync_rank0": (0, "RankMismatchError: the ranks disagree about no_sync (gradient "
                         "accumulation): at this step rank 0 records inside no_sync; rank 1 "
                         "starts a synced step"),
    "one_freezes": (1, "RankMismatchError: the ranks planned different tensors for "
                       "data-parallel reduction: the first difference is at position 0 in "
                       "attach order: rank 0 has 0.weight"),
    "backward_every": (0, "RuntimeError: a data-parallel recording ended without "
                          "gm.backward(), but the attached tensors' .grad changed during it"),
}


@pytest.mark.parametrize("habit", sorted(REFUSED))
def test_ranks_that_disagree_or_a_typed_backward_raise_on_every_rank_and_go_on(ranks, habit):
    """dist_workers/paddle_rank_habits.py: only rank 0 wraps step 0 in ``no_sync(gm)``; only
    rank 1 freezes ``0.weight`` at step 1; ``loss.backward()`` inside ``with gm:`` at step 0
    on every rank. That step raises on every rank, not in gloo and without a hang; the other
    steps raise nothing, and the ranks' parameters stay alike (a step that raised is not
    applied)."""
    at, error = REFUSED[habit]
    for rank, side in enumerate(_rank_habit(ranks, habit)):
        for step, got in enumerate(side["errors"]):
            if step == at:
                assert (got or "").startswith(error), (rank, got)
            else:
                assert got is None, (rank, step, got)


def test_a_typed_backward_on_one_rank_makes_the_others_raise(ranks):
    """``loss.backward()`` inside ``with gm:`` on rank 1 alone: rank 1 raises that it wrote
    ``.grad`` without ``gm.backward()``, rank 0 ``RankFailedError`` with ``.grad`` as it was
    (none); the next steps are whole on both."""
    sides = _rank_habit(ranks, "backward_rank1")
    assert sides[0]["errors"][0].startswith("RankFailedError: another rank's backward raised")
    assert sides[1]["errors"][0].startswith(REFUSED["backward_every"][1]), sides[1]["errors"]
    assert sides[0]["grads"][0] == [None] * 4
    assert [side["errors"][1:] for side in sides] == [[None, None]] * 2


def test_a_weight_unfrozen_after_data_parallel_is_reduced(ranks):
    """``0.weight`` frozen when ``data_parallel(model)`` ran, unfrozen on every rank after
    step 0: from step 1 on its ``.grad`` is the full-batch mean like the others'
    (``rtol=1e-5, atol=1e-6``). (``paddle.DataParallel`` leaves it out of its reducer: in a
    probe its ranks' values of that weight differed after the step.)"""
    model = suite.net(0)
    for step in range(suite.STEPS):
        want = full_batch_grads(model, [step])
        if step == 0:
            want[0] = None
        for rank, side in enumerate(_rank_habit(ranks, "unfreeze")):
            assert side["errors"][step] is None, (rank, step)
            for i, (got, w) in enumerate(zip(side["grads"][step], want)):
                assert (got is None) == (w is None), (rank, step, i)
                if w is not None:
                    np.testing.assert_allclose(got, w, rtol=REL, atol=ABS,
                                               err_msg=f"rank {rank} step {step} [{i}]")
        for p, g in zip(model.parameters(), want):
            if g is not None:
                p.set_value(p - 0.1 * paddle.to_tensor(g))


def test_a_layer_replaced_after_data_parallel_is_refused_until_a_new_manager(ranks):
    """``model[2] = paddle.nn.Linear(8, 3)`` on every rank after step 0, each rank's own
    initial weights: every later recording raises on every rank, naming the new parameter,
    with no ``.grad`` written (as PyTorch's path; ``paddle.DataParallel`` raises too); then a
    new manager broadcasts rank 0's weights and its step gives every rank the same gradients
    and parameters. The old code looked for no changed layer on Paddle: the new layer got no
    gradient and kept each rank's own weights, silently."""
    sides = [out["rank_habits"]["replaced"] for out in ranks]
    for rank, side in enumerate(sides):
        assert side["errors"][0] is None, (rank, side["errors"][0])
        for step in (1, 2):
            error = side["errors"][step]
            assert error is not None and error.startswith("RuntimeError: data_parallel(): the "
                                                          "model has a parameter it did not "
                                                          "have"), (rank, step, error)
            assert "2.weight" in error, error
            assert all(g is None for g in side["grads"][step]), (rank, step)
        assert side["rewrapped_error"] is None, (rank, side["rewrapped_error"])
        assert all(g is not None for g in side["rewrapped_grads"]), rank
    for a, b in zip(sides[0]["rewrapped_grads"], sides[1]["rewrapped_grads"]):
        np.testing.assert_array_equal(a, b)  # the mean, the same bits on every rank
    for a, b in zip(sides[0]["rewrapped_params"], sides[1]["rewrapped_params"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("where", ["inside", "before"])
def test_a_sparse_gradient_is_refused_on_every_rank_and_a_dense_step_follows(ranks, where):
    """``Embedding(10, 4, sparse=True)`` under ``data_parallel``, its forward inside ``with
    gm:`` or before it (then gradmgr's watch has hooks on the parameters, and the tape runs
    them): ``SparseGradientError`` on every rank, in Paddle's words, no ``.grad`` written;
    then a dense step (``F.embedding``, each rank its own rows) gives the mean of the ranks'
    gradients, bit for bit. On the old code the sparse gradient reached the buckets or the
    hooks' backward: ``OSError`` (a dimension of garbage size) on every rank."""
    paddle.seed(0)  # rank 0's weights: the ones data_parallel broadcast
    model = paddle.nn.Sequential(paddle.nn.Embedding(10, 4, sparse=True),
                                 paddle.nn.Linear(4, 1))
    ids = paddle.to_tensor(np.array([[1, 3, 3]], dtype="int64"))
    local = [paddle.grad(model[1](paddle.nn.functional.embedding(ids + r, model[0].weight))
                         .sum(), list(model.parameters())) for r in range(2)]
    for rank, out in enumerate(ranks):
        got = out["rank_habits"]["sparse"][where]
        assert (got["error"] or "").startswith(
            "SparseGradientError: the allreduce callback reduces dense gradients only, and a "
            "tensor of shape [10, 4] got a sparse one"), (rank, got["error"])
        assert "reduce that tensor with paddle.DataParallel" in got["error"], rank
        assert got["grads_after"] == [None] * 3, rank
        for i, (a, b) in enumerate(zip(*local)):
            np.testing.assert_array_equal(got["grads"][i], ((a + b) * 0.5).numpy(),
                                          err_msg=f"rank {rank} [{i}]")
