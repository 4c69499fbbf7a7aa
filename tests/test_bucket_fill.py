"""A bucket buffer made with a ``factor`` (``TensorOps.new_buffer``; 1/world for a mean) is, bit
for bit, the buffer made without one and then scaled as a whole, as ``Wire.send`` did before
the scaling moved into the fill (issue 39): for each way a member arrives (gradient only,
``.grad`` only, both, neither), large members (copied in at ``put``) and small ones (packed at
``finish``), unused slots and the failure marker. Paddle's buffer: test_paddle_bucket_fill.py."""

from __future__ import annotations

import numpy as np
import pytest

from gradmgr.distributed.reduce.bucket import LARGE_BYTES, BucketPlan

FACTORS = [0.5, 1.0 / 3.0, 1.0 / 7.0, None]
CASES = ["grad", "local", "both", "neither"]  # how each member arrives, large then small


def _bucket(ops, tensors):
    plan = BucketPlan(tensors, ops, bucket_bytes=2**40, first_bucket_bytes=2**40)
    assert len(plan.buckets) == 1
    return plan.buckets[0]


def _arrivals(bucket, make):
    """(grad, local) for each slot: ``make(shape)`` draws values; slot by slot the CASES."""
    out = []
    for slot, shape in enumerate(bucket.shapes):
        case = CASES[slot % len(CASES)]
        grad = make(shape) if case in ("grad", "both") else None
        local = make(shape) if case in ("local", "both") else None
        out.append((grad, local))
    return out


def _finished(ops, bucket, like, arrivals, unused, failed, factor=None):
    buffer = ops.new_buffer(bucket, like) if factor is None else ops.new_buffer(
        bucket, like, factor)
    for slot, (grad, local) in enumerate(arrivals):
        buffer.put(slot, grad, local)
    return buffer.finish(unused, failed)


def assert_concat_buffer_scales_as_after(ops, to_tensor, dtype, factor, seed):
    """For a backend whose buffer concatenates in ``finish`` (MegEngine's, Paddle's): made with
    ``factor``, its finished buffer has the bytes of the one made without, then ``ops.scale``d.
    ``to_tensor``: a numpy array as the framework's tensor."""
    rng = np.random.default_rng(seed)

    def make(shape):
        values = rng.standard_normal(shape) * 10.0 ** rng.integers(-7, 4, shape)
        return to_tensor(values.astype(dtype))

    shapes = [(300, 300), (3, 5), (7,), (2, 2, 2)] * 2
    tensors = [to_tensor(np.zeros(s, dtype=dtype)) for s in shapes]
    bucket = _bucket(ops, tensors)
    arrivals = _arrivals(bucket, make)
    for failed in (False, True):
        before = _finished(ops, bucket, tensors[0], arrivals, [2], failed)
        if factor is not None:
            before = ops.scale(before, factor)
        after = _finished(ops, bucket, tensors[0], arrivals, [2], failed, factor)
        assert after.numpy().dtype == np.dtype(dtype)
        assert after.numpy().tobytes() == before.numpy().tobytes(), (dtype, factor, failed)


# ------------------------------------------------------------------------------- PyTorch
def _torch_values(torch, dtype, generator):
    """Values over many magnitudes (fp16 subnormals included), where roundings differ."""
    def make(shape):
        mags = 10.0 ** torch.randint(-7, 4, shape, generator=generator).double()
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * mags).to(dtype)
    return make


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("failed", [False, True])
def test_torch_buffer_scaled_while_filled_is_the_buffer_scaled_after(dtype, factor, failed):
    torch = pytest.importorskip("torch")
    from gradmgr.backends.torch.ops import TORCH_OPS

    kind = getattr(torch, dtype)
    large = LARGE_BYTES * 8 // torch.finfo(kind).bits  # elements of a large member
    shapes = [(large // 64, 64)] * 4 + [(3, 5), (7,), (), (2, 2, 2)]
    tensors = [torch.zeros(s, dtype=kind) for s in shapes]
    bucket = _bucket(TORCH_OPS, tensors)
    assert sum(bucket.large) == 4 and len(bucket.small) == 4
    arrivals = _arrivals(bucket, _torch_values(torch, kind, torch.Generator().manual_seed(3)))
    unused = [1, 6]  # a large and a small slot
    before = _finished(TORCH_OPS, bucket, tensors[0], arrivals, unused, failed).clone()
    if factor is not None:
        before.mul_(factor)  # what Wire.send's ops.scale did to the finished buffer
    after = _finished(TORCH_OPS, bucket, tensors[0], arrivals, unused, failed, factor)
    assert after.dtype == kind
    assert torch.equal(after, before), (dtype, factor, failed,
                                        (after != before).nonzero()[:5].tolist())
    flags = after[bucket.numel:].double().tolist()
    one = 1.0 if factor is None else float(torch.tensor(factor, dtype=kind))
    expected = [0.0 if s in unused else one for s in range(len(shapes))]
    assert flags == expected + [one if failed else 0.0]


@pytest.mark.torch
def test_torch_large_member_in_another_dtype_is_copied_then_scaled():
    """A gradient whose dtype is not the bucket's (no engine hands one over, but a hook may):
    cast by the copy first, then scaled in the bucket's dtype, as before."""
    torch = pytest.importorskip("torch")
    from gradmgr.backends.torch.ops import TORCH_OPS

    tensors = [torch.zeros(LARGE_BYTES // 2, dtype=torch.float16)]
    bucket = _bucket(TORCH_OPS, tensors)
    grad = torch.randn(LARGE_BYTES // 2, generator=torch.Generator().manual_seed(1)) * 1e-4
    before = _finished(TORCH_OPS, bucket, tensors[0], [(grad, None)], (), False).clone()
    after = _finished(TORCH_OPS, bucket, tensors[0], [(grad, None)], (), False, 1.0 / 3.0)
    assert torch.equal(after, before.mul_(1.0 / 3.0))


# ----------------------------------------------------------------------------- MegEngine
@pytest.mark.megengine
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("factor", FACTORS)
def test_megengine_buffer_scaled_when_finished_is_the_buffer_scaled_after(dtype, factor):
    megengine = pytest.importorskip("megengine")
    from gradmgr.backends.megengine.ops import MEGENGINE_OPS

    assert_concat_buffer_scales_as_after(MEGENGINE_OPS, megengine.Tensor, dtype, factor, seed=5)
