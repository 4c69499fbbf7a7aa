"""DDP's communication hooks through ``data_parallel(model, comm_hook=, comm_state=)`` (issue
26, item 3), on 2 gloo ranks next to ``DDP.register_comm_hook`` with the same hook, on torch's
C++ reducer (``native``) and on gradmgr's buckets (``python``); and the combinations refused.

The model (tests/dist_workers/comm_hooks.py) has a frozen layer, two trained layers with
biases and a layer never used; six SGD steps.

Tolerances: bit for bit for ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``
(DDP refuses that one over gloo by its name: its reference runs the same function renamed) and
a user's quantizing hook, with one bucket and with several (gradmgr's and DDP's buckets then
differ where DDP has ``find_unused_parameters=True``: the hooks work per element); and a
user's 8-bit hook scaled by the bucket's largest value, with one bucket (where gradmgr's
used-flags leak into what a hook sees, its scale, and every gradient, changes). PowerSGD:
within the error DDP + PowerSGD itself shows against plain DDP (the issue's bound; measured
here: 0.19 to 0.23 in the parameters from the third step, where PowerSGD starts), and
measured equal bit for bit to DDP + PowerSGD, which is asserted too (DDP with its default
buckets, one for this model, which gradmgr's then match in index, order and members).
PowerSGD is not compared on several buckets over gloo: its future callbacks launch collectives
while the next bucket's go out, which gloo pairs differently on the two ranks (DDP hangs;
gradmgr refuses it with ValueError, tested).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from ranks import spawn_scenarios  # noqa: E402

from gradmgr import GradManager  # noqa: E402
from gradmgr.distributed import (  # noqa: E402
    data_parallel,
    make_allreduce_cb,
    make_reduce_scatter_cb,
)

EXACT = ["allreduce", "fp16", "bf16", "quantize"]
PATHS = {"native": "reducer", "python": "buckets"}
STEPS = 6
TRAIN = [f"{h}_{p}_{b}" for h in EXACT for p in PATHS for b in ("one", "two")]
TRAIN += [f"int8_{p}_one" for p in PATHS]  # its scale is per bucket: one, as DDP's
POWERSGD = [f"powersgd_{p}_one" for p in PATHS]
PROBE = [f"{kind}_{p}" for kind in ("probe", "accumulate", "raising", "mismatch", "racing",
                                    "powersgd_mlp", "one_rank", "one_rank_two") for p in PATHS]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    # CPU ranks over gloo, CUDA hidden: torch's powerSGD_hook calls torch.cuda.synchronize
    # on a CPU tensor's device wherever CUDA is available (DDP + PowerSGD fails there too).
    return spawn_scenarios("comm_hooks", tmp_path_factory.mktemp("comm_hooks"),
                           TRAIN + POWERSGD + PROBE, timeout=400, CUDA_VISIBLE_DEVICES="")


def _params(out: dict, prefix: str, side: str) -> list:
    count = sum(1 for k in out if k.startswith(f"{prefix}_{side}") and k[len(prefix) + 1 +
                                                                        len(side):].isdigit())
    assert count > 0, f"nothing saved for {prefix}_{side}"
    return [out[f"{prefix}_{side}{i}"] for i in range(count)]


@pytest.mark.parametrize("scenario", TRAIN)
def test_hook_equals_ddp_bit_for_bit(ranks, scenario):
    hook, path, _ = scenario.split("_")
    for rank, out in enumerate(ranks.scenario(scenario)):
        assert str(out[f"{scenario}_path"]) == PATHS[path], (rank, out[f"{scenario}_path"])
        for step in range(STEPS):
            prefix = f"{scenario}_s{step}"
            # which .grad were None: the frozen and the unused layer's, as DDP's
            np.testing.assert_array_equal(out[f"{prefix}_none_gm"], out[f"{prefix}_none_ddp"])
            for i, (gm, ddp) in enumerate(zip(_params(out, prefix, "gm"),
                                              _params(out, prefix, "ddp"))):
                np.testing.assert_array_equal(gm, ddp, err_msg=f"rank {rank} {prefix} {i}")


@pytest.mark.parametrize("scenario", POWERSGD)
def test_powersgd_within_its_own_error(ranks, scenario):
    for rank, out in enumerate(ranks.scenario(scenario)):
        assert str(out[f"{scenario}_path"]) == PATHS[scenario.split("_")[1]]
        for step in range(STEPS):
            prefix = f"{scenario}_s{step}"
            gm, ddp = _params(out, prefix, "gm"), _params(out, prefix, "ddp")
            plain = _params(out, prefix, "ref")
            ours = max(float(np.abs(a - b).max()) for a, b in zip(gm, ddp))
            theirs = max(float(np.abs(a - b).max()) for a, b in zip(ddp, plain))
            assert ours <= theirs, (rank, step, ours, theirs)
            if step >= 2:  # PowerSGD compresses from its third iteration (start_powerSGD_iter)
                assert theirs > 1e-3, (rank, step, theirs)
            for i, (a, b) in enumerate(zip(gm, ddp)):  # measured: equal
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} {prefix} {i}")


@pytest.mark.parametrize("path", list(PATHS))
def test_powersgd_on_an_mlp_equals_ddp_bit_for_bit(ranks, path):
    """docs/communication-hooks.md: PowerSGD bit for bit where the buckets are DDP's, on a
    16-32-32-4 MLP after 10 steps (issue 38: the reducer path was 3e-8 off, its hook's
    buffer misaligned)."""
    for rank, out in enumerate(ranks.scenario(f"powersgd_mlp_{path}")):
        gm, ddp = _params(out, f"powersgd_mlp_{path}", "gm"), _params(out, f"powersgd_mlp_{path}",
                                                                      "ddp")
        assert len(gm) == len(ddp) == 6
        for i, (a, b) in enumerate(zip(gm, ddp)):
            np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} param {i}")


@pytest.mark.parametrize("path", list(PATHS))
def test_hook_sees_ddps_buckets(ranks, path):
    """Index, is_last, gradients' shapes, parameters and buffer size of each bucket, as DDP
    hands them over once it has re-formed its buckets (from its second step): with one bucket
    and with two; on the reducer's path the used-flags stay out of the last one."""
    for out in ranks.scenario(f"probe_{path}"):
        for buckets, count in (("one", 1), ("two", 2)):
            ours = list(out[f"probe_{path}_{buckets}_gm"])
            theirs = list(out[f"probe_{path}_{buckets}_ddp"])
            assert len(ours) == 3 * count
            assert ours[count:] == theirs[-2 * count:], (ours, theirs)


@pytest.mark.parametrize("path", list(PATHS))
def test_hook_with_no_sync_equals_ddp(ranks, path):
    """Gradient accumulation: the hook reduces the local sum of the micro-batches, as DDP's."""
    for rank, out in enumerate(ranks.scenario(f"accumulate_{path}")):
        for step in range(3):
            prefix = f"accumulate_{path}_s{step}"
            for i, (gm, ddp) in enumerate(zip(_params(out, prefix, "gm"),
                                              _params(out, prefix, "ddp"))):
                np.testing.assert_array_equal(gm, ddp, err_msg=f"rank {rank} {prefix} {i}")


@pytest.mark.parametrize("path", list(PATHS))
def test_hook_that_fails(ranks, path):
    """A hook that raises, returns no future, or a future of a tensor of the wrong shape: the
    backward raises, on every rank; the ranks stay paired and the next steps equal DDP's."""
    for rank, out in enumerate(ranks.scenario(f"raising_{path}")):
        errors = list(out[f"raising_{path}_errors"])
        assert len(errors) == 3, (rank, errors)
        assert errors[0] == "1: ValueError: the hook failed", (rank, errors)
        assert errors[1].startswith("2: TypeError") and "returned Tensor" in errors[1], errors
        assert errors[2].startswith("3: ") and "gave a tensor of shape (1,)" in errors[2], errors
        for step in (0, 4, 5):
            prefix = f"raising_{path}_s{step}"
            for i, (gm, ddp) in enumerate(zip(_params(out, prefix, "gm"),
                                              _params(out, prefix, "ddp"))):
                np.testing.assert_array_equal(gm, ddp, err_msg=f"rank {rank} {prefix} {i}")


ONE_RANK = [f"{kind}_{p}" for kind in ("one_rank", "one_rank_two") for p in PATHS]


@pytest.mark.parametrize("scenario", ONE_RANK)
def test_hook_that_fails_on_one_rank(ranks, scenario):
    """Issue 38: a hook's ``.then()`` callback that raises on rank 0 only, then a hook that
    raises on rank 0 only after launching its allreduce: rank 0 raises the hook's error, rank
    1 RankFailedError, at the same steps; the ranks stay paired and the other steps equal
    DDP's. With one bucket and with two (the hook fails on the first, where the reducer's
    path has no used-flags: they go out with the second once every hook future is done)."""
    for rank, out in enumerate(ranks.scenario(scenario)):
        errors = list(out[f"{scenario}_errors"])
        assert [e.split(":")[0] for e in errors] == ["1", "2"], (rank, errors)
        if rank == 0:
            assert "ValueError: the callback failed" in errors[0], errors
            assert errors[1] == "2: ValueError: the hook failed", errors
        else:
            assert all(e.split(": ")[1] == "RankFailedError" for e in errors), errors
        for step in (0, 3, 4):
            prefix = f"{scenario}_s{step}"
            for i, (gm, ddp) in enumerate(zip(_params(out, prefix, "gm"),
                                              _params(out, prefix, "ddp"))):
                np.testing.assert_array_equal(gm, ddp, err_msg=f"rank {rank} {prefix} {i}")


@pytest.mark.parametrize("scenario", ONE_RANK)
def test_a_failed_hook_is_called_once_and_leaves_grad_as_before_the_step(ranks, scenario):
    """Issue 38, the same scenarios: the hook is called once per bucket and step, also at a
    step where it raises; after each error, on every rank, ``.grad`` is what it was before
    the step (None), on both paths (the reducer's used to keep the local, unreduced sums)."""
    buckets = 2 if "_two_" in scenario else 1
    for rank, out in enumerate(ranks.scenario(scenario)):
        assert list(out[f"{scenario}_calls"]) == [buckets] * 5, (rank, scenario)
        assert list(out[f"{scenario}_cleared"]) == [True, True], (rank, scenario)


@pytest.mark.parametrize("path", list(PATHS))
def test_ranks_with_different_hooks_raise(ranks, path):
    """Ranks with different hooks would pair different collectives: every rank raises
    RankMismatchError at the first step, naming its hook."""
    hooks = ["fp16_compress_hook", "allreduce_hook"]
    for rank, out in enumerate(ranks.scenario(f"mismatch_{path}")):
        message = str(out[f"mismatch_{path}_error"])
        assert f"comm_hook={hooks[rank]}" in message and "comm_hook= options" in message, (
            rank, message)


@pytest.mark.parametrize("path", list(PATHS))
def test_powersgd_over_gloo_with_buckets_is_refused(ranks, path):
    """PowerSGD over gloo with two buckets: DDP hangs at its third step (measured, torch
    2.8); gradmgr aborted inside gloo before it refused. Now a ValueError on every rank."""
    for rank, out in enumerate(ranks.scenario(f"racing_{path}")):
        for message in out[f"racing_{path}_errors"]:
            assert "more than one bucket" in str(message) and "NCCL" in str(message), (
                rank, message)


# ---------------------------------------------------------------- refused combinations
def _model():
    return torch.nn.Linear(3, 2)


def test_hook_with_compression_is_refused():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with pytest.raises(ValueError, match="choose one"):
        make_allreduce_cb("mean", compression="fp16", comm_hook=default_hooks.allreduce_hook)
    with pytest.raises(ValueError, match="choose one"):
        data_parallel(_model(), compression="bf16", comm_hook=default_hooks.allreduce_hook)


def test_hook_with_shard_is_refused():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = default_hooks.fp16_compress_hook
    with pytest.raises(ValueError, match="compression='fp16'"):
        data_parallel(_model(), shard=True, comm_hook=hook)
    with pytest.raises(ValueError, match="sharded"):
        make_reduce_scatter_cb("mean", comm_hook=hook)


def test_hook_options_are_checked():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with pytest.raises(ValueError, match="reduce must stay 'mean'"):
        make_allreduce_cb("sum", comm_hook=default_hooks.allreduce_hook)
    with pytest.raises(TypeError, match="callable"):
        make_allreduce_cb("mean", comm_hook="fp16")
    with pytest.raises(ValueError, match="pass the hook too"):
        make_allreduce_cb("mean", comm_state=object())


@pytest.mark.megengine
def test_megengine_refuses_a_hook():
    mge = pytest.importorskip("megengine", reason="megengine is not installed here")
    param = mge.Parameter(np.ones(3, dtype="float32"))
    cb = make_allreduce_cb("mean", comm_hook=lambda state, bucket: None)
    with pytest.raises(ValueError, match="not PyTorch's"):
        GradManager().attach([param], callbacks=[cb])
