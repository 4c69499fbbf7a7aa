"""Paddle's bucket buffer made with a ``factor`` is, bit for bit, the buffer made without one
and then scaled as a whole (``TensorOps.scale``), as ``Wire.send`` did before the scaling
moved into the buffer (issue 39); the other backends' in test_bucket_fill.py. Runs only where
PaddlePaddle is installed (conftest.py: FRAMEWORK_FILES)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from test_bucket_fill import FACTORS, _arrivals, _bucket, _finished

from gradmgr.backends.paddle.ops import PADDLE_OPS


@pytest.mark.paddle
@pytest.mark.parametrize("dtype", ["float32", "float64"])  # (no float16 add on Paddle's CPU)
@pytest.mark.parametrize("factor", FACTORS)
def test_paddle_buffer_scaled_when_finished_is_the_buffer_scaled_after(dtype, factor):
    rng = np.random.default_rng(7)

    def make(shape):
        values = rng.standard_normal(shape) * 10.0 ** rng.integers(-7, 4, shape)
        return paddle.to_tensor(values.astype(dtype))

    shapes = [[300, 300], [3, 5], [7], [2, 2, 2]] * 2
    tensors = [paddle.to_tensor(np.zeros(s, dtype=dtype)) for s in shapes]
    bucket = _bucket(PADDLE_OPS, tensors)
    arrivals = _arrivals(bucket, make)
    for failed in (False, True):
        before = _finished(PADDLE_OPS, bucket, tensors[0], arrivals, [2], failed)
        if factor is not None:
            before = PADDLE_OPS.scale(before, factor)
        after = _finished(PADDLE_OPS, bucket, tensors[0], arrivals, [2], failed, factor)
        assert after.numpy().dtype == np.dtype(dtype)
        assert after.numpy().tobytes() == before.numpy().tobytes(), (dtype, factor, failed)
