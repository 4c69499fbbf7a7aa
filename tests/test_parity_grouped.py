"""Grouped convolutions across PyTorch and MegEngine (gradmgr.parity's weight map): MegEngine
stores a grouped weight as ``(groups, out/groups, in/groups, *kernel)``, PyTorch as
``(out, in/groups, *kernel)``, the same elements in the same order. The map reshapes one into
the other for convolutions only (gradmgr.parity.mapping.grouped), in both directions and in
converted checkpoints; a port whose grouped weight is laid out otherwise (the group axis and
the channel axis exchanged, or the groups' blocks exchanged: the same shapes) is BROKEN.

Tolerances: the tool's own for its verdicts; a test's own comparisons of two frameworks'
outputs within 1e-5 of their largest magnitude (float32 kernels on the same weights), copied
values bit for bit (a reshape moves no bits)."""

from __future__ import annotations

import numpy as np
import pytest

mge = pytest.importorskip("megengine")
torch = pytest.importorskip("torch")

import megengine.functional as MF  # noqa: E402
import megengine.module as M  # noqa: E402
from torch import nn  # noqa: E402

from gradmgr.parity import (  # noqa: E402
    compare_step,
    convert_checkpoint,
    save_map,
    transfer_weights,
)

X = np.random.RandomState(0).randn(2, 3, 6, 6).astype(np.float32)
DIRECTIONS = ["torch->megengine", "megengine->torch"]
GROUPED = ("grouped.weight", "expand.weight", "up.weight")


def _next(lib):
    """A ResNeXt-style block in ``lib`` (torch.nn or megengine.module): a 1x1 reduction, a
    3x3 grouped convolution (4 channels in 2 groups: its groups and its channels per group
    both 2), a grouped 1x1 expansion, a grouped transposed convolution up, a head."""

    class NeXt(lib.Module):
        def __init__(self) -> None:
            super().__init__()
            self.reduce = lib.Conv2d(3, 4, 1)
            self.grouped = lib.Conv2d(4, 4, 3, padding=1, groups=2)
            self.relu = lib.ReLU()
            self.expand = lib.Conv2d(4, 8, 1, groups=4)
            self.up = lib.ConvTranspose2d(8, 8, 2, stride=2, groups=2)
            self.fc = lib.Linear(8, 5)

        def forward(self, x):
            x = self.up(self.expand(self.relu(self.grouped(self.reduce(x)))))
            return self.fc(x.mean((2, 3)))
    return NeXt()


def TorchNeXt():  # noqa: N802 (a model's name)
    return _next(nn)


def MgeNeXt():  # noqa: N802
    return _next(M)


def _models(direction: str):
    torch.manual_seed(0)
    mge.random.seed(0)
    return (TorchNeXt(), MgeNeXt()) if direction == "torch->megengine" else (MgeNeXt(),
                                                                             TorchNeXt())


def _values(model) -> dict:
    """The state dict as numpy arrays (MegEngine's holds them already)."""
    return {k: np.array(v.detach().numpy() if isinstance(v, torch.Tensor) else v)
            for k, v in model.state_dict().items()}


def _output(model, x=X) -> np.ndarray:
    if isinstance(model, torch.nn.Module):
        with torch.no_grad():
            return model(torch.from_numpy(x)).numpy()
    return model(mge.tensor(x)).numpy()


def _close(x: np.ndarray, y: np.ndarray) -> None:
    assert np.abs(x - y).max() <= 1e-5 * np.abs(x).max(), np.abs(x - y).max()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_grouped_port_maps_both_ways_and_is_parity(direction):
    """Old code: strict transfer_weights raised MappingError ("not a layout-only change")."""
    a, b = _models(direction)
    report = transfer_weights(a, b, probe=X)
    hows = {p.src: p.how for p in report.pairs}
    assert all("grouped convolution" in hows[n] for n in GROUPED), report.text()
    va, vb = _values(a), _values(b)
    for name in va:  # every tensor copied as is, reshaped only
        np.testing.assert_array_equal(va[name].reshape(-1), vb[name].reshape(-1), name)
    assert vb["grouped.weight"].shape == ((2, 2, 2, 3, 3) if direction == "torch->megengine"
                                          else (4, 2, 3, 3))
    _close(_output(a), _output(b))  # the frameworks' own forwards agree on the copy
    step = compare_step(a, b, X)
    assert step.ok, step.text()
    assert {e.name for e in step.entries if e.what == "grad"} >= {f"{n} / {n}" for n in GROUPED}


def test_a_grouped_weights_gradient_has_one_tolerance_in_both_directions():
    """The gradient's batch reduction is per output channel: MegEngine's first dim is the
    groups, so reading it there gave the torch -> MegEngine check another tolerance than the
    way back (its reduction over 2 groups, not 4 channels)."""
    torch.manual_seed(0)
    a, b = nn.Conv2d(4, 4, 3, groups=2), M.Conv2d(4, 4, 3, groups=2)
    x = X[:, :2].repeat(2, axis=1)
    transfer_weights(a, b, probe=x)
    tols = [next(e.tol for e in compare_step(*models, x).entries if e.name == "weight / weight")
            for models in ((a, b), (b, a))]
    assert tols[0] == pytest.approx(tols[1], rel=1e-9), tols


def _group_axes_exchanged(w: np.ndarray) -> np.ndarray:
    """(groups, out/groups, ...) read as (out/groups, groups, ...): 2 and 2 here."""
    grouped = w.reshape(2, 2, *w.shape[-3:])
    return np.ascontiguousarray(grouped.transpose(1, 0, 2, 3, 4)).reshape(w.shape)


def _group_blocks_exchanged(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w.reshape(2, 2, *w.shape[-3:])[::-1]).reshape(w.shape)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("bug", [_group_axes_exchanged, _group_blocks_exchanged])
def test_a_grouped_weight_laid_out_otherwise_is_broken_at_its_layer(bug, direction):
    """The port's grouped weight holds the reference's values in another order of the same
    shape: the forward departs at that convolution."""
    a, b = _models(direction)
    transfer_weights(a, b, probe=X)
    wrong = bug(_values(b)["grouped.weight"])
    assert not np.array_equal(wrong, _values(b)["grouped.weight"])
    if isinstance(b, torch.nn.Module):
        with torch.no_grad():
            b.grouped.weight.copy_(torch.from_numpy(wrong))
    else:
        b.grouped.weight._reset(mge.tensor(wrong))
    report = compare_step(a, b, X)
    assert not report.ok and report.first_forward.layer == "grouped", report.text()


def _scale(framework: str):
    """A port's own layer (kind ``scale`` on both sides) whose weight MegEngine's side holds
    as (2, 2, 2, 3) and torch's as (4, 2, 3)."""
    if framework == "torch":
        class Scale(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = nn.Parameter(torch.ones(4, 2, 3))

            def forward(self, x):
                return x * self.weight
    else:
        class Scale(M.Module):  # type: ignore[no-redef]
            def __init__(self) -> None:
                super().__init__()
                self.weight = mge.Parameter(np.ones((2, 2, 2, 3), np.float32))

            def forward(self, x):
                return x * MF.reshape(self.weight, (4, 2, 3))
    return Scale()


def test_the_grouped_reshape_is_for_convolutions_only():
    """A port's own layer whose tensor splits the other's first dim is not a grouped
    convolution: which element goes where would be a guess, so it stays unmapped."""
    x = np.ones((2, 4, 2, 3), np.float32)
    report = transfer_weights(_scale("torch"), _scale("megengine"), probe=x, strict=False)
    assert not report.ok and not report.pairs
    assert "not a layout-only change" in report.unmapped[0].reason, report.text()


@pytest.mark.parametrize("kind", ["Conv3d", "ConvTranspose2d"])
def test_the_grouped_reshape_is_megengines_own_layout(kind):
    """MegEngine's own layers compute torch's on the reshaped weight (Conv2d: above)."""
    torch.manual_seed(0)
    a, b = getattr(nn, kind)(4, 6, 3, groups=2), getattr(M, kind)(4, 6, 3, groups=2)
    x = np.random.RandomState(1).randn(2, 4, *([5] * (3 if kind == "Conv3d" else 2)))
    transfer_weights(a, b, probe=x.astype(np.float32))
    assert b.weight.ndim == a.weight.ndim + 1
    _close(_output(a, x.astype(np.float32)), _output(b, x.astype(np.float32)))


@pytest.mark.parametrize("built", DIRECTIONS)
def test_a_grouped_checkpoint_converts_both_ways(tmp_path, built):
    """A map built either way converts a MegEngine checkpoint into a torch one and back
    (old code: save_map raised MappingError)."""
    paths = {n: str(tmp_path / n) for n in ("map.json", "ref.mge", "port.pth", "back.mge")}
    mge.random.seed(3)
    reference = MgeNeXt()
    mge.save(reference.state_dict(), paths["ref.mge"])
    models = (MgeNeXt(), TorchNeXt())
    save_map(*(models if built == "megengine->torch" else models[::-1]), paths["map.json"],
             probe=X)
    convert_checkpoint(paths["ref.mge"], paths["port.pth"], paths["map.json"],
                       reverse=built == "torch->megengine")
    port = TorchNeXt()
    port.load_state_dict(torch.load(paths["port.pth"]))  # strict
    for name, value in _values(reference).items():
        np.testing.assert_array_equal(_values(port)[name].reshape(-1), value.reshape(-1))
    assert tuple(port.grouped.weight.shape) == (4, 2, 3, 3)
    _close(_output(reference), _output(port))
    with torch.no_grad():
        port.grouped.weight.mul_(2.0)
    torch.save(port.state_dict(), paths["port.pth"])
    convert_checkpoint(paths["port.pth"], paths["back.mge"], paths["map.json"],
                       reverse=built == "megengine->torch")
    back = MgeNeXt()
    back.load_state_dict(mge.load(paths["back.mge"]))
    assert back.grouped.weight.shape == (2, 2, 2, 3, 3)
    for name, value in _values(port).items():
        np.testing.assert_array_equal(_values(back)[name].reshape(-1), value.reshape(-1))
    _close(_output(port), _output(back))
