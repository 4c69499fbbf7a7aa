"""The plain step's engine call (issue 27 item 2): what ``with gm: gm.backward(loss)`` leaves
in ``.grad`` is bit for bit what PyTorch's engine gives, and where attached tensors do not cover
every leaf of the graph that requires grad, only the attached ones get a gradient.

The engine call without ``inputs=`` is faster (it skips the engine's marking of the nodes that
lead to the inputs), but it writes ``.grad`` of every leaf it reaches. These tests pin the cases
where that would differ from gradmgr's result: an unattached leaf that requires grad (from the
first step on, or only from a later step on: what one walk of the graph saw does not hold for
the next step's graph), a frozen attached layer, a hook on a tensor outside the attached
tensors' paths, ``create_graph`` for an earlier-started manager, and groups. With the usual
step's engine call made without ``inputs=`` (``tape.run_engine_plain`` replaced by such a call,
checked by hand), the tests with a leaf or a hook outside the attached tensors (the unattached
leaf, both ways; the hook; the group, whose members each leave the other's tensors out) fail;
the others pin results that call must keep. Exact comparisons (``torch.equal``): the same
engine runs the same nodes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradmgr import GradManager  # noqa: E402

STEPS = 4  # the first backward walks the graph; the later ones take the usual step's path


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def reference(model: torch.nn.Module, loss_of, steps: int = STEPS) -> list:
    """``.grad`` after ``steps`` accumulating ``loss.backward(inputs=params)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    for _ in range(steps):
        loss_of().backward(inputs=params)
    return [p.grad for p in params]


def test_all_attached_matches_loss_backward_bit_for_bit():
    model, x = mlp(), torch.randn(5, 8)
    twin = mlp()
    gm = GradManager().attach(model.parameters())
    for _ in range(STEPS):
        with gm:
            gm.backward(model(x).square().mean())
        twin(x).square().mean().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("from_step", [0, 2], ids=["from-the-start", "from-a-later-step"])
def test_an_unattached_leaf_that_requires_grad_gets_no_grad(from_step):
    model, other = mlp(), torch.nn.Linear(8, 3)
    x = torch.randn(5, 8)
    gm = GradManager().attach(model.parameters())
    for step in range(STEPS):
        if step == from_step:
            x.requires_grad_(True)
        with gm:
            gm.backward((model(x) + other(x)).square().mean())
    assert x.grad is None and other.weight.grad is None and other.bias.grad is None
    twin = mlp()
    expected = reference(twin, lambda: (twin(x) + other(x)).square().mean())
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p.grad, e)


def test_a_frozen_attached_layer_keeps_no_grad():
    model, x = mlp(), torch.randn(5, 8)
    model[0].requires_grad_(False)
    gm = GradManager().attach(model.parameters())
    for _ in range(STEPS):
        with gm:
            gm.backward(model(x).square().mean())
    twin = mlp()
    twin[0].requires_grad_(False)
    expected = reference(twin, lambda: twin(x).square().mean())
    assert model[0].weight.grad is None and model[0].bias.grad is None
    for p, e in zip(model[2].parameters(), expected):
        assert torch.equal(p.grad, e)


def test_a_hook_off_the_attached_tensors_paths_does_not_run():
    model, x = mlp(), torch.randn(5, 8)
    side = torch.randn(3, requires_grad=True)  # not attached
    calls = []
    gm = GradManager().attach(model.parameters())
    for _ in range(STEPS):
        with gm:
            doubled = side * 2
            doubled.register_hook(lambda g: calls.append(1))
            gm.backward(model(x).square().mean() + doubled.sum())
    assert calls == [] and side.grad is None


def test_an_earlier_managers_recording_gets_the_second_derivative():
    w = torch.tensor([1.5, -2.0], requires_grad=True)
    outer, inner = GradManager().attach(w), GradManager().attach(w)
    for _ in range(STEPS):
        w.grad = None
        with outer:
            with inner:
                inner.backward((w ** 3).sum())  # w.grad = 3 w^2, recorded by outer
            first = w.grad
            w.grad = None
            outer.backward(first.sum())  # d/dw sum(3 w^2) = 6 w
        assert torch.equal(w.grad, 6 * w.detach())


def test_group_members_each_get_only_their_own_tensors_gradients():
    model, x = mlp(), torch.randn(5, 8)
    first, second = list(model[0].parameters()), list(model[2].parameters())
    gm1, gm2 = GradManager().attach(first), GradManager().attach(second)
    twin = mlp()
    expected = reference(twin, lambda: twin(x).square().mean())
    for _ in range(STEPS):
        with gm1 | gm2:
            loss = model(x).square().mean()
            gm1.backward(loss)
            gm2.backward(loss)
    for p, e in zip(first + second, expected):
        assert torch.equal(p.grad, e)
