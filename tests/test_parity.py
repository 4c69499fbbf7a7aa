"""Cross-framework parity: one program, written once against the op table, run through
``gradmgr.GradManager`` on PyTorch and on MegEngine from the same numpy weights and data.

Tolerance: both frameworks compute in float32 but with different kernels (matmul/conv blocking,
reduction order, fused softmax), so results differ by a few ulps per op, compounding through a
few layers. ``rtol=1e-4`` (about 800 float32 ulps) leaves ample room for that while still
catching any real semantic difference (a missed term, a wrong sign or scale, an accumulation
that should not happen, all of which are O(1) relative errors); ``atol=1e-5`` covers elements
whose true value is near zero, where a relative bound means nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megengine")

from frameworks import Framework, make_framework  # noqa: E402

from gradmgr import GradManager  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5

RNG = np.random.default_rng(2024)
X = RNG.standard_normal((6, 4)).astype("float32")
LABELS = np.array([0, 2, 1, 1, 0, 2], dtype="int32")
MLP = {
    "w1": RNG.standard_normal((8, 4)).astype("float32") * 0.5,
    "b1": RNG.standard_normal(8).astype("float32") * 0.1,
    "w2": RNG.standard_normal((3, 8)).astype("float32") * 0.5,
    "b2": RNG.standard_normal(3).astype("float32") * 0.1,
}
IMG = RNG.standard_normal((2, 3, 5, 5)).astype("float32")
CONV = {
    "cw": RNG.standard_normal((4, 3, 3, 3)).astype("float32") * 0.3,
    "cb": RNG.standard_normal(4).astype("float32") * 0.1,
    "gamma": 1 + RNG.standard_normal(4).astype("float32") * 0.1,
    "beta": RNG.standard_normal(4).astype("float32") * 0.1,
    "fw_": RNG.standard_normal((3, 4 * 3 * 3)).astype("float32") * 0.2,
    "fb": np.zeros(3, "float32"),
}


def assert_close(a: Any, b: Any, path: str = "result") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_close(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            assert_close(u, v, f"{path}[{i}]")
    elif a is None or b is None:
        assert a is None and b is None, f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, (np.ndarray, np.generic, float)):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL, err_msg=path)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def on_both(program: Callable[[Framework], Any]) -> Any:
    """Run ``program`` on torch and on megengine; assert the results agree; return torch's."""
    results = [program(make_framework(name)) for name in ("torch", "megengine")]
    assert_close(results[0], results[1])
    return results[0]


def mlp_loss(fw: Framework, p: dict, x: Any) -> Any:
    h = fw.relu(fw.linear(x, p["w1"], p["b1"]))
    return fw.softmax_cross_entropy(fw.linear(h, p["w2"], p["b2"]), fw.int_tensor(LABELS))


def conv_loss(fw: Framework, p: dict) -> Any:
    h = fw.conv2d(fw.tensor(IMG), p["cw"], p["cb"], stride=1, padding=0)  # (2, 4, 3, 3)
    h = fw.relu(fw.batch_norm(h, p["gamma"], p["beta"]))
    logits = fw.linear(fw.flatten(h), p["fw_"], p["fb"])
    return fw.softmax_cross_entropy(logits, fw.int_tensor(LABELS[:2]))


def grads(fw: Framework, params: dict) -> dict:
    return {k: fw.grad(v) for k, v in params.items()}


# ---------------------------------------------------------------- programs
def test_mlp():
    def program(fw):
        p = {k: fw.parameter(v) for k, v in MLP.items()}
        gm = GradManager().attach(list(p.values()))
        with gm:
            loss = mlp_loss(fw, p, fw.tensor(X))
            gm.backward(loss)
        return fw.numpy(loss), grads(fw, p)

    loss, g = on_both(program)
    assert all(np.abs(v).sum() > 0 for v in g.values())
    # and the framework's own autodiff agrees on torch
    ref = make_framework("torch")
    keys = list(MLP)
    expected = ref.reference_grads(
        lambda *ts: mlp_loss(ref, dict(zip(keys, ts)), ref.tensor(X)),
        [ref.tensor(MLP[k]) for k in keys],
    )
    for k, e in zip(keys, expected):
        np.testing.assert_allclose(g[k], e, rtol=1e-6, atol=1e-7)  # same engine: ~exact


def test_conv_batchnorm_net():
    def program(fw):
        p = {k: fw.parameter(v) for k, v in CONV.items()}
        gm = GradManager().attach(list(p.values()))
        with gm:
            loss = conv_loss(fw, p)
            gm.backward(loss)
        return fw.numpy(loss), grads(fw, p)

    _, g = on_both(program)
    assert all(g[k].shape == CONV[k].shape for k in CONV)


def test_softmax_cross_entropy_matches_closed_form():
    def program(fw):
        logits = fw.tensor(X[:, :3])
        gm = GradManager().attach(logits)
        with gm:
            gm.backward(fw.softmax_cross_entropy(logits, fw.int_tensor(LABELS)))
        return fw.grad(logits)

    g = on_both(program)
    z = X[:, :3].astype("float64")
    softmax = np.exp(z - z.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    expected = (softmax - np.eye(3)[LABELS]) / len(LABELS)  # d mean CE / d logits
    np.testing.assert_allclose(g, expected, rtol=RTOL, atol=ATOL)


def test_where_masks_gradient():
    data = np.array([-2.0, -0.5, 0.5, 3.0], dtype="float32")

    def program(fw):
        x, other = fw.tensor(data), fw.tensor(data * 10)
        gm = GradManager().attach([x, other])
        with gm:
            cond = fw.greater(x, fw.zeros_like(x))
            gm.backward(fw.sum(fw.where(cond, x * x, other)))
        return fw.grad(x), fw.grad(other)

    gx, gother = on_both(program)
    np.testing.assert_array_equal(gx, np.where(data > 0, 2 * data, 0))  # exact in float32
    np.testing.assert_array_equal(gother, np.where(data > 0, 0.0, 1.0))


def test_dy_given():
    data = np.array([0.3, -1.2, 2.0], dtype="float32")
    dy = np.array([1.5, -0.5, 2.0], dtype="float32")

    def program(fw):
        x = fw.tensor(data)
        gm = GradManager().attach(x)
        with gm:
            gm.backward(fw.sin(x) * x, fw.tensor(dy))
        return fw.grad(x)

    g = on_both(program)
    np.testing.assert_allclose(g, dy * (np.cos(data) * data + np.sin(data)), rtol=RTOL, atol=ATOL)


def test_callbacks_chain_and_values():
    def program(fw):
        a, b = fw.tensor([1.0, 2.0]), fw.tensor([3.0])
        log = []

        def make(tag, scale):
            def cb(tensor, grad):
                log.append((tag, "a" if tensor is a else "b", fw.numpy(grad).tolist()))
                return grad * scale

            return cb

        gm = GradManager().attach([a, b], callbacks=make("f", 2.0))
        gm.attach(b, callbacks=make("g", -1.0))
        with gm:
            gm.backward(fw.sum(a * a) * fw.sum(b))
        per_tensor = {name: [(t, g) for t, n, g in log if n == name] for name in ("a", "b")}
        return per_tensor, fw.grad(a), fw.grad(b)

    per_tensor, ga, gb = on_both(program)
    assert per_tensor == {"a": [("f", [6.0, 12.0])], "b": [("f", [5.0]), ("g", [10.0])]}
    np.testing.assert_array_equal(ga, [12.0, 24.0])  # 2ab ×2
    np.testing.assert_array_equal(gb, [-10.0])  # Σa² ×2 ×(-1)


def test_second_order_by_nesting():
    data = np.array([0.2, -0.7, 1.4], dtype="float32")

    def program(fw):
        x = fw.tensor(data)
        outer, inner = GradManager().attach(x), GradManager().attach(x)
        with outer:
            with inner:
                inner.backward(fw.sum(fw.sin(x) * x))
            first = fw.grad(x).copy()  # torch's numpy() is a view; backward adds in place
            outer.backward(x.grad)
        return first, fw.grad(x)

    first, final = on_both(program)
    d1 = np.cos(data) * data + np.sin(data)
    d2 = 2 * np.cos(data) - data * np.sin(data)
    np.testing.assert_allclose(first, d1, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(final, d1 + d2, rtol=RTOL, atol=ATOL)


def test_groups_and_visibility():
    data = np.array([0.1, 0.9], dtype="float32")

    def program(fw):
        x = fw.tensor(data)
        gm1, gm2 = GradManager().attach(x), GradManager().attach(x)
        with gm1 | gm2:
            y = fw.cos(x)
            gm1.backward(y)
            gm2.backward(y)
        both_members = fw.grad(x)
        x2 = fw.tensor(data)
        gm3, gm4 = GradManager().attach(x2), GradManager().attach(x2)
        with gm3 | gm4:
            gm4.backward(fw.cos(x2))
            gm3.backward(x2.grad)  # gm3 did not record gm4's backward: adds nothing
        return both_members, fw.grad(x2)

    both_members, visible = on_both(program)
    np.testing.assert_allclose(both_members, -2 * np.sin(data), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(visible, -np.sin(data), rtol=RTOL, atol=ATOL)


def test_sgd_training_loop_losses_agree_step_by_step():
    lr = 0.5

    def program(fw):
        arrays = dict(MLP)
        gm = GradManager()
        losses = []
        for _ in range(5):
            # fresh leaves each step, built from numpy (the op table has no in-place update);
            # the previous step's tensors die and the manager forgets them
            p = {k: fw.parameter(v) for k, v in arrays.items()}
            gm.attach(list(p.values()))
            with gm:
                loss = mlp_loss(fw, p, fw.tensor(X))
                gm.backward(loss)
            losses.append(float(fw.numpy(loss)))
            arrays = {k: fw.numpy(v) - lr * fw.grad(v) for k, v in p.items()}
            assert len(gm.attached_tensors()) == len(arrays)
        return losses, arrays

    losses, _ = on_both(program)
    assert losses[-1] < losses[0]  # it trains
