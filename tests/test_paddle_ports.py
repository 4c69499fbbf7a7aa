"""The Paddle porting examples (examples/porting/paddle_*.py) against their torch originals,
without the parity tool: the torch model's weights copied by hand (``nn.Linear`` weights
transposed to Paddle's ``[in, out]``, BatchNorm's running statistics to ``_mean`` /
``_variance``), one training step (train mode, cross entropy) on the same batch in each
framework, and every named layer's output, the logits and every parameter's gradient compared.

The correct ports agree with torch within ``CROSS_FW`` = 1e-4 of the largest magnitude of the
tensor's layer (as tests/test_parity_models.py: two frameworks' kernels round differently).
Each broken port of ``paddle_broken.PORTS`` is bit-identical to the correct Paddle port (same
weights, same kernels) up to its bug, and differs from torch where it says it does, by more than
``SEPARATION`` = 10 times the correct port's own difference there: a forward bug at its
``layer``'s output (every layer finished before it bit-identical), a backward-only bug in a
gradient (by more than 10 x ``CROSS_FW`` too) while every output is bit-identical, the
config-only bug in BatchNorm's running mean (likewise) while outputs and gradients are
bit-identical. So the fixtures the PaDiff bench (bench/bench_padiff.py) runs on are
what they say they are. ResNet-18 runs on 8 images of 16 x 16, the encoder on 4 sequences of 16.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Dict, Tuple

import numpy as np
import paddle
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
from porting import (  # noqa: E402
    paddle_broken,
    paddle_encoder,
    paddle_resnet,
    torch_encoder,
    torch_resnet,
)

CROSS_FW = 1e-4
SEPARATION = 10
BUFFERS = {"running_mean": "_mean", "running_var": "_variance"}

TORCH = {"resnet18": torch_resnet.resnet18, "encoder": torch_encoder.EncoderClassifier}
PADDLE = {"resnet18": paddle_resnet.resnet18, "encoder": paddle_encoder.EncoderClassifier}


def batch(model: str) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    if model == "resnet18":
        return rng.standard_normal((8, 3, 16, 16)).astype("float32"), rng.integers(0, 10, 8)
    return rng.integers(0, 100, (4, 16)).astype("int64"), rng.integers(0, 3, 4)


def paddle_state(src: Any) -> Dict[str, np.ndarray]:
    """torch's state as Paddle names it: Linear weights transposed, BatchNorm buffers renamed."""
    linears = {f"{n}.weight" for n, m in src.named_modules() if isinstance(m, torch.nn.Linear)}
    state = {}
    for name, value in src.state_dict().items():
        if name.endswith("num_batches_tracked"):
            continue
        prefix, _, leaf = name.rpartition(".")
        array = value.detach().numpy().copy()  # the buffers change in place in a step
        state[f"{prefix}.{BUFFERS.get(leaf, leaf)}"] = array.T if name in linears else array
    return state


def load(dst: Any, state: Dict[str, np.ndarray]) -> None:
    target = dst.state_dict()
    assert set(state) == set(target), set(state) ^ set(target)
    assert all(tuple(target[k].shape) == v.shape for k, v in state.items())
    dst.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})


def recorder(outputs: Dict[str, np.ndarray], name: str) -> Any:
    """A forward hook keeping a layer's first output (a hook must return None)."""
    def hook(_layer: Any, _inputs: Any, out: Any) -> None:
        if name not in outputs:
            outputs[name] = (out.detach() if hasattr(out, "detach") else out).numpy().copy()
    return hook


def step_torch(model: Any, x: np.ndarray, y: np.ndarray) -> Dict[str, Any]:
    outputs: Dict[str, np.ndarray] = {}
    for name, m in model.named_modules():
        m.register_forward_hook(recorder(outputs, name))
    model.train()
    logits = model(torch.from_numpy(x))
    torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    means = {n: b.numpy() for n, b in model.named_buffers() if n.endswith("running_mean")}
    return {"outputs": outputs, "grads": grads, "means": means}


def step_paddle(model: Any, x: np.ndarray, y: np.ndarray) -> Dict[str, Any]:
    outputs: Dict[str, np.ndarray] = {}
    for name, m in model.named_sublayers(include_self=True):
        m.register_forward_post_hook(recorder(outputs, name))
    model.train()
    logits = model(paddle.to_tensor(x))
    paddle.nn.functional.cross_entropy(logits, paddle.to_tensor(y)).backward()
    # BatchNorm's running statistics are parameters with stop_gradient set in Paddle
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if not p.stop_gradient}
    # Linear weights are [in, out] here: compare with torch's (out, in)
    grads = {n: g.T if g.ndim == 2 and not n.startswith("embeddings") else g
             for n, g in grads.items()}
    means = {n.replace("_mean", "running_mean"): b.numpy()
             for n, b in model.named_parameters() if n.endswith("._mean")}
    return {"outputs": outputs, "grads": grads, "means": means}


def layer_of(name: str) -> str:
    return name.rpartition(".")[0]


def rel_diffs(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> Dict[str, float]:
    """Per name: the largest difference over the largest magnitude of ``a`` in the name's layer
    (a gradient that cancels to rounding noise, as the attention key's bias, is judged at the
    scale of its layer's weight)."""
    assert set(a) <= set(b), set(a) - set(b)
    scale: Dict[str, float] = {}
    for n, v in a.items():
        scale[layer_of(n)] = max(scale.get(layer_of(n), 0.0), float(np.abs(v).max()))
    return {n: float(np.abs(a[n] - b[n]).max() / max(scale[layer_of(n)], 1e-30)) for n in a}


_RUNS: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]] = {}
_STATES: Dict[str, Dict[str, np.ndarray]] = {}


def reference_runs(model: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """torch's step and the correct Paddle port's, once per model (the weights kept too)."""
    if model not in _RUNS:
        torch.manual_seed(0)
        reference = TORCH[model]()
        _STATES[model] = paddle_state(reference)
        x, y = batch(model)
        _RUNS[model] = step_torch(reference, x, y), step_paddle(port(model, PADDLE[model]), x, y)
    return _RUNS[model]


def port(model: str, build: Any) -> Any:
    """A Paddle model holding the torch reference's initial weights."""
    paddle_model = build()
    load(paddle_model, _STATES[model])
    return paddle_model


def diffs(ref: Dict[str, Any], port: Dict[str, Any], what: str) -> Dict[str, float]:
    return rel_diffs(ref[what], port[what])


def identical(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("model", ["resnet18", "encoder"])
def test_correct_paddle_port_equals_torch(model):
    ref, port = reference_runs(model)
    worst = {what: max(diffs(ref, port, what).items(), key=lambda kv: kv[1], default=("", 0.0))
             for what in ("outputs", "grads", "means")}
    assert all(d <= CROSS_FW for _, d in worst.values()), worst


@pytest.mark.parametrize("name", sorted(paddle_broken.PORTS))
def test_broken_paddle_port_differs_where_it_says(name):
    """Against the correct Paddle port (same weights, same kernels): bit-identical up to the
    bug; against torch: beyond 10 x the correct port's own difference from torch there."""
    spec = paddle_broken.PORTS[name]
    ref, correct = reference_runs(spec.model)
    broken = step_paddle(port(spec.model, spec.build), *batch(spec.model))
    bad, good = ({w: diffs(ref, run, w) for w in ("outputs", "grads", "means")}
                 for run in (broken, correct))
    if spec.config_only or spec.backward_only:
        assert identical(broken["outputs"], correct["outputs"])
    if spec.config_only:
        assert identical(broken["grads"], correct["grads"])
        key = f"{spec.layer}.running_mean"
        assert bad["means"][key] > SEPARATION * max(good["means"][key], CROSS_FW), key
    elif spec.backward_only:
        worst = max(bad["grads"], key=lambda n: bad["grads"][n] - SEPARATION * good["grads"][n])
        assert bad["grads"][worst] > SEPARATION * max(good["grads"][worst], CROSS_FW), worst
    else:
        order = list(correct["outputs"])
        before = order[:order.index(spec.layer)]
        assert identical({n: broken["outputs"][n] for n in before},
                         {n: correct["outputs"][n] for n in before})
        assert not np.array_equal(broken["outputs"][spec.layer], correct["outputs"][spec.layer])
        at = bad["outputs"][spec.layer]
        assert at > SEPARATION * good["outputs"][spec.layer], at


def parity_verdict(model: str, build: Any) -> Tuple[bool, str]:
    """What a porting user gets from the parity tool on the torch reference and a Paddle port:
    (a difference reported, the text that names where). ``transfer_weights`` refusing a
    layer's configuration is a report at that layer, before any step."""
    from gradmgr.parity import MappingError, compare_step, transfer_weights

    torch.manual_seed(0)
    paddle.seed(0)
    reference, paddle_model = TORCH[model](), build()
    try:
        transfer_weights(reference, paddle_model)
    except MappingError as refused:
        return True, str(refused)
    x, y = batch(model)
    report = compare_step(
        reference, paddle_model, (x, y),
        loss_a=lambda out, labels: torch.nn.functional.cross_entropy(out, labels.long()),
        loss_b=lambda out, labels: paddle.nn.functional.cross_entropy(
            out, labels.astype("int64")))
    return not report.ok, report.text()


@pytest.mark.parametrize("model", ["resnet18", "encoder"])
def test_the_parity_tool_says_ok_on_a_correct_paddle_port(model):
    found, text = parity_verdict(model, PADDLE[model])
    assert not found, text


@pytest.mark.parametrize("name", sorted(paddle_broken.PORTS))
def test_the_parity_tool_names_each_broken_paddle_port_at_its_layer(name):
    """docs/porting.md's "Side by side with PaDiff" table, gradmgr's column: every broken
    port reported (no false OK), and the report names the layer the port broke (for a
    backward-only bug among the suspects; for the attention scale, the dropout whose input it
    is; for a layer substituted by one of another kind, in the first divergence's line)."""
    spec = paddle_broken.PORTS[name]
    found, text = parity_verdict(spec.model, spec.build)
    assert found, text
    assert "PARITY OK" not in text
    assert re.search(rf"\b{re.escape(spec.layer)}\b", text), text
