"""gradmgr.parity on PaddlePaddle (issue 40): the CNN and the LayerNorm/Linear/GELU block of
tests/test_parity_tool.py written in Paddle (tests/parity_small_paddle.py) against their
PyTorch and MegEngine versions, weights transferred in both directions, one step compared
layer by layer, the drift of a few steps, and checkpoint files converted.

Runs in .venv-paddle (torch, MegEngine and Paddle in one process) with
GRADMGR_FRAMEWORKS=paddle,torch,megengine. Tolerances are the tool's own
(gradmgr/parity/tolerance.py); where a test asserts values itself it says its tolerance. A
copied tensor (a transfer, a converted checkpoint) moves no bits: compared for equality.
"""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")
torch = pytest.importorskip("torch")
mge = pytest.importorskip("megengine")

import megengine.optimizer  # noqa: E402,F401
import parity_small_mge as G  # noqa: E402
import parity_small_paddle as P  # noqa: E402
import parity_small_torch as T  # noqa: E402
from parity_tied_checks import (  # noqa: E402
    BLOCK,
    check_block_called_twice_on_one_side,
    check_edited_tied_checkpoint,
    check_shared_layer_on_both_sides,
    check_shared_layer_on_one_side,
    check_tied_checkpoint,
    check_tied_on_both_sides,
    check_tied_on_one_side,
    check_untied_into_tied,
)

from gradmgr.parity import (  # noqa: E402
    assert_parity,
    compare_step,
    convert_checkpoint,
    save_map,
    train_drift,
    transfer_weights,
)
from gradmgr.parity.contract import adapter_for  # noqa: E402
from gradmgr.parity.errors import MappingError  # noqa: E402

RS = np.random.RandomState(0)
XIMG = RS.randn(4, 3, 8, 8).astype(np.float32)
XSEQ = RS.randn(4, 5, 16).astype(np.float32)
X16 = RS.randn(8, 16).astype(np.float32)
MAKERS = {"torch": {"cnn": T.CNN, "block": T.Block, "mlp": T.MLP},
          "megengine": {"cnn": G.CNN, "block": G.Block, "mlp": G.MLP},
          "paddle": {"cnn": P.CNN, "block": P.Block, "mlp": P.MLP}}
BATCHES = {"cnn": XIMG, "block": XSEQ, "mlp": X16}
DIRECTIONS = ["torch->paddle", "paddle->torch", "megengine->paddle", "paddle->megengine"]
# each framework's BatchNorm momentum for PyTorch's 0.1 (the weight of the new statistic)
MOMENTUM = {"torch": 0.1, "megengine": 0.9, "paddle": 0.9}


def raw(model) -> dict:
    """Every parameter and buffer as its framework stores it, as numpy (not through the
    parity adapters: what the tests check them against)."""
    if isinstance(model, torch.nn.Module):
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return {k: np.array(v.numpy() if hasattr(v, "numpy") else v)
            for k, v in model.state_dict().items()}


def make(framework: str, case: str, seed: int, **broken):
    """A model with biases and statistics moved away from 0 and 1 (a lost or swapped one
    shows)."""
    torch.manual_seed(seed)
    paddle.seed(seed)
    model = MAKERS[framework][case](**broken)
    rs = np.random.RandomState(seed)
    state = {k: v + rs.uniform(0.05, 0.2, v.shape).astype(v.dtype)
             if v.dtype.kind == "f" and not k.endswith("weight") else v
             for k, v in raw(model).items()}
    if framework == "paddle":
        model.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    elif framework == "torch":
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    else:
        model.load_state_dict(state)
    return model


def pair(case: str, direction: str, **broken):
    """(reference, port, batch): the port built with the bug ``broken`` names, the
    reference's weights transferred into it."""
    src, dst = direction.split("->")
    a, b = make(src, case, 0), make(dst, case, 1, **broken)
    transfer_weights(a, b, probe=BATCHES[case], strict=False)
    return a, b, BATCHES[case]


def linear_names(model) -> set:
    return {f"{n}.weight" for n, m in model.named_sublayers() if isinstance(m, paddle.nn.Linear)}


def assert_transferred(a, b, paddle_model) -> None:
    """Every tensor of ``b`` is ``a``'s, bit for bit, as each framework stores it: Paddle's
    Linear weights transposed, its ``_mean``/``_variance`` torch's ``running_mean``/``_var``."""
    names = {"_mean": "running_mean", "_variance": "running_var"}
    va, vb = raw(a), raw(b)
    flip = linear_names(paddle_model)

    def common(name: str) -> str:
        layer, _, role = name.rpartition(".")
        return f"{layer}.{names.get(role, role)}"
    ca = {common(k): (k, v) for k, v in va.items() if "num_batches" not in k}
    cb = {common(k): (k, v) for k, v in vb.items() if "num_batches" not in k}
    assert ca.keys() == cb.keys() and len(ca) >= 6
    for name, (ka, x) in ca.items():
        kb, y = cb[name]
        if (ka if paddle_model is a else kb) in flip:
            x = x.T
        assert np.array_equal(x.reshape(y.shape), y), name


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", ["cnn", "block"])
def test_a_correct_port_is_ok_and_its_paddle_gradients_are_paddles_own(case, direction):
    src, dst = direction.split("->")
    a, b, x = make(src, case, 0), make(dst, case, 1), BATCHES[case]
    mapping = transfer_weights(a, b, probe=x)
    pm, other = (a, b) if src == "paddle" else (b, a)
    # the transfer: bit for bit, Paddle's Linear weights transposed and said so
    assert mapping.ok and mapping.unmapped == []
    assert_transferred(a, b, pm)
    side = "src" if src == "paddle" else "dst"
    for p in mapping.pairs:
        transposed = p.src.endswith("weight") and p.src.split(".")[0] in ("fc", "up", "down")
        assert (f"({side} stores it transposed, [in, out]" in p.how) == transposed, p
    reference = MAKERS["paddle"][case]()  # the Paddle model before the step
    reference.set_state_dict(pm.state_dict())
    report = assert_parity(a, b, x)
    assert report.ok and report.flips == [] and report.unmatched == []
    assert report.text().startswith("PARITY OK")
    compared = {e.name.split(" / ")[0] for e in report.entries if e.what == "grad"}
    assert compared == {n for n, _ in a.named_parameters()
                        if not n.endswith(("_mean", "_variance"))}
    # gradmgr's gradients on the Paddle model are Paddle's own loss.backward()'s, bit for bit
    reference(paddle.to_tensor(x)).mean().backward()
    theirs = dict(reference.named_parameters())
    for name, p in pm.named_parameters():
        if not p.stop_gradient:
            assert np.array_equal(p.grad.numpy(), theirs[name].grad.numpy()), name
    # and the other framework's, read as each stores them (Paddle's Linear transposed), to
    # 1e-4 of their layer's largest gradient
    flip, grads = linear_names(pm), _grads(other)
    for name, p in pm.named_parameters():
        if p.stop_gradient:
            continue
        g = p.grad.numpy().T if name in flip else p.grad.numpy()
        layer = name.rpartition(".")[0]
        scale = max(np.abs(v).max() for n, v in grads.items() if n.rpartition(".")[0] == layer)
        np.testing.assert_allclose(g, grads[name].reshape(g.shape), atol=1e-4 * scale, rtol=0,
                                   err_msg=name)


def _grads(model) -> dict:
    if isinstance(model, torch.nn.Module):
        return {n: p.grad.numpy() for n, p in model.named_parameters()}
    return {n: np.array(p.grad.numpy()) for n, p in model.named_parameters()}


def statistics(model) -> dict:
    """BatchNorm's running statistics under PyTorch's names, flattened."""
    found = {}
    for k, v in raw(model).items():
        layer, _, role = k.rpartition(".")
        role = {"_mean": "running_mean", "_variance": "running_var"}.get(role, role)
        if role in ("running_mean", "running_var"):
            found[f"{layer}.{role}"] = v.reshape(-1)
    return found


@pytest.mark.parametrize("direction", ["torch->paddle", "paddle->megengine"])
def test_batchnorm_statistics_momentum_translated_and_paddles_biased_variance_said(direction):
    """Momentum 0.9 in Paddle is 0.1 in PyTorch: the running means agree after a step. The
    running variances do not, and cannot: Paddle's kernel updates them with the biased batch
    variance (divided by N), PyTorch's and MegEngine's with the unbiased one (N - 1). The
    weight map says so; measured here to 1e-5 relative."""
    a, b, x = pair("cnn", direction)
    report = transfer_weights(a, b, probe=x)
    var = next(p for p in report.pairs if p.src.startswith("bn1") and "var" in p.src)
    assert "biased batch variance (divided by N;" in var.how
    mean = next(p for p in report.pairs if p.src.startswith("bn1") and "mean" in p.src)
    assert "biased" not in mean.how
    before = statistics(a)
    step = compare_step(a, b, x)
    assert step.ok
    # the running means as the step left them are rows; the variances, noted, are not
    assert sorted(e.name.split(" / ")[0] for e in step.entries if e.what == "buffer") == sorted(
        p.src for p in report.pairs if "mean" in p.src)
    after = statistics(a), statistics(b)
    paddle_side = 0 if direction.startswith("paddle") else 1
    assert after[0].keys() == after[1].keys() == before.keys() and len(before) == 4
    counts = {"bn1": 4 * 8 * 8, "bn2": 4 * 4 * 4}  # the elements per channel (N)
    for name, old in before.items():
        ours, theirs = after[paddle_side][name], after[1 - paddle_side][name]
        assert np.abs(ours - old).max() > 1e-3, name  # the statistics moved
        if name.endswith("mean"):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=name)
            continue
        n = counts[name.split(".")[0]]  # new = 0.9 old + 0.1 var: var * (N - 1) / N
        np.testing.assert_allclose(ours - 0.9 * old, (theirs - 0.9 * old) * (n - 1) / n,
                                   rtol=1e-5, atol=1e-7, err_msg=name)
        assert np.abs(ours - theirs).max() > 10 * 1e-5 * np.abs(theirs).max(), name


BROKEN = [  # (case, the port's bug, the layer it must be named at, its config key)
    ("cnn", {"bn_eps": 1e-3}, "bn2", "eps"),
    ("block", {"ln_eps": 1e-3}, "norm", "eps"),
    ("cnn", {"momentum": None}, "bn1", "momentum"),  # None: the other convention's number
]
# a momentum written in the other convention: PyTorch's 0.1 in a Paddle or MegEngine port
# (whose 0.9 is PyTorch's 0.1), Paddle's 0.9 in a PyTorch port
UNTRANSLATED = {"torch": 0.9, "megengine": 0.1, "paddle": 0.1}


@pytest.mark.parametrize("case,bug,layer,key,direction", [
    case + (d,) for case in BROKEN for d in DIRECTIONS
    if case[0] == "cnn" or d in ("torch->paddle", "paddle->megengine")],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_a_broken_port_is_parity_broken_at_its_layer(case, bug, layer, key, direction):
    if key == "momentum":
        bug = {"momentum": UNTRANSLATED[direction.split("->")[1]]}
    a, b, x = pair(case, direction, **bug)
    report = compare_step(a, b, x)
    assert not report.ok and report.text().startswith("PARITY BROKEN")
    assert [(f.layer_src, f.key) for f in report.findings] == [(layer, key)]
    if key == "momentum":  # the running statistics only: the step itself agrees
        assert report.first_forward is None and "PaddlePaddle's is 1 - it" in report.text()
        return
    assert report.first_forward is not None and report.first_forward.layer == layer
    with pytest.raises(AssertionError, match=f"first forward divergence: layer {layer} "):
        assert_parity(a, b, x)


@pytest.mark.parametrize("direction", ["torch->paddle", "paddle->torch"])
def test_a_port_multiplying_by_the_other_layout_is_broken_at_its_linear(direction):
    """A square Linear that multiplies as the other framework writes it (x @ W where the
    reference computes x @ W.T): the shapes fit, the values do not."""
    a, b, x = pair("mlp", direction, transposed=True)
    report = compare_step(a, b, x)
    assert not report.ok and report.text().startswith("PARITY BROKEN")
    assert report.first_forward is not None and report.first_forward.layer == "fc2"
    assert report.weights == [] and report.findings == []
    with pytest.raises(AssertionError, match="first forward divergence: layer fc2 "):
        assert_parity(a, b, x)


@pytest.mark.parametrize("direction", ["torch->paddle", "paddle->torch"])
def test_a_linear_weight_loaded_without_its_transpose_is_named(direction):
    """The porting bug Paddle's layout invites: a [out, in] weight loaded into an [in, out]
    Linear (or back) by reshaping, not transposing."""
    a, b, x = pair("block", direction)
    shape = tuple(b.up.weight.shape)
    wrong = raw(a)["up.weight"].reshape(shape)
    if isinstance(b, torch.nn.Module):
        with torch.no_grad():
            b.up.weight.copy_(torch.from_numpy(wrong))
    elif isinstance(b, paddle.nn.Layer):
        b.up.weight.set_value(wrong)
    else:
        b.up.weight._reset(mge.tensor(wrong))
    report = compare_step(a, b, x)
    assert report.weights == ["up.weight / up.weight"] and not report.ok
    assert report.text().startswith("PARITY BROKEN")
    assert report.first_forward is not None and report.first_forward.layer == "up"
    assert "transfer the weights first" in report.text()


def test_drift_is_small_for_a_correct_port_but_for_paddles_running_variances():
    """Against MegEngine (torch.optim's first optimizer imports torch._dynamo: 7 s here)."""
    a, b, _ = pair("cnn", "paddle->megengine")
    rs = np.random.RandomState(1)
    batches = [(rs.randn(4, 3, 8, 8).astype(np.float32), rs.randint(0, 10, 4))
               for _ in range(3)]
    report = train_drift(a, b, paddle.optimizer.Momentum(0.1, momentum=0.9,
                                                         parameters=a.parameters()),
                         mge.optimizer.SGD(b.parameters(), lr=0.1, momentum=0.9), batches,
                         loss_a=P.cross_entropy, loss_b=G.cross_entropy)
    assert report.steps == 3 and max(report.rel_l2) < 1e-5 and max(report.max_abs) < 1e-5
    np.testing.assert_allclose(report.loss_a, report.loss_b, rtol=1e-5)
    # the running variances (biased in Paddle) drift apart, step after step; the parameters
    # do not
    assert report.buffer_rel_l2[0] > 1e-4
    assert all(y > x for x, y in zip(report.buffer_rel_l2, report.buffer_rel_l2[1:]))


def _save(framework: str, model, path: str) -> None:
    state = model.state_dict()
    {"torch": torch.save, "paddle": paddle.save, "megengine": mge.save}[framework](state, path)


@pytest.mark.parametrize("other", ["torch", "megengine"])
def test_a_checkpoint_converts_paddle_to_the_other_and_back_bit_for_bit(other, tmp_path):
    pm, om = make("paddle", "cnn", 0), make(other, "cnn", 1)
    paths = {n: str(tmp_path / n) for n in ("map.json", "p.pd", "o.ckpt", "back.pd")}
    written = save_map(pm, om, paths["map.json"], probe=XIMG)
    fc = next(p for p in written["pairs"] if p["src"] == "fc.weight")
    assert fc["transform"] == "transpose" and fc["src_shape"] == [16, 10]
    assert fc["dst_shape"] == [10, 16]
    _save("paddle", pm, paths["p.pd"])
    convert_checkpoint(paths["p.pd"], paths["o.ckpt"], paths["map.json"])
    if other == "torch":
        om.load_state_dict(torch.load(paths["o.ckpt"]))  # strict: every key, no extra
    else:
        om.load_state_dict(mge.load(paths["o.ckpt"]))
    assert_transferred(pm, om, pm)
    original = raw(pm)
    pm.eval()
    om.eval()  # the running statistics converted too: eval mode reads them
    with torch.no_grad():  # the converted model computes what the original does (1e-5 rel)
        out_p = pm(paddle.to_tensor(XIMG)).numpy()
        out_o = (om(torch.from_numpy(XIMG)).numpy() if other == "torch"
                 else np.array(om(mge.tensor(XIMG)).numpy()))
    assert np.abs(out_p - out_o).max() <= 1e-5 * np.abs(out_p).max()
    convert_checkpoint(paths["o.ckpt"], paths["back.pd"], paths["map.json"], reverse=True)
    back = paddle.load(paths["back.pd"])
    assert back.keys() == original.keys()
    for name, value in original.items():
        assert np.array_equal(np.array(back[name].numpy()), value), name


@pytest.mark.parametrize("case", ["mlp", "cnn"])
def test_a_paddle_dump_keeps_the_weights_paddle_stores_transposed(case, tmp_path):
    """A dump read back must map as its live model does: the MLP's fc2 is square (32, 32), so
    a map built from a dump that forgot Paddle's [in, out] would pass every shape check and
    convert that weight untransposed; the CNN's BatchNorm variance keeps its note."""
    from gradmgr.parity import dump
    from gradmgr.parity.contract import adapter_for

    pm, tm = make("paddle", case, 0), make("torch", case, 1)
    recorded = dump(pm, BATCHES[case], str(tmp_path / "run.npz"))
    live = save_map(pm, tm, str(tmp_path / "live.json"), probe=BATCHES[case])
    offline = save_map(recorded, tm, str(tmp_path / "dump.json"), probe=BATCHES[case])
    assert offline == live
    assert recorded.slots() == adapter_for(pm).slots()
    assert recorded.header["framework_version"] == paddle.__version__
    flipped = {p["src"] for p in live["pairs"] if p["transform"] == "transpose"}
    assert flipped == linear_names(pm) and len(flipped) >= 1


# Tied weights (docs/paddle.md): an LM head on its embedding's weight, as Paddle ports write it
# (a matmul with transpose_y, tests/parity_small_paddle.py), and two nn.Linear on one weight
# (stored [in, out] under both names), and one layer holding its weight under two attribute
# names (tests/test_parity_tool.py's "own", there a MegEngine fix).
TIED = {"torch": {"lm": T.TiedLM, "shared": T.Shared, "own": T.TiedInOneModule},
        "paddle": {"lm": P.TiedLM, "shared": P.Shared, "own": P.TiedInOneModule}}
TIED_BATCHES = {"lm": RS.randint(0, 10, (4, 5)), "shared": RS.randn(4, 8).astype(np.float32)}
TIED_BATCHES["own"] = TIED_BATCHES["shared"]
TIES = {"lm": ("head.weight", "emb.weight"), "shared": ("b.weight", "a.weight"),
        "shared_layer": ("b.weight", "a.weight"), "own": ("core.w2", "core.w")}


def tied_model(framework: str, case: str, tied: bool, seed: int):
    torch.manual_seed(seed)
    paddle.seed(seed)
    return TIED[framework][case](tied=tied)


def untied_paddle_grads(pm, case: str, batch) -> dict:
    """The gradients Paddle's own loss.backward() gives an untied copy of ``pm`` (each name
    its own parameter, the tied values copied to both), as Paddle stores them."""
    copy = tied_model("paddle", case, False, 2)
    copy.set_state_dict({n: paddle.to_tensor(p.numpy())
                         for n, p in pm.named_parameters(remove_duplicate=False)})
    copy(paddle.to_tensor(batch)).mean().backward()  # compare_step's loss: the output's mean
    return {n: p.grad.numpy() for n, p in copy.named_parameters()}


@pytest.mark.parametrize("direction", ["torch->paddle", "paddle->torch"])
@pytest.mark.parametrize("case", ["lm", "shared", "own"])
def test_tied_weights_on_both_sides_are_parity_and_sum_both_uses(case, direction):
    src, dst = direction.split("->")
    a, b, x = tied_model(src, case, True, 0), tied_model(dst, case, True, 1), TIED_BATCHES[case]
    alias, first = TIES[case]
    pm = a if src == "paddle" else b
    # the tied gradient sums both uses on both sides: torch's within 1e-5 of its largest (two
    # frameworks' float32 kernels), and Paddle's is what Paddle's own backward gives an untied
    # copy's two parameters together (1e-6 of its largest: the sum's order)
    check_tied_on_both_sides(a, b, x, pm, alias, first, rel=1e-5)
    own = untied_paddle_grads(pm, case, x)
    stored = dict(pm.named_parameters())[first].grad.numpy()
    np.testing.assert_allclose(stored, own[first] + own[alias], rtol=0,
                               atol=1e-6 * np.abs(stored).max())


@pytest.mark.parametrize("tied_side", ["paddle", "torch"])
@pytest.mark.parametrize("case", ["lm", "shared", "own"])
def test_tied_weights_on_one_side_only_are_a_finding_at_the_gradients(case, tied_side):
    """The tied side is the reference (parity_tied_checks.check_tied_on_one_side); the tied
    gradient within 1e-5 of its largest of the sum of the untied side's two."""
    other = "torch" if tied_side == "paddle" else "paddle"
    a, b = tied_model(tied_side, case, True, 0), tied_model(other, case, False, 1)
    check_tied_on_one_side(a, b, TIED_BATCHES[case], *TIES[case], rel=1e-5)


class _LinearOnEmbedding(paddle.nn.Layer):
    """An nn.Linear (10 -> 8) on an embedding's weight: stored [10, 8], the embedding's
    [vocab, dim] and the Linear's [in, out] at once."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = paddle.nn.Embedding(10, 8), paddle.nn.Linear(10, 8, bias_attr=False)
        self.head.weight = self.emb.weight

    def forward(self, t):
        return self.emb(t) * self.head(paddle.nn.functional.one_hot(t, 10))


def test_a_linear_tied_to_an_embedding_is_transposed_as_the_linear_its_dump_too(tmp_path):
    from gradmgr.parity import dump

    paddle.seed(0)
    model, t = _LinearOnEmbedding(), TIED_BATCHES["lm"]
    adapter = adapter_for(model)
    assert adapter.aliases == {"head.weight": "emb.weight"}
    slots = {s.name: (s.shape, s.transposed) for s in adapter.slots()}
    assert slots == {"emb.weight": ((10, 8), False), "head.weight": ((8, 10), True)}
    assert np.array_equal(adapter.read("head.weight"), model.emb.weight.numpy().T)
    value = RS.randn(8, 10).astype(np.float32)
    adapter.write("head.weight", value)
    assert np.array_equal(model.emb.weight.numpy(), value.T)
    recorded = dump(model, t, str(tmp_path / "run.npz"))
    g = model.emb.weight.grad.numpy()
    assert np.array_equal(adapter.grad("emb.weight"), g)
    assert np.array_equal(adapter.grad("head.weight"), g.T)
    for name in ("emb.weight", "head.weight"):  # the dump reads each name in its own layout
        assert np.array_equal(recorded.read(name), adapter.read(name)), name
        assert np.array_equal(recorded.grad(name), adapter.grad(name)), name


class _LMHead(paddle.nn.Layer):
    """PaddleNLP's LM head: the embedding's weight held as ``decoder_weight``."""

    def __init__(self, weight) -> None:
        super().__init__()
        self.decoder_weight = weight

    def forward(self, x):
        return paddle.matmul(x, self.decoder_weight, transpose_y=True)


class _HeadOrInline(paddle.nn.Layer):
    """T.TiedLM's port with the head in an _LMHead (``head``), or written inline in the
    model's forward: a second use under no second name."""

    def __init__(self, head: bool) -> None:
        super().__init__()
        self.emb, self.mid = paddle.nn.Embedding(10, 8), paddle.nn.Linear(8, 8)
        self.head = _LMHead(self.emb.weight) if head else None

    def forward(self, t):
        x = paddle.tanh(self.mid(self.emb(t)))
        return (self.head(x) if self.head is not None
                else paddle.matmul(x, self.emb.weight, transpose_y=True))


def test_a_tie_under_another_name_pairs_by_name_map_and_one_under_none_is_unmapped():
    x = TIED_BATCHES["lm"]
    a = tied_model("torch", "lm", True, 0)
    with pytest.raises(MappingError, match="unmapped \\(src\\) head.weight: no linear layer"):
        transfer_weights(a, _HeadOrInline(head=False), probe=x)
    b = _HeadOrInline(head=True)
    with pytest.raises(MappingError, match="unmapped \\(dst\\) head.decoder_weight"):
        transfer_weights(a, b, probe=x)
    name_map = {"head.weight": "head.decoder_weight"}
    assert transfer_weights(a, b, name_map, probe=x).ok
    report = compare_step(a, b, x, name_map=name_map)
    assert report.ok, report.text()
    assert "head.weight / head.decoder_weight" in {e.name for e in report.entries}


# One Linear under two names (``self.b = self.a``), as tests/test_parity_tool.py's against
# MegEngine: stored [in, out] under both names.
SHARED_LAYER = {"torch": T.SharedLayer, "paddle": P.SharedLayer}


def shared_layer(framework: str, shared: bool, seed: int):
    torch.manual_seed(seed)
    paddle.seed(seed)
    return SHARED_LAYER[framework](shared=shared)


@pytest.mark.parametrize("direction", ["torch->paddle", "paddle->torch"])
def test_a_layer_shared_under_two_names_on_both_sides_is_parity_with_paddle(direction):
    """parity_tied_checks.check_shared_layer_on_both_sides, torch's gradients to 1e-5 of
    their largest."""
    src, dst = direction.split("->")
    a, b, x = shared_layer(src, True, 0), shared_layer(dst, True, 1), TIED_BATCHES["shared"]
    check_shared_layer_on_both_sides(a, b, x, rel=1e-5)
    # the shared gradient sums both uses: what Paddle's own backward gives an unshared copy
    pm = a if src == "paddle" else b
    copy = shared_layer("paddle", False, 2)
    values = {n: paddle.to_tensor(p.numpy()) for n, p in pm.named_parameters()}
    copy.set_state_dict({**values, "b.weight": values["a.weight"], "b.bias": values["a.bias"]})
    copy(paddle.to_tensor(x)).mean().backward()
    own = {n: p.grad.numpy() for n, p in copy.named_parameters()}
    stored = pm.a.weight.grad.numpy()
    np.testing.assert_allclose(stored, own["a.weight"] + own["b.weight"], rtol=0,
                               atol=1e-6 * np.abs(stored).max())


@pytest.mark.parametrize("shared_side", ["paddle", "torch"])
def test_a_layer_shared_on_one_side_only_is_a_tie_finding_with_paddle(shared_side):
    """parity_tied_checks.check_shared_layer_on_one_side, the gradients to 1e-5."""
    other = "torch" if shared_side == "paddle" else "paddle"
    a, b = shared_layer(shared_side, True, 0), shared_layer(other, False, 1)
    check_shared_layer_on_one_side(a, b, TIED_BATCHES["shared"], rel=1e-5)


# Checkpoints of tied models (tests/parity_tied_checks.py; tests/test_parity_checkpoint_ties.py
# on PyTorch and MegEngine alone): a converted tensor moves no bits; forwards within 1e-5.
TIED_CLASSES = {"lm": "TiedLM", "shared": "Shared", "shared_layer": "SharedLayer",
                "own": "TiedInOneModule"}
TIED_PORTS = {"torch": T, "megengine": G, "paddle": P}


def tied_maker(framework: str, case: str, tied: bool):
    def make(seed: int):
        torch.manual_seed(seed)
        paddle.seed(seed)
        mge.random.seed(seed)
        return getattr(TIED_PORTS[framework], TIED_CLASSES[case])(tied)
    return make


def _batch(case: str) -> np.ndarray:
    return TIED_BATCHES["shared" if case == "shared_layer" else case]


@pytest.mark.parametrize("case", ["lm", "shared", "shared_layer", "own"])
@pytest.mark.parametrize("other", ["torch", "megengine", "paddle"])
def test_a_tied_paddle_checkpoint_converts_to_the_other_and_back_bit_for_bit(other, case,
                                                                             tmp_path):
    check_tied_checkpoint(tied_maker("paddle", case, True), tied_maker(other, case, True),
                          _batch(case), str(tmp_path), rel=1e-5)


def test_a_paddle_linear_tied_to_an_embedding_converts_in_its_stored_layout(tmp_path):
    def make(seed: int):
        paddle.seed(seed)
        return _LinearOnEmbedding()
    written = check_tied_checkpoint(make, make, TIED_BATCHES["lm"], str(tmp_path), rel=1e-5)
    head = next(p for p in written["pairs"] if p["src"] == "head.weight")
    assert head["src_shape"] == head["dst_shape"] == [10, 8] and head["transform"] is None


@pytest.mark.parametrize("case", ["lm", "shared", "shared_layer", "own"])
@pytest.mark.parametrize("tied,untied", [("paddle", "torch"), ("torch", "paddle"),
                                         ("paddle", "megengine"), ("megengine", "paddle")])
def test_tied_on_one_side_with_paddle_never_picks_one_of_two_values(tied, untied, case,
                                                                     tmp_path):
    check_untied_into_tied(tied_maker(tied, case, True), tied_maker(untied, case, False),
                           _batch(case), str(tmp_path), *TIES[case], rel=1e-5)


@pytest.mark.parametrize("case", ["lm", "shared"])
@pytest.mark.parametrize("other", ["torch", "megengine"])
def test_a_paddle_checkpoint_whose_tied_names_differ_is_refused(other, case, tmp_path):
    check_edited_tied_checkpoint(tied_maker("paddle", case, True),
                                 tied_maker(other, case, True), _batch(case), str(tmp_path),
                                 *TIES[case])


# One block of three layers shared, as tests/test_parity_tool.py's against MegEngine: under
# two names (SharedBlock) or called twice under one (BlockCalledTwice); every pair of
# frameworks with Paddle, MegEngine's too.
BLOCKS = {"torch": {"named": T.SharedBlock, "called": T.BlockCalledTwice},
          "megengine": {"named": G.SharedBlock, "called": G.BlockCalledTwice},
          "paddle": {"named": P.SharedBlock, "called": P.BlockCalledTwice}}


def block_model(framework: str, case: str, shared: bool, seed: int):
    torch.manual_seed(seed)
    paddle.seed(seed)
    mge.random.seed(seed)
    return BLOCKS[framework][case](shared=shared)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", ["named", "called"])
def test_a_block_shared_on_both_sides_pairs_its_layers_and_is_parity_with_paddle(case,
                                                                                 direction):
    """parity_tied_checks.check_shared_layer_on_both_sides: seven calls each paired with its
    namesake; the gradients to 1e-5 of their largest."""
    src, dst = direction.split("->")
    a, b = block_model(src, case, True, 0), block_model(dst, case, True, 1)
    check_shared_layer_on_both_sides(a, b, TIED_BATCHES["shared"], rel=1e-5, forwards=7)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_block_under_two_names_on_one_side_only_is_a_tie_finding_with_paddle(direction):
    """parity_tied_checks.check_shared_layer_on_one_side (the shared side first): a tie
    finding for each of the block's four tensors, the gradients to 1e-5."""
    src, dst = direction.split("->")
    a, b = block_model(src, "named", True, 0), block_model(dst, "named", False, 1)
    check_shared_layer_on_one_side(a, b, TIED_BATCHES["shared"], rel=1e-5, tied=BLOCK,
                                   forwards=7)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("shared_side", ["src", "dst"])
def test_a_block_called_twice_on_one_side_only_is_refused_with_paddle(shared_side,
                                                                      direction):
    """parity_tied_checks.check_block_called_twice_on_one_side."""
    src, dst = direction.split("->")
    a = block_model(src, "called", shared_side == "src", 0)
    b = block_model(dst, "called", shared_side == "dst", 1)
    check_block_called_twice_on_one_side(a, b, TIED_BATCHES["shared"])


class _TorchEmb(torch.nn.Module):
    def __init__(self, pad) -> None:  # noqa: ANN001
        super().__init__()
        self.emb, self.fc = torch.nn.Embedding(5, 4, padding_idx=pad), torch.nn.Linear(4, 2)

    def forward(self, ids):  # noqa: ANN001, ANN201
        return self.fc(self.emb(ids))


class _PaddleEmb(paddle.nn.Layer):
    def __init__(self, pad) -> None:  # noqa: ANN001
        super().__init__()
        self.emb, self.fc = paddle.nn.Embedding(5, 4, padding_idx=pad), paddle.nn.Linear(4, 2)

    def forward(self, ids):  # noqa: ANN001, ANN201
        return self.fc(self.emb(ids))


IDS_NO_PAD = np.array([[1, 2, 3], [3, 2, 1]], dtype=np.int64)


@pytest.mark.parametrize("pads", [(0, None), (None, 0), (0, 4), (-1, 0)])
def test_an_embedding_padding_idx_dropped_or_moved_in_the_paddle_port_is_a_finding(pads):
    """The padding row gets no gradient (in PyTorch and Paddle alike): a port without it, or
    with another, trains that row differently, which a batch without the padding id does not
    show. That port used to be PARITY OK on such a batch, the weight map ok."""
    torch.manual_seed(0)
    a, b = _TorchEmb(pads[0]), _PaddleEmb(pads[1])
    want = [4 if p == -1 else p for p in pads]  # -1: the last row, on both sides
    with pytest.raises(MappingError, match=f"emb / emb: padding_idx is {want[0]} on one side, "
                                           f"{want[1]} on the other"):
        transfer_weights(a, b, probe=IDS_NO_PAD)
    transfer_weights(a, b, probe=IDS_NO_PAD, strict=False)
    report = compare_step(a, b, IDS_NO_PAD)
    assert not report.ok and [(f.layer_src, f.key) for f in report.findings] == [
        ("emb", "padding_idx")], report.text()
    assert report.first_forward is None and report.first_grad is None  # the batch: alike


@pytest.mark.parametrize("pads", [(0, 0), (-1, -1), (-1, 4), (None, None)])
def test_an_embedding_with_the_same_padding_row_in_the_paddle_port_is_parity(pads):
    torch.manual_seed(0)
    a, b = _TorchEmb(pads[0]), _PaddleEmb(pads[1])
    assert transfer_weights(a, b, probe=IDS_NO_PAD).ok
    ids = np.array([[0, 1, 4], [4, 2, 0]], dtype=np.int64)  # padding ids too
    assert compare_step(a, b, ids).ok


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("direction", ["torch->paddle", "paddle->torch"])
def test_a_paddle_conv2dtranspose_pairs_with_torchs_convtranspose2d(groups, direction):
    """Paddle's Conv2DTranspose is torch's ConvTranspose2d, weight [in, out / groups, k, k]
    in both (4 channels in and out: the shapes cannot tell the two dims apart, the values
    do). Its kind was conv2dtranspose, no match for convtranspose2d: the automatic map
    refused it and compare_step called it a substituted layer, a correct port BROKEN."""
    torch.manual_seed(0)
    paddle.seed(0)
    models = [torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 4, 3, groups=groups)),
              paddle.nn.Sequential(paddle.nn.Conv2DTranspose(4, 4, 3, groups=groups))]
    a, b = models if direction == "torch->paddle" else models[::-1]
    x = RS.randn(2, 4, 5, 5).astype(np.float32)
    report = transfer_weights(a, b, probe=x)
    assert report.ok and [p.how for p in report.pairs] == ["copy", "copy"]
    report = compare_step(a, b, x)
    assert report.ok, report.text()
    assert [e.name for e in report.entries if e.what == "grad"] == ["0.weight / 0.weight",
                                                                    "0.bias / 0.bias"]


def test_a_paddle_conv2dtranspose_weight_with_its_channel_dims_exchanged_is_broken_at_it():
    """[in, out, k, k] read as [out, in, k, k]: with 4 channels in and out the shapes fit."""
    torch.manual_seed(0)
    paddle.seed(0)
    a = torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 4, 3))
    b = paddle.nn.Sequential(paddle.nn.Conv2DTranspose(4, 4, 3))
    x = RS.randn(2, 4, 5, 5).astype(np.float32)
    transfer_weights(a, b, probe=x)
    b[0].weight.set_value(np.ascontiguousarray(b[0].weight.numpy().transpose(1, 0, 2, 3)))
    report = compare_step(a, b, x)
    assert not report.ok and report.first_forward.layer == "0", report.text()
    assert report.weights == ["0.weight / 0.weight"]  # and said: not the weights transferred


def _rnns(kind, direction, deep=True, size=(3, 4), layers=None):  # noqa: ANN001, ANN202
    """torch's and Paddle's GRU or LSTM of ``size`` (input, hidden) and ``layers`` (``deep``:
    two layers, both ways; one way else), then a Linear."""
    (inp, hidden), layers, two = size, layers or 1 + deep, deep and not layers

    class TorchRNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(torch.nn, kind)(inp, hidden, num_layers=layers,
                                               batch_first=True, bidirectional=two)
            self.fc = torch.nn.Linear(hidden * (1 + two), 2)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.fc(self.rnn(x)[0])

    class PaddleRNN(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(paddle.nn, kind)(inp, hidden, num_layers=layers,
                                                direction="bidirect" if two else "forward")
            self.fc = paddle.nn.Linear(hidden * (1 + two), 2)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.fc(self.rnn(x)[0])

    torch.manual_seed(0)
    paddle.seed(0)
    models = (TorchRNN(), PaddleRNN())
    return models if direction == "torch->paddle" else models[::-1]


def _set(model, name, value):  # noqa: ANN001, ANN202
    """``model.rnn``'s parameter ``name`` set to the array ``value``."""
    if isinstance(model, torch.nn.Module):
        with torch.no_grad():
            getattr(model.rnn, name).copy_(torch.from_numpy(value))
    else:
        getattr(model.rnn, name).set_value(value)


XRNN = RS.randn(2, 5, 3).astype(np.float32)


@pytest.mark.parametrize("deep", [False, True])
@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["torch->paddle", "paddle->torch"])
def test_a_paddle_gru_or_lstm_maps_to_torchs_and_a_gate_swap_is_broken_at_it(kind, direction,
                                                                            deep):
    """Paddle's GRU and LSTM keep torch's names, layouts and gate order (weight_ih_l0 of
    [gates * hidden, in]; measured here: every forward and gradient within the tool's
    tolerance). Their cells hold the same parameters again under other names, and an empty
    _dropout_state buffer could not be written back: the weight map raised ValueError
    ("cannot reshape array of size 0"). A gate pair swapped in one weight is BROKEN at it."""
    a, b = _rnns(kind, direction, deep)
    count = 2 + 16 if deep else 2 + 4  # the Linear's and the RNN's
    report = transfer_weights(a, b, probe=XRNN)
    assert report.ok and len(report.pairs) == count, report.text()
    report = compare_step(a, b, XRNN)
    assert report.ok and len([e for e in report.entries if e.what == "grad"]) == count, (
        report.text())
    name = "weight_hh_l1" if deep else "weight_hh_l0"
    weight = raw(b)[f"rnn.{name}"]  # its first two gates (r, z; i, f) exchanged
    _set(b, name, np.concatenate([weight[4:8], weight[:4], weight[8:]]))
    report = compare_step(a, b, XRNN)
    assert not report.ok and report.first_forward.layer == "rnn", report.text()


# An LSTM of 4 layers, 32 -> 64, over 80 steps: its output's difference between the
# frameworks was 1.28-1.45 times the tolerance of an elementwise layer (the old code's), 0.37
# of the recurrent layers' (bench/parity_tolerance_rnn.py, bench/RESULTS.md)
XLONG = np.random.RandomState(0).randn(4, 80, 32).astype(np.float32)


@pytest.mark.parametrize("direction", ["torch->paddle", "paddle->torch"])
def test_a_long_deep_lstm_port_is_ok_and_its_gates_swapped_broken(direction):
    """Old code: this correct port was PARITY BROKEN at the LSTM (its forward's tolerance
    was an elementwise layer's; tolerance.py's recurrent_reduction now). Its last layer's
    first two gates swapped stay BROKEN at it."""
    a, b = _rnns("LSTM", direction, size=(32, 64), layers=4)
    transfer_weights(a, b, probe=XLONG)
    report = compare_step(a, b, XLONG)
    assert report.ok and report.first_forward is None, report.text()
    rnn = next(e for e in report.entries if e.what == "forward" and e.layer == "rnn")
    assert rnn.max_abs > 0 and rnn.tol <= 2e-5 * rnn.max_abs / rnn.max_rel  # not vacuous
    weight = raw(b)["rnn.weight_hh_l3"]  # [4 * 64, 64]: i, f, g, o
    _set(b, "weight_hh_l3", np.concatenate([weight[64:128], weight[:64], weight[128:]]))
    report = compare_step(a, b, XLONG)
    assert not report.ok and report.first_forward.layer == "rnn", report.text()


def test_a_transposed_square_lstm_weight_is_broken_under_the_recurrent_tolerance():
    """An LSTM 256 -> 64 (weight_ih_l0 [4 * 64, 256], square), two layers, 80 steps: its
    tolerance counts 448 terms (sqrt: 21 times an elementwise layer's), and a port whose
    input weight is used transposed is BROKEN at it all the same."""
    x = np.random.RandomState(1).randn(4, 80, 256).astype(np.float32)
    a, b = _rnns("LSTM", "torch->paddle", size=(256, 64), layers=2)
    transfer_weights(a, b, probe=x)
    assert compare_step(a, b, x).ok
    _set(b, "weight_ih_l0", np.ascontiguousarray(raw(b)["rnn.weight_ih_l0"].T))
    report = compare_step(a, b, x)
    assert not report.ok and report.first_forward.layer == "rnn", report.text()


def test_a_paddle_gru_checkpoint_converts_with_its_cells_names_and_back(tmp_path):
    """Paddle's state dict lists an RNN's parameters twice (rnn.weight_ih_l0 and
    rnn.0.cell_fw.weight_ih): the converted file holds both (set_state_dict finds no key
    missing or unexpected), and converting it back reads the one value, refusing two."""
    ref, port = _rnns("GRU", "torch->paddle")
    save_map(ref, port, str(tmp_path / "map.json"), probe=XRNN)
    torch.save(ref.state_dict(), tmp_path / "ref.pth")
    convert_checkpoint(str(tmp_path / "ref.pth"), str(tmp_path / "port.pdparams"),
                       str(tmp_path / "map.json"))
    state = paddle.load(str(tmp_path / "port.pdparams"))
    assert set(state) == set(port.state_dict())
    assert port.set_state_dict(state) == ([], [])
    np.testing.assert_array_equal(port.rnn.weight_ih_l0.numpy(), ref.rnn.weight_ih_l0.detach())
    convert_checkpoint(str(tmp_path / "port.pdparams"), str(tmp_path / "back.pth"),
                       str(tmp_path / "map.json"), reverse=True)
    back = torch.load(tmp_path / "back.pth")
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())
    state = paddle.load(str(tmp_path / "port.pdparams"))  # (set_state_dict emptied it)
    assert "rnn.0.cell_fw.weight_ih" in state  # the forward cell of the first layer
    state["rnn.0.cell_fw.weight_ih"] = state["rnn.0.cell_fw.weight_ih"] + 1  # one name edited
    paddle.save(state, str(tmp_path / "edited.pdparams"))
    with pytest.raises(MappingError, match="rnn.weight_ih_l0, rnn.0.cell_fw.weight_ih: one "
                                           "parameter"):
        convert_checkpoint(str(tmp_path / "edited.pdparams"), str(tmp_path / "no.pth"),
                           str(tmp_path / "map.json"), reverse=True)


@pytest.mark.parametrize("direction", ["paddle->megengine", "megengine->paddle"])
def test_a_grouped_paddle_conv_maps_to_megengines_and_is_parity(direction):
    """Paddle's grouped Conv2D weight is torch's [out, in / groups, k, k], MegEngine's
    (groups, out / groups, in / groups, k, k): the same order, reshaped (old code: unmapped,
    "not a layout-only change")."""
    paddle.seed(0)
    mge.random.seed(0)
    models = [paddle.nn.Sequential(paddle.nn.Conv2D(4, 4, 3, groups=2)),
              mge.module.Sequential(mge.module.Conv2d(4, 4, 3, groups=2))]
    a, b = models if direction == "paddle->megengine" else models[::-1]
    x = RS.randn(2, 4, 6, 6).astype(np.float32)
    report = transfer_weights(a, b, probe=x)
    assert "grouped convolution" in {p.src: p.how for p in report.pairs}["0.weight"]
    report = compare_step(a, b, x)
    assert report.ok, report.text()
