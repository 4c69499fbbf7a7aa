"""Issue 19 item 4 on MegEngine: the same messages as on PyTorch (test_habits_torch.py), since
a MegEngine user makes the same slips. ``xfail(strict=True)`` where today's code fails.

MegEngine is imported inside the tests: the ``megengine`` mark deselects them where it is not
installed (tests/conftest.py), which a module-level skip would not.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradmgr import GradManager

pytestmark = pytest.mark.megengine


def weight():
    mge = pytest.importorskip("megengine")
    return mge.Parameter(np.arange(20, dtype="float32").reshape(5, 4) / 10)


def linear_loss(w):
    import megengine
    import megengine.functional as F

    x = megengine.Tensor(np.ones((3, 4), "float32"))
    return F.sum(F.matmul(x, w, transpose_b=True))


def test_backward_twice_says_the_first_backward_ended_the_recording():
    w = weight()
    gm = GradManager().attach(w)
    with gm:
        loss = linear_loss(w)
        gm.backward(loss)
        with pytest.raises(RuntimeError) as info:
            gm.backward(loss)
    assert "the first backward() ended the recording" in str(info.value), str(info.value)


def test_one_argument_callback_is_told_the_signature():
    w = weight()
    with pytest.raises(TypeError) as info:  # at attach() or at the backward: either is fine
        gm = GradManager().attach(w, callbacks=[lambda g: g * 2])
        with gm:
            gm.backward(linear_loss(w))
    assert "cb(tensor, grad) -> grad" in str(info.value), str(info.value)
    assert w.grad is None


def test_raising_callback_is_named_with_its_tensor():
    def my_check(t, g):
        raise ValueError("found a NaN")

    w = weight()
    gm = GradManager().attach(w, callbacks=[my_check])
    with pytest.raises(Exception) as info, gm:
        gm.backward(linear_loss(w))
    message = str(info.value)
    assert "my_check" in message and "(5, 4)" in message, message
    error = info.value
    assert isinstance(error, ValueError) or isinstance(error.__cause__, ValueError)


def test_attach_module_suggests_parameters():
    M = pytest.importorskip("megengine.module")
    with pytest.raises(TypeError) as info:
        GradManager().attach(M.Linear(2, 3))
    assert "model.parameters()" in str(info.value), str(info.value)
