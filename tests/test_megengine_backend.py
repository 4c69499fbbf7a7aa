"""MegEngine-specific behaviour of the backend that the contract suite does not cover."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

mge = pytest.importorskip("megengine")

import megengine.functional as F  # noqa: E402
from megengine.autodiff import GradManager as NativeGradManager  # noqa: E402
from megengine.core.autodiff.grad import Grad  # noqa: E402

from gradmgr import GradManager, get_backend  # noqa: E402
from gradmgr.backends.megengine import MegEngineBackend, MegEngineTape  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def clean_grad_stack():
    yield
    assert Grad.stack == [] and not Grad.grouping, "MegEngine's global Grad state leaked"


def test_registered_backend_and_capabilities():
    backend = get_backend("megengine")
    assert isinstance(backend, MegEngineBackend)
    assert backend.name == "megengine" and backend.tensor_modules == ("megengine",)
    caps = backend.capabilities
    assert caps.higher_order and caps.cuda and caps.exact_pre_record_semantics
    assert not caps.requires_grad_flag


def test_parameter_and_tensor_are_both_tensors_with_equal_gradients():
    backend = get_backend("megengine")
    data = np.array([[0.5, -1.5], [2.0, 0.25]], dtype="float32")
    p, t = mge.Parameter(data), mge.Tensor(data)
    assert backend.is_tensor(p) and backend.is_tensor(t)
    assert not backend.is_tensor(data) and not backend.is_tensor([1.0])
    gm = GradManager().attach([p, t])
    with gm:
        gm.backward((F.exp(p) + F.exp(t)).sum())
    assert gm.backend is backend
    np.testing.assert_array_equal(p.grad.numpy(), t.grad.numpy())
    np.testing.assert_allclose(p.grad.numpy(), np.exp(data), rtol=1e-6)  # float32 exp


@pytest.mark.parametrize("dtype", ["int32", "bool", "uint8"])
def test_non_floating_dtype_is_a_type_error_naming_dtype_and_shape(dtype):
    bad = mge.Tensor(np.zeros((2, 3)), dtype=dtype)
    good = mge.Tensor([1.0])
    gm = GradManager()
    with pytest.raises(TypeError, match=rf"dtype {dtype}.*shape \(2, 3\)"):
        gm.attach([good, bad])
    assert gm.attached_tensors() == []  # validation happens before anything is attached


def test_float16_is_attachable():
    x = mge.Tensor([1.0, 2.0], dtype="float16")
    gm = GradManager().attach(x)
    with gm:
        gm.backward((x * x).sum())
    assert x.grad.dtype == np.float16
    np.testing.assert_array_equal(x.grad.numpy(), np.array([2.0, 4.0], "float16"))  # exact


def test_non_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="numpy.ndarray"):
        GradManager().attach([np.ones(3, "float32")])


def test_shape_ones_like_device_and_accumulate():
    backend = get_backend("megengine")
    x = mge.Tensor(np.arange(6, dtype="float32").reshape(2, 3))
    assert backend.shape(x) == (2, 3)
    np.testing.assert_array_equal(backend.ones_like(x).numpy(), np.ones((2, 3), "float32"))
    assert f"device {x.device}" in backend.describe(x)  # the device, for messages
    assert x.grad is None
    backend.accumulate(x, mge.Tensor(np.full((2, 3), 2.0, "float32")))
    backend.accumulate(x, mge.Tensor(np.full((2, 3), 0.5, "float32")))
    np.testing.assert_array_equal(x.grad.numpy(), np.full((2, 3), 2.5, "float32"))


def test_seed_of_a_scalar_loss_may_be_ones_like_as_with_native():
    """F.ones_like of a 0-d loss has shape (1,); the native manager accepts it as dy."""
    grads = []
    for manager in (NativeGradManager, GradManager):
        w = mge.Parameter(np.array([1.0, 2.0, 3.0], dtype="float32"))
        gm = manager().attach(w)
        with gm:
            loss = (w * w).sum()
            assert loss.shape == () and F.ones_like(loss).shape == (1,)
            gm.backward(loss, F.ones_like(loss) * 3)
        grads.append(w.grad.numpy())
    np.testing.assert_array_equal(grads[1], grads[0])
    np.testing.assert_allclose(grads[1], [6.0, 12.0, 18.0], rtol=1e-6)


@pytest.mark.parametrize("y_shape,dy_shape", [((2,), (1,)), ((2,), (2, 1)), ((), (2,))])
def test_seed_that_megengine_would_broadcast_is_rejected(y_shape, dy_shape):
    w = mge.Parameter(np.ones(2, dtype="float32"))
    gm = GradManager().attach(w)
    with gm, pytest.raises(ValueError, match=r"shape"):
        y = w.sum() * mge.tensor(np.ones(y_shape, dtype="float32")) if y_shape else w.sum()
        gm.backward(y, mge.tensor(np.ones(dy_shape, dtype="float32")))
    assert w.grad is None


def test_reachable_is_not_supported():
    x = mge.Tensor([1.0])
    gm = GradManager().attach(x)
    with pytest.raises(NotImplementedError, match="megengine"):
        gm.reachable(x * 2)


def test_tape_misuse_and_idempotent_stop():
    tape = MegEngineTape()
    with pytest.raises(RuntimeError, match="not started"):
        tape.watch(mge.Tensor([1.0]), lambda g: None, eager=False)
    tape.start()
    tape.stop()
    tape.stop()
    with pytest.raises(RuntimeError, match="not started"):
        tape.backward([mge.Tensor([1.0])], [mge.Tensor([1.0])], create_graph=False,
                      retain_graph=False)


def test_reattach_with_callbacks_keeps_first_snapshot_like_native():
    def program(make):
        x = mge.Tensor([1.0, -2.0])
        calls = []
        gm = make().attach(x)
        with gm:
            y = x * 3
            gm.attach(x, callbacks=lambda t, g: calls.append(g.numpy()) or g)
            gm.backward((y * x).sum())  # one snapshot: d(3x²)/dx = 6x
        return x.grad.numpy(), calls

    ours, native = program(GradManager), program(NativeGradManager)
    np.testing.assert_array_equal(ours[0], [6.0, -12.0])
    np.testing.assert_array_equal(ours[0], native[0])
    assert len(ours[1]) == len(native[1]) == 1


def test_group_start_failure_leaves_no_global_state():
    x = mge.Tensor([2.0])
    busy, fresh = GradManager().attach(x), GradManager().attach(x)
    busy.record()
    for group in (busy | fresh, fresh | busy):  # fails on the first and on the last member
        with pytest.raises(RuntimeError, match="already recording"):
            group.record()
        assert not Grad.grouping
        assert len(Grad.stack) == 1  # only busy's own Grad remains
    assert not fresh.is_recording
    busy.release()
    with busy:
        busy.backward(x * x)
    np.testing.assert_array_equal(x.grad.numpy(), [4.0])


def test_recording_group_refuses_to_nest():
    backend = get_backend("megengine")
    with pytest.raises(RuntimeError, match="already being formed"), \
            backend.recording_group(), backend.recording_group():
        pass
    assert Grad.stack == [] and not Grad.grouping


def _in_thread(fn) -> list:
    errors = []

    def work() -> None:
        try:
            fn()
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return errors


def test_megengine_cannot_run_outside_the_main_thread():
    """Why S12 (managers in threads) cannot hold on MegEngine: MegEngine 1.13 sets up its
    dispatch context only in the main thread, so even creating a tensor elsewhere fails. If a
    MegEngine release lifts this, this test fails and S12 should be enabled for MegEngine."""
    errors = _in_thread(lambda: mge.Tensor([1.0]))
    assert len(errors) == 1 and "transformations" in errors[0], errors


def test_attach_outside_the_main_thread_says_so():
    w = mge.Parameter([1.0])  # made in the main thread
    errors = _in_thread(lambda: GradManager().attach(w))
    assert len(errors) == 1 and "main thread" in errors[0], errors


def test_recording_inside_a_gradient_callback_says_so():
    x, y = mge.Parameter([1.0, 2.0]), mge.Parameter([3.0])
    inner = GradManager().attach(x)

    def cb(tensor, grad):
        with inner:
            inner.backward((x * x).sum())
        return grad

    outer = GradManager().attach(y, callbacks=cb)
    with pytest.raises(RuntimeError, match="inside a gradient callback"), outer:
        outer.backward((y * 2).sum())
    assert x.grad is None and y.grad is None
    plain = GradManager().attach(y)  # the engine still works afterwards
    with plain:
        plain.backward((y * 2).sum())
    with inner:
        inner.backward((x * x).sum())
    np.testing.assert_array_equal(y.grad.numpy(), [2.0])  # exact: d(2y)/dy
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0])  # exact: 2x


def test_detection_does_not_import_torch():
    code = (
        "import sys, megengine, gradmgr\n"
        "gm = gradmgr.GradManager().attach(megengine.Parameter([1.0]))\n"
        "assert gm.backend.name == 'megengine', gm.backend\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.torch
def test_mixing_with_torch_is_a_type_error():
    torch = pytest.importorskip("torch")
    gm = GradManager().attach(mge.Tensor([1.0]))
    with pytest.raises(TypeError, match="megengine.*torch"):
        gm.attach(torch.ones(1))


@pytest.mark.cuda
@pytest.mark.skipif(not mge.is_cuda_available(), reason="CUDA: megengine sees no GPU")
def test_gradients_land_on_the_gpu():
    x = mge.Tensor([1.0, 2.0], device="gpu0")
    gm = GradManager().attach(x)
    with gm:
        gm.backward((x * x).sum())
    assert "gpu" in str(x.grad.device)
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0])  # exact: 2x
