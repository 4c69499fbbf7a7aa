"""Issue 30's real models through ``gradmgr.parity``: ResNet-18 and a BERT-style encoder, each
written once in MegEngine and once in PyTorch as a porting user writes them
(``examples/porting``), weights carried across automatically, one training step compared layer
by layer in both directions (MegEngine -> PyTorch and PyTorch -> MegEngine), kink flips, four
deliberately broken ports, and the drift of a few optimizer steps.

Tolerances. The verdicts are the tool's (``gradmgr/parity/tolerance.py``:
``C * eps(float32) * sqrt(K) * scale`` with ``K`` the reductions behind a tensor). The values
this file checks on its own state theirs where they are made:

* gradmgr's gradients against each framework's own autodiff on the same weights and batch
  (plain ``loss.backward()``, native ``megengine.autodiff.GradManager``): bit-identical
  (``SAME_FW = 0``): the same engine runs the same kernels in the same order;
* the two frameworks' own results against each other, without the tool: ``1e-4`` of the
  largest magnitude in the layer (``CROSS_FW``; measured on CPU: ResNet-18 logits 9e-6 and
  gradients 2.5e-5, the encoder 2.4e-7 and 1.2e-6). Scaled by the layer, not the tensor: the
  attention key's bias has a gradient that cancels to ~1e-13 (softmax ignores a shift of every
  score) and is rounding noise at its own scale.

ResNet-18 runs on 8 images of 32 x 32, so that one compared step costs about 3 s of CPU.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Callable, Dict, Tuple

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

pytest.importorskip("torch")
pytest.importorskip("megengine")  # conftest.py leaves this file out where MegEngine is not expected

from quiet_megengine import import_megengine  # noqa: E402

mge = import_megengine()

import megengine.functional as MF  # noqa: E402
import megengine.optimizer as mge_optim  # noqa: E402
import torch  # noqa: E402
from megengine.autodiff import GradManager as NativeGradManager  # noqa: E402
from porting import broken, mge_encoder, mge_resnet, torch_encoder, torch_resnet  # noqa: E402

from gradmgr import parity  # noqa: E402

SAME_FW = 0.0
CROSS_FW = 1e-4
BATCH = 8
RESNET_BATCHES = 10

DIRECTIONS = {"mge->torch": ("megengine", "torch"), "torch->mge": ("torch", "megengine")}
# "resnet18": the MegEngine side writes its ReLUs as M.ReLU modules; "resnet18-frelu": as
# MegEngine/Models writes them, F.relu (watched while the tool runs a step, flips pinned too).
BUILD: Dict[Tuple[str, str], Callable[[], Any]] = {
    ("resnet18", "torch"): torch_resnet.resnet18,
    ("resnet18", "megengine"): lambda: mge_resnet.resnet18(relu_modules=True),
    ("resnet18-frelu", "torch"): torch_resnet.resnet18,
    ("resnet18-frelu", "megengine"): mge_resnet.resnet18,
    ("encoder", "torch"): torch_encoder.EncoderClassifier,
    ("encoder", "megengine"): mge_encoder.EncoderClassifier,
    ("encoder-hidden", "torch"): lambda: torch_encoder.EncoderClassifier(
        torch_encoder.EncoderConfig(embeddings=False)),
    ("encoder-hidden", "megengine"): lambda: mge_encoder.EncoderClassifier(
        mge_encoder.EncoderConfig(embeddings=False)),
}
OPTIONS = {("resnet18", "megengine"): {"relu_modules": True}}  # for broken.PORTS builds


def torch_loss(out: Any, labels: Any) -> Any:
    return torch.nn.functional.cross_entropy(out, labels.long())


def mge_loss(out: Any, labels: Any) -> Any:
    return MF.nn.cross_entropy(out, labels)


LOSS = {"torch": torch_loss, "megengine": mge_loss}


def batch_of(model: str, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if model.startswith("resnet18"):
        return (rng.standard_normal((BATCH, 3, 32, 32)).astype("float32"),
                rng.integers(0, 10, BATCH).astype("int32"))
    cfg = torch_encoder.EncoderConfig()
    labels = rng.integers(0, cfg.num_classes, BATCH).astype("int32")
    if model == "encoder-hidden":  # no embeddings: the encoder takes hidden states
        return rng.standard_normal((BATCH, cfg.max_len, cfg.hidden)).astype("float32"), labels
    return rng.integers(0, cfg.vocab_size, (BATCH, cfg.max_len)).astype("int32"), labels


def build(model: str, framework: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    mge.random.seed(seed)
    return BUILD[(model, framework)]()


def ported(model: str, direction: str, dst: Any = None, strict: bool = True,
           seed: int = 0) -> Tuple[Any, Any, parity.MappingReport]:
    """The source model of ``direction`` and its port holding the source's weights."""
    src_fw, dst_fw = DIRECTIONS[direction]
    src = build(model, src_fw, seed)
    dst = build(model, dst_fw, seed + 1) if dst is None else dst
    mapping = parity.transfer_weights(src, dst, probe=batch_of(model, 0)[0], strict=strict)
    return src, dst, mapping


def compare(src: Any, dst: Any, direction: str, batch: Any, **kwargs: Any) -> Any:
    src_fw, dst_fw = DIRECTIONS[direction]
    return parity.compare_step(src, dst, batch, loss_a=LOSS[src_fw], loss_b=LOSS[dst_fw],
                               **kwargs)


def batch_without_flips(model: str, direction: str, src: Any, dst: Any,
                        seeds: range = range(1, 9)) -> Tuple[Any, Any]:
    """The first seed's batch on which no ReLU input sits within tolerance of its kink, and its
    report. Which seeds have such inputs depends on the CPU's kernels (seed 1 had none on the
    Intel machines these tests were written on, and has a pinned flip on an AMD EPYC), so the
    test picks one instead of naming it."""
    for seed in seeds:
        batch = batch_of(model, seed)
        report = compare(src, dst, direction, batch)
        if not report.unverified and not [f for f in report.flips if f.seen]:
            return batch, report
    raise AssertionError(f"every batch of seeds {seeds} has a kink flip\n{report.text()}")


def closest_to_tolerance(report: Any) -> Dict[str, Any]:
    """Per kind of entry (forward, loss, grad): the entry whose max abs came nearest its
    tolerance."""
    found: Dict[str, Any] = {}
    for e in report.entries:
        ratio = e.max_abs / e.tol if e.tol else 0.0
        if e.what not in found or ratio > found[e.what][0]:
            found[e.what] = (ratio, e)
    return {what: e for what, (_, e) in found.items()}


# --------------------------------------------------------------- the frameworks' own answers
def torch_native(model: Any, batch: Tuple[np.ndarray, ...]) -> Tuple[np.ndarray, dict]:
    """Logits and the gradients of plain ``loss.backward()`` on a copy of ``model``."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    device = next(m.parameters()).device
    out = m(torch.as_tensor(batch[0]).to(device))
    torch_loss(out, torch.as_tensor(batch[1]).to(device)).backward()
    return (out.detach().cpu().numpy(),
            {n: p.grad.cpu().numpy() for n, p in m.named_parameters()})


def mge_native(model: Any, batch: Tuple[np.ndarray, ...]) -> Tuple[np.ndarray, dict]:
    """Logits and the gradients of MegEngine's own ``GradManager`` on a copy of ``model``."""
    m = copy.deepcopy(model)
    params = dict(m.named_parameters())
    for p in params.values():
        p.grad = None
    gm = NativeGradManager().attach(list(params.values()))
    with gm:
        out = m(mge.tensor(batch[0]))
        gm.backward(mge_loss(out, mge.tensor(batch[1])))
    return out.numpy(), {n: p.grad.numpy() for n, p in params.items()}


NATIVE = {"torch": torch_native, "megengine": mge_native}


def grads_of(model: Any) -> Dict[str, np.ndarray]:
    """What a compared step left in ``.grad``."""
    return {n: (p.grad.cpu().numpy() if isinstance(p, torch.Tensor) else p.grad.numpy())
            for n, p in model.named_parameters()}


def assert_same_grads(got: Dict[str, np.ndarray], want: Dict[str, np.ndarray], rtol: float,
                      what: str) -> float:
    """Every gradient within ``rtol`` of the largest magnitude in its layer (module); returns
    the largest difference seen, relative to that scale."""
    assert sorted(got) == sorted(want), what
    layer_scale: Dict[str, float] = {}
    for name, g in want.items():
        layer = name.rpartition(".")[0]
        layer_scale[layer] = max(layer_scale.get(layer, 0.0), float(np.abs(g).max()))
    worst = 0.0
    for name, g in want.items():
        other = got[name].reshape(g.shape)
        diff = float(np.abs(other.astype(np.float64) - g).max())
        scale = layer_scale[name.rpartition(".")[0]]
        assert diff <= rtol * scale, (
            f"{what}: {name} differs by {diff:.3g} (layer scale {scale:.3g}, "
            f"allowed {rtol:g} of it)")
        worst = max(worst, diff / scale if scale else 0.0)
    return worst


# ------------------------------------------------------------------- both ports, both ways
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("model", ["resnet18", "resnet18-frelu", "encoder", "encoder-hidden"])
def test_correct_port_passes_in_both_directions(model, direction):
    src, dst, mapping = ported(model, direction)
    assert mapping.ok, mapping.text()
    params = len(list(dst.parameters()))
    assert len([p for p in mapping.pairs if p.src in dict(src.named_parameters())]) == params

    batch, report = batch_without_flips(model, direction, src, dst)
    src_fw, dst_fw = DIRECTIONS[direction]
    logits_src, native_src = NATIVE[src_fw](src, batch)
    logits_dst, native_dst = NATIVE[dst_fw](dst, batch)

    assert report.ok, report.text()
    assert report.first_forward is None and report.first_grad is None
    grads = [e for e in report.entries if e.what == "grad"]
    assert len(grads) == params, report.text()
    assert {e.layer for e in report.entries if e.what == "forward"} >= {
        p.dst.rpartition(".")[0] for p in mapping.pairs}, "every layer with weights compared"
    print(f"\n{model} {direction}, nearest the tolerance: " + "; ".join(
        f"{what} {e.name}: max abs {e.max_abs:.3g} (rel {e.max_rel:.3g}), tol {e.tol:.3g}"
        for what, e in closest_to_tolerance(report).items()))
    print("  largest: " + "; ".join(
        f"{what} max abs {max(e.max_abs for e in report.entries if e.what == what):.3g}, "
        f"max rel {max(e.max_rel for e in report.entries if e.what == what):.3g}"
        for what in ("forward", "loss", "grad")))

    # gradmgr's gradients are each framework's own
    own = [assert_same_grads(grads_of(m), native, SAME_FW, f"{fw} under gradmgr vs native")
           for m, native, fw in ((src, native_src, src_fw), (dst, native_dst, dst_fw))]
    # and the two frameworks agree without the tool in between
    scale = float(np.abs(logits_src).max())
    logits = float(np.abs(logits_src - logits_dst).max())
    assert logits <= CROSS_FW * scale
    cross = assert_same_grads(native_dst, native_src, CROSS_FW, f"{dst_fw} vs {src_fw}")
    print(f"  gradmgr vs native: {src_fw} {own[0]:.2g}, {dst_fw} {own[1]:.2g}; native "
          f"{dst_fw} vs {src_fw}: logits {logits / scale:.2g}, grads {cross:.2g} "
          f"(relative to the largest magnitude in the layer)")


def _cuda_reason() -> str:
    if not torch.cuda.is_available():
        return "CUDA: torch sees no GPU"
    if not mge.is_cuda_available():
        return "CUDA: MegEngine sees no GPU"
    return ""


def _to_cuda(model: Any) -> Any:
    if isinstance(model, torch.nn.Module):
        return model.cuda()
    for _, t in list(model.named_parameters()) + list(model.named_buffers()):
        t._reset(t.to("gpu0"))
    return model


@pytest.mark.cuda
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("model", ["resnet18", "encoder"])
def test_correct_port_passes_on_cuda(model, direction):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    src, dst, mapping = ported(model, direction)
    src, dst = _to_cuda(src), _to_cuda(dst)
    report = compare(src, dst, direction, batch_of(model, 1))
    assert report.ok, report.text()


# ------------------------------------------------------------------------------ kink flips
def _module(model: Any, path: str) -> Any:
    for part in path.split("."):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def _output_of(model: Any, path: str, x: np.ndarray) -> np.ndarray:
    """The output of the module at ``path`` in one training-mode forward of ``x``; BatchNorm's
    running statistics are put back as they were."""
    found = []
    module = _module(model, path)
    if isinstance(model, torch.nn.Module):
        kept = {n: b.clone() for n, b in model.named_buffers()}
        handle = module.register_forward_hook(lambda m, i, out: found.append(out.clone()))
        with torch.no_grad():
            model(torch.as_tensor(x))
        for n, b in model.named_buffers():
            b.copy_(kept[n])
        handle.remove()
        return found[0].numpy()
    kept = {n: b.numpy().copy() for n, b in model.named_buffers()}
    handle = module.register_forward_hook(lambda m, i, out: found.append(out.numpy().copy()))
    model(mge.tensor(x))
    for n, b in model.named_buffers():
        b._reset(mge.tensor(kept[n]))
    handle.remove()
    return found[0]


def _bias(model: Any, bn: str) -> np.ndarray:
    bias = _module(model, bn).bias
    return (bias.detach().numpy() if isinstance(bias, torch.Tensor) else bias.numpy()).copy()


def _set_bias(model: Any, bn: str, channel: int, value: np.float32) -> None:
    module = _module(model, bn)
    if isinstance(module.bias, torch.Tensor):
        with torch.no_grad():
            module.bias[channel] = float(value)
        return
    bias = _bias(model, bn)
    bias.reshape(-1)[channel] = value
    module.bias._reset(mge.tensor(bias))


def nudge_to_kink(a: Any, b: Any, x: np.ndarray, bn: str, tries: int = 40) -> int:
    """Shift one channel's bias of the BatchNorm ``bn`` (followed by a ReLU), by the same
    float32 value on both models, so that one element of the ReLU's input sits at zero within
    rounding and the two frameworks put it on different sides of the kink: a flip built on
    purpose, since a random batch flips only now and then. Tries the elements nearest zero
    first; returns the flat index of the element that flipped."""
    pre_a = _output_of(a, bn, x)
    for index in np.argsort(np.abs(pre_a), axis=None)[:tries]:
        channel = int(np.unravel_index(index, pre_a.shape)[1])
        old = np.float32(_bias(a, bn).reshape(-1)[channel])
        new = np.float32(old - pre_a.reshape(-1)[index])
        _set_bias(a, bn, channel, new)
        _set_bias(b, bn, channel, new)
        va = _output_of(a, bn, x).reshape(-1)[index]
        vb = _output_of(b, bn, x).reshape(-1)[index]
        if (va > 0) != (vb > 0):
            return int(index)
        _set_bias(a, bn, channel, old)
        _set_bias(b, bn, channel, old)
    raise AssertionError(f"no element among the {tries} nearest zero flipped")


def _assert_no_bug(report: Any) -> None:
    """Nothing beyond tolerance: flips are listed as flips, ReLU flips pinned and checked."""
    assert report.failures() == [] and not report.findings and not report.unmapped, (
        report.text())
    for flip in report.flips:
        assert flip.count >= 1, report.text()
        if flip.kind == "relu" and flip.seen:
            assert flip.pinned, f"a ReLU flip is pinned and re-checked\n{report.text()}"
    if report.flips:
        assert "kink flip (rounding, not a bug)" in report.text() or not any(
            f.seen for f in report.flips)


def test_resnet_random_batches_report_flips_not_bugs():
    src, dst, _ = ported("resnet18", "mge->torch")
    flipped, unverified, pending = [], 0, None
    for seed in range(100, 100 + RESNET_BATCHES):
        report = compare(src, dst, "mge->torch", batch_of("resnet18", seed))
        _assert_no_bug(report)
        if report.flips:
            flipped.append([(f.layer_b, f.kind, f.count, f.pinned) for f in report.flips])
        left = {e.name for e in report.unverified}
        unverified += bool(left)
        assert not left or any(not f.pinned for f in report.flips), report.text()
        pending = left if pending is None else pending & left
    print(f"\nResNet-18 mge->torch, {RESNET_BATCHES} random batches of {BATCH}: "
          f"{len(flipped)} with a flip {flipped}; {unverified} left gradients unverified")
    assert not pending, f"gradients never verified on any batch: {sorted(pending)}"


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_resnet_constructed_flip_is_reported_and_pinned(direction):
    src, dst, _ = ported("resnet18", direction)
    batch = batch_of("resnet18", 1)
    index = nudge_to_kink(src, dst, batch[0], bn="layer4.0.bn1")

    report = compare(src, dst, direction, batch)
    _assert_no_bug(report)
    assert report.ok, report.text()
    torch_side = "layer_a" if DIRECTIONS[direction][0] == "torch" else "layer_b"
    here = [f for f in report.flips if getattr(f, torch_side) == "layer4.0.relu"]
    assert here and here[0].count >= 1, report.text()
    print(f"\nconstructed flip {direction}: element {index} of layer4.0.bn1's output: "
          + "; ".join(f"{f.layer_a} / {f.layer_b}: {f.count}" for f in report.flips))

    # without the pinned re-run the flip's gradients are not the other side's
    unpinned = compare(src, dst, direction, batch, pin=False)
    moved = [e for e in unpinned.entries if e.what == "grad" and e.verdict != "ok"]
    assert moved, f"the flip moved no gradient beyond tolerance\n{unpinned.text()}"
    assert unpinned.failures() == [], unpinned.text()


def test_a_constructed_flip_with_the_reference_dumped_is_pinned_on_the_live_side(tmp_path):
    """The same flip as above, with the MegEngine reference read back from a dump (as from
    another environment): the dump's branch is fixed, so the live torch side is pinned to it,
    and every gradient is verified; without the pin they are not the dump's. With the dump as
    side b nothing can be pinned: the gradients behind the flip are unverified."""
    src, dst, _ = ported("resnet18", "mge->torch")
    batch = batch_of("resnet18", 1)
    nudge_to_kink(src, dst, batch[0], bn="layer4.0.bn1")
    parity.dump(src, batch, str(tmp_path / "ref.npz"), loss=mge_loss)
    reference = parity.load(str(tmp_path / "ref.npz"))
    report = parity.compare_step(reference, dst, batch, loss_b=torch_loss)
    _assert_no_bug(report)
    assert report.ok, report.text()
    here = [f for f in report.flips if f.layer_b == "layer4.0.relu"]
    assert here and here[0].count >= 1 and here[0].pinned, report.text()
    # each step moved dst's running statistics and none moves the dump's: back to its state
    parity.transfer_weights(reference, dst, probe=reference.batch)
    unpinned = parity.compare_step(reference, dst, batch, loss_b=torch_loss, pin=False)
    assert [e for e in unpinned.entries if e.what == "grad" and e.verdict != "ok"], (
        unpinned.text())
    # the dump as side b: its branch cannot be moved, so the gradients behind the flip are
    # NOT VERIFIED, never OK and never a bug
    parity.transfer_weights(reference, dst, probe=reference.batch)
    report = parity.compare_step(dst, reference, batch, loss_a=torch_loss)
    assert report.failures() == [] and report.unverified and not report.ok, report.text()
    assert "NOT VERIFIED" in report.text()


def test_a_flip_at_a_megengine_functional_relu_is_pinned_and_verified():
    """MegEngine/Models' own style: the MegEngine side's ReLUs are ``F.relu`` calls
    (``self.relu = F.relu``). No hook saw them: the flip built at layer4.0's first ReLU was
    neither confirmed nor pinned, the gradients it moves unverified on that batch. The tool
    now watches ``megengine.functional`` while it runs the step: the flip is seen at the
    MegEngine call, pinned on the torch side, and every gradient verified on that batch."""
    src, dst, _ = ported("resnet18-frelu", "mge->torch")
    flipped = batch_of("resnet18", 1)
    nudge_to_kink(src, dst, flipped[0], bn="layer4.0.bn1")

    report = compare(src, dst, "mge->torch", flipped)
    _assert_no_bug(report)
    assert report.ok and report.unverified == [], report.text()
    here = [f for f in report.flips if f.layer_b == "layer4.0.relu"]
    assert here and here[0].layer_a == "layer4.0:relu()", report.text()
    assert here[0].seen and here[0].pinned and here[0].count >= 1, report.text()
    assert not [c for c in report.unmatched if "relu" in c], report.text()
    # without the pinned re-run the flip's gradients are not the other side's
    unpinned = compare(src, dst, "mge->torch", flipped, pin=False)
    assert unpinned.failures() == [] and unpinned.unverified, unpinned.text()


def test_broken_port_behind_a_flip_is_still_pinned():
    port = broken.PORTS["wrong_eps"]  # MegEngine, layer2.0.bn1: after the stem's flip
    src, dst, mapping = ported("resnet18", "torch->mge", dst=port.build(**OPTIONS[
        ("resnet18", "megengine")]), strict=False)
    batch = batch_of("resnet18", 1)
    nudge_to_kink(src, dst, batch[0], bn="layer1.0.bn1")

    report = compare(src, dst, "torch->mge", batch)
    text = report.text()
    assert not report.ok and report.failures(), text
    assert any(f.layer_a == "layer1.0.relu" and f.seen and f.pinned for f in report.flips), text
    assert report.first_forward is not None and report.first_forward.layer == port.layer, text
    assert f"first forward divergence: layer {port.layer}" in text


# -------------------------------------------------------------------------- broken ports
@pytest.mark.parametrize("bug", sorted(broken.PORTS))
def test_broken_port_is_reported_at_its_layer(bug):
    port = broken.PORTS[bug]
    direction = "mge->torch" if port.framework == "torch" else "torch->mge"
    built = port.build(**OPTIONS.get((port.model, port.framework), {}))
    src, dst, mapping = ported(port.model, direction, dst=built, strict=False)
    if "eps" in bug:  # a configuration the weights' map already sees
        assert [(f.layer_dst, f.key) for f in mapping.findings] == [(port.layer, "eps")]
    else:
        assert mapping.ok, mapping.text()

    report = compare(src, dst, direction, batch_of(port.model, 1))
    text = report.text()
    assert not report.ok, text
    if port.backward_only:  # named among the layers whose backward the tool cannot see into
        assert report.first_forward is None and report.first_grad is not None, text
        assert report.unverified == [] and port.layer in report.suspects[0], text
        assert "every forward agrees but a gradient differs" in text, text
        return
    first = report.first_forward
    assert first is not None and first.layer == port.layer, text
    forwards = [e for e in report.entries if e.what == "forward"]
    blamed = forwards.index(first)
    assert all(e.ok for e in forwards[:blamed]), f"a layer before {port.layer} blamed\n{text}"
    assert f"first forward divergence: layer {port.layer}" in text, text
    assert "DIFFERS" in text
    assert "draws its own dropout mask" not in text  # every dropout here has p=0
    if port.named:
        assert f"its input came through {port.named}" in first.note, text
    if "eps" in bug:
        assert "eps" in text, text
    print(f"\n{bug}: first divergence {first.layer} max abs {first.max_abs:.3g} "
          f"(tol {first.tol:.3g}); loss " + ", ".join(
              f"{e.max_abs:.3g}" for e in report.entries if e.what == "loss"))


def test_a_copied_momentum_is_flagged_though_one_step_agrees():
    """MegEngine's BatchNorm momentum 0.9 copied into the torch port as 0.9: every BatchNorm
    is a configuration finding (compared in torch's convention), the strict transfer refuses
    and says which layers, and one training step's outputs and gradients agree, which is why
    the map must say it; the running statistics the step leaves differ (buffer rows)."""
    src = build("resnet18", "megengine")
    dst = broken.torch_resnet_copied_momentum()
    probe = batch_of("resnet18", 0)[0]
    with pytest.raises(parity.MappingError, match="momentum"):
        parity.transfer_weights(src, dst, probe=probe)
    mapping = parity.transfer_weights(src, dst, probe=probe, strict=False)
    bns = [n for n, m in dst.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert sorted(f.layer_dst for f in mapping.findings if f.key == "momentum") == sorted(bns)
    assert {f.key for f in mapping.findings} == {"momentum"}, mapping.text()

    report = compare(src, dst, "mge->torch", batch_of("resnet18", 1))
    assert {e.what for e in report.failures()} == {"buffer"} and not report.ok, report.text()
    assert {e.layer for e in report.failures()} == set(bns)
    # MegEngine's 0.9 as 1 - 0.9, shown as written (it was 0.09999999999999998)
    assert "config: bn1 / bn1: momentum is 0.1 on one side, 0.9 on the other" in report.text()


# ---------------------------------------------------------------------------------- drift
def _optimizers(a: Any, b: Any) -> Tuple[Any, Any]:
    settings = {"lr": 0.1, "momentum": 0.9}
    made = []
    for m in (a, b):
        if isinstance(m, torch.nn.Module):
            made.append(torch.optim.SGD(m.parameters(), **settings))
        else:
            made.append(mge_optim.SGD(m.parameters(), **settings))
    return made[0], made[1]


def test_drift_plot_small_for_the_port_large_for_a_broken_one(tmp_path):
    steps = 6
    batches = [batch_of("encoder", 200)] * steps  # one batch learnt: the loss must fall
    drifts = {}
    for name, dst in (("correct", None), ("transposed_weight",
                                          broken.PORTS["transposed_weight"].build())):
        src, dst, _ = ported("encoder", "mge->torch", dst=dst)
        opt_src, opt_dst = _optimizers(src, dst)
        report = parity.train_drift(src, dst, opt_src, opt_dst, batches,
                                    loss_a=mge_loss, loss_b=torch_loss)
        assert report.steps == steps
        path = report.plot(str(tmp_path / f"drift_{name}.png"))
        with open(path, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 10_000
        drifts[name] = report
        print(f"\n{name}: {report.text()}")
    good, bad = drifts["correct"], drifts["transposed_weight"]
    assert max(good.rel_l2) < 1e-5, good.text()
    assert bad.rel_l2[-1] > 100 * max(good.rel_l2[-1], 1e-7), bad.text()
    assert good.loss_a[-1] < good.loss_a[0], "the encoder learns: a drift of a real run"
