"""Data-parallel allreduce callbacks (gradmgr.distributed) on real collectives.

Multi-process tests spawn 2 ranks on 127.0.0.1 (gloo) with bounded timeouts; the ranks save
their gradients to ``tmp_path`` and every assertion runs here, in the parent. One spawn runs
many scenarios (see dist_workers/torch_suite.py) to keep the suite short on a small machine.

Tolerances: float32 results against single-process references ``rtol=1e-5, atol=1e-6``;
against PyTorch DDP ``atol=1e-6``; fp16 wire ``2e-3`` and bf16 wire ``1.6e-2`` times the
largest reference magnitude.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from dist_workers.data import batch, weights  # noqa: E402
from ranks import spawn  # noqa: E402

from gradmgr import Future, GradManager, get_backend  # noqa: E402
from gradmgr.distributed import (  # noqa: E402
    AllreduceCallback,
    BucketPlan,
    data_parallel,
    make_allreduce_cb,
)

TESTS = os.path.dirname(os.path.abspath(__file__))
REL, ABS = 1e-5, 1e-6
MLP = range(2, 8)  # Net.parameters(): extra, never, then the MLP's 6 tensors


def close(actual, expected, rtol=REL, atol=ABS, what=""):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


# ---------------------------------------------------------------------- references
def full_batch_grads(step: int = 0, use_extra: bool = False) -> list:
    """Single-process gradients of the whole batch (2 ranks x half the batch)."""
    from dist_workers.torch_suite import Net

    net = Net()
    x, y = batch(step)
    net(torch.from_numpy(x), torch.from_numpy(y), use_extra).backward()
    return [None if p.grad is None else p.grad.numpy() for p in net.parameters()]


@pytest.fixture(scope="module", params=["native", "python"])
def torch_ranks(request, tmp_path_factory):
    """The torch suite's results, once with plain backwards reduced by torch's C++ Reducer
    (the default where it can be) and once by gradmgr's own buckets; every check must hold
    for both."""
    native = request.param == "native"
    outs = spawn("torch_suite", tmp_path_factory.mktemp(f"torch_suite_{request.param}"),
                 GRADMGR_NATIVE_REDUCER="1" if native else "0")
    assert all(bool(out["native"]) == native for out in outs), "the suite took the other path"
    return outs


# ---------------------------------------------------------------------- torch, 2 ranks
def test_mean_equals_single_process_on_whole_batch(torch_ranks):
    ref = full_batch_grads()
    for rank, out in enumerate(torch_ranks):
        assert list(out["mean_dtypes"]) == ["torch.float32"] * 6
        for i in MLP:
            close(out[f"mean_g{i}"], ref[i], what=f"rank {rank} param {i}")
        # attached but used by no rank: .grad stays None, as with DDP(find_unused_parameters)
        assert "mean_g0" not in out and "mean_g1" not in out
        assert "ddp_g0" not in out and "ddp_g1" not in out


def test_mean_equals_ddp_and_training_matches(torch_ranks):
    for out in torch_ranks:
        for i in MLP:
            close(out[f"mean_g{i}"], out[f"ddp_g{i}"], rtol=0, what=f"param {i}")
            close(out[f"train_gm_p{i}"], out[f"train_ddp_p{i}"], rtol=0, what=f"param {i}")
        assert int(out["hooks_left"]) == (0 if bool(out["native"]) else 8)
        # training moved the parameters (the comparison is not between untouched copies)
        assert not np.allclose(out["train_gm_p2"], weights()[0])
    # gradients before any communication; BatchNorm statistics (as with DDP, they follow each
    # rank's own batches after the broadcast at the start of a step); an attached input's
    # gradient (test_an_attached_input_gets_ddps_gradients), as under DDP, each rank's own
    local_only = ("noout_local", "nosync_first", "sync_hand_b", "sync_one_b", "sync_ddp_b")
    inputs = {f"input{step}_{kind}{MLP.stop}" for step in range(2) for kind in ("gm", "ddp")}
    for key in torch_ranks[0]:
        if (torch_ranks[0][key].dtype.kind == "f" and not key.startswith(local_only)
                and key not in inputs):
            close(torch_ranks[1][key], torch_ranks[0][key], rtol=0, what=f"ranks differ: {key}")


def test_sum(torch_ranks):
    ref = full_batch_grads()
    for out in torch_ranks:
        for i in MLP:
            close(out[f"sum_g{i}"], 2 * ref[i], what=f"param {i}")


def test_several_buckets_equal_one_bucket(torch_ranks):
    ref = full_batch_grads()
    for out in torch_ranks:
        assert int(out["small_nbuckets"]) >= 3
        assert int(out["one_nbuckets"]) == 1
        for i in MLP:
            close(out[f"small_g{i}"], out[f"one_g{i}"], rtol=0, what=f"param {i}")
            close(out[f"one_g{i}"], ref[i], what=f"param {i}")


def test_bucket_order_independent_of_arrival_order(torch_ranks):
    r0, r1 = torch_ranks
    # the ranks really saw their gradients in different orders...
    assert list(r0["order_arrived"]) != list(r1["order_arrived"])
    assert sorted(r0["order_arrived"]) == sorted(r1["order_arrived"]) == [3, 5, 7]
    # ...and still got the mean of k=1 and k=2 terms: sin(a)*k, b^2*k, c*k
    for out in torch_ranks:
        a, b, c = out["order_p0"], out["order_p1"], out["order_p2"]
        close(out["order_g0"], 1.5 * np.cos(a))
        close(out["order_g1"], 1.5 * 2 * b)
        close(out["order_g2"], np.full_like(c, 1.5))


def test_parameter_unused_on_one_rank(torch_ranks):
    ref = full_batch_grads()
    extra = np.linspace(-1.0, 1.0, 4, dtype="float32")
    for out in torch_ranks:
        for name in ("unused", "unused_small"):
            # rank 0's gradient (extra itself) averaged with rank 1's zeros
            close(out[f"{name}_g0"], extra / 2, what=name)
            close(out[f"{name}_g0"], out["unused_ddp_g0"], rtol=0, what=name)
            for i in MLP:
                close(out[f"{name}_g{i}"], ref[i], what=f"{name} param {i}")


def test_rank_without_outputs_still_contributes(torch_ranks):
    local = [torch_ranks[0][f"noout_local{i}"] for i in range(6)]
    for out in torch_ranks:
        for i in range(6):
            close(out[f"noout_g{i}"], local[i] / 2, what=f"param {i}")


def test_no_sync_accumulation_is_bit_identical_to_ddp_on_every_rank(torch_ranks):
    """Exact equality (no tolerance): the synced step reduces what .grad holds plus the new
    gradient, as DDP does, so every rank ends with the same bits as DDP."""
    extra = np.linspace(-1.0, 1.0, 4, dtype="float32")
    for rank, out in enumerate(torch_ranks):
        # inside no_sync nothing is communicated: .grad is the local micro-batch gradient
        for i in [0, *MLP]:
            np.testing.assert_array_equal(out[f"nosync_first_gm{i}"], out[f"nosync_first_ddp{i}"])
        for rnd in range(2):
            ref = [full_batch_grads(3 * rnd + m, use_extra=m == 0) for m in range(3)]
            for i in [0, *MLP]:
                np.testing.assert_array_equal(out[f"nosync_r{rnd}_gm{i}"],
                                              out[f"nosync_r{rnd}_ddp{i}"],
                                              err_msg=f"round {rnd} rank {rank} param {i}")
                np.testing.assert_array_equal(out[f"nosync_r{rnd}_gm{i}"],
                                              torch_ranks[0][f"nosync_r{rnd}_gm{i}"])
            for i in MLP:
                close(out[f"nosync_r{rnd}_gm{i}"], sum(r[i] for r in ref),
                      what=f"round {rnd} rank {rank} param {i}")
            # used in a no_sync micro-batch only: its local sum is reduced at the synced step
            close(out[f"nosync_r{rnd}_gm0"], extra)
        for i in [0, *MLP]:  # the manager-level switch and data_parallel() do the same
            np.testing.assert_array_equal(out[f"switch_gm{i}"], out[f"switch_ddp{i}"])


def test_an_attached_input_gets_ddps_gradients(torch_ranks):
    """An input with requires_grad=True, not a parameter, attached to data_parallel()'s
    manager before and inside the recording: its .grad is this rank's own gradient and the
    parameters' the mean, as under DDP, bit for bit (the Paddle counterpart:
    test_paddle_distributed.py)."""
    for rank, out in enumerate(torch_ranks):
        for step in range(2):
            keys = sorted(k for k in out if k.startswith(f"input{step}_ddp"))
            assert len(keys) == len(MLP) + 1, keys  # the MLP's and the input's
            for key in keys:
                np.testing.assert_array_equal(out[key.replace("_ddp", "_gm")], out[key],
                                              err_msg=f"rank {rank} {key}")
    inputs = [out[f"input0_gm{MLP.stop}"] for out in torch_ranks]  # after Net's 8 parameters
    assert not np.array_equal(*inputs)  # each rank's own, not reduced


def test_initial_broadcast_and_buffers_match_ddp(torch_ranks):
    """Ranks seeded differently: without the broadcast they would train different models."""
    r0, r1 = torch_ranks
    for out in torch_ranks:
        for kind, n in (("p", 6), ("b", 2)):
            for i in range(n):
                names = ("sync_hand", "sync_one") if kind == "p" else ("sync_one",)
                for name in names:
                    # data_parallel() broadcasts the buffers when a synced step ends, DDP at
                    # the next forward: every rank holds what DDP broadcasts there, rank 0's
                    ddp = r0 if kind == "b" else out
                    np.testing.assert_array_equal(out[f"{name}_{kind}{i}"],
                                                  ddp[f"sync_ddp_{kind}{i}"],
                                                  err_msg=f"{name} {kind}{i}")
                    if kind == "p":
                        np.testing.assert_array_equal(out[f"{name}_p{i}"], r0[f"{name}_p{i}"])
    # data_parallel() broadcast the BatchNorm statistics at every step, as DDP does, so they
    # equal DDP's; the by-hand recipe broadcast them once, so they differ from DDP's
    assert not np.array_equal(r1["sync_hand_b0"], r0["sync_ddp_b0"])


def test_ranks_that_attach_different_tensors_fail_clearly_on_every_rank(torch_ranks):
    expected = {
        "swapped": ("position 0", "rank 0 has float32[4]", "rank 1 has float32[6]"),
        "shapes": ("position 0", "rank 0 has float32[4, 4]", "rank 1 has float32[5, 4]"),
        "freeze": ("position 2", "rank 0 has float32[8, 16]", "rank 1 has float32[8]"),
        "all_frozen": ("position 0", "rank 0 has float32[3]", "rank 1 has no tensor there"),
    }
    for rank, out in enumerate(torch_ranks):
        for name, parts in expected.items():
            message = str(out[f"mismatch_{name}"])
            for part in parts:
                assert part in message, (name, message)
            assert "same order" in message
        # ranks where only rank 0 has an after-backward callback of its own: it needs the
        # Python path, the other could use torch's reducer; the plan check catches that
        paths = str(out["mismatch_paths"])
        if bool(out["native"]):
            assert "planned the same tensors" in paths and "C++ Reducer" in paths, paths
            assert "after-backward callbacks" in paths
        else:
            assert paths == "no error"
        for name, values in (("reduce", ("'mean'", "'sum'")), ("compression", ("'fp16'", "'bf16'")),
                             ("bucket_bytes", ("1048576", "16"))):
            message = str(out[f"mismatch_option_{name}"])
            assert "would reduce them differently" in message, (name, message)
            assert f"{name}={values[rank]}" in message, (name, message)
        # the process group is intact afterwards: 1 + 2
        np.testing.assert_array_equal(out["mismatch_after"], [3.0])


def test_split_backwards_and_post_accumulate_hooks_between_plain_steps(torch_ranks):
    """A split backward takes gradmgr's own buckets; a post-accumulate-grad hook (optimizer in
    backward) must see the reduced gradient, so from then on every step takes them too."""
    for out in torch_ranks:
        for step in range(4):
            for i in MLP:
                close(out[f"mixed{step}_gm{i}"], out[f"mixed{step}_ddp{i}"], rtol=0,
                      what=f"step {step} param {i}")
        native = bool(out["native"])
        assert list(out["mixed_paths"]) == [native, native, False, False]
        assert list(out["mixed_hook_steps"]) == [2, 3]
        for step in (2, 3):  # mlp[0].weight is parameter 2
            close(out[f"mixed_hook{step}"], out[f"mixed{step}_ddp2"], rtol=0)


def test_kept_gradients_and_a_parameter_unused_on_some_ranks_match_ddp(torch_ranks):
    for out in torch_ranks:
        for step in range(4):
            for micro in range(2):
                for i in range(8):
                    key = f"kept{step}{micro}_gm{i}"
                    assert (key in out) == (f"kept{step}{micro}_ddp{i}" in out), key
                    if key in out:
                        close(out[key], out[f"kept{step}{micro}_ddp{i}"], rtol=0, what=key)


def test_a_new_plan_inside_a_no_sync_window_keeps_what_the_window_used(torch_ranks):
    extra = np.linspace(-1.0, 1.0, 4, dtype=np.float32)  # its gradient on rank 0, none on 1
    for out in torch_ranks:
        close(out["replan_extra_g"], extra / 2, rtol=0)


def test_a_sparse_gradient_is_refused_clearly_and_dense_steps_follow(torch_ranks):
    for out in torch_ranks:
        message = str(out["sparse_error"])
        assert message.startswith("SparseGradientError") and "sparse=False" in message
        assert bool(out["sparse_grad_is_none"])
        # indices 1, 2, 2 on both ranks: the mean of the ranks' dense gradients
        expected = np.zeros((10, 4), dtype=np.float32)
        expected[1], expected[2] = 1.0, 2.0
        np.testing.assert_array_equal(out["sparse_then_dense_g"], expected)


def test_a_backward_that_raises_midway_leaves_nothing_behind(torch_ranks):
    for out in torch_ranks:
        assert bool(out["recovery_raised"])
        for step in range(2):
            for i in MLP:
                close(out[f"recovery{step}_gm{i}"], out[f"recovery{step}_ddp{i}"], rtol=0,
                      what=f"step {step} param {i}")


def test_a_backward_that_raises_on_one_rank_fails_that_step_on_every_rank(torch_ranks):
    for rank, out in enumerate(torch_ranks):
        failed = "ValueError" if rank == 1 else "RankFailedError"
        assert list(out["onefail_errors"]) == ["none", failed, "none", "none"], rank
        assert bool(out["onefail_grad_kept"])
        for step in (0, 2, 3):
            for i in MLP:
                close(out[f"onefail{step}_gm{i}"], out[f"onefail{step}_ddp{i}"], rtol=0,
                      what=f"rank {rank} step {step} param {i}")


def test_a_plan_changed_on_one_rank_only_fails_the_next_step_on_every_rank(torch_ranks):
    """Rank 1 alone freezes a parameter, attaches a tensor, or (on the reducer's path) moves
    to the per-tensor path: the next step raises RankMismatchError on both ranks, leaves .grad
    alone and the process group intact; once the ranks agree again, gradients equal DDP's."""
    differences = {
        "freeze": "rank 0 has float32[8, 16]; rank 1 has float32[8]",
        "attach": "rank 0 has no tensor there",
        "hook": "would reduce them differently",
    }
    for out in torch_ranks:
        native = bool(out["native"])
        for name, difference in differences.items():
            errors = list(out[f"replan_{name}_errors"])
            if name == "hook" and not native:  # both ranks were on the per-tensor path
                assert errors == ["none"] * 3, errors
                continue
            assert errors[0] == "none" and errors[2] == "none", (name, errors)
            assert difference in errors[1], (name, errors[1])
            assert bool(out[f"replan_{name}_kept"]), name
            for phase in (0, 2):
                for i in MLP:
                    close(out[f"replan_{name}{phase}_gm{i}"], out[f"replan_{name}{phase}_ddp{i}"],
                          rtol=0, what=f"{name} phase {phase} param {i}")
        np.testing.assert_array_equal(out["replan_after"], [3.0])


def test_a_refused_first_step_still_broadcasts_once_the_ranks_agree(torch_ranks):
    for out in torch_ranks:
        assert list(out["first_refused_errors"]) == ["mismatch", "none"]
        np.testing.assert_array_equal(out["first_refused_w"], [1.0, 1.0, 1.0])  # rank 0's
        np.testing.assert_array_equal(out["first_refused_g"], [2.0, 2.0, 2.0])  # d(w*w) = 2w


def test_frozen_parameter_gets_no_gradient_and_stays_put(torch_ranks):
    for out in torch_ranks:
        assert bool(out["frozen_grad_is_none"]) and not bool(out["frozen_moved"])
        # unfrozen again: back in the plan, reduced (bit-identical on both ranks, checked above)
        assert all(f"unfrozen_g{i}" in out for i in range(6))


def test_fp16_and_bf16_compression(torch_ranks):
    ref = full_batch_grads()
    for out in torch_ranks:
        for i in MLP:
            scale = np.abs(ref[i]).max()
            fp16, bf16 = out[f"fp16_g{i}"], out[f"bf16_g{i}"]
            close(fp16, ref[i], rtol=0, atol=2e-3 * scale, what=f"fp16 param {i}")
            close(bf16, ref[i], rtol=0, atol=1.6e-2 * scale, what=f"bf16 param {i}")
            assert fp16.dtype == bf16.dtype == np.float32
            # what crossed the wire was fp16 / bf16: the results are exactly representable
            np.testing.assert_array_equal(fp16.astype(np.float16).astype(np.float32), fp16)
            assert not (bf16.view(np.uint32) & 0xFFFF).any()
        assert any(not np.array_equal(out[f"fp16_g{i}"], out[f"mean_g{i}"]) for i in MLP)


# ---------------------------------------------------------------------- in one process
class _Handle:
    def __init__(self, value) -> None:
        self.value = value

    def wait(self):
        return self.value


class FakeTransport:
    """Test double for a 2-rank world whose other rank's contribution is ``other`` (already
    divided like ours) everywhere but in the last element, a bucket's failure marker, where it
    is 0 (the other rank's backward did not fail); logs each launch. The real engines are
    tested by the spawned ranks."""

    def __init__(self, log: list, other: float) -> None:
        self.log, self.other = log, other

    def world_size(self) -> int:
        return 2

    def allreduce_async(self, flat):
        self.log.append(("launch", flat.numel()))
        peer = torch.full_like(flat, self.other)
        peer[-1] = 0
        return _Handle(flat + peer)


class MirrorTransport:
    """Test double for a 2-rank world whose other rank sends exactly what this one sends (so
    the plan check agrees); logs the size of each collective."""

    def __init__(self, log: list) -> None:
        self.log = log

    def world_size(self) -> int:
        return 2

    def allreduce_async(self, flat):
        self.log.append(flat.numel())
        return _Handle(flat * 2)


PLAN_CHECK_SIZE = 2 * (3 + 8 + 3) + 1  # fingerprint (count, plan, accumulation) and its
# squares (no rank()), the request flag


@pytest.mark.parametrize("verify, expected", [("step", [1, 1, 1, 0, 1]),
                                              ("plan", [1, 0, 1, 0, 0])])
def test_the_plan_check_runs_every_synced_step_or_only_where_the_plan_changed(verify, expected):
    """verify="step" (the default) compares plans at every synced step, so a change on one
    rank alone is caught; "plan" only where this rank re-planned (the first step, and after a
    freeze). No check in a no_sync step (step 3). Gradients are the same either way."""
    w, v = torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)
    log: list = []
    cb = make_allreduce_cb("mean", transport=MirrorTransport(log), verify=verify,
                           broadcast=False)
    gm = GradManager().attach([w, v], callbacks=[cb])
    checks = []
    for step in range(5):
        if step == 2:
            v.requires_grad_(False)
        log.clear()
        with cb.no_sync() if step == 3 else contextlib.nullcontext(), gm:
            loss = (w * 2).sum() + ((v * 3).sum() if v.requires_grad else 0)
            gm.backward(loss)
        checks.append(log.count(PLAN_CHECK_SIZE))
        if step != 3:  # mean of two equal ranks' 2 (plus the no_sync step's local 2)
            np.testing.assert_array_equal(w.grad, [4.0 if step == 4 else 2.0] * 3)
            w.grad = None
    assert checks == expected


# The fake peer adds a constant to every buffer, so it cannot take part in the cross-rank plan
# check or the initial broadcast (the spawned ranks test those).
FAKE_PEER = {"verify": False, "broadcast": False}


def test_buckets_launch_during_backward_and_mean_math():
    torch.manual_seed(0)
    layers = [torch.randn(4, 4, requires_grad=True) for _ in range(4)]
    log: list = []
    cb = make_allreduce_cb("mean", bucket_bytes=2 * 64, transport=FakeTransport(log, 0.5),
                           **FAKE_PEER)
    returned: list = []
    gm = GradManager().attach(
        layers, callbacks=[lambda t, g: (log.append(("grad", t.numel())), g)[1], cb,
                           lambda t, g: (returned.append(g), g)[1]],
    )
    x = torch.randn(3, 4)
    with gm:
        h = x
        for w in layers:
            h = torch.tanh(h @ w)
        gm.backward(h.sum())
    assert len(returned) == 4 and all(isinstance(f, Future) for f in returned)
    kinds = [k for k, _ in log]
    assert kinds.count("launch") == 2 == len(cb.buckets(gm))
    # the late layers' bucket went out before the early layers' gradients existed
    assert kinds.index("launch") < len(kinds) - 1 - kinds[::-1].index("grad")
    assert [b.members for b in cb.buckets(gm)] == [[3, 2], [1, 0]]
    ref = torch.autograd.grad(_forward(x, layers).sum(), layers)
    for w, g in zip(layers, ref):
        # the other rank sent ones: mean = (g + 1) / 2
        close(w.grad.numpy(), ((g + 1) / 2).numpy(), what="mean with a peer of ones")


def _forward(x, layers):
    h = x
    for w in layers:
        h = torch.tanh(h @ w)
    return h


def test_replans_when_attached_tensors_change():
    log: list = []
    cb = make_allreduce_cb("sum", bucket_bytes=1, transport=FakeTransport(log, 0.0), **FAKE_PEER)
    a = torch.ones(3, requires_grad=True)
    gm = GradManager().attach(a, callbacks=[cb])
    with gm:
        gm.backward((a * 2).sum())
    assert [b.members for b in cb.buckets(gm)] == [[0]]
    b = torch.ones(2, requires_grad=True)
    gm.attach(b, callbacks=[cb])
    with gm:
        gm.backward((a * b.sum()).sum())
    assert [b.members for b in cb.buckets(gm)] == [[1], [0]]
    close(a.grad.numpy(), np.full(3, 4.0, "float32"))  # 2 + b.sum()
    close(b.grad.numpy(), np.full(2, 3.0, "float32"))


def test_bucket_plan_separates_dtypes_and_reverses_order():
    ts = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4), torch.zeros(8)]
    plan = BucketPlan(ts, get_backend("torch").tensor_ops(), bucket_bytes=32)
    assert [(b.key[0], b.members) for b in plan.buckets] == [
        ("float32", [3]), ("float32", [2, 0]), ("float64", [1])]
    assert [b.nbytes for b in plan.buckets] == [32, 32, 32]
    assert plan.matches(ts) and not plan.matches(ts[:3])


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="reduce"):
        make_allreduce_cb("max")
    with pytest.raises(ValueError, match="compression"):
        make_allreduce_cb(compression="int8")
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_allreduce_cb(bucket_bytes=0)
    with pytest.raises(ValueError, match="verify must be True, 'step', 'plan' or False"):
        make_allreduce_cb(verify="always")
    with pytest.raises(TypeError, match="allreduce_async"):
        make_allreduce_cb(transport=object())
    # transport names are the backend's: checked once the tensors' backend is known
    gm = GradManager().attach(torch.ones(1, requires_grad=True),
                              callbacks=[AllreduceCallback(transport="carrier-pigeon")])
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon' for torch"):
        gm.record()
    with pytest.raises(RuntimeError, match="during backward"):
        make_allreduce_cb()(torch.ones(1), torch.ones(1))


@pytest.mark.parametrize("collect", [False, True], ids=["kept", "collected"])
def test_no_sync_refuses_alike_whether_a_dropped_recording_manager_was_collected(collect):
    """A manager dropped in a reference cycle while recording lives on until a rank's garbage
    collector frees it, which differs between ranks: cb.no_sync() must answer the same either
    way (it refuses: the recording never ended). One that released is held by nothing."""
    w = torch.ones(2, requires_grad=True)
    cb = make_allreduce_cb("mean", transport=MirrorTransport([]), broadcast=False)

    def dropped_while_recording():
        gm = GradManager().attach(w, callbacks=[cb])
        gm.register_release_callback(lambda ran: gm)  # the cycle: gm -> its hook -> gm
        gm.record()
        return weakref.ref(gm)

    enabled = gc.isenabled()
    gc.disable()  # the collector runs only where this test says
    try:
        dropped = dropped_while_recording()
        if collect:
            gc.collect()
        assert (dropped() is None) == collect  # the two cases the ranks can be in
        refused = pytest.raises(RuntimeError, match="while a manager it serves is recording")
        with refused, cb.no_sync():
            pass
    finally:
        if enabled:
            gc.enable()


def test_a_recording_that_ended_leaves_nothing_holding_its_manager():
    """However the recording ends (release(), the backward, an error in the block), the
    callback keeps no reference to the manager, and its no_sync() is free again."""
    w = torch.ones(2, requires_grad=True)
    cb = make_allreduce_cb("mean", transport=MirrorTransport([]), broadcast=False)
    for end in ("release", "backward", "error"):
        gm = GradManager().attach(w, callbacks=[cb])
        with contextlib.suppress(ZeroDivisionError), gm:
            if end == "backward":
                gm.backward((w * 3).sum())
            elif end == "error":
                raise ZeroDivisionError
        if end == "release":
            gm.record()
            gm.release()
        ended = weakref.ref(gm)
        del gm
        gc.collect()
        assert ended() is None, end
        with cb.no_sync():
            pass
    np.testing.assert_array_equal(w.grad, [3.0, 3.0])  # the mean of ours and a mirrored 3

def test_without_process_group_backward_says_what_to_do():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    w = torch.ones(2, requires_grad=True)
    gm = GradManager().attach(w, callbacks=[make_allreduce_cb()])
    with pytest.raises(RuntimeError, match="init_process_group"), gm:
        gm.backward((w * 3).sum())


def test_data_parallel_without_process_group_names_torchrun():
    """A script run with plain ``python`` (no torchrun, no init_process_group) is told how to
    start its ranks, not only what to call."""
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match=r"(?s)not initialised.*torchrun --nproc_per_node.*"
                                           r"init_process_group\('gloo' or 'nccl'\)"):
        data_parallel(torch.nn.Linear(2, 1))
    assert not dist.is_initialized()


# ---------------------------------------------------------------------- MegEngine, 2 ranks
@pytest.fixture(scope="module")
def megengine_ranks(tmp_path_factory):
    pytest.importorskip("megengine", reason="megengine is not installed in this environment")
    return spawn("megengine_suite", tmp_path_factory.mktemp("megengine_suite"))


def test_megengine_tensors_through_gloo(megengine_ranks):
    ref = full_batch_grads()
    extra = np.linspace(-1.0, 1.0, 4, dtype="float32")
    nosync_ref = [full_batch_grads(m, use_extra=m == 0) for m in range(3)]
    for rank, out in enumerate(megengine_ranks):
        assert str(out["transport"]) == "MegEngineViaTorchTransport"
        assert int(out["small_nbuckets"]) >= 3
        for i in MLP:
            what = f"rank {rank} param {i}"
            assert str(out[f"mean_g_type{i}"]).startswith("megengine")
            assert out[f"mean_g{i}"].dtype == np.float32
            close(out[f"mean_g{i}"], ref[i], what=what)
            close(out[f"sum_g{i}"], 2 * ref[i], what=what)
            close(out[f"small_g{i}"], ref[i], what=what)
            close(out[f"unused_g{i}"], ref[i], what=what)
            close(out[f"fp16_g{i}"], ref[i], rtol=0, atol=2e-3 * np.abs(ref[i]).max(),
                  what=what)
            close(out[f"nosync_g{i}"], sum(r[i] for r in nosync_ref), what=what)
        close(out["unused_g0"], extra / 2)  # used on rank 0 only
        close(out["nosync_g0"], extra)  # used in a no_sync micro-batch only
        assert "mean_g1" not in out  # used by no rank: .grad stays None
        for i in range(8):  # rank 1 started from other weights: the broadcast gave rank 0's
            np.testing.assert_array_equal(out[f"synced_p{i}"], megengine_ranks[0][f"synced_p{i}"])
    for key, value in megengine_ranks[0].items():
        if value.dtype.kind == "f":
            close(megengine_ranks[1][key], value, rtol=0, what=f"ranks differ: {key}")


# ---------------------------------------------------------------------- CUDA / nccl
def test_cuda_tensors_over_nccl(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("CUDA: no CUDA device visible")
    if not dist.is_nccl_available():
        pytest.skip("CUDA: this torch build has no nccl")
    world = min(2, torch.cuda.device_count())
    ranks = spawn("cuda_suite", tmp_path, world=world, backend="nccl")
    x, y = batch(0)
    half = len(x) // world * world  # world 1 or 2: the whole batch
    from dist_workers.torch_suite import Net

    net = Net()
    net(torch.from_numpy(x[:half]), torch.from_numpy(y[:half])).backward()
    ref = [p.grad.numpy() for p in net.parameters() if p.grad is not None]
    for rank, out in enumerate(ranks):
        assert bool(out["mean_none0"]) and bool(out["mean_none1"])  # unused by every rank
        for j, i in enumerate(MLP):
            assert str(out[f"mean_dev{i}"]) == f"cuda:{rank}"
            close(out[f"mean_g{i}"], ref[j], rtol=1e-4, atol=1e-5, what=f"param {i}")
            close(out[f"small_g{i}"], out[f"mean_g{i}"], rtol=0, what=f"param {i}")
            close(out[f"fp16_g{i}"], ref[j], rtol=0, atol=2e-3 * np.abs(ref[j]).max())


def test_importing_distributed_imports_no_framework():
    code = ("import sys, gradmgr.distributed; "
            "print(sorted(m for m in ('torch', 'megengine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_large_and_small_members_with_no_sync_in_one_bucket():
    """Members of 256 KiB and more are copied into the bucket on arrival, smaller ones packed
    at launch; both paths reduce .grad (from no_sync steps) plus the new gradient, exactly."""
    from gradmgr.distributed import no_sync

    torch.manual_seed(0)
    big = torch.randn(300, 300, requires_grad=True)  # 352 KiB: large
    small = torch.randn(300, requires_grad=True)
    log: list = []
    cb = make_allreduce_cb("mean", transport=FakeTransport(log, 0.5), **FAKE_PEER)
    gm = GradManager().attach([big, small], callbacks=[cb])
    xs = [torch.randn(4, 300) for _ in range(3)]

    def loss(x):
        return torch.tanh(x @ big + small).square().sum()

    for i, x in enumerate(xs):
        with no_sync(gm) if i < 2 else contextlib.nullcontext(), gm:
            gm.backward(loss(x))
    bucket = cb.buckets(gm)[0]
    assert bucket.large == [False, True] and bucket.layout == [0, 1]  # reverse attach order
    grads = [torch.autograd.grad(loss(x), [big, small]) for x in xs]
    for i, t in enumerate((big, small)):
        local = grads[0][i].clone()
        local.add_(grads[1][i])  # what .grad held after the two no_sync steps
        expected = (grads[2][i] + local) * 0.5 + 0.5
        assert torch.equal(t.grad, expected), t.shape
    assert [k for k, _ in log] == ["launch"]  # one bucket, sent once


def test_bucket_buffers_are_reused_only_when_nothing_holds_them():
    """A steady loop (zero_grad sets .grad to None) reuses each bucket's buffer, as DDP's
    persistent buckets; a .grad still held (kept for logging, or zeroed in place) is never
    written by a later step."""
    class InPlace(FakeTransport):  # reduces in place, as gloo and nccl do
        def allreduce_async(self, flat):
            return _Handle(flat.add_(self.other))

    torch.manual_seed(0)
    w = torch.randn(200, 400, requires_grad=True)  # 312 KiB: copied in on arrival
    b = torch.randn(400, requires_grad=True)
    cb = make_allreduce_cb("mean", transport=InPlace([], 0.0), **FAKE_PEER)
    gm = GradManager().attach([w, b], callbacks=[cb])
    x = torch.randn(3, 200)

    def step(scale):
        with gm:
            gm.backward(((x @ w + b) * scale).sum())

    step(1.0)
    first = w.grad.data_ptr()
    w.grad = b.grad = None
    step(2.0)
    assert w.grad.data_ptr() == first, "the dropped buffer was not reused"
    kept_w, kept_b = w.grad, b.grad
    values = (kept_w.clone(), kept_b.clone())
    w.grad = b.grad = None
    step(3.0)
    assert torch.equal(kept_w, values[0]) and torch.equal(kept_b, values[1])
    assert w.grad.data_ptr() != kept_w.data_ptr()
    ref = torch.autograd.grad(((x @ w + b) * 3.0).sum(), [w, b])
    assert torch.equal(w.grad, ref[0] * 0.5) and torch.equal(b.grad, ref[1] * 0.5)


def test_a_lossy_custom_transport_passes_the_plan_check(torch_ranks):
    """The check's values travel exactly through fp16 when the transport knows its rank."""
    ref = full_batch_grads()
    for out in torch_ranks:
        for i in range(6):
            close(out[f"fp16t_g{i}"], ref[2 + i], rtol=0, atol=2e-3 * np.abs(ref[2 + i]).max())


def test_a_transport_without_rank_or_broadcast_says_how_to_sync():
    class Mirror(FakeTransport):  # a consistent peer: the other rank sends the same values
        def allreduce_async(self, flat):
            return _Handle(flat * 2)

    w = torch.ones(3, requires_grad=True)
    gm = GradManager().attach(w, callbacks=[make_allreduce_cb(transport=Mirror([], 0.0))])
    with pytest.raises(TypeError, match="broadcast=False"):
        gm.record()
    gm2 = GradManager().attach(w, callbacks=[make_allreduce_cb(transport=Mirror([], 0.0),
                                                                broadcast=False)])
    with gm2:
        gm2.backward((w * 3).sum())
    close(w.grad.numpy(), np.full(3, 3.0, "float32"))  # (3 + 3) / 2


@pytest.mark.parametrize("env, path", [
    ({}, "reducer"),
    ({"GRADMGR_REDUCER": "0"}, "buckets"),
    ({"GRADMGR_NATIVE_REDUCER": "0"}, "buckets"),  # the older spelling, still read
    ({"GRADMGR_REDUCER": "1", "GRADMGR_NATIVE_REDUCER": "1"}, "reducer"),
])
def test_either_spelling_of_the_reducer_switch_picks_the_path(gloo_one_rank, monkeypatch, env,
                                                              path):
    """Issue 41: the environment's switch is named for the reducer now, GRADMGR_REDUCER;
    GRADMGR_NATIVE_REDUCER, the name the docs gave before, keeps working."""
    for name in ("GRADMGR_REDUCER", "GRADMGR_NATIVE_REDUCER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    torch.manual_seed(0)
    model, plain = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    plain.load_state_dict(model.state_dict())
    cb = make_allreduce_cb()
    gm = GradManager()
    gm.attach(list(model.parameters()), callbacks=[cb])
    x = torch.randn(4, 3)
    with gm:
        gm.backward(model(x).square().sum())
    assert cb.path(gm) == path
    plain(x).square().sum().backward()  # one rank: the mean is this rank's gradient
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0)
    del gm


def test_the_two_spellings_of_the_reducer_switch_must_agree(monkeypatch):
    monkeypatch.setenv("GRADMGR_REDUCER", "0")
    monkeypatch.setenv("GRADMGR_NATIVE_REDUCER", "1")
    with pytest.raises(ValueError, match="GRADMGR_REDUCER=0 and GRADMGR_NATIVE_REDUCER=1"):
        make_allreduce_cb()
