"""Issue 38: what users do with a model under ``data_parallel`` besides training it.

A layer replaced (or added) after ``data_parallel(model)``, as fine-tuning code does: the next
``with gm:`` raises, before any collective, saying to make a new manager (DDP raises at its
next step too); after ``del gm`` and ``data_parallel(model)`` again, the model trains exactly
as a fresh model with the same values does.

``copy.deepcopy(model)`` (an EMA copy) and ``torch.save(model)`` (a snapshot) give a plain
model, as DDP's ``module`` does: the same parameters and buffers, no hook of gradmgr's, and a
plain ``loss.backward()`` on the copy computes the gradients a fresh model computes (exactly:
the same kernels). The original keeps its manager: it still refuses a forgotten ``with gm:``
and trains on. One gloo rank in this process: the copies involve no collective.
"""

from __future__ import annotations

import copy
import io

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")

from gradmgr.distributed import data_parallel  # noqa: E402

PATHS = {"reducer": {}, "buckets": {"native": False}, "sharded": {"shard": True}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 2))


def _step(gm, model) -> None:
    with gm:
        gm.backward(model(torch.randn(6, 4)).square().mean())


def _saved(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("copier", [copy.deepcopy, _saved], ids=["deepcopy", "torch.save"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_copy_of_a_wrapped_model_is_a_plain_model(gloo_one_rank, path, copier):
    model = _model()
    gm = data_parallel(model, **PATHS[path])
    _step(gm, model)
    twin = copier(model)
    assert not twin._forward_hooks and "__getstate__" not in vars(twin)
    assert all(not p._backward_hooks for p in twin.parameters())
    for (name, mine), theirs in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(mine, theirs), name
    x = torch.randn(6, 4)
    reference = copy.deepcopy(_model())  # an unwrapped model with the same values
    reference.load_state_dict(model.state_dict())
    reference(x).sum().backward()
    twin.zero_grad()
    twin(x).sum().backward()  # a plain backward: no manager on the copy
    for mine, theirs in zip(twin.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, theirs.grad)
    with pytest.raises(RuntimeError, match="outside `with gm:`"):
        model(x).sum().backward()  # the original still has its manager
    model.zero_grad()
    _step(gm, model)
    del gm


def _grads(model) -> list:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("path", ["reducer", "buckets"])
@pytest.mark.parametrize("change", ["replace", "add"])
def test_a_layer_changed_after_wrapping_raises_then_a_new_manager_trains(
        gloo_one_rank, path, change):
    model = _model()
    gm = data_parallel(model, **PATHS[path])
    _step(gm, model)
    model[1] = model[1]  # the same layer again: nothing changed
    model.zero_grad()
    _step(gm, model)
    torch.manual_seed(1)
    if change == "replace":
        model[2] = torch.nn.Linear(8, 2)
    else:
        model.append(torch.nn.Linear(2, 2))
    model.zero_grad()
    with pytest.raises(RuntimeError, match=r"{}\.weight.*`del gm`".format(2 if change ==
                                                                          "replace" else 3)):
        _step(gm, model)
    assert not gm.is_recording
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="did not have"):
        _step(gm, model)  # again at every step, until a new manager
    del gm
    twin = copy.deepcopy(model)
    gm = data_parallel(model, **PATHS[path])
    torch.manual_seed(2)
    _step(gm, model)
    del gm
    fresh = data_parallel(twin, **PATHS[path])
    torch.manual_seed(2)
    _step(fresh, twin)
    for mine, theirs in zip(_grads(model), _grads(twin)):
        assert torch.equal(mine, theirs)
    del fresh


def test_data_parallel_looks_the_models_backend_up_once(gloo_one_rank, monkeypatch):
    """Issue 41: data_parallel(model) asked the registry for the model's backend four times
    (the wrapper check, the ranks' comparison, the broadcast, the tensor operations)."""
    from gradmgr.distributed import wrap

    asked = []
    real = wrap.backend_for
    monkeypatch.setattr(wrap, "backend_for", lambda tensor: asked.append(tensor) or real(tensor))
    model = _model()
    gm = data_parallel(model)
    assert len(asked) == 1
    x = torch.randn(6, 4)
    with gm:
        gm.backward(model(x).square().mean())
    twin = _model()  # one rank: the mean over the ranks is this rank's gradient, bit for bit
    twin(x).square().mean().backward()
    for mine, plain in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, plain.grad, rtol=0, atol=0)
    del gm
