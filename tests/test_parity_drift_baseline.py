"""train_drift's rounding baseline (a copy of ``a`` trained on the rows reversed: the drift
rounding alone gives the model at hand, issue 36 item 4) and its progress bar (item 5). Torch
only, so it runs in every environment; the cross-framework use is in test_parity_false_oks."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch
from torch import nn

from gradmgr.parity import ParityError, train_drift

RS = np.random.RandomState(3)
BATCHES = [(RS.randn(8, 3, 12, 12).astype(np.float32), RS.randint(0, 5, 8)) for _ in range(4)]
LR = 0.05


def _net(eps: float = 1e-5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16, eps=eps), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16, eps=eps),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


def _loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, labels.long())


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _drift(b: nn.Module, a: nn.Module, twin: nn.Module, **kwargs):
    return train_drift(a, b, _sgd(a), _sgd(b), BATCHES, loss_a=_loss, loss_b=_loss,
                       baseline=(twin, _sgd(twin)), **kwargs)


def test_the_baseline_is_a_copy_of_a_trained_on_reversed_rows():
    """What the report calls rounding is measured, not assumed: the baseline's parameters
    equal, bit for bit, a plain torch loop training a copy of a on every batch's rows
    reversed, and its distance from a is that loop's distance."""
    a = _net()
    twin = copy.deepcopy(a)
    reference = copy.deepcopy(a)
    report = _drift(copy.deepcopy(a), a, twin, progress=False)
    opt = _sgd(reference)
    for x, y in BATCHES:
        opt.zero_grad()
        _loss(reference(torch.from_numpy(x[::-1].copy())), torch.from_numpy(y[::-1].copy())
              ).backward()
        opt.step()
    for mine, theirs in zip(twin.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    diffs = [(p - q).detach().double() for p, q in zip(a.parameters(), reference.parameters())]
    norm = float(torch.sqrt(sum((p.detach().double() ** 2).sum() for p in a.parameters())))
    expected = float(torch.sqrt(sum((d ** 2).sum() for d in diffs))) / norm
    assert report.baseline_rel_l2[-1] == pytest.approx(expected, rel=1e-9)
    assert report.baseline_max_abs[-1] == pytest.approx(max(float(d.abs().max())
                                                            for d in diffs), rel=1e-9)


def test_a_correct_port_sits_at_zero_a_wrong_eps_far_above_the_rounding_baseline():
    """Same framework, same kernels: the correct port drifts 0.0 while reversing the rows
    already moves the model by rounding (measured: 7e-9 relative L2 after the first step, 2e-8
    after the fourth, on torch 2.8 and 2.13); a BatchNorm eps of 1e-3 instead of 1e-5 drifts
    2.6e-5 to 1.3e-4, more than a thousand times the baseline."""
    a = _net()
    good = _drift(copy.deepcopy(a), a, copy.deepcopy(a), progress=False)
    assert good.rel_l2 == [0.0] * 4
    assert 0.0 < good.baseline_rel_l2[-1] < 1e-5, good.text()
    a = _net()
    wrong = _net(eps=1e-3)
    wrong.load_state_dict(a.state_dict())
    broken = _drift(wrong, a, copy.deepcopy(a), progress=False)
    assert broken.rel_l2[-1] > 100 * broken.baseline_rel_l2[-1], broken.text()
    assert "rounding rel L2" in broken.text() and "rows reversed" in broken.text()
    b = copy.deepcopy(a)
    assert "rounding rel L2" not in train_drift(a, b, _sgd(a), _sgd(b), BATCHES[:1],
                                                progress=False).text()


def test_a_baseline_that_is_not_a_copy_of_a_is_refused():
    a = _net()
    b = copy.deepcopy(a)
    other = _net()
    with torch.no_grad():
        other[0].weight.add_(1e-3)
    with pytest.raises(ParityError, match=r"does not hold a's 0\.weight exactly"):
        _drift(b, a, other)
    with pytest.raises(ParityError, match=r"a copy of a \(got a itself\)"):
        train_drift(a, b, _sgd(a), _sgd(b), BATCHES, loss_a=_loss, loss_b=_loss,
                    baseline=(a, _sgd(a)))
    with pytest.raises(ParityError, match=r"baseline= takes \(model, optimizer\)"):
        train_drift(a, b, _sgd(a), _sgd(b), BATCHES, loss_a=_loss, loss_b=_loss,
                    baseline=copy.deepcopy(a))
    twin = copy.deepcopy(a)
    with pytest.raises(ParityError, match=r"opt_baseline \(SGD\) holds none"):
        train_drift(a, b, _sgd(a), _sgd(b), BATCHES, loss_a=_loss, loss_b=_loss,
                    baseline=(twin, _sgd(a)))
    lin, port, twin = nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(4, 2)
    port.load_state_dict(lin.state_dict())
    twin.load_state_dict(lin.state_dict())
    before = lin.weight.detach().clone()
    x = np.ones((3, 4), np.float32)
    with pytest.raises(ParityError, match=r"the same leading \(batch\) dimension"):
        train_drift(lin, port, _sgd(lin), _sgd(port), [(x, np.float32(1.0))],
                    loss_a=lambda o, t: o.mean() * t, loss_b=lambda o, t: o.mean() * t,
                    baseline=(twin, _sgd(twin)))
    assert torch.equal(lin.weight, before)  # refused before any step


def test_progress_bar_on_request_and_never_by_default_off_a_terminal(capsys, monkeypatch):
    a = nn.Linear(4, 2)
    x = np.ones((3, 4), np.float32)

    def run(**kwargs):
        b = copy.deepcopy(a)
        return train_drift(a, b, _sgd(a), _sgd(b), [x] * 3, **kwargs)

    run(progress=True)
    err = capsys.readouterr().err
    assert "train_drift" in err and "3/3" in err, err
    run()  # pytest's stderr is no terminal: no bar
    run(progress=False)
    assert capsys.readouterr().err == ""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(ImportError, match=r"train_drift\(progress=True\) needs tqdm.*"
                                          r"gradmgr\[parity\]"):
        run(progress=True)
    run()  # without tqdm the default shows nothing and does not fail
