"""Input gradients (a saliency map): attach the data, not the weights.

After a short training run of the small CNN, a fresh GradManager attaches only a batch of
images. ``gm.backward(logits, dy=one_hot(labels))`` then puts the gradient of each image's
true-class score into ``images.grad``; its magnitude shows which pixels the score depends on.

The script checks that the input gradients equal the framework's own autodiff (PyTorch:
``torch.autograd.grad`` with respect to the images; MegEngine: its native ``GradManager``),
rtol 1e-5, atol 1e-7; that the weights, which are not attached, get no ``.grad``; and on
PyTorch that the images' ``requires_grad`` flag is restored to False afterwards.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np
from cli import assert_close, expect, run
from models import NUM_CLASSES, cnn_forward, make_dataset

from gradmgr import GradManager

TRAIN_STEPS = 150
SHADES = " .:-=+*#%@"


def ascii_map(a: np.ndarray) -> list:
    """Rows of characters, darkest for the largest value in ``a``."""
    lo, hi = float(a.min()), float(a.max())
    scaled = (a - lo) / (hi - lo + 1e-12) * (len(SHADES) - 1)
    return ["".join(SHADES[int(round(v))] * 2 for v in row) for row in scaled]


def batch() -> tuple:
    """The first image of each class and the one-hot matrix of their labels."""
    data = make_dataset()
    rows = [int(np.flatnonzero(data.labels == c)[0]) for c in range(NUM_CLASSES)]
    return data.images[rows], data.labels[rows], np.eye(NUM_CLASSES, dtype=np.float32)


def show(saliency: np.ndarray, images: np.ndarray, labels: np.ndarray) -> None:
    names = ["horizontal", "vertical", "diagonal", "anti-diagonal"]
    for image, sal, label in zip(images[:, 0], saliency[:, 0], labels):
        print(f"  class {label} ({names[label]}): image | |d score / d pixel|")
        for left, right in zip(ascii_map(image), ascii_map(sal)):
            print(f"    {left} | {right}")


def check(framework: str, train: Callable, ops, reference: Callable) -> Any:
    """Train, attach a batch of images, compare its gradients; return the images tensor."""
    log = train("cnn", steps=TRAIN_STEPS)
    print(f"  trained the CNN for {TRAIN_STEPS} steps: loss {log.losses[0]:.3f} -> "
          f"{np.mean(log.losses[-10:]):.3f}")
    params = {k: ops.parameter(v) for k, v in log.params.items()}
    images_np, labels, one_hot = batch()
    images = ops.tensor(images_np)
    gm = GradManager().attach(images)
    with gm:
        logits = cnn_forward(ops, params, images)
        gm.backward(logits, ops.tensor(one_hot))
    saliency = ops.numpy(images.grad)
    show(np.abs(saliency), images_np, labels)
    assert_close("input gradients", saliency, reference(log.params, images_np, one_hot),
                 atol=1e-7)
    unexpected = [k for k, p in params.items() if p.grad is not None]
    expect(not unexpected, f"weights that were not attached got .grad: {unexpected}")
    print(f"  check: no weight got a .grad ({framework}: only attached tensors do)")
    return images


def run_torch() -> None:
    import torch
    from models import torch_ops
    from train_torch import train

    ops = torch_ops()

    def reference(weights, images, one_hot):
        x = torch.from_numpy(images).requires_grad_(True)
        params = {k: torch.from_numpy(v) for k, v in weights.items()}
        score = (cnn_forward(ops, params, x) * torch.from_numpy(one_hot)).sum()
        return torch.autograd.grad(score, x)[0].numpy()

    ops.tensor = lambda a: torch.from_numpy(a.copy())
    images = check("torch", train, ops, reference)
    expect(not images.requires_grad, "the images' requires_grad flag was not restored")
    print("  check: images.requires_grad is False again after the recording")


def run_megengine() -> None:
    from quiet_megengine import import_megengine

    megengine = import_megengine()  # without the CUDA banner of a GPU-less machine
    from megengine.autodiff import GradManager as NativeGradManager
    from models import megengine_ops
    from train_megengine import train

    ops = megengine_ops()

    def reference(weights, images, one_hot):
        x = megengine.tensor(images)
        params = {k: megengine.tensor(v) for k, v in weights.items()}
        gm = NativeGradManager().attach(x)
        with gm:
            gm.backward(cnn_forward(ops, params, x), megengine.tensor(one_hot))
        return x.grad.numpy()

    check("megengine", train, ops, reference)


if __name__ == "__main__":
    sys.exit(run(__doc__.splitlines()[0], {"torch": run_torch, "megengine": run_megengine}))
