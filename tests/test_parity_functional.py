"""Issue 36 item 1: the parity tool watches torch's functional calls that branch (``F.relu``,
``F.max_pool2d``, ...) through a ``TorchFunctionMode``: a functional call pairs with a module
(or a functional call) on the other side, its flips are pinned and the gradients behind it
verified. Each test failed on the code that watched modules only."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from parity_ports_torch import MaskLessReLU  # noqa: E402
from torch import nn  # noqa: E402

from gradmgr.parity import ParityError, compare_step, dump, load, transfer_weights  # noqa: E402,E501

WIDTH = 16
X = np.random.RandomState(0).randn(8, 6).astype(np.float32)


class Modules(nn.Module):
    """The reference: its ReLU and max-pool are modules."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act = nn.Linear(6, WIDTH), nn.ReLU()
        self.pool, self.fc2 = nn.MaxPool2d(2), nn.Linear(WIDTH // 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x)).reshape(-1, 1, 4, WIDTH // 4)
        return self.fc2(self.pool(h).flatten(1))


class Functions(nn.Module):
    """The port: the same, with ``relu`` and ``F.max_pool2d`` called as functions;
    ``shift`` is subtracted from fc1's output (a constant the tool does not see)."""

    def __init__(self, relu=F.relu, shift=None) -> None:  # noqa: ANN001
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, WIDTH), nn.Linear(WIDTH // 4, 3)
        self.relu, self.shift = relu, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x) if self.shift is None else self.fc1(x) - self.shift
        h = self.relu(h).reshape(-1, 1, 4, WIDTH // 4)
        return self.fc2(F.max_pool2d(h, 2).flatten(1))


def _pair(b: nn.Module, zero_rows: int = 0):
    torch.manual_seed(0)
    a = Modules()
    with torch.no_grad():  # rows of fc1 whose outputs are exactly 0: at the ReLU's kink
        a.fc1.weight[:zero_rows] = 0
        a.fc1.bias[:zero_rows] = 0
    transfer_weights(a, b, probe=X)
    return a, b


def test_functional_calls_pair_with_modules_and_a_correct_port_is_ok():
    a, b = _pair(Functions())
    report = compare_step(a, b, X)
    assert report.ok, report.text()
    forward = {e.name: e for e in report.entries if e.what == "forward"}
    assert set(forward) == {"fc1 / fc1", "act / relu()", "pool / max_pool2d()", "fc2 / fc2"}
    assert all(e.max_abs == 0.0 for e in forward.values())
    assert report.unmatched == [] and report.flips == []


def test_a_backward_only_bug_in_a_functional_relu_differs_at_that_relu():
    """Many elements at the kink (more than the tool sizes one flip at a time) used to leave
    every gradient behind the one-sided ReLU 'unverified'; now the functional call is paired,
    nothing flipped, and the gradients DIFFER, the relu named."""
    a, b = _pair(Functions(relu=MaskLessReLU.apply), zero_rows=8)  # 8 rows x 8 = 64 at 0
    report = compare_step(a, b, X)
    assert report.first_forward is None and report.flips == [], report.text()
    assert report.unverified == [], report.text()
    assert report.first_grad is not None and report.first_grad.layer == "fc1"
    # measured: fc1.weight off by 0.05 abs (about 0.6 relative); the tolerance is ~1e-6
    assert report.first_grad.max_rel > 0.1
    assert {e.name for e in report.failures()} == {"fc1.weight / fc1.weight",
                                                   "fc1.bias / fc1.bias"}
    assert report.suspects[0] == "act / clamp() (relu)", report.suspects
    assert "in the backward of act / clamp() (relu)" in report.text()


class Flat(Modules):
    """The reference without its pool (a flip then reaches fc1's gradients: a pooled one
    would sit in a max-pool's near tie too)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc2 = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class FlatFunctions(Functions):
    def __init__(self, shift: torch.Tensor) -> None:
        super().__init__(shift=shift)
        self.fc2 = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x) - self.shift))


# What the MegEngine and Paddle ports of these models (tests/test_parity_mge_functional.py,
# tests/test_parity_paddle_functional.py) assert alike, each with its own port.


def check_paired_call_by_call(a, b, forward):  # noqa: ANN001, ANN201
    """``a`` and ``b`` compared both ways agree, every call paired, the forward entries named
    ``forward`` (or its pairs reversed); the reports, for more checks."""
    transfer_weights(a, b, probe=X)
    reports = compare_step(a, b, X), compare_step(b, a, X)
    for report in reports:
        names = [e.name for e in report.entries if e.what == "forward"]
        assert report.ok and report.unmatched == [], report.text()
        assert names in (forward, [" / ".join(n.split(" / ")[::-1]) for n in forward]), names
    return reports


def check_flip_pinned(port, place):  # noqa: ANN001, ANN201
    """fc1's unit 3 gives +1e-8 on side a (torch, ``Flat``'s ``nn.ReLU``), -1e-8 on side b
    (``port(shift)``, its ReLU a function called at ``place``): a flip, within rounding of the
    kink, pinned at b's call and every gradient verified; unpinned, fc1's gradients move."""
    shift = np.zeros(WIDTH, np.float32)
    shift[3] = 2e-8
    torch.manual_seed(0)
    a, b = Flat(), port(shift)
    with torch.no_grad():
        a.fc1.weight[3] = 0
        a.fc1.bias[3] = 1e-8
    transfer_weights(a, b, probe=X)
    report = compare_step(a, b, X)
    assert [(f.layer_a, f.layer_b, f.count, f.pinned, f.seen) for f in report.flips] == [
        ("act", place, len(X), True, True)], report.text()
    assert report.ok and report.unverified == [], report.text()
    unpinned = compare_step(a, b, X, pin=False)  # the flip moves fc1's gradients: measured
    assert not unpinned.ok and unpinned.failures() == [], unpinned.text()
    assert {e.name for e in unpinned.unverified} == {"fc1.weight / fc1.weight",
                                                      "fc1.bias / fc1.bias"}


def check_torch_backward_only_bug_named(reference):  # noqa: ANN001, ANN201
    """``reference`` (another framework's port, ``F.relu`` a function) against the torch port
    whose ReLU forgets its mask in backward, 64 of fc1's outputs exactly at the kink: the
    calls pair, nothing flips, and fc1's gradients DIFFER. The report, for more checks."""
    torch.manual_seed(0)
    a, b = Modules(), Functions(relu=MaskLessReLU.apply)
    with torch.no_grad():
        a.fc1.weight[:8] = 0
        a.fc1.bias[:8] = 0
    transfer_weights(a, reference, probe=X)
    transfer_weights(reference, b, probe=X)
    report = compare_step(reference, b, X)
    assert report.first_forward is None and report.flips == [], report.text()
    assert report.unverified == [], report.text()
    assert report.first_grad is not None and report.first_grad.layer == "fc1", report.text()
    # measured: fc1.weight off by 0.05 abs (about 0.6 relative); the tolerance is ~1e-6
    assert report.first_grad.max_rel > 0.1
    assert {e.name for e in report.failures()} == {"fc1.weight / fc1.weight",
                                                   "fc1.bias / fc1.bias"}
    assert "possible kink flip" not in report.text() and "unverified" not in report.text()
    return report


def port_after_its_error(port_class):  # noqa: ANN001, ANN201
    """A ``port_class`` whose forward raises after its ReLU call, once its weights transfer
    failed with that error: the model, to check that every replaced name is put back."""

    class Failing(port_class):
        def forward(self, x):  # noqa: ANN001, ANN201
            self.relu(self.fc1(x))
            raise RuntimeError("a port's bug")

    b = Failing()
    with pytest.raises(ParityError, match="a port's bug"):
        transfer_weights(Modules(), b, probe=X)
    return b


def straight_through_relu(h: torch.Tensor) -> torch.Tensor:
    """A port's ReLU written straight-through: the forward a ReLU's, the backward the
    identity (no mask): a backward-only bug in a functional call."""
    return h + (h.clamp(min=0) - h).detach()


def test_a_backward_only_bug_at_a_functional_call_differs_at_that_call():
    """The gradient the call sends to its input is compared: the straight-through ReLU's
    clamp gets none (zero) where the reference's ReLU passes the masked one."""
    a, b = _pair(Functions(relu=straight_through_relu))
    report = compare_step(a, b, X)
    assert report.first_forward is None and report.flips == [], report.text()
    assert report.first_grad.name == "act / clamp(): input", report.text()
    # measured: max abs 0.034 (relative 1: nothing reaches b's clamp); tolerance ~2e-7
    assert report.first_grad.max_rel == 1.0 and report.first_grad.tol < 1e-5
    assert {e.name for e in report.failures()} == {
        "act / clamp(): input", "fc1.weight / fc1.weight", "fc1.bias / fc1.bias"}
    assert report.suspects == ["act / clamp() (relu)"]
    assert "in the backward of act / clamp() (relu): the gradient at its input differs" \
        in report.text()
    # the correct port: the gradients at both calls' inputs agree exactly
    a, b = _pair(Functions())
    report = compare_step(a, b, X)
    inputs = {e.name: e.max_abs for e in report.entries if e.name.endswith(": input")}
    assert inputs == {"act / relu(): input": 0.0, "pool / max_pool2d(): input": 0.0}


def test_a_flip_at_a_functional_relu_is_pinned_and_the_port_verified():
    """fc1's unit 3 gives +1e-8 on side a, -1e-8 on side b: a flip, within rounding of the
    kink. With the port's ReLU a function, the flip used to leave fc1's gradients
    'unverified'; now it is pinned to side a's branch and every gradient compared."""
    shift = torch.zeros(WIDTH)
    shift[3] = 2e-8
    torch.manual_seed(0)
    a, b = Flat(), FlatFunctions(shift)
    transfer_weights(a, b, probe=X)
    with torch.no_grad():
        for m in (a, b):
            m.fc1.weight[3] = 0
            m.fc1.bias[3] = 1e-8
    report = compare_step(a, b, X)
    assert [(f.layer_a, f.layer_b, f.count, f.pinned, f.seen) for f in report.flips] == [
        ("act", "relu()", len(X), True, True)], report.text()
    assert report.ok and report.unverified == [], report.text()
    unpinned = compare_step(a, b, X, pin=False)  # the flip moves fc1's gradients: measured
    assert not unpinned.ok and {e.name for e in unpinned.unverified} == {
        "fc1.weight / fc1.weight", "fc1.bias / fc1.bias", "act / relu(): input"}


def test_a_functional_pairing_the_tool_would_guess_is_left_unpaired():
    """Side a calls its ReLU module twice where side b calls ``F.relu`` once: which call is
    the counterpart is a guess, so none is paired."""

    class Twice(Modules):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.act(self.act(self.fc1(x))).reshape(-1, 1, 4, WIDTH // 4)
            return self.fc2(self.pool(h).flatten(1))

    torch.manual_seed(0)
    a, b = Twice(), Functions()
    transfer_weights(a, b, probe=X)
    report = compare_step(a, b, X)
    assert "b relu() (relu), call 1" in report.unmatched, report.unmatched
    assert not any("relu()" in e.name for e in report.entries), report.text()


def test_the_function_mode_is_left_on_no_error():
    class Failing(Functions):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            F.relu(self.fc1(x))
            raise RuntimeError("a port's bug")

    b = Failing()
    with pytest.raises(ParityError, match="a port's bug"):
        transfer_weights(Modules(), b, probe=X)
    assert torch._C._len_torch_function_stack() == 0
    assert not b._forward_hooks and not b._forward_pre_hooks
    assert all(not m._forward_hooks for m in b.modules())


@pytest.mark.megengine
def test_megengine_modules_pair_with_torch_functions():
    """MegEngine's F.* has no function mode: the torch side's functional calls pair with a
    MegEngine model's modules."""
    mge = pytest.importorskip("megengine")
    import megengine.module as M

    class Port(M.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act = M.Linear(6, WIDTH), M.ReLU()
            self.pool, self.fc2 = M.MaxPool2d(2), M.Linear(WIDTH // 4, 3)

        def forward(self, x):  # noqa: ANN001, ANN201
            h = self.act(self.fc1(x)).reshape(-1, 1, 4, WIDTH // 4)
            return self.fc2(self.pool(h).reshape(h.shape[0], -1))

    assert mge is not None
    for relu, ok in ((F.relu, True), (MaskLessReLU.apply, False)):
        torch.manual_seed(0)
        mge.random.seed(0)  # the bug shows only where a pooled window is all negative
        a, b = Port(), Functions(relu=relu)
        transfer_weights(a, b, probe=X)
        report = compare_step(a, b, X)
        assert report.ok is ok, report.text()
        names = {e.name for e in report.entries if e.what == "forward"}
        assert {"act / " + ("relu()" if ok else "clamp()"), "pool / max_pool2d()"} <= names
        if not ok:
            assert report.first_grad.layer == "fc1" and report.unverified == []


def test_a_dump_keeps_its_functional_calls(tmp_path):
    """A dumped side's functional calls are no layers of its model: the file keeps their kind
    and configuration, and the comparison pairs them as a live run does."""
    a, b = _pair(Functions())
    recorded = dump(b, X, str(tmp_path / "port.npz"))
    report = compare_step(a, load(str(tmp_path / "port.npz")), X)
    assert report.ok, report.text()
    assert [e.name for e in report.entries if e.what == "forward"] == [
        "fc1 / fc1", "act / relu()", "pool / max_pool2d()", "fc2 / fc2"]
    assert recorded.recorded_order() == ["fc1", "relu()", "max_pool2d()", "fc2"]
