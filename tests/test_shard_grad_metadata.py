"""Issue 39 item 5 on 2 gloo ranks: after a sharded backward (``data_parallel(model,
shard=True)``) ``.grad`` answers the whole gradient's metadata as DDP's ``.grad`` does, so
memory-accounting and logging code written for DDP or FSDP2 runs; ``to_local()`` is this
rank's slice; reads that need the values still raise, saying what to do
(dist_workers/shard_grad_metadata.py, next to DDP in the same ranks).

Tolerances: metadata equal; the slices bit for bit DDP's (2 ranks sum the same two numbers);
the norms rel 1e-6 (per-parameter norms summed from the slices, as test_habits_sharded.py);
the parameters after the steps bit for bit (nothing clips: max_norm 1e9).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from ranks import spawn  # noqa: E402


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    return spawn("shard_grad_metadata", tmp_path_factory.mktemp("ranks"), 2, timeout=300)


def test_metadata_reads_equal_ddps(outs):
    """Every read of READS (shape, dtype, numel(), element_size(), nbytes, strides...) on each
    parameter's stand-in equals the same read of DDP's .grad; a float64 layer and one laid out
    transposed included. On old code element_size() raised."""
    for out in outs:
        for step in out["steps"]:
            assert step["types"] == ["ShardedGradient"] * 5
            for i, (ours, ddp) in enumerate(zip(step["ours"], step["ddp"])):
                assert ours == ddp, f"parameter {i}"
            assert step["ddp"][2]["stride()"] == (1, 3)  # the transposed one
            assert step["ddp"][3]["dtype"] == torch.float64


def test_memory_accounting_is_ddps(outs):
    """``sum(p.grad.numel() * p.grad.element_size() ...)`` is DDP's: the whole gradients'
    bytes (4 x 192 float32 elements + 8 x 12 float64 ones)."""
    for out in outs:
        for step in out["steps"]:
            ours, ddp = step["accounted"]
            assert ours == ddp == 4 * (8 * 16 + 16 + 16 * 3) + 8 * (3 * 3 + 3)


def test_to_local_is_this_ranks_slice_of_ddps_gradient(outs):
    """``p.grad.to_local()`` is DDP's ``p.grad.flatten()[start:stop]``, ``(start, stop) =
    p.grad.local_range()``, bit for bit; the two ranks' ranges cover each gradient once."""
    for step in range(2):
        for i in range(5):
            covered = []
            for out in outs:
                got = out["steps"][step]["local"][i]
                assert got[0] != "raised", got
                (start, stop), local = got
                full = out["steps"][step]["ddp_flat"][i]
                assert local.dim() == 1 and local.dtype == full.dtype
                assert torch.equal(local, full[start:stop]), (step, i)
                covered += range(start, stop)
            assert sorted(covered) == list(range(full.numel())), (step, i)


def test_value_reads_still_raise_saying_what_to_do(outs):
    for out in outs:
        for name, got in out["refused"].items():
            assert got is not None, f"{name} did not raise"
            kind, message = got
            assert kind == "RuntimeError", (name, got)
            assert "p.grad.to_local() is this rank's slice" in message, name
            assert "opt.clip_grad_norm_(max_norm)" in message, name
        assert out["format"].startswith("ShardedGradient(shape=[16, 8]")
        kind, message = out["stale"]
        assert kind == "RuntimeError" and "opt.zero_grad()" in message


def test_norms_zero_grad_and_set_to_none_work_as_before(outs):
    """torch's get_total_norm (torch 2.6 and later) and clip_grad_norm_ over the stand-ins are
    DDP's norm; opt.zero_grad(), model.zero_grad() and ``p.grad = None`` leave .grad None; the
    parameters after the steps are DDP's bit for bit, the second step's gradients halved in
    place, through ``to_local()`` here and ``.grad`` under DDP (to_local() is a view)."""
    for out in outs:
        for step in out["steps"]:
            ours, ddp = step["clip"]
            assert ours == pytest.approx(ddp, rel=1e-6) and ours > 0
            total, ddp = step["total_norm"]
            if hasattr(torch.nn.utils, "get_total_norm"):
                assert total == pytest.approx(ddp, rel=1e-6)
        assert out["after_zero_grad"] == [True] * 5
        assert out["model_zero_grad"] == [True] * 5
        assert out["set_none"] == [True] * 5
        for a, b in zip(*out["params"]):
            assert torch.equal(a, b)
