"""gradmgr.parity across frameworks (issue 30): small real models written in PyTorch and in
MegEngine, weights transferred in both directions, one step compared layer by layer.

Tolerances are the tool's own (gradmgr/parity/tolerance.py, docs/porting.md); where a test
asserts values itself it says its tolerance. The models are in tests/parity_small_torch.py and
tests/parity_small_mge.py (the ResNet-18 and encoder tests are tests/test_parity_models*.py).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

mge = pytest.importorskip("megengine")
torch = pytest.importorskip("torch")

import megengine.optimizer as mge_optim  # noqa: E402
import parity_small_mge as G  # noqa: E402
import parity_small_torch as T  # noqa: E402
from parity_tied_checks import (  # noqa: E402
    BLOCK,
    check_block_called_twice_on_one_side,
    check_shared_layer_on_both_sides,
    check_shared_layer_on_one_side,
    check_tied_on_both_sides,
    check_tied_on_one_side,
)

from gradmgr.parity import (  # noqa: E402
    MappingError,
    ModelTypeError,
    ParityError,
    assert_parity,
    compare_step,
    train_drift,
    transfer_weights,
)

RS = np.random.RandomState(0)
X16 = RS.randn(8, 16).astype(np.float32)
XIMG = RS.randn(4, 3, 8, 8).astype(np.float32)
XSEQ = RS.randn(4, 5, 16).astype(np.float32)
LABELS = RS.randint(0, 10, size=4).astype(np.int64)
CASES = {"mlp": (T.MLP, G.MLP, X16), "cnn": (T.CNN, G.CNN, XIMG),
         "block": (T.Block, G.Block, XSEQ)}


def pair(case: str, direction: str, **broken):
    """(reference, port, batch): the port of ``direction`` ("torch->megengine" or back)
    built with the bug ``broken`` names, the reference's weights transferred into it."""
    make_t, make_m, x = CASES[case]
    torch.manual_seed(0)
    mge.random.seed(0)  # (MegEngine's initial weights: without it each run draws its own)
    if direction == "torch->megengine":
        a, b = make_t(), make_m(**broken)
    else:  # MegEngine starts biases at zero: give them values, so that a lost one shows
        a, b = make_m(), make_t(**broken)
        rs = np.random.RandomState(1)
        a.load_state_dict({k: v + rs.uniform(-0.1, 0.1, v.shape).astype(v.dtype)
                           if k.endswith("bias") else v for k, v in a.state_dict().items()})
    transfer_weights(a, b, probe=x, strict=False)
    return a, b, x


def numpy_of(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    return t.detach().numpy() if isinstance(t, torch.Tensor) else t.numpy()


DIRECTIONS = ["torch->megengine", "megengine->torch"]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_correct_port_passes_and_its_gradients_are_the_plain_backwards(case, direction):
    a, b, x = pair(case, direction)
    torch_model = a if direction == "torch->megengine" else b
    reference = copy.deepcopy(torch_model)  # before the step: BatchNorm statistics as a's
    report = assert_parity(a, b, x)
    assert report.ok and report.flips == [] and report.unmatched == []
    # the tolerances are not vacuous: every one below 1e-4 of its tensor's scale
    for e in report.entries:
        assert e.tol <= 1e-4 * max(e.max_abs / max(e.max_rel, 1e-30), 1e-30) or e.max_abs == 0
    # the torch side's gradients (gradmgr's GradManager) equal plain loss.backward()'s
    reference(torch.as_tensor(x)).mean().backward()
    for (name, p), q in zip(torch_model.named_parameters(), reference.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-6, atol=1e-9,
                                   err_msg=name)
    # and the MegEngine side's gradients equal the torch side's to 1e-4 of their layer's
    # scale (a bias before a training-mode BatchNorm has a gradient of rounding noise only)
    mge_model = b if direction == "torch->megengine" else a
    mge_grads = dict(mge_model.named_parameters())
    for name, p in torch_model.named_parameters():
        g = numpy_of(mge_grads[name].grad).reshape(p.shape)
        layer = name.rpartition(".")[0]
        scale = max(np.abs(q.grad.numpy()).max() for n, q in torch_model.named_parameters()
                    if n.rpartition(".")[0] == layer)
        np.testing.assert_allclose(g, p.grad.numpy(), atol=1e-4 * scale, rtol=0, err_msg=name)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_batchnorm_statistics_and_shapes_cross_with_momentum_translated(direction):
    a, b, x = pair("cnn", direction)
    report = transfer_weights(a, b, probe=x)
    hows = {p.src: p.how for p in report.pairs}
    assert "reshape" in hows["bn1.weight"] and "reshape" in hows["bn1.running_var"]
    assert hows["conv1.weight"] == "copy" and report.findings == []
    assert [name for name, _ in report.ignored] == ["bn1.num_batches_tracked",
                                                    "bn2.num_batches_tracked"]
    compare_step(a, b, x)  # one training step: running statistics updated on both sides
    stats_a = {k: numpy_of(v).reshape(-1) for k, v in a.named_buffers() if "running" in k}
    stats_b = {k: numpy_of(v).reshape(-1) for k, v in b.named_buffers() if "running" in k}
    assert stats_a.keys() == stats_b.keys() and len(stats_a) == 4
    for name in stats_a:  # momentum 0.1 (torch) == 0.9 (MegEngine): the same statistics
        np.testing.assert_allclose(stats_a[name], stats_b[name], rtol=1e-5, atol=1e-6)
        assert not np.allclose(stats_a[name], 0 if "mean" in name else 1)


def test_a_momentum_copied_without_translation_is_a_finding():
    a, b, x = pair("cnn", "torch->megengine", momentum=0.1)  # MegEngine's 0.1 is torch's 0.9
    report = compare_step(a, b, x)
    assert [(f.layer_src, f.key) for f in report.findings] == [("bn1", "momentum")]
    assert not report.ok and "PyTorch's convention" in report.text()


BROKEN = [  # (case, the bug, the layer it must be pinned to, the config key it changes)
    ("mlp", {"transposed": True}, "fc2", None),
    ("mlp", {"no_bias": True}, "fc3", "bias"),
    ("cnn", {"bn_eps": 1e-3}, "bn2", "eps"),
    ("cnn", {"padding": 2}, "conv2", "padding"),
    ("block", {"ln_eps": 1e-3}, "norm", "eps"),
]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case,bug,layer,key", BROKEN,
                         ids=[f"{c}-{next(iter(b))}" for c, b, _, _ in BROKEN])
def test_a_broken_port_is_pinned_to_its_layer(case, bug, layer, key, direction):
    a, b, x = pair(case, direction, **bug)
    report = compare_step(a, b, x)
    assert not report.ok
    assert report.first_forward is not None and report.first_forward.layer == layer
    assert [f.key for f in report.findings] == ([key] if key else [])
    assert all(e.ok for e in report.entries if e.what == "forward"
               and report.entries.index(e) < report.entries.index(report.first_forward))
    with pytest.raises(AssertionError) as info:
        assert_parity(a, b, x)
    assert f"first forward divergence: layer {layer} " in str(info.value)


def test_a_missing_bias_is_left_unmapped_and_strict_transfer_refuses():
    torch.manual_seed(0)
    a, b = T.MLP(), G.MLP(no_bias=True)
    with pytest.raises(MappingError) as info:
        transfer_weights(a, b, probe=X16)
    message = str(info.value)
    assert "unmapped (src) fc3.bias: the matching layer has no bias" in message
    assert "fc3 / fc3: bias is True on one side, False on the other" in message
    assert info.value.report.unmapped[0].name == "fc3.bias"


def test_an_unmappable_model_gets_a_clear_report():
    with pytest.raises(MappingError) as info:
        transfer_weights(T.MLP(), G.CNN(), probe=None)
    message = str(info.value)
    assert "no linear layer at this place in the other model" in message
    assert "no conv2d layer at this place" in message


def craft_flip(a, b, leaky_rows: int = 1):
    """Make the first sample's fc1 pre-activation of unit 0 exactly 0.0 on ``a`` (integers and
    powers of two: exact in any summation order) and one ulp above on ``b``: a ReLU kink flip."""
    state = {k: numpy_of(v).copy() for k, v in a.state_dict().items()}
    state["fc1.weight"][0] = 0.25
    state["fc1.bias"][0] = -4.0
    load(a, state)
    transfer_weights(a, b, probe=X16)
    nudged = {k: numpy_of(v).copy() for k, v in b.state_dict().items()}
    nudged["fc1.bias"].reshape(-1)[0] = np.nextafter(np.float32(-4.0), np.float32(0.0))
    load(b, nudged)
    x = X16.copy()
    x[0] = 1.0
    return x


def load(model, state) -> None:
    if isinstance(model, torch.nn.Module):
        model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    else:
        model.load_state_dict(state)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_relu_kink_flip_is_a_flip_and_the_pinned_step_verifies_every_gradient(direction):
    torch.manual_seed(0)
    a, b = (T.MLP(), G.MLP()) if direction == "torch->megengine" else (G.MLP(), T.MLP(inplace=True))
    x = craft_flip(a, b)
    unpinned = compare_step(a, b, x, pin=False)
    # without the pin, the flipped element moves fc1's gradients far beyond tolerance (they
    # are unverified, not wrong); the forward agrees
    moved = {e.name: e for e in unpinned.unverified}
    assert sorted(moved) == ["fc1.bias / fc1.bias", "fc1.weight / fc1.weight"]
    assert all(e.max_abs > 100 * e.tol for e in moved.values())
    assert all(e.ok for e in unpinned.entries if e.what == "forward")
    report = compare_step(a, b, x)
    assert [(f.layer_a, f.count, f.pinned) for f in report.flips] == [("act1", 1, True)]
    assert report.ok, report.text()
    assert "kink flip (rounding, not a bug): 1 element(s) of relu act1" in report.text()


def test_a_bug_in_a_layer_before_a_flip_is_still_reported():
    torch.manual_seed(0)
    a, b = T.MLP(), G.MLP()
    x = craft_flip(a, b)
    state = {k: numpy_of(v).copy() for k, v in b.state_dict().items()}
    state["fc1.weight"][5] += 1e-3  # a porting bug in another unit of the same layer
    b.load_state_dict(state)
    report = compare_step(a, b, x)
    assert [(f.layer_a, f.count) for f in report.flips] == [("act1", 1)]
    assert not report.ok and report.first_forward.layer == "fc1"
    # fc1's own gradient does not depend on its weight (ReLU, linear loss); fc2's does
    assert {"fc1 / fc1", "fc2.weight / fc2.weight"} <= {e.name for e in report.failures()}
    assert report.flips[0].pinned and report.unverified == []


def test_a_flip_that_cannot_be_pinned_leaves_gradients_unverified_until_a_batch_verifies():
    torch.manual_seed(0)
    a, b = T.MLP(leaky=True), G.MLP(leaky=True)
    x = craft_flip(a, b)
    report = compare_step(a, b, x)
    assert [(f.layer_a, f.kind, f.pinned) for f in report.flips] == [("act1", "leakyrelu",
                                                                       False)]
    assert {e.name for e in report.unverified} == {"fc1.weight / fc1.weight",
                                                   "fc1.bias / fc1.bias"}
    assert report.failures() == [] and not report.ok
    assert report.text().startswith("NOT VERIFIED")
    with pytest.raises(AssertionError, match="unverified by kink flips .* fc1.bias / fc1.bias"):
        assert_parity(a, b, [x, x])
    clean = x.copy()
    clean[0] = 2.0  # pre-activation 4.0: no flip, every gradient verified
    assert assert_parity(a, b, lambda i: x if i == 0 else clean).ok


def train(direction: str, **broken):
    a, b, x = pair("cnn", direction, **broken)
    rs = np.random.RandomState(1)
    batches = [(rs.randn(4, 3, 8, 8).astype(np.float32), rs.randint(0, 10, 4))
               for _ in range(8)]
    optimizers = []
    for model in (a, b):
        if isinstance(model, torch.nn.Module):
            optimizers.append(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        else:
            optimizers.append(mge_optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = [T.cross_entropy if isinstance(m, torch.nn.Module) else G.cross_entropy
              for m in (a, b)]
    return train_drift(a, b, *optimizers, batches, loss_a=losses[0], loss_b=losses[1])


def test_drift_is_small_for_a_correct_port_and_its_plot_is_written(tmp_path):
    report = train("torch->megengine")
    assert report.steps == 8 and report.loss_a[-1] < report.loss_a[0]
    assert max(report.rel_l2) < 1e-5 and max(report.max_abs) < 1e-5
    np.testing.assert_allclose(report.loss_a, report.loss_b, rtol=1e-5)
    path = report.plot(str(tmp_path / "drift.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_drift_is_large_for_a_broken_port():
    report = train("megengine->torch", bn_eps=1e-3)
    # (measured, seeded: 2.4e-5 after the first step, 2.2e-4 after the last, 2,000 times the
    # correct port's; the bounds leave a factor of 2 or more)
    assert report.rel_l2[-1] > 1e-4 and report.rel_l2[-1] > 5 * report.rel_l2[0]
    assert report.rel_l2[-1] > train("megengine->torch").rel_l2[-1] * 100


def test_targets_reach_the_loss_and_a_wrong_batch_is_a_clear_error():
    a, b, x = pair("cnn", "torch->megengine")
    report = compare_step(a, b, (x, LABELS), loss_a=T.cross_entropy, loss_b=G.cross_entropy)
    assert report.ok, report.text()
    loss = next(e for e in report.entries if e.what == "loss")
    assert loss.max_rel < 1e-5
    with pytest.raises(ParityError, match=r"the torch model \(CNN\) failed on the batch's "
                                          r"input\(s\) of shape \(8, 16\)"):
        compare_step(a, b, X16)
    with pytest.raises(ParityError, match="batch item 0 has dtype <U1"):
        compare_step(a, b, (np.array(["a"]),))
    with pytest.raises(ModelTypeError, match="cannot compare a str"):
        compare_step("model", b, x)


def test_a_megengine_sequential_of_twelve_layers_maps_in_written_order_without_a_probe():
    """MegEngine sorts names as strings (``10`` before ``2``): without a probe the automatic
    map used to copy layer 10 into torch's layer 2, same shapes, no error."""
    import megengine.module as M

    a = M.Sequential(*[M.Linear(4, 4) for _ in range(12)])
    b = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)])
    report = transfer_weights(a, b)
    assert [(p.src, p.dst) for p in report.pairs] == \
        [(f"{i}.{r}", f"{i}.{r}") for i in range(12) for r in ("bias", "weight")]
    for i in range(12):  # exact copies, layer by layer
        np.testing.assert_array_equal(b[i].weight.detach().numpy(), a[i].weight.numpy())
    step = compare_step(a, b, X16[:, :4])
    assert step.ok, step.text()


def test_a_float64_torch_reference_against_a_megengine_port_fed_a_megengine_tensor():
    """MegEngine computes in float32: the tolerance is float32's, not the float64 side's
    (every layer used to differ by 1e-7 against a tolerance of 1e-15); a MegEngine tensor as
    the batch is one item (it used to be iterated over its rows)."""
    a, b = T.MLP().double(), G.MLP()
    transfer_weights(a, b, probe=X16)
    report = compare_step(a, b, mge.tensor(X16))
    assert report.ok, report.text()
    worst = max(e.max_abs for e in report.entries if e.what == "forward")
    assert 0 < worst < 1e-5  # float32 rounding seen, and accepted


# Tied weights (docs/megengine.md): an LM head on its embedding's weight, two Linears on
# one weight, and one module holding its weight under two attribute names ("own": MegEngine
# listed it once, under one name, before the fix: the tie unseen, a tied port unmapped).
# MegEngine's named_parameters lists a tied parameter once, under its first name in sorted
# order; the adapter finds its other names itself.
TIED = {"torch": {"lm": T.TiedLM, "shared": T.Shared, "own": T.TiedInOneModule},
        "megengine": {"lm": G.TiedLM, "shared": G.Shared, "own": G.TiedInOneModule}}
_TRS = np.random.RandomState(3)
TIED_BATCHES = {"lm": _TRS.randint(0, 10, (4, 5)), "shared": _TRS.randn(4, 8).astype(np.float32)}
TIED_BATCHES["own"] = TIED_BATCHES["shared"]
TIES = {"lm": ("head.weight", "emb.weight"), "shared": ("b.weight", "a.weight"),
        "own": ("core.w2", "core.w")}


def tied_model(framework: str, case: str, tied: bool, seed: int):
    torch.manual_seed(seed)
    mge.random.seed(seed)
    return TIED[framework][case](tied=tied)


def untied_mge_grads(mm, case: str, batch) -> dict:
    """The gradients MegEngine's own GradManager gives an untied copy of ``mm`` (each name its
    own parameter, the tied values copied to both)."""
    import megengine.autodiff as ad

    copy_ = tied_model("megengine", case, False, 2)
    values = {n: p.numpy() for n, p in mm.named_parameters()}
    alias, first = TIES[case]
    copy_.load_state_dict({**values, alias: values[first]})
    gm = ad.GradManager().attach(copy_.parameters())
    with gm:
        gm.backward(copy_(mge.tensor(batch)).mean())  # compare_step's loss: the output's mean
    return {n: p.grad.numpy() for n, p in copy_.named_parameters()}


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", ["lm", "shared", "own"])
def test_tied_weights_on_both_sides_are_parity_and_sum_both_uses(case, direction):
    src, dst = direction.split("->")
    a, b, x = tied_model(src, case, True, 0), tied_model(dst, case, True, 1), TIED_BATCHES[case]
    alias, first = TIES[case]
    mm = a if src == "megengine" else b
    # the tied gradient sums both uses: torch's to 1e-4 of its largest (this file's
    # cross-framework bound), and MegEngine's is what its own GradManager gives an untied
    # copy's two parameters together (1e-6 of its largest: the sum's order)
    check_tied_on_both_sides(a, b, x, mm, alias, first, rel=1e-4)
    own = untied_mge_grads(mm, case, x)
    stored = dict(mm.named_parameters())[first].grad.numpy()
    np.testing.assert_allclose(stored, own[first] + own[alias], rtol=0,
                               atol=1e-6 * np.abs(stored).max())


@pytest.mark.parametrize("tied_side", ["megengine", "torch"])
@pytest.mark.parametrize("case", ["lm", "shared", "own"])
def test_tied_weights_on_one_side_only_are_a_finding_at_the_gradients(case, tied_side):
    """The tied side is the reference (parity_tied_checks.check_tied_on_one_side); the tied
    gradient within 1e-4 of its largest of the sum of the untied side's two."""
    other = "torch" if tied_side == "megengine" else "megengine"
    a, b = tied_model(tied_side, case, True, 0), tied_model(other, case, False, 1)
    check_tied_on_one_side(a, b, TIED_BATCHES[case], *TIES[case], rel=1e-4)


def test_a_tie_under_another_name_pairs_by_name_map_and_one_under_none_is_unmapped():
    import megengine.functional as F
    import megengine.module as M

    class LMHead(M.Module):  # an LM head holding the embedding's weight as decoder_weight
        def __init__(self, weight) -> None:
            super().__init__()
            self.decoder_weight = weight

        def forward(self, x):
            return F.matmul(x, self.decoder_weight, transpose_b=True)

    class HeadOrInline(M.Module):  # T.TiedLM's port, its head in LMHead or inline
        def __init__(self, head: bool) -> None:
            super().__init__()
            self.emb, self.mid = M.Embedding(10, 8), M.Linear(8, 8)
            self.head = LMHead(self.emb.weight) if head else None

        def forward(self, t):
            x = F.tanh(self.mid(self.emb(t)))
            return (self.head(x) if self.head is not None
                    else F.matmul(x, self.emb.weight, transpose_b=True))

    x = TIED_BATCHES["lm"]
    a = tied_model("torch", "lm", True, 0)
    with pytest.raises(MappingError, match="unmapped \\(src\\) head.weight: no linear layer"):
        transfer_weights(a, HeadOrInline(head=False), probe=x)
    b = HeadOrInline(head=True)
    with pytest.raises(MappingError, match="unmapped \\(dst\\) head.decoder_weight"):
        transfer_weights(a, b, probe=x)
    name_map = {"head.weight": "head.decoder_weight"}
    assert transfer_weights(a, b, name_map, probe=x).ok
    report = compare_step(a, b, x, name_map=name_map)
    assert report.ok, report.text()
    assert "head.weight / head.decoder_weight" in {e.name for e in report.entries}


def test_a_tie_whose_first_name_differs_between_the_frameworks_is_still_one_tie():
    """torch keeps a tied parameter's first name as registered (``wte``), MegEngine its first
    in sorted order (``lm_head``): the tie is the same on both sides, no finding."""
    import megengine.functional as F
    import megengine.module as M

    class TorchGPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.lm_head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, t):
            return self.lm_head(torch.tanh(self.wte(t)))

    class MgeGPT(M.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.lm_head = M.Embedding(10, 8), M.Linear(8, 10, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, t):
            return self.lm_head(F.tanh(self.wte(t)))

    from gradmgr.parity.contract import adapter_for

    torch.manual_seed(0)
    a, b, x = TorchGPT(), MgeGPT(), TIED_BATCHES["lm"]
    assert adapter_for(a).aliases == {"lm_head.weight": "wte.weight"}
    assert adapter_for(b).aliases == {"wte.weight": "lm_head.weight"}
    mapping = transfer_weights(a, b, probe=x)
    assert mapping.ok and not mapping.findings
    np.testing.assert_array_equal(b.wte.weight.numpy(), a.wte.weight.detach().numpy())
    report = compare_step(a, b, x)
    assert report.ok, report.text()
    np.testing.assert_allclose(b.wte.weight.grad.numpy(), a.wte.weight.grad.numpy(), rtol=0,
                               atol=1e-4 * np.abs(a.wte.weight.grad.numpy()).max())


def test_a_tied_megengine_model_dumped_keeps_its_tie(tmp_path):
    """The dump records the tie (its header's aliases): against a tied torch port it is
    parity, against an untied one the tie finding, as live."""
    from gradmgr.parity import dump, load
    from gradmgr.parity.mapping import TIED as TIE

    x = TIED_BATCHES["lm"]
    dump(tied_model("megengine", "lm", True, 0), x, str(tmp_path / "tied.npz"))
    recorded = load(str(tmp_path / "tied.npz"))
    assert recorded.aliases == {"head.weight": "emb.weight"}
    np.testing.assert_array_equal(recorded.grad("head.weight"), recorded.grad("emb.weight"))
    tied, untied = tied_model("torch", "lm", True, 1), tied_model("torch", "lm", False, 1)
    assert transfer_weights(recorded, tied, probe=recorded.batch).ok
    report = compare_step(recorded, tied, recorded.batch)
    assert report.ok, report.text()
    mapping = transfer_weights(recorded, untied, probe=recorded.batch, strict=False)
    assert [f.key for f in mapping.findings] == [TIE]
    assert not compare_step(recorded, untied, recorded.batch).ok


# A whole layer under two names (``self.b = self.a``): its parameters' second names are
# aliases, its name a second name of the one layer, hooked once and called twice.
SHARED_LAYER = {"torch": T.SharedLayer, "megengine": G.SharedLayer}


def shared_layer(framework: str, shared: bool, seed: int):
    torch.manual_seed(seed)
    mge.random.seed(seed)
    return SHARED_LAYER[framework](shared=shared)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_layer_shared_under_two_names_on_both_sides_is_parity(direction):
    """parity_tied_checks.check_shared_layer_on_both_sides, torch's gradients to 1e-4 of
    their largest; strict: raised before the fix (unmapped b.*)."""
    src, dst = direction.split("->")
    a, b, x = shared_layer(src, True, 0), shared_layer(dst, True, 1), TIED_BATCHES["shared"]
    check_shared_layer_on_both_sides(a, b, x, rel=1e-4)
    # the shared layer's gradient sums both uses: what an unshared copy's two Linears get
    # together (MegEngine's GradManager; 1e-6 of its largest)
    mm = a if src == "megengine" else b
    copy_ = shared_layer("megengine", False, 2)
    values = {n: p.numpy() for n, p in mm.named_parameters()}
    copy_.load_state_dict({**values, "b.weight": values["a.weight"],
                           "b.bias": values["a.bias"]})
    import megengine.autodiff as ad

    gm = ad.GradManager().attach(copy_.parameters())
    with gm:
        gm.backward(copy_(mge.tensor(x)).mean())
    own = {n: p.grad.numpy() for n, p in copy_.named_parameters()}
    for role in ("weight", "bias"):
        stored = dict(mm.named_parameters())[f"a.{role}"].grad.numpy()
        np.testing.assert_allclose(stored, own[f"a.{role}"] + own[f"b.{role}"], rtol=0,
                                   atol=1e-6 * np.abs(stored).max())


@pytest.mark.parametrize("shared_side", ["megengine", "torch"])
def test_a_layer_shared_on_one_side_only_is_a_tie_finding_not_unmapped(shared_side):
    """parity_tied_checks.check_shared_layer_on_one_side, the gradients to 1e-4."""
    other = "torch" if shared_side == "megengine" else "megengine"
    a, b = shared_layer(shared_side, True, 0), shared_layer(other, False, 1)
    check_shared_layer_on_one_side(a, b, TIED_BATCHES["shared"], rel=1e-4)


# One block of three layers shared (tests/parity_small_*.py): under two names (SharedBlock,
# its second name's tensors tied to its first's) or called twice under one (BlockCalledTwice).
BLOCKS = {"torch": {"named": T.SharedBlock, "called": T.BlockCalledTwice},
          "megengine": {"named": G.SharedBlock, "called": G.BlockCalledTwice}}


def block_model(framework: str, case: str, shared: bool, seed: int):
    torch.manual_seed(seed)
    mge.random.seed(seed)
    return BLOCKS[framework][case](shared=shared)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", ["named", "called"])
def test_a_block_shared_on_both_sides_pairs_its_layers_and_is_parity(case, direction):
    """parity_tied_checks.check_shared_layer_on_both_sides: the block's three layers called
    twice and the head, seven calls each paired with its namesake; torch's gradients to 1e-4
    of their largest."""
    src, dst = direction.split("->")
    a, b = block_model(src, case, True, 0), block_model(dst, case, True, 1)
    check_shared_layer_on_both_sides(a, b, TIED_BATCHES["shared"], rel=1e-4, forwards=7)


@pytest.mark.parametrize("shared_side", ["megengine", "torch"])
def test_a_block_under_two_names_on_one_side_only_is_a_tie_finding(shared_side):
    """parity_tied_checks.check_shared_layer_on_one_side: a tie finding for each of the
    block's four tensors, the gradients to 1e-4."""
    other = "torch" if shared_side == "megengine" else "megengine"
    a, b = block_model(shared_side, "named", True, 0), block_model(other, "named", False, 1)
    check_shared_layer_on_one_side(a, b, TIED_BATCHES["shared"], rel=1e-4, tied=BLOCK,
                                   forwards=7)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("shared_side", ["src", "dst"])
def test_a_block_called_twice_on_one_side_only_is_refused_not_parity(shared_side, direction):
    """parity_tied_checks.check_block_called_twice_on_one_side."""
    src, dst = direction.split("->")
    a = block_model(src, "called", shared_side == "src", 0)
    b = block_model(dst, "called", shared_side == "dst", 1)
    check_block_called_twice_on_one_side(a, b, TIED_BATCHES["shared"])


def test_a_dumped_shared_block_keeps_its_second_names(tmp_path):
    """A dump has no modules: its layers' second names come from its aliases and recorded
    calls (the adapter contract's ``second``). Against a shared MegEngine port it is parity
    with the seven calls paired, against an unshared one a tie finding per tensor."""
    from gradmgr.parity import dump, load
    from gradmgr.parity.contract import adapter_for
    from gradmgr.parity.mapping import TIED as TIE

    x = TIED_BATCHES["shared"]
    live = block_model("torch", "named", True, 0)
    dump(live, x, str(tmp_path / "block.npz"))
    recorded = load(str(tmp_path / "block.npz"))
    assert recorded.second == adapter_for(live).second == {"second.0": "first.0",
                                                           "second.2": "first.2"}
    shared, unshared = (block_model("megengine", "named", s, 1) for s in (True, False))
    assert transfer_weights(recorded, shared, probe=recorded.batch).ok
    report = compare_step(recorded, shared, recorded.batch)
    assert report.ok and not report.unmatched, report.text()
    assert sum(e.what == "forward" for e in report.entries) == 7
    transfer_weights(recorded, unshared, probe=recorded.batch, strict=False)
    report = compare_step(recorded, unshared, recorded.batch)
    assert not report.ok and [f.key for f in report.findings] == [TIE] * 4
