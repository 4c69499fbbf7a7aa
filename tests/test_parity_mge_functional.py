"""Issue 36 item 1 on MegEngine: the parity tool watches ``megengine.functional``'s calls that
branch (``F.relu``, ``F.max_pool2d``, ``F.maximum(x, 0)``...) for the duration of the watched
step (gradmgr/backends/megengine/parity_functions.py). A MegEngine port written with functions
is compared against a torch model of modules call by call, its flips are pinned, and a
backward-only bug on the torch side is named. Each test failed on the code that watched
MegEngine's modules only (the calls were 'no counterpart', their flips unverified)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
mge = pytest.importorskip("megengine")

import megengine.functional as F  # noqa: E402
import megengine.module as M  # noqa: E402
from megengine.functional import relu as bound_relu  # noqa: E402  (bound at import time)
from test_parity_functional import (  # noqa: E402
    WIDTH,
    Modules,
    X,
    check_flip_pinned,
    check_paired_call_by_call,
    check_torch_backward_only_bug_named,
    port_after_its_error,
)

from gradmgr.parity import compare_step, transfer_weights  # noqa: E402

FORWARD = ["fc1 / fc1", "act / relu()", "pool / max_pool2d()", "fc2 / fc2"]


class MgeFunctions(M.Module):
    """A MegEngine port of ``Modules`` written with functions: ``relu`` as an attribute
    (``self.relu = F.relu``, as MegEngine/Models writes it), ``F.max_pool2d`` in the forward;
    ``shift`` is subtracted from fc1's output."""

    def __init__(self, relu=F.relu, shift=None, pool: bool = True) -> None:  # noqa: ANN001
        super().__init__()
        self.fc1 = M.Linear(6, WIDTH)
        self.fc2 = M.Linear(WIDTH // 4 if pool else WIDTH, 3)
        self.relu, self.shift, self.pool = relu, shift, pool

    def forward(self, x):  # noqa: ANN001, ANN201
        h = self.fc1(x)
        if self.shift is not None:
            h = h - mge.tensor(self.shift)
        h = self.relu(h)
        if not self.pool:
            return self.fc2(h)
        h = F.max_pool2d(h.reshape(-1, 1, 4, WIDTH // 4), 2)
        return self.fc2(h.reshape(h.shape[0], -1))


class ImportBound(MgeFunctions):
    """``from megengine.functional import relu`` at the top of the model's file."""

    def forward(self, x):  # noqa: ANN001, ANN201
        h = bound_relu(self.fc1(x)).reshape(-1, 1, 4, WIDTH // 4)
        h = F.max_pool2d(h, 2)
        return self.fc2(h.reshape(h.shape[0], -1))


@pytest.mark.parametrize("port", [MgeFunctions, ImportBound])
def test_a_megengine_port_of_functions_is_compared_call_by_call(port):
    torch.manual_seed(0)
    b = port()
    check_paired_call_by_call(Modules(), b, FORWARD)
    # the functions are MegEngine's own again once the step is over
    assert F.relu is F.nn.relu and b.relu is F.relu and bound_relu is F.relu


def test_a_flip_at_a_megengine_functional_relu_is_pinned_and_the_port_verified():
    """The flip at ``F.relu`` (test_parity_functional.check_flip_pinned). It used to be a
    possible flip at a ReLU watched on one side only, fc1's gradients 'unverified'; now it is
    pinned at b's call."""
    check_flip_pinned(lambda shift: MgeFunctions(shift=shift, pool=False), "relu()")


def test_a_backward_only_bug_on_the_torch_side_is_named_not_called_a_flip():
    """The reference is MegEngine with ``F.relu``, the torch port's ReLU forgets its mask in
    backward (test_parity_functional.check_torch_backward_only_bug_named). With the MegEngine
    call unwatched they were possible flips at a one-sided ReLU, too many to size: every
    gradient 'unverified'. Now the calls pair, nothing flips, and fc1's gradients DIFFER."""
    report = check_torch_backward_only_bug_named(MgeFunctions())
    assert report.suspects[0] == "relu() / clamp() (relu)", report.suspects
    assert "every forward agrees but a gradient differs" in report.text()


def test_maximum_with_zero_is_a_relu_and_other_calls_are_compared():
    """``F.maximum(x, 0)`` is watched as a ReLU (torch's ``x.clamp(min=0)`` is); ``F.abs``,
    a comparison and ``F.where`` are compared forward, by torch's kinds."""

    class Calls(MgeFunctions):
        def forward(self, x):  # noqa: ANN001, ANN201
            h = F.maximum(self.fc1(x), 0)
            return self.fc2(F.where(h > 0, h, F.abs(h)).reshape(-1, WIDTH // 4 * 4)[:, :4])

    torch.manual_seed(0)
    a, b = Modules(), Calls()
    transfer_weights(a, b, probe=X)
    report = compare_step(a, b, X)
    kinds = {e.name: e.kind for e in report.entries if e.what == "forward"}
    assert kinds["act / maximum()"] == "relu", report.text()
    places = [c for c in report.unmatched if c.startswith("b ")]
    assert places == ["b abs() (abs), call 2", "b where() (where), call 3"], report.unmatched


def test_every_function_is_put_back_after_an_error():
    b = port_after_its_error(MgeFunctions)
    assert F.relu is F.nn.relu and F.max_pool2d is F.nn.max_pool2d
    assert getattr(F.relu, "__wrapped__", None) is None and b.relu is F.relu
    assert bound_relu is F.relu and F.maximum is F.elemwise.maximum
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in b.modules())


def test_calls_megengine_makes_itself_are_not_the_models():
    """``F.normalize`` calls ``F.clip`` and ``F.abs``-like helpers of its own: they are no
    calls of the model (torch's ``F.normalize`` shows none either)."""

    class Normalized(MgeFunctions):
        def forward(self, x):  # noqa: ANN001, ANN201
            h = F.normalize(self.fc1(x), axis=1)
            return self.fc2(F.relu(h).reshape(-1, 4, 4).max(axis=1))

    torch.manual_seed(0)
    b = Normalized()
    report = compare_step(b, b, X)
    assert [e.name for e in report.entries if e.what == "forward"] == [
        "fc1 / fc1", "relu() / relu()", "fc2 / fc2"], report.text()


def test_each_watched_function_is_watched_under_torchs_kind():
    """The kinds docs/porting.md lists: ``F.clip(x, 0)`` is a ReLU, another clip a clamp,
    the comparisons by torch's short names."""

    class Calls(MgeFunctions):
        def forward(self, x):  # noqa: ANN001, ANN201
            h = self.fc1(x)
            low = F.minimum(F.clip(h, 0), F.leaky_relu(h))
            w = F.where(F.greater(h, 0), low, F.abs(h))
            top = F.max(w, axis=1, keepdims=True) + F.clip(w, -1, 1)
            return self.fc2(top[:, :4])

    report = compare_step(Calls(), Calls(), X)
    assert [(e.name.partition(" / ")[0], e.kind) for e in report.entries
            if e.what == "forward"] == [
        ("fc1", "linear"), ("clip()", "relu"), ("leaky_relu()", "leakyrelu"),
        ("minimum()", "minimum"), ("greater()", "gt"), ("abs()", "abs"), ("where()", "where"),
        ("max()", "max"), ("clip()", "clamp"), ("fc2", "linear")], report.text()


def test_a_leaky_relu_called_on_both_sides_pairs():
    """MegEngine's ``F.leaky_relu`` and torch's are watched alike (a call watched on one side
    only would leave the gradients behind its near-kink inputs unverified)."""
    import torch.nn.functional as TF

    class Torch(Modules):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = TF.leaky_relu(self.fc1(x), 0.1).reshape(-1, 1, 4, WIDTH // 4)
            return self.fc2(self.pool(h).flatten(1))

    class Mge(MgeFunctions):
        def forward(self, x):  # noqa: ANN001, ANN201
            h = F.max_pool2d(F.leaky_relu(self.fc1(x), 0.1).reshape(-1, 1, 4, WIDTH // 4), 2)
            return self.fc2(h.reshape(h.shape[0], -1))

    torch.manual_seed(0)
    a, b = Torch(), Mge()
    transfer_weights(a, b, probe=X)
    report = compare_step(a, b, X)
    assert report.ok and report.unmatched == [], report.text()
    assert "leaky_relu() / leaky_relu()" in {e.name for e in report.entries}, report.text()
