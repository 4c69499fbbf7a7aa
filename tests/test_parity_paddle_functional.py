"""The parity tool watches Paddle's functional calls that branch (``F.relu``, ``F.max_pool2d``,
``paddle.clip(x, 0)``...) for the duration of the watched step
(gradmgr/backends/paddle/parity_functions.py), as it does MegEngine's
(tests/test_parity_mge_functional.py, mirrored here): a Paddle port written with functions is
compared against a torch model of modules call by call, its flips are pinned, and a
backward-only bug on the torch side is named. Each test failed on the code that watched
Paddle's layers only (the calls were 'no counterpart', their flips unverified).

Runs in .venv-paddle with GRADMGR_FRAMEWORKS=paddle,torch,megengine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
paddle = pytest.importorskip("paddle")

import paddle.nn.functional as F  # noqa: E402
from paddle.nn.functional import relu as bound_relu  # noqa: E402  (bound at import time)
from test_parity_functional import (  # noqa: E402
    WIDTH,
    Modules,
    X,
    check_flip_pinned,
    check_paired_call_by_call,
    check_torch_backward_only_bug_named,
    port_after_its_error,
)

from gradmgr.parity import compare_step  # noqa: E402

FORWARD = ["fc1 / fc1", "act / relu()", "pool / max_pool2d()", "fc2 / fc2"]
RELU = paddle.nn.functional.activation.relu  # Paddle's own, under its defining module


class PdFunctions(paddle.nn.Layer):
    """A Paddle port of ``Modules`` written with functions: ``relu`` as an attribute
    (``self.relu = F.relu``), ``F.max_pool2d`` in the forward; ``shift`` is subtracted from
    fc1's output."""

    def __init__(self, relu=F.relu, shift=None, pool: bool = True) -> None:  # noqa: ANN001
        super().__init__()
        self.fc1 = paddle.nn.Linear(6, WIDTH)
        self.fc2 = paddle.nn.Linear(WIDTH // 4 if pool else WIDTH, 3)
        self.relu, self.shift, self.pool = relu, shift, pool

    def forward(self, x):  # noqa: ANN001, ANN201
        h = self.fc1(x)
        if self.shift is not None:
            h = h - paddle.to_tensor(self.shift)
        h = self.relu(h)
        if not self.pool:
            return self.fc2(h)
        h = F.max_pool2d(h.reshape([-1, 1, 4, WIDTH // 4]), 2)
        return self.fc2(h.reshape([h.shape[0], -1]))


class ImportBound(PdFunctions):
    """``from paddle.nn.functional import relu`` at the top of the model's file."""

    def forward(self, x):  # noqa: ANN001, ANN201
        h = bound_relu(self.fc1(x)).reshape([-1, 1, 4, WIDTH // 4])
        h = F.max_pool2d(h, 2)
        return self.fc2(h.reshape([h.shape[0], -1]))


class Clipped(PdFunctions):
    """``paddle.clip(x, min=0)``: a ReLU (torch's ``x.clamp(min=0)`` is one)."""

    def forward(self, x):  # noqa: ANN001, ANN201
        h = paddle.clip(self.fc1(x), min=0).reshape([-1, 1, 4, WIDTH // 4])
        h = F.max_pool2d(h, kernel_size=2)
        return self.fc2(h.reshape([h.shape[0], -1]))


@pytest.mark.parametrize("port", [PdFunctions, ImportBound, Clipped])
def test_a_paddle_port_of_functions_is_compared_call_by_call(port):
    torch.manual_seed(0)
    b = port()
    forward = [n.replace("relu()", "clip()") for n in FORWARD] if port is Clipped else FORWARD
    for report in check_paired_call_by_call(Modules(), b, forward):
        kinds = {e.name: e.kind for e in report.entries if e.what == "forward"}
        assert {"relu", "maxpool2d"} <= set(kinds.values()), kinds
    # the functions are Paddle's own again once the step is over
    assert F.relu is RELU and b.relu is F.relu and bound_relu is F.relu
    assert F.max_pool2d is paddle.nn.functional.pooling.max_pool2d


def clip_at_zero(h):  # noqa: ANN001, ANN201
    return paddle.clip(h, min=0)


@pytest.mark.parametrize("relu, place", [(F.relu, "relu()"), (clip_at_zero, "clip()")])
def test_a_flip_at_a_paddle_functional_relu_is_pinned_and_the_port_verified(relu, place):
    """The flip (test_parity_functional.check_flip_pinned) at Paddle's ``F.relu`` or
    ``paddle.clip(h, min=0)``, pinned at b's call."""
    check_flip_pinned(lambda shift: PdFunctions(relu=relu, shift=shift, pool=False), place)


def test_a_backward_only_bug_on_the_torch_side_is_named_not_called_a_flip():
    """The reference is Paddle with ``F.relu``, the torch port's ReLU forgets its mask in
    backward (test_parity_functional.check_torch_backward_only_bug_named)."""
    check_torch_backward_only_bug_named(PdFunctions())


def test_each_watched_function_is_watched_under_torchs_kind():
    """``paddle.clip(x, 0)`` is a ReLU, another clip a clamp, the comparisons by torch's
    short names; Paddle's own calls inside a function (``F.normalize``) and inside a layer
    (``nn.ReLU`` calls ``F.relu``) are not the model's."""

    class Calls(PdFunctions):
        def __init__(self) -> None:
            super().__init__()
            self.act = paddle.nn.ReLU()

        def forward(self, x):  # noqa: ANN001, ANN201
            h = self.act(F.normalize(self.fc1(x), axis=1))
            low = paddle.minimum(paddle.clip(h, 0), F.leaky_relu(h))
            w = paddle.where(paddle.greater_than(h, paddle.zeros_like(h)), low, paddle.abs(h))
            top = paddle.max(w, axis=1, keepdim=True) + paddle.clip(w, -1, 1)
            return self.fc2(top[:, :4])

    report = compare_step(Calls(), Calls(), X)
    assert [(e.name.partition(" / ")[0], e.kind) for e in report.entries
            if e.what == "forward"] == [
        ("fc1", "linear"), ("act", "relu"), ("clip()", "relu"), ("leaky_relu()", "leakyrelu"),
        ("minimum()", "minimum"), ("greater_than()", "gt"), ("abs()", "abs"),
        ("where()", "where"), ("max()", "max"), ("clip()", "clamp"), ("fc2", "linear")], \
        report.text()


def test_every_function_is_put_back_after_an_error():
    b = port_after_its_error(PdFunctions)
    assert F.relu is RELU and F.max_pool2d is paddle.nn.functional.pooling.max_pool2d
    assert getattr(F.relu, "__wrapped__", None) is None and b.relu is F.relu
    assert bound_relu is F.relu and paddle.maximum is paddle.tensor.maximum
    assert all(not m._forward_pre_hooks and not m._forward_post_hooks
               for m in b.sublayers(include_self=True))


def test_the_other_watched_functions_are_compared_forward_under_torchs_kinds():
    """The rest of the list docs/porting.md gives for Paddle."""

    class Calls(PdFunctions):
        def forward(self, x):  # noqa: ANN001, ANN201
            h = self.fc1(x)
            z = paddle.zeros_like(h)
            m = paddle.maximum(h, z) + paddle.min(h, axis=1, keepdim=True)
            m = m + paddle.amax(h, axis=1, keepdim=True) + paddle.amin(h, axis=1, keepdim=True)
            flags = [f(h, z) for f in (paddle.less_than, paddle.greater_equal,
                                       paddle.less_equal, paddle.equal, paddle.not_equal)]
            m = m + sum(f.astype("float32") for f in flags)
            return self.fc2(F.hardtanh(m)[:, :4])

    b = Calls()
    report = compare_step(b, b, X)
    assert report.ok, report.text()
    assert [(e.name.partition(" / ")[0], e.kind) for e in report.entries
            if e.what == "forward"][1:-1] == [
        ("maximum()", "maximum"), ("min()", "min"), ("amax()", "amax"), ("amin()", "amin"),
        ("less_than()", "lt"), ("greater_equal()", "ge"), ("less_equal()", "le"),
        ("equal()", "eq"), ("not_equal()", "ne"), ("hardtanh()", "hardtanh")], report.text()
