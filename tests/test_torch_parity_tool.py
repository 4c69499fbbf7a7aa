"""gradmgr.parity between two PyTorch models (runs in every environment): the weight map's
explicit paths (name_map, declared transforms, transposes refused), flips with an in-place
ReLU pinned, and the tool's gradients against plain ``loss.backward()``."""

from __future__ import annotations

import copy
import os
import re

import numpy as np
import pytest
import torch
from torch import nn

from gradmgr.parity import (
    MappingError,
    ModelTypeError,
    ParityError,
    assert_parity,
    compare_step,
    transfer_weights,
)

X = np.random.RandomState(0).randn(6, 4).astype(np.float32)


class InOutLinear(nn.Module):
    """A port that stores its weight as (in, out) and multiplies x @ W."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def test_a_misspelt_transform_is_refused_naming_the_one_there_is():
    """A transform is "transpose" or a function; another string was called as one
    (TypeError: 'str' object is not callable)."""
    a, b = nn.Linear(4, 3), InOutLinear(4, 3)
    before = b.weight.detach().clone()
    with pytest.raises(ValueError, match=r"unknown transform 'transposed': give 'transpose' "
                                         r"or a function of the array"):
        transfer_weights(a, b, {"weight": "weight", "bias": "bias"},
                         transforms={"weight": "transposed"})
    assert torch.equal(b.weight.detach(), before)  # nothing written


def test_a_transposed_layout_is_refused_until_declared_then_compared_through_it():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), InOutLinear(4, 3)
    names = {"weight": "weight", "bias": "bias"}
    with pytest.raises(MappingError, match=r"looks transposed: \(3, 4\) against weight \(4, 3\)"
                                           r".*transforms=\{'weight': 'transpose'\}"):
        transfer_weights(a, b, names)
    report = transfer_weights(a, b, names, transforms={"weight": "transpose"})
    assert [(p.src, p.how) for p in report.pairs] == [("weight", "transform"), ("bias", "copy")]
    np.testing.assert_array_equal(b.weight.detach().numpy(), a.weight.detach().numpy().T)
    step = compare_step(a, b, X, name_map=names, transforms={"weight": "transpose"})
    assert step.ok, step.text()
    np.testing.assert_allclose(b.weight.grad.numpy(), a.weight.grad.numpy().T, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_a_cuda_model_against_its_cpu_copy():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True),
                      nn.Linear(16, 2))
    b = copy.deepcopy(a).cuda()
    report = assert_parity(a, b, X)
    assert report.entries and all(e.ok for e in report.entries)
    assert b[0].weight.grad.is_cuda


def test_a_name_map_names_what_it_misses():
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    with pytest.raises(MappingError) as info:
        transfer_weights(a, b, {"weight": "weight", "nope": "bias"})
    message = str(info.value)
    assert "unmapped (src) nope: name_map names a tensor the model does not have" in message
    assert "unmapped (src) bias: not in name_map" in message
    assert "unmapped (dst) bias: not in name_map" in message


def test_the_tools_gradients_are_plain_backwards_gradients():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    b = copy.deepcopy(a)
    reference = copy.deepcopy(a)
    report = compare_step(a, b, X)
    # 3 forwards, the loss, 4 parameters' gradients, the gradient at the ReLU's input
    assert report.ok and len(report.entries) == 3 + 1 + 4 + 1
    reference(torch.as_tensor(X)).mean().backward()
    for p, q in zip(a.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    grads = [e for e in report.entries if e.what == "grad"]
    assert all(e.max_abs == 0.0 for e in grads)  # one framework, same ops: bit-identical


def test_a_flip_at_an_inplace_relu_is_pinned_without_the_inplace_op_spoiling_the_input():
    """b's ReLU blocks an element a's passes: the pin must multiply b's ReLU INPUT by a's mask,
    which an in-place ReLU would have overwritten with 0 (and a gradient of 0) by then."""
    torch.manual_seed(0)
    b = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    with torch.no_grad():  # unit 0 of sample 0 exactly at the kink on b: 4 * 0.25 - 1 == 0
        b[0].weight[0] = 0.25
        b[0].bias[0] = -1.0
    a = copy.deepcopy(b)
    with torch.no_grad():  # one ulp above it on a
        a[0].bias[0] = float(np.nextafter(np.float32(-1.0), np.float32(0.0)))
    x = X.copy()
    x[0] = 1.0
    unpinned = compare_step(a, b, x, pin=False)
    assert {e.name for e in unpinned.unverified} == {"0.weight / 0.weight", "0.bias / 0.bias",
                                                     "1 / 1: input"}
    report = compare_step(a, b, x)
    assert [(f.layer_a, f.count, f.pinned) for f in report.flips] == [("1", 1, True)]
    assert report.ok, report.text()
    # the pinned b took a's branch: its gradients are a's, to rounding
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)


def test_a_max_pool_near_tie_is_a_flip_pinned_by_lifting_a_s_pick():
    """One 2x2 window holds two candidates one ulp apart, in opposite order on a and b: the
    pool routes the gradient to a different element on each side unless pinned."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Conv2d(2, 1, 1, bias=False), nn.MaxPool2d(2), nn.Flatten(),
                      nn.Linear(4, 1))
    b = copy.deepcopy(a)
    one_up = float(np.nextafter(np.float32(1.0), np.float32(2.0)))
    with torch.no_grad():
        a[0].weight.copy_(torch.tensor([1.0, one_up]).view(1, 2, 1, 1))
        b[0].weight.copy_(torch.tensor([one_up, 1.0]).view(1, 2, 1, 1))
    x = np.zeros((1, 2, 4, 4), np.float32)
    x[0, 0, 0, 0] = 1.0  # element p of the first window: channel 0 only
    x[0, 1, 0, 1] = 1.0  # element q: channel 1 only; a picks q, b picks p
    x[0, :, 2:, :] = np.random.RandomState(0).rand(2, 2, 4)
    unpinned = compare_step(a, b, x, pin=False)
    assert {e.name for e in unpinned.unverified} == {"0.weight / 0.weight", "1 / 1: input"}
    report = compare_step(a, b, x)
    assert [(f.layer_a, f.kind, f.count, f.pinned) for f in report.flips] == [
        ("1", "maxpool2d", 1, True)]
    assert report.ok, report.text()


class FunctionalRelu(nn.Module):
    """The port writes its ReLU as a function: the tool sees one side's ReLU only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class UnwatchedRelu(FunctionalRelu):
    """The port writes its ReLU as ``h * (h > 0)``: no call the tool watches as a ReLU, so
    the tool sees one side's ReLU only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h * (h > 0))


class ModuleRelu(FunctionalRelu):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_a_flip_at_a_relu_seen_on_one_side_only_leaves_gradients_unverified_never_wrong():
    torch.manual_seed(0)
    a = ModuleRelu()
    with torch.no_grad():  # unit 0 of sample 0 exactly at the kink on a
        a.fc1.weight[0] = 0.25
        a.fc1.bias[0] = -1.0
    b = UnwatchedRelu()
    transfer_weights(a, b, probe=X)
    with torch.no_grad():  # one ulp above it on b
        b.fc1.bias[0] = float(np.nextafter(np.float32(-1.0), np.float32(0.0)))
    x = X.copy()
    x[0] = 1.0
    # torch.relu is watched (a TorchFunctionMode): the flip is seen, pinned and verified
    watched = FunctionalRelu()
    watched.load_state_dict(b.state_dict())
    report = compare_step(a, watched, x)
    assert [(f.layer_a, f.layer_b, f.count, f.pinned) for f in report.flips] == [
        ("act", "relu()", 1, True)], report.text()
    assert report.ok and report.unverified == [], report.text()
    report = compare_step(a, b, x)
    assert report.failures() == [] and not report.ok
    assert {e.name for e in report.unverified} == {"fc1.weight / fc1.weight",
                                                   "fc1.bias / fc1.bias"}
    assert [(f.layer_a, f.layer_b, f.seen) for f in report.flips] == [("act", "?", False)]
    assert "possible kink flips at ReLUs watched on one side only" in report.text()
    assert "within tolerance of the kink at act (a): 1;" in report.text()
    clean = x.copy()
    clean[0] = 2.0  # pre-activation 1.0: far from the kink, every gradient verified
    assert assert_parity(a, b, [x, clean]).ok
    with pytest.raises(AssertionError, match="unverified by kink flips"):
        assert_parity(a, b, [x, x])


class Residual(nn.Module):
    """A residual block with a 1x1 downsample, called before the block's convolutions
    (``early``) or after them, as torchvision does; its ReLU a shared module or a function."""

    def __init__(self, early: bool, relu_module: bool) -> None:
        super().__init__()
        self.early = early
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.down = nn.Sequential(nn.Conv2d(3, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8))
        self.relu = nn.ReLU(inplace=True) if relu_module else torch.relu
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.down(x) if self.early else None
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = identity if self.early else self.down(x)
        out = self.relu(out + identity)
        return self.fc(out.mean((2, 3)))


def test_layers_called_in_another_order_and_functional_relus_still_map_and_align():
    torch.manual_seed(0)
    a, b = Residual(early=False, relu_module=True), Residual(early=True, relu_module=False)
    x = np.random.RandomState(1).randn(4, 3, 8, 8).astype(np.float32)
    mapping = transfer_weights(a, b, probe=x)
    assert ("down.0", "down.0") in mapping.layers and ("conv1", "conv1") in mapping.layers
    report = assert_parity(a, b, x)
    forward = {e.layer for e in report.entries if e.what == "forward"}
    # b's F.relu calls are watched (a TorchFunctionMode) and pair with a's ReLU module
    assert forward == {"conv1", "bn1", "conv2", "bn2", "down.0", "down.1", "fc", "relu"}
    assert report.unmatched == [], report.text()
    assert {e.name for e in report.entries if e.layer == "relu"} == {
        "relu / relu()", "relu / relu(): input"}


class WithPosition(nn.Module):
    """A model that owns a parameter itself besides its children's."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(4))
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.pos)


def test_a_tensor_owned_by_a_module_with_children_is_mapped_and_compared():
    torch.manual_seed(0)
    a, b = WithPosition(), WithPosition()
    report = transfer_weights(a, b, probe=X)
    assert [p.src for p in report.pairs] == ["pos", "fc.weight", "fc.bias"]
    torch.testing.assert_close(a.pos, b.pos, rtol=0, atol=0)
    assert compare_step(a, b, X).ok
    with torch.no_grad():
        b.pos[0] += 0.01
    report = compare_step(a, b, X)
    # the first divergence is fc's output (the model's own output, which returns after it,
    # parts too); pos's gradient does not depend on pos (a linear model), fc's weight's does
    assert not report.ok and report.first_forward.layer == "fc"
    assert {"fc / fc", " / ", "fc.weight / fc.weight"} <= {e.name for e in report.failures()}


def test_a_dropout_in_training_mode_is_named_as_the_cause():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 2))
    b = copy.deepcopy(a)
    report = compare_step(a, b, X)
    assert report.first_forward.layer == "1"
    assert "draws its own dropout mask: use eval() or p=0" in report.first_forward.note
    assert compare_step(a.eval(), b.eval(), X).ok


def test_bad_inputs_are_clear_errors():
    a = nn.Linear(4, 3)
    with pytest.raises(ModelTypeError, match="cannot compare a list"):
        transfer_weights([1.0], a)
    with pytest.raises(ModelTypeError, match="cannot compare a Identity"):
        compare_step(nn.Identity(), a, X)  # no parameter: no framework to tell
    with pytest.raises(ParityError, match="the batch is empty"):
        compare_step(a, nn.Linear(4, 3), ())
    with pytest.raises(ParityError, match=r"returned a tuple, not a tensor: pass loss_a="):
        class Pair(nn.Linear):
            def forward(self, x):
                return super().forward(x), x
        compare_step(Pair(4, 3), Pair(4, 3), X)
    with pytest.raises(AssertionError, match="PARITY BROKEN"):
        assert_parity(a, nn.Linear(4, 3), X)


def test_the_core_imports_no_framework():
    import subprocess
    import sys

    code = ("import sys, gradmgr.parity; "
            "print(sorted(m for m in ('torch', 'megengine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def test_a_tensor_as_the_batch_is_one_item_and_a_nested_tuple_a_clear_error():
    """A torch tensor iterates over its rows: it used to be read as a batch of 6 items, and
    a tuple inside the batch was stacked into one array (the model saw shape (2, 6, 4))."""
    torch.manual_seed(0)
    a = _bn_net()
    a2, b, b2 = copy.deepcopy(a), copy.deepcopy(a), copy.deepcopy(a)  # (a steps: its stats)
    from_numpy, from_tensor = compare_step(a, b, X), compare_step(a2, b2, torch.from_numpy(X))
    assert from_tensor.ok, from_tensor.text()
    assert [(e.name, e.max_abs) for e in from_tensor.entries] == \
        [(e.name, e.max_abs) for e in from_numpy.entries]
    np.testing.assert_array_equal(b2[0].weight.grad.numpy(), b[0].weight.grad.numpy())
    with pytest.raises(ParityError, match=r"batch item 0 \(Tensor\) cannot be read as a numpy "
                                          r"array .*x\.detach\(\)\.cpu\(\)\.numpy\(\)"):
        compare_step(a, b, torch.from_numpy(X).requires_grad_())
    with pytest.raises(ParityError, match=r"batch item 0 is a tuple: the batch is a flat tuple"
                                          r".*inputs="):
        compare_step(a, b, ((X, X), X))


def test_a_failing_loss_leaves_neither_model_a_step_ahead_and_names_the_side():
    """b's loss raising after a's step ran used to leave a's BatchNorm statistics one step
    ahead of b's (every later compare then differs), and the error unexplained."""
    torch.manual_seed(0)
    a = _bn_net()
    b = copy.deepcopy(a)
    before = {k: v.clone() for k, v in a.state_dict().items()}

    def broken(output):
        raise KeyError("logits")
    with pytest.raises(ParityError, match=r"the torch loss failed \(targets' dtypes: none\): "
                                          r"KeyError: 'logits'$"):
        compare_step(a, b, X, loss_a=lambda output: output.mean(), loss_b=broken)
    for name, value in a.state_dict().items():  # exact: put back, not recomputed
        assert torch.equal(value, before[name]), name
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in a.modules())
    ce = nn.functional.cross_entropy
    with pytest.raises(ParityError, match=r"targets. dtypes: torch.int32\): RuntimeError: .*"
                                          r"give class targets as int64"):
        compare_step(a, b, (X, np.arange(6, dtype=np.int32) % 3), loss_a=ce, loss_b=ce)
    assert compare_step(a, b, X).ok


def test_a_float64_reference_against_its_float32_port():
    """The batch reaches each model in that model's float dtype and the tolerance is the
    coarser dtype's: it used to fail on the dtype (float32 batch into the float64 model), and
    with a float64 batch the float32 side failed."""
    torch.manual_seed(0)
    a = _bn_net().double()
    b = copy.deepcopy(a).float()
    report = compare_step(a, b, X)
    assert report.ok, report.text()
    reference = copy.deepcopy(a)  # plain backward in float64: the tool's a side is exact
    reference(torch.from_numpy(X).double()).mean().backward()
    np.testing.assert_allclose(a[0].weight.grad.numpy(), reference[0].weight.grad.numpy(),
                               rtol=1e-12, atol=0)
    with torch.no_grad():
        b[3].bias.add_(1e-4)  # a bug above float32 rounding is still caught, at its layer
    broken = compare_step(a, b, X.astype(np.float64))
    assert not broken.ok and broken.first_forward.layer == "3"


def test_one_model_left_in_eval_mode_is_named_at_its_first_batchnorm():
    """Forgetting .eval() (or .train()) on one side used to show as an unexplained BatchNorm
    difference; the weights still transfer between models in different modes."""
    torch.manual_seed(0)
    a = _bn_net()
    b, fixed = copy.deepcopy(a).eval(), copy.deepcopy(a).eval()
    assert transfer_weights(a, b).ok
    report = compare_step(a, b, X)
    assert not report.ok and report.first_forward.layer == "1"
    assert report.first_forward.note == ("a in training mode, b in eval mode: call .train() "
                                         "or .eval() on both models")
    assert compare_step(fixed, b, X).ok  # (a's running statistics moved one step)


def test_a_typo_in_name_map_is_answered_with_the_closest_name():
    a, b = _bn_net(), _bn_net()
    names = {n: n for n in a.state_dict() if "num_batches" not in n}
    names["0.wieght"] = names.pop("0.weight")
    with pytest.raises(MappingError, match=r"unmapped \(src\) 0\.wieght: name_map names a "
                                           r"tensor the model does not have \(did you mean "
                                           r"'0\.weight'\?\)"):
        transfer_weights(a, b, names)
    names["0.weight"] = "1.runing_var"
    report = transfer_weights(a, b, names, strict=False)
    assert [str(u.reason) for u in report.unmapped if u.name == "1.runing_var"] == \
        ["name_map names a tensor the model does not have (did you mean '1.running_var'?)"]
    assert torch.equal(a[3].weight, b[3].weight)  # what it could map was copied


def test_a_layer_frozen_on_one_side_says_so_and_frozen_on_both_compares():
    torch.manual_seed(0)
    a = _bn_net()
    b = copy.deepcopy(a)
    b[0].weight.requires_grad_(False)
    report = compare_step(a, b, X)
    assert not report.ok and report.first_grad.name == "0.weight / 0.weight"
    assert report.first_grad.note.startswith(
        "gradient only on side a: b's is frozen (requires_grad=False) or not reached by its "
        "loss; freeze it on both sides, or compare it trainable on both")
    a[0].weight.requires_grad_(False)
    report = compare_step(a, b, X)
    assert report.ok, report.text()
    assert a[0].weight.grad is None and not a[0].weight.requires_grad  # left frozen
    reference = copy.deepcopy(a)  # the trained gradients: plain backward, exact
    reference[0].weight.grad = reference[0].bias.grad = None
    reference(torch.from_numpy(X)).mean().backward()
    assert torch.equal(reference[0].bias.grad, b[0].bias.grad)


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 5, batch_first=True)
        self.out = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0])


def test_a_layer_returning_a_tuple_is_compared_by_its_first_tensor():
    """An LSTM returns (output, (h, c)): its forward used to go uncompared, and a broken
    LSTM was reported at the Linear after it."""
    torch.manual_seed(0)
    a = _Recurrent()
    b = copy.deepcopy(a)
    x = np.random.RandomState(0).randn(2, 3, 4).astype(np.float32)
    report = compare_step(a, b, x)
    assert report.ok and [e.layer for e in report.entries if e.what == "forward"] == \
        ["rnn", "out"]
    with torch.no_grad():
        b.rnn.weight_hh_l0.add_(0.01)
    report = compare_step(a, b, x)
    assert report.first_forward.layer == "rnn"
    with torch.no_grad():  # the LSTM's own output difference, exact
        expected = float((a.rnn(torch.from_numpy(x))[0] - b.rnn(torch.from_numpy(x))[0])
                         .abs().max())
    assert report.first_forward.max_abs == pytest.approx(expected, rel=1e-6)


def test_train_drift_refuses_an_optimizer_that_holds_none_of_its_models_parameters():
    """A stale optimizer (built before the model was copied) used to step nothing: loss b
    stayed constant and the drift grew with no word why; swapped optimizers raised an
    AttributeError after one side had stepped."""
    from gradmgr.parity import train_drift

    torch.manual_seed(0)
    a = _bn_net()
    b = copy.deepcopy(a)
    stale = torch.optim.SGD(b.parameters(), lr=0.1)
    b = copy.deepcopy(b)
    with pytest.raises(ParityError, match=r"opt_b \(SGD\) holds none of b's parameters"):
        train_drift(a, b, torch.optim.SGD(a.parameters(), lr=0.1), stale, [X] * 2)
    before = copy.deepcopy(a.state_dict())
    with pytest.raises(ParityError, match=r"opt_a \(SGD\) holds none of a's parameters"):
        train_drift(a, b, torch.optim.SGD(b.parameters(), lr=0.1),
                    torch.optim.SGD(a.parameters(), lr=0.1), [X] * 2)
    assert all(torch.equal(v, before[k]) for k, v in a.state_dict().items())  # nothing ran
    report = train_drift(a, b, torch.optim.SGD(a.parameters(), lr=0.1),
                         torch.optim.SGD(b.parameters(), lr=0.1), [X] * 2)
    assert report.max_abs == [0.0, 0.0]  # same framework, same ops: bit for bit


def test_the_report_shows_long_names_whole_in_aligned_columns():
    """Rows were cut at 40 characters: 'stage3.block0.downsample.weight / stage3.bl'."""
    torch.manual_seed(0)
    a = nn.Sequential()
    a.add_module("stage3", nn.Sequential())
    a.stage3.add_module("block0", nn.Sequential())
    a.stage3.block0.add_module("downsample", nn.Linear(4, 4))
    a.add_module("head", nn.Linear(4, 2))
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.head.bias.add_(1.0)
    lines = compare_step(a, b, X).text().splitlines()
    name = "stage3.block0.downsample.weight / stage3.block0.downsample.weight"
    row = next(line for line in lines if name in line)
    header = next(line for line in lines if line.startswith("tensor"))
    rows = [line for line in lines if line.startswith(("forward", "loss", "grad"))]
    assert row.split()[:3] == ["grad", "stage3.block0.downsample.weight", "/"]
    verdicts = {re.search(r"  (ok|DIFFERS)", line).start() + 2 for line in rows}
    assert verdicts == {header.index("verdict")}  # one column


def test_train_drift_refuses_one_array_for_its_batches():
    """An array is a sequence of rows: train_drift(..., X, steps=2) used to train on X[0],
    then X[1], one row per step, without a word."""
    from gradmgr.parity import train_drift

    a = nn.Linear(4, 2)
    b = copy.deepcopy(a)
    before = a.weight.detach().clone()
    for batch in (X, torch.from_numpy(X)):
        with pytest.raises(ParityError, match=r"a list of batches or a function step -> batch,"
                                              r" not one .*\[batch\] \* steps"):
            train_drift(a, b, torch.optim.SGD(a.parameters(), lr=0.1),
                        torch.optim.SGD(b.parameters(), lr=0.1), batch, steps=2)
    assert torch.equal(a.weight, before)


def _stem_net(pool: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), pool, nn.Conv2d(4, 4, 3),
                         nn.Flatten(), nn.LazyLinear(2))


XIMG = np.random.RandomState(2).randn(2, 3, 8, 8).astype(np.float32)


def test_issue36_report_text_names_both_sides_and_keeps_its_promises():
    """The kind column was cut at 12 characters, forward rows and the first-divergence line
    named a's layer only, text(all_rows=False) listed every call without counterpart, and
    assert_parity's message began with 'batch 0:' instead of the verdict."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from parity_ports_torch import BertLayerNorm  # a kind longer than 12 characters

    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, eps=1e-12), nn.ReLU(), nn.Linear(4, 2))
    b = nn.Sequential(nn.Linear(4, 4), BertLayerNorm(4), nn.ReLU(), nn.Linear(4, 2))
    b.load_state_dict(a.state_dict())
    b.add_module("extra", nn.Identity())  # a call without counterpart
    b.forward = lambda x: b.extra(nn.Sequential.forward(b, x))
    with torch.no_grad():
        b[3].bias.add_(0.1)
    report = compare_step(a, b, X)
    text = report.text()
    assert "layernorm / bertlayernorm" in text and report.first_forward.name == "3 / 3"
    assert "first forward divergence: layer 3 / 3 (linear)" in text
    assert "forward  0 / 0" in text
    assert "no counterpart: b extra (identity)" in text
    short = report.text(all_rows=False)
    assert "no counterpart: b extra" not in short and "no counterpart: 2 call(s)" in short
    with pytest.raises(AssertionError) as info:
        assert_parity(a, b, X)
    assert str(info.value).startswith("PARITY BROKEN: torch (a) against torch (b), one step "
                                      "(batch 0)")


def test_issue36_a_loss_on_one_side_only_is_an_error():
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    with pytest.raises(ParityError, match="loss_a given without loss_b"):
        compare_step(a, b, X, loss_a=lambda out: out.sum())
    with pytest.raises(ParityError, match="loss_b given without loss_a"):
        assert_parity(a, b, X, loss_b=lambda out: out.sum())


def test_issue36_untransferred_weights_say_transfer_the_weights_first():
    torch.manual_seed(0)
    a, b = _bn_net(), _bn_net()
    report = compare_step(a, b, X)
    assert not report.ok and len(report.weights) == 4  # BatchNorm starts equal
    assert "transfer the weights first" in report.text()
    transfer_weights(a, b)
    assert compare_step(a, b, X).weights == []


def test_issue36_did_you_mean_stays_in_the_layer():
    """A bias named for a convolution that has none was answered with the BatchNorm's bias
    ("did you mean '1.bias'?"): another layer's tensor."""
    a = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Linear(4, 4))
    names = {"0.bias": "0.bias", "2.wieght": "2.weight"}
    report = transfer_weights(a, copy.deepcopy(a), names, strict=False)
    reasons = {u.name: u.reason for u in report.unmapped if u.side == "src"}
    assert reasons["0.bias"] == "name_map names a tensor the model does not have"
    assert reasons["2.wieght"] == ("name_map names a tensor the model does not have (did you "
                                   "mean '2.weight'?)")


def test_issue36_a_substituted_pool_is_blamed_at_the_pool():
    torch.manual_seed(0)
    a = _stem_net(nn.MaxPool2d(2))
    a(torch.from_numpy(XIMG))
    b = _stem_net(nn.AvgPool2d(2))
    b(torch.from_numpy(XIMG))
    transfer_weights(a, b, probe=XIMG)
    report = compare_step(a, b, XIMG)
    assert report.first_forward.layer == "2" and "substituted" in report.first_forward.note


def test_issue36_a_maskless_relu_behind_one_sided_relus_is_a_difference():
    """A port whose ReLU is a hand-written function with no mask in its backward, against a
    reference with ReLU modules: its gradients used to be 'unverified behind a kink flip'."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from parity_ports_torch import MaskLessReLU

    torch.manual_seed(0)
    a = ModuleRelu()
    with torch.no_grad():  # unit 0 of sample 0 exactly at the kink: a possible flip
        a.fc1.weight[0] = 0.25
        a.fc1.bias[0] = -1.0
    b = UnwatchedRelu()
    transfer_weights(a, b, probe=X)
    x = X.copy()
    x[0] = 1.0
    good = compare_step(a, b, x)
    assert good.failures() == [] and good.flips[0].seen is False, good.text()
    b.forward = lambda x: b.fc2(_UnwatchedMaskLess.apply(b.fc1(x)))
    report = compare_step(a, b, x)
    assert report.first_forward is None and report.first_grad.layer == "fc1"
    assert report.unverified == [] and "beyond what the possible kink flips" in \
        report.first_grad.note
    # its forward's clamp(min=0) is watched: paired with act, nothing one-sided
    b.forward = lambda x: b.fc2(MaskLessReLU.apply(b.fc1(x)))
    report = compare_step(a, b, x)
    assert report.first_grad.layer == "fc1" and report.flips == [], report.text()
    assert report.suspects == ["act / clamp() (relu)"], report.text()


class _UnwatchedMaskLess(torch.autograd.Function):
    """A hand-written ReLU without its mask in backward, its forward no call the tool
    watches as a ReLU."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x * (x > 0)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad


class _Tied(nn.Module):
    """An embedding whose weight the output layer reuses (GPT's wte / lm_head), or not."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(10, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, t):
        return self.head(torch.tanh(self.mid(self.emb(t))))


def test_tied_weights_against_an_untied_port_break_at_the_gradients_not_the_forward():
    """Issue 38: the tied alias (head.weight) was no slot of the reference, so its value was
    never copied into the port's own head.weight, and the step reported a first forward
    divergence at head that the port (same values) does not have. Now the value is copied,
    every forward agrees, and the verdict, still BROKEN, names the tie and the gradients."""
    torch.manual_seed(0)
    a, b = _Tied(True), _Tied(False)
    t = torch.randint(0, 10, (4, 5))
    with pytest.raises(MappingError, match="tied to"):
        transfer_weights(a, b, probe=t.numpy())
    mapping = transfer_weights(a, b, probe=t.numpy(), strict=False)
    assert torch.equal(b.head.weight, a.emb.weight) and torch.equal(b.emb.weight, a.emb.weight)
    assert not mapping.unmapped
    with torch.no_grad():
        assert torch.equal(a(t), b(t))
    report = compare_step(a, b, t.numpy())
    assert not report.ok and report.first_forward is None
    assert all(e.ok for e in report.entries if e.what in ("forward", "loss"))
    assert "head.weight / head.weight: tied to is 'emb.weight'" in str(report)
    assert report.first_grad is not None and report.first_grad.what == "grad"
    # the tied gradient is the sum of the port's two
    np.testing.assert_allclose(a.emb.weight.grad, b.emb.weight.grad + b.head.weight.grad,
                               rtol=1e-6, atol=1e-7)


def test_tied_weights_on_both_sides_are_parity():
    torch.manual_seed(0)
    a, b = _Tied(True), _Tied(True)
    t = torch.randint(0, 10, (4, 5))
    mapping = transfer_weights(a, b, probe=t.numpy())
    assert mapping.ok and not mapping.findings
    assert compare_step(a, b, t.numpy()).ok


def _sequential_of_one_block(shared: bool, seed: int) -> nn.Module:
    """``nn.Sequential(block, block)`` (``shared``: one block under the names 0 and 1, whose
    Linear is called twice) or two blocks, then a head."""
    torch.manual_seed(seed)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    return nn.Sequential(block, block if shared else copy.deepcopy(block), nn.Linear(4, 2))


def test_a_block_shared_in_a_sequential_is_parity_and_shared_on_one_side_a_tie_finding():
    a, b = _sequential_of_one_block(True, 0), _sequential_of_one_block(True, 1)
    assert transfer_weights(a, b, probe=X).ok  # strict: raised before (unmapped 1.0.*)
    report = compare_step(a, b, X)
    assert report.ok and not report.unmatched, report.text()
    assert sum(e.what == "forward" for e in report.entries) == 5  # 2 Linear, 2 Tanh, head
    # the shared Linear's gradient sums both uses: plain backward on an unshared copy
    unshared = _sequential_of_one_block(False, 2)
    unshared.load_state_dict(a.state_dict())  # (a's state dict names the block twice)
    unshared(torch.as_tensor(X)).mean().backward()
    want = unshared[0][0].weight.grad + unshared[1][0].weight.grad
    a.zero_grad(set_to_none=True)
    a(torch.as_tensor(X)).mean().backward()  # compare_step's loss: the output's mean
    torch.testing.assert_close(a[0][0].weight.grad, want, rtol=0, atol=1e-6)
    from gradmgr.parity.contract import adapter_for

    np.testing.assert_array_equal(adapter_for(a).grad("1.0.weight"), want.numpy())

    c = _sequential_of_one_block(False, 3)
    with pytest.raises(MappingError, match="tied to"):
        transfer_weights(a, c, probe=X)
    mapping = transfer_weights(a, c, probe=X, strict=False)
    assert not mapping.unmapped and len(mapping.findings) == 2, mapping.text()
    report = compare_step(a, c, X)
    assert not report.ok and report.first_forward is None and not report.unmatched
    assert "1.0.weight / 1.0.weight: tied to is '0.0.weight'" in str(report)
