"""Paddle's bucket buffer made with a ``factor`` is, bit for bit, the buffer made without one
and then scaled as a whole (``TensorOps.scale``), as ``Wire.send`` did before the scaling
moved into the buffer (issue 39); the other backends' in test_bucket_fill.py. Runs only where
PaddlePaddle is installed (conftest.py: FRAMEWORK_FILES)."""

from __future__ import annotations

import paddle
import pytest
from test_bucket_fill import FACTORS, assert_concat_buffer_scales_as_after

from gradmgr.backends.paddle.ops import PADDLE_OPS


@pytest.mark.paddle
@pytest.mark.parametrize("dtype", ["float32", "float64"])  # (no float16 add on Paddle's CPU)
@pytest.mark.parametrize("factor", FACTORS)
def test_paddle_buffer_scaled_when_finished_is_the_buffer_scaled_after(dtype, factor):
    assert_concat_buffer_scales_as_after(PADDLE_OPS, paddle.to_tensor, dtype, factor, seed=7)
