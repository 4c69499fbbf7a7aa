"""Issue 25, item 3: ``loss.backward()`` typed by habit inside ``with gm:`` in one process.

On the old code the callbacks were skipped silently (a callback returning zeros ran 0 times and
``.grad`` held the full gradient). Now the recording's end raises a RuntimeError that says to
call ``gm.backward(loss)``, wherever an attached tensor has callbacks (the tensor hooks that run
them see the foreign backward; no work is added to ``gm.backward``). Without callbacks the
result is what ``gm.backward(loss)`` gives, compared exactly below. Native MegEngine has no
``Tensor.backward`` at all (an AttributeError), nor do gradmgr's MegEngine tensors.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")

from gradmgr import GradManager  # noqa: E402


def _zeroing(calls: list):
    def cb(tensor, grad):
        calls.append(tuple(tensor.shape))
        return grad * 0

    return cb


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _loss(model):
    torch.manual_seed(1)
    return model(torch.randn(5, 4)).pow(2).mean()


def test_plain_backward_inside_recording_with_callbacks_raises():
    model, calls = _model(), []
    gm = GradManager().attach(model.parameters(), callbacks=[_zeroing(calls)])
    wanted = r"gm\.backward\(loss\) inside `with gm:`"
    with pytest.raises(RuntimeError, match=wanted) as info, gm:
        _loss(model).backward()
    assert "4 attached tensor(s)" in str(info.value)
    assert calls == [] and not gm.is_recording
    # the manager works on: the next step runs every callback
    model.zero_grad(set_to_none=True)
    with gm:
        gm.backward(_loss(model))
    assert len(calls) == 4
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_release_by_hand_raises_too():
    model = _model()
    gm = GradManager().attach(model.parameters(), callbacks=[lambda t, g: g])
    gm.record()
    _loss(model).backward()
    with pytest.raises(RuntimeError, match="ended without gm.backward"):
        gm.release()
    gm.release()  # idempotent, nothing left to raise
    assert not gm.is_recording


def test_the_blocks_own_error_wins():
    model = _model()
    gm = GradManager().attach(model.parameters(), callbacks=[lambda t, g: g])
    with pytest.raises(ValueError, match="bad batch"), gm:
        _loss(model).backward()
        raise ValueError("bad batch")


def test_autograd_grad_inside_a_recording_is_legal():
    """``torch.autograd.grad`` writes no ``.grad``: nothing was bypassed."""
    model, calls = _model(), []
    gm = GradManager().attach(model.parameters(), callbacks=[_zeroing(calls)])
    with gm:
        grads = torch.autograd.grad(_loss(model), list(model.parameters()))
    assert len(grads) == 4 and calls == []
    assert all(p.grad is None for p in model.parameters())


def test_a_nested_managers_backward_is_not_a_habit():
    """An inner manager's backward reaches the outer one's watched tensors: legal, also when
    the outer recording then ends without a backward."""
    model = _model()
    outer = GradManager().attach(model.parameters(), callbacks=[lambda t, g: g])
    inner = GradManager().attach(model.parameters(), callbacks=[lambda t, g: g])
    with outer, inner:
        inner.backward(_loss(model))
    assert all(p.grad is not None for p in model.parameters())


def test_another_threads_plain_backward_is_not_this_recordings_habit():
    """S12: a ``loss.backward()`` in another thread, through a parameter this thread's manager
    attached with callbacks, while this thread records a step it then leaves without a
    backward (a skipped batch). Old code: the recording's end raised the habit's RuntimeError
    ("loss.backward() ... ran inside a recording"), blaming this thread for the other one's
    legal backward. Now no error, and ``.grad`` is that backward's, as with torch alone."""
    import threading

    model = _model()
    gm = GradManager().attach(model.parameters(), callbacks=[lambda t, g: g])
    reference = _model()
    _loss(reference).backward()
    errors = []

    def other():
        try:
            _loss(model).backward()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with gm:
        model(torch.ones(1, 4)).sum()  # this thread's forward, no backward
        worker = threading.Thread(target=other)
        worker.start()
        worker.join(timeout=60)
    assert not worker.is_alive() and not errors, errors
    for mine, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, ref.grad)


def test_a_group_releases_every_member_and_raises():
    model = _model()
    gm1 = GradManager().attach(model[0].weight, callbacks=[lambda t, g: g])
    gm2 = GradManager().attach(model[2].weight, callbacks=[lambda t, g: g])
    with pytest.raises(RuntimeError, match="ended without gm.backward"), gm1 | gm2:
        _loss(model).backward()
    assert not gm1.is_recording and not gm2.is_recording


def test_without_callbacks_the_result_is_gm_backwards():
    """No callback to skip: ``.grad`` is exactly what ``gm.backward(loss)`` gives."""
    habit, reference = _model(), _model()
    with GradManager().attach(habit.parameters()):
        _loss(habit).backward()
    gm = GradManager().attach(reference.parameters())
    with gm:
        gm.backward(_loss(reference))
    for mine, ref in zip(habit.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, ref.grad)


@pytest.mark.megengine
def test_megengine_tensors_have_no_backward():
    mge = pytest.importorskip("megengine")
    from megengine.autodiff import GradManager as NativeGradManager

    w = mge.Parameter([1.0, 2.0])
    for gm in (NativeGradManager().attach(w), GradManager().attach(w)):
        with gm:
            y = (w * w).sum()
            assert not hasattr(y, "backward")
            gm.backward(y)
