"""Issue 19, item 6: the divergences the scenario harness found on PyTorch, minimised by hand.

Each test states what the contract gives (checked by hand against native MegEngine or plain
autograd, as its docstring says), and what gradmgr did before it was fixed.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradmgr import GradManager  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::gradmgr.GradMgrWarning")


def _same(t, values) -> bool:
    return t is not None and torch.equal(t, torch.tensor(values))


# ---------------------------------------------------------------- an input shared in a group
def _group_shares_input(first: int = 1):
    """The issue's program: ``x`` attached to gm1 before recording and to gm2 inside the
    recording of ``gm1 | gm2`` (gm1 holds ``x``'s flag then); both backward ``y``."""
    x, w = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0], requires_grad=True)
    gm1, gm2 = GradManager().attach(x), GradManager()
    with (gm1 | gm2 if first == 1 else gm2 | gm1):
        gm2.attach(x)
        y = (x * w).sum()
        gm1.backward(y)
        gm2.backward(y)
    return x, w, gm2


@pytest.mark.parametrize("first", [1, 2], ids=["gm1|gm2", "gm2|gm1"])
def test_input_attached_while_another_manager_holds_its_flag_gets_both_gradients(first):
    """Native MegEngine (and gradmgr on MegEngine): x.grad = [6, 8] (as plain autograd of
    ``y`` twice). In the order ``gm2 | gm1`` MegEngine gives gm1 nothing, since gm2's attach
    snapshots ``x`` inside the group (test_megengine_dropin.py); on PyTorch the order of a
    group's members does not matter. (gm2, with nothing attached, also warned it started
    late there when MegEngine was imported.)"""
    x, _, _ = _group_shares_input(first)
    assert _same(x.grad, [6.0, 8.0]), x.grad


def test_that_input_gets_the_second_managers_gradient_later_alone():
    """Native MegEngine (and gradmgr on MegEngine): x.grad = [3, 4]."""
    x, w, gm2 = _group_shares_input()
    x.grad = None
    with gm2:
        gm2.backward((x * w).sum())
    assert _same(x.grad, [3.0, 4.0]), x.grad


def test_a_view_of_an_input_another_manager_holds_is_an_input():
    """``v = x[0:1]`` made before any recording; gm1 attaches ``x`` (turning its flag on, which
    ``v`` shows too), then gm2 attaches ``v``. gm2's gradient must not depend on whether gm1
    still records: gm1 releases first here. Expected (the user's flag of ``v`` is off, so ``v``
    is gm2's input, as in MegEngine): v.grad = dy = [2]."""
    x = torch.tensor([0.5, 1.5])
    v = x[0:1]
    gm1, gm2 = GradManager(), GradManager()
    with gm1 | gm2:
        gm1.attach(x)
        gm2.attach(v)
        gm1.release()
        gm2.backward((v * 2.0).sum())
    assert _same(v.grad, [2.0]), v.grad


# ---------------------------------------------------------------- frozen, then attached again
@pytest.mark.parametrize("callbacks", [None, [lambda t, g: g]], ids=["plain", "callbacks"])
def test_a_frozen_parameter_attached_again_gets_no_gradient(callbacks):
    """Decided rule: freezing wins for a ``Parameter``, whatever its attach calls and
    callbacks (as with ``loss.backward()`` and DDP)."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    gm = GradManager().attach(w)
    w.requires_grad_(False)
    gm.attach(w, callbacks=callbacks)
    with gm:
        gm.backward((w * 3.0).sum())
    assert w.grad is None and not w.requires_grad


def _frozen_tensor_attached_again(callbacks, inside: bool):
    w = torch.tensor([1.0, 2.0], requires_grad=True)  # a plain tensor, not a Parameter
    gm = GradManager().attach(w)
    w.requires_grad_(False)
    if not inside:
        gm.attach(w, callbacks=callbacks)
    with gm:
        if inside:
            gm.attach(w, callbacks=callbacks)
        gm.backward((w * 3.0).sum())
    return w


def test_a_frozen_tensor_attached_again_without_callbacks_is_an_input():
    """Contract: a plain leaf attached with ``requires_grad=False`` is an input and gets its
    gradient, whatever the callbacks: w.grad = [3, 3] (plain autograd of 3 * w), and its flag
    is the user's again afterwards."""
    w = _frozen_tensor_attached_again(None, inside=False)
    assert _same(w.grad, [3.0, 3.0]) and not w.requires_grad, w.grad


def test_a_frozen_tensor_attached_again_with_callbacks_is_an_input():
    w = _frozen_tensor_attached_again([lambda t, g: g], inside=False)
    assert _same(w.grad, [3.0, 3.0]) and not w.requires_grad, w.grad


@pytest.mark.parametrize("callbacks", [None, [lambda t, g: g]], ids=["plain", "callbacks"])
def test_a_frozen_tensor_attached_again_while_recording_is_an_input_at_once(callbacks):
    """The same attach inside the recording (S8: later operations are differentiated):
    w.grad = [3, 3] from this backward already."""
    w = _frozen_tensor_attached_again(callbacks, inside=True)
    assert _same(w.grad, [3.0, 3.0]) and not w.requires_grad, w.grad


def test_a_frozen_tensor_gets_no_gradient_from_a_manager_it_is_not_an_input_of():
    """``w`` is trainable for gm1 and frozen by the user before gm2 attaches it (an input of
    gm2). gm1 gives it no gradient when it records alone (as the harness's freezing schedules
    check); in a group with gm2, which turns ``w``'s flag on, it must not either:
    w.grad = [3, 3] (gm2's alone), not [6, 6]. (MegEngine has no freezing.)"""
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    gm1 = GradManager().attach(w)
    w.requires_grad_(False)
    gm2 = GradManager().attach(w)
    with gm1 | gm2:
        y = (w * 3.0).sum()
        gm1.backward(y)
        gm2.backward(y)
    assert _same(w.grad, [3.0, 3.0]) and not w.requires_grad, w.grad


# ---------------------------------------------------------------- outputs
def test_dy_is_not_written_by_a_later_accumulation():
    """``y = x.reshape(6)`` with a user ``dy``, no callbacks: PyTorch's AccumulateGrad steals
    the gradient, a view of ``dy``, as ``.grad``; the next backward added into it in place, so
    the user's ``dy`` changed (plain ``loss.backward()`` does the same; contract point 6 says
    ``.grad`` owns its storage, and gradmgr copies a ``dy`` that reaches ``.grad`` directly,
    test_torch_correctness.py::test_a_gradient_that_is_the_users_dy_is_copied)."""
    x = torch.nn.Parameter(torch.ones(2, 3))
    dy = torch.ones(6)
    gm = GradManager().attach(x)
    for _ in range(2):
        with gm:
            gm.backward(x.reshape(6), dy)
    assert torch.equal(dy, torch.ones(6)), dy
    assert torch.equal(x.grad, torch.full((2, 3), 2.0))


def test_an_attached_input_view_as_output_gets_dy():
    """``v = x[0:1]`` of an input ``x`` (no grad), attached: gradmgr turns ``v``'s own flag on,
    so ``v`` is a leaf with a gradient accumulator and plain autograd gives ``v.grad = dy``
    (``v.requires_grad_(True); v.backward(dy)``). gradmgr raised RuntimeError ("an output
    requires grad but has no gradient path"), meant for a view whose flag comes from its base
    only (reentrant checkpointing), where PyTorch refuses too (backends/torch/graph.py,
    graph_root, now tells the two apart)."""
    x = torch.tensor([0.5, 1.5])
    v = x[0:1]
    gm = GradManager()
    with gm:
        gm.attach(v)
        gm.backward(v, torch.tensor([2.0]))
    assert _same(v.grad, [2.0]), v.grad


# ---------------------------------------------------------------- custom autograd Functions
class _NoGradForB(torch.autograd.Function):
    """``a + b`` whose backward gives ``b`` no gradient (None)."""

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_a_none_gradient_from_a_custom_function_leaves_grad_none():
    """Plain autograd: ``torch.autograd.grad(y, [a, b], allow_unused=True)`` is ``(ones,
    None)``, and PyTorch calls ``b``'s tensor hooks with None. With a callback on ``b``, gradmgr's
    hook used to read ``None._version`` (backends/torch/tape.py, _hook now passes None on)."""
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(2, requires_grad=True)
    gm = GradManager().attach(a).attach(b, callbacks=lambda t, g: g)
    with gm:
        gm.backward(_NoGradForB.apply(a, b).sum())
    assert _same(a.grad, [1.0, 1.0]) and b.grad is None
