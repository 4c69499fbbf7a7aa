"""Shared pieces of the examples: a synthetic data set and two small models defined once.

Weights are created as numpy arrays from a fixed seed and the models are written as plain
functions of a parameter dict over a tiny op table, so the very same network with the very same
starting weights runs on PyTorch, on MegEngine and on PaddlePaddle. Frameworks are imported only
inside the op table constructors, so this module imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

NUM_CLASSES = 4
FEATURES = 16
IMAGE = 8  # images are 1 x IMAGE x IMAGE

Params = Dict[str, Any]


@dataclass(frozen=True)
class Dataset:
    """Synthetic classification data: feature vectors and images share the labels."""

    vectors: np.ndarray  # (n, FEATURES) float32
    images: np.ndarray  # (n, 1, IMAGE, IMAGE) float32
    labels: np.ndarray  # (n,) int32


def make_dataset(n: int = 1024, seed: int = 0) -> Dataset:
    """Gaussian blobs for the MLP and noisy bar/diagonal patterns for the CNN."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, size=n).astype(np.int32)
    centres = rng.normal(0.0, 0.4, size=(NUM_CLASSES, FEATURES))
    vectors = centres[labels] + rng.normal(0.0, 1.0, size=(n, FEATURES))

    templates = np.zeros((NUM_CLASSES, IMAGE, IMAGE))
    templates[0, IMAGE // 2, :] = 1.0  # horizontal bar
    templates[1, :, IMAGE // 2] = 1.0  # vertical bar
    templates[2] = np.eye(IMAGE)  # diagonal
    templates[3] = np.fliplr(np.eye(IMAGE))  # anti-diagonal
    shifts = rng.integers(-1, 2, size=(n, 2))
    images = np.stack(
        [np.roll(templates[c], tuple(s), axis=(0, 1)) for c, s in zip(labels, shifts)]
    )
    images = images + rng.normal(0.0, 0.5, size=images.shape)
    return Dataset(
        vectors=vectors.astype(np.float32),
        images=images[:, None].astype(np.float32),
        labels=labels,
    )


def batches(n: int, batch_size: int, steps: int, seed: int = 1) -> list:
    """The index arrays of ``steps`` mini-batches, identical for every framework."""
    rng = np.random.default_rng(seed)
    return [rng.choice(n, size=batch_size, replace=False) for _ in range(steps)]


def _uniform(rng: np.random.Generator, shape: Tuple[int, ...], fan_in: int) -> np.ndarray:
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def init_mlp(seed: int = 0, hidden: int = 64, depth: int = 3) -> Dict[str, np.ndarray]:
    """Weights of an MLP FEATURES -> hidden x (depth-1) -> NUM_CLASSES, as (out, in) matrices."""
    rng = np.random.default_rng(seed)
    sizes = [FEATURES] + [hidden] * (depth - 1) + [NUM_CLASSES]
    params: Dict[str, np.ndarray] = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"fc{i}.weight"] = _uniform(rng, (fan_out, fan_in), fan_in)
        params[f"fc{i}.bias"] = _uniform(rng, (fan_out,), fan_in)
    return params


def init_cnn(seed: int = 0, channels: int = 8) -> Dict[str, np.ndarray]:
    """Weights of conv3x3 -> relu -> avgpool2 -> conv3x3 -> relu -> avgpool2 -> linear."""
    rng = np.random.default_rng(seed)
    c = channels
    flat = 2 * c * (IMAGE // 4) ** 2
    return {
        "conv0.weight": _uniform(rng, (c, 1, 3, 3), 9),
        "conv0.bias": _uniform(rng, (c,), 9),
        "conv1.weight": _uniform(rng, (2 * c, c, 3, 3), 9 * c),
        "conv1.bias": _uniform(rng, (2 * c,), 9 * c),
        "fc.weight": _uniform(rng, (NUM_CLASSES, flat), flat),
        "fc.bias": _uniform(rng, (NUM_CLASSES,), flat),
    }


def mlp_forward(ops: Any, params: Params, x: Any) -> Any:
    """Logits of the MLP whose weights are ``params`` (see :func:`init_mlp`)."""
    depth = len(params) // 2
    h = x
    for i in range(depth):
        h = ops.linear(h, params[f"fc{i}.weight"], params[f"fc{i}.bias"])
        if i < depth - 1:
            h = ops.relu(h)
    return h


def cnn_forward(ops: Any, params: Params, x: Any) -> Any:
    """Logits of the CNN whose weights are ``params`` (see :func:`init_cnn`)."""
    h = ops.avg_pool(ops.relu(ops.conv2d(x, params["conv0.weight"], params["conv0.bias"])))
    h = ops.avg_pool(ops.relu(ops.conv2d(h, params["conv1.weight"], params["conv1.bias"])))
    return ops.linear(ops.flatten(h), params["fc.weight"], params["fc.bias"])


MODELS: Dict[str, Tuple[Callable[..., Dict[str, np.ndarray]], Callable[..., Any], str]] = {
    "mlp": (init_mlp, mlp_forward, "vectors"),
    "cnn": (init_cnn, cnn_forward, "images"),
}
"""name -> (weight initialiser, forward function, the Dataset field it reads)."""

LEARNING_RATES = {"mlp": 0.1, "cnn": 0.5}
"""Plain SGD step sizes at which both models learn within a few hundred steps."""


def torch_ops() -> SimpleNamespace:
    """The op table on PyTorch."""
    import torch
    import torch.nn.functional as F

    return SimpleNamespace(
        name="torch",
        tensor=lambda a: torch.from_numpy(np.ascontiguousarray(a)),
        parameter=lambda a: torch.nn.Parameter(torch.from_numpy(a.copy())),
        numpy=lambda t: t.detach().numpy(),
        linear=F.linear,
        relu=torch.relu,
        conv2d=lambda x, w, b: F.conv2d(x, w, b, padding=1),
        avg_pool=lambda x: F.avg_pool2d(x, 2),
        flatten=lambda x: x.flatten(1),
        cross_entropy=lambda logits, y: F.cross_entropy(logits, y.long()),
    )


def megengine_ops() -> SimpleNamespace:
    """The op table on MegEngine (conv bias is reshaped in-graph so parameter shapes match)."""
    from quiet_megengine import import_megengine

    megengine = import_megengine()  # without the CUDA banner of a GPU-less machine
    import megengine.functional as F

    return SimpleNamespace(
        name="megengine",
        tensor=lambda a: megengine.tensor(a),
        parameter=lambda a: megengine.Parameter(a.copy()),
        numpy=lambda t: t.numpy(),
        linear=F.nn.linear,
        relu=F.relu,
        conv2d=lambda x, w, b: F.nn.conv2d(x, w, b.reshape(1, -1, 1, 1), padding=1),
        avg_pool=lambda x: F.nn.avg_pool2d(x, 2),
        flatten=lambda x: F.flatten(x, 1),
        cross_entropy=F.nn.cross_entropy,
    )


def paddle_ops() -> SimpleNamespace:
    """The op table on PaddlePaddle. The weights keep the layout of the other two (Linear
    ``[out, in]``), as a user who ports a checkpoint keeps it, so the product is written with
    ``transpose_y`` rather than Paddle's ``F.linear`` (which takes ``[in, out]``)."""
    import paddle
    import paddle.nn.functional as F

    def parameter(a: np.ndarray) -> Any:
        return paddle.create_parameter(list(a.shape), "float32",
                                       default_initializer=paddle.nn.initializer.Assign(a))

    return SimpleNamespace(
        name="paddle",
        tensor=lambda a: paddle.to_tensor(a),
        parameter=parameter,
        numpy=lambda t: t.numpy(),
        linear=lambda x, w, b: paddle.matmul(x, w, transpose_y=True) + b,
        relu=F.relu,
        conv2d=lambda x, w, b: F.conv2d(x, w, b, padding=1),
        avg_pool=lambda x: F.avg_pool2d(x, 2),
        flatten=lambda x: paddle.flatten(x, 1),
        cross_entropy=lambda logits, y: F.cross_entropy(logits, y.astype("int64")),
    )


OPS: Dict[str, Callable[[], SimpleNamespace]] = {
    "torch": torch_ops, "megengine": megengine_ops, "paddle": paddle_ops,
}


def available_frameworks() -> list:
    """The frameworks of OPS that can be imported here."""
    import importlib.util

    return [name for name in OPS if importlib.util.find_spec(name) is not None]


@dataclass
class TrainLog:
    """What a training run reports: the loss of every step, gradients at logging steps and the
    final weights."""

    framework: str
    model: str
    losses: list = field(default_factory=list)
    grads: Dict[int, Dict[str, np.ndarray]] = field(default_factory=dict)
    seconds: float = 0.0
    params: Dict[str, np.ndarray] = field(default_factory=dict)
    """The trained weights."""


def check_close(name: str, got: Dict[str, np.ndarray], want: Dict[str, np.ndarray],
                rtol: float = 1e-5, atol: float = 1e-6) -> float:
    """Raise AssertionError if any array differs beyond ``atol + rtol*|want|``; return the
    largest absolute difference."""
    worst = 0.0
    for key, ref in want.items():
        value = got.get(key)
        if value is None:
            raise AssertionError(f"{name}: no gradient for {key}")
        diff = float(np.max(np.abs(value - ref))) if ref.size else 0.0
        worst = max(worst, diff)
        if not np.allclose(value, ref, rtol=rtol, atol=atol):
            raise AssertionError(f"{name}: {key} differs from the reference by {diff:.3g}")
    return worst


def training_main(framework: str, train: Callable[..., TrainLog],
                  reference_first_step: Callable[[str], Dict[str, np.ndarray]],
                  reference_name: str, description: str, argv: Optional[list] = None) -> int:
    """The command line shared by train_torch.py and train_megengine.py: train the chosen
    models, check step 0's gradients against ``reference_first_step`` and that the loss
    dropped (below 70 % of its start when running 100 steps or more). Returns the exit code."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", choices=["mlp", "cnn", "both"], default="both")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=None)
    args = parser.parse_args(argv)
    models = ["mlp", "cnn"] if args.model == "both" else [args.model]
    for model in models:
        log = train(model, steps=args.steps, lr=args.lr)
        worst = check_close(f"{model} step 0", log.grads[0], reference_first_step(model))
        first, last = log.losses[0], float(np.mean(log.losses[-max(1, args.steps // 10):]))
        print(
            f"{framework} {model}: loss {first:.4f} -> {last:.4f} in {args.steps} steps "
            f"({log.seconds:.2f} s); step-0 grads match {reference_name} "
            f"(max |diff| {worst:.2e})"
        )
        if args.steps >= 100 and not last < 0.7 * first:
            print(f"FAIL: {model} loss did not drop below 70% of its start", file=sys.stderr)
            return 1
    return 0
