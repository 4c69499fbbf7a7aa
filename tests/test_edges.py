"""The contract at its edges (issue 29): a recording never released, a manager that recorded
with nothing attached, freezing after attach, operations before ``record()``, in-place changes
of attached inputs. MegEngine's own GradManager is the reference where it has the case, plain
torch autograd elsewhere; gradients are compared exactly (same kernels on the same data)."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from gradmgr import GradManager


# ------------------------------------------------------------------ a recording never released
def _drop_recording(manager_class, attach=()):
    """``def h(): gm = GradManager(); gm.record()``: the manager is dropped while recording."""
    gm = manager_class()
    if attach:
        gm.attach(list(attach))
    gm.record()
    gm.cycle = gm  # held by a reference cycle: only the collector frees it
    return weakref.ref(gm)


def test_dropped_recording_torch_ends_when_collected(torch_fw):
    import torch

    w = torch.ones(2, requires_grad=True)
    x = torch.tensor([3.0, 4.0])  # an input: the recording turns requires_grad on
    dropped = _drop_recording(GradManager, [x])
    assert x.requires_grad  # still recording: not collected yet
    gc.collect()
    assert dropped() is None  # the thread's list of recording managers did not keep it alive
    assert not x.requires_grad  # the user's flag is back: x.numpy() works
    x.numpy()
    gm = GradManager().attach(w)
    for _ in range(2):
        with gm:
            gm.backward((w * x).sum())
    # not recorded by the dropped manager: no higher-order graph chained into .grad
    assert w.grad.grad_fn is None
    assert w.grad.tolist() == [6.0, 8.0]


def test_dropped_recording_megengine_as_native(mge_fw):
    import megengine
    import megengine.functional as F
    from megengine.autodiff import GradManager as NativeGradManager

    def run(manager_class, attach_x):
        w = megengine.Parameter([1.0, 2.0])
        x = megengine.tensor([3.0, 4.0])
        dropped = _drop_recording(manager_class, [x] if attach_x else [])
        gc.collect()
        gm = manager_class().attach(w)
        for _ in range(2):
            with gm:
                gm.backward(F.sum(w * x))
        return dropped() is None, w.grad.numpy()

    from megengine.core.autodiff.grad import Grad

    for attach_x in (False, True):
        entered = len(Grad.stack)
        freed, grad = run(GradManager, attach_x)
        assert len(Grad.stack) == entered  # the Grad the dropped manager entered was exited
        native_freed, native_grad = run(NativeGradManager, attach_x)
        np.testing.assert_array_equal(grad, native_grad)
        # Native frees a manager with nothing attached; one with an attached tensor it keeps
        # alive through the callback it gave the engine (a leak gradmgr does not copy).
        assert freed and native_freed == (not attach_x)
