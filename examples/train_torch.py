"""Train the small MLP and CNN on PyTorch with a gradmgr GradManager.

The loop is the MegEngine idiom on PyTorch tensors: attach the parameters once, then for each
batch ``with gm: loss = ...; gm.backward(loss)`` and step an ordinary ``torch.optim.SGD``.
Running the script checks that the first step's gradients equal plain ``torch.autograd.grad``
(rtol 1e-5, atol 1e-6) and that training lowers the loss; it exits non-zero otherwise.

    python examples/train_torch.py --model both --steps 200
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Dict, Optional

import numpy as np
import torch
from models import (
    LEARNING_RATES,
    MODELS,
    TrainLog,
    batches,
    make_dataset,
    torch_ops,
    training_main,
)

from gradmgr import GradManager


def train(
    model: str = "mlp",
    steps: int = 200,
    lr: Optional[float] = None,
    batch_size: int = 64,
    log_every: int = 10,
    seed: int = 0,
    fresh_manager: bool = False,
    progress: Optional[Callable[[int], object]] = None,
) -> TrainLog:
    """Train ``model`` ("mlp" or "cnn") for ``steps`` SGD steps (``lr`` defaults per model).

    With ``fresh_manager`` every step uses ``with GradManager() as gm: gm.attach(...)`` (a new
    manager that attaches while recording) instead of one manager attached once.
    """
    torch.manual_seed(seed)
    ops = torch_ops()
    init, forward, kind = MODELS[model]
    data = make_dataset(seed=seed)
    inputs = torch.from_numpy(getattr(data, kind))
    labels = torch.from_numpy(data.labels)
    params = {name: ops.parameter(value) for name, value in init(seed).items()}
    opt = torch.optim.SGD(params.values(), lr=lr or LEARNING_RATES[model])
    gm = GradManager().attach(params.values())
    log = TrainLog("torch", model)
    start = time.perf_counter()
    for step, index in enumerate(batches(len(labels), batch_size, steps, seed + 1)):
        rows = torch.from_numpy(index)
        x, y = inputs[rows], labels[rows]
        if fresh_manager:
            with GradManager() as step_gm:
                step_gm.attach(params.values())
                loss = ops.cross_entropy(forward(ops, params, x), y)
                step_gm.backward(loss)
        else:
            with gm:
                loss = ops.cross_entropy(forward(ops, params, x), y)
                gm.backward(loss)
        log.losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            log.grads[step] = {k: p.grad.numpy().copy() for k, p in params.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if progress is not None:
            progress(1)
    log.seconds = time.perf_counter() - start
    log.params = {k: ops.numpy(p).copy() for k, p in params.items()}
    return log


def reference_first_step(model: str, batch_size: int = 64, seed: int = 0) -> Dict[str, np.ndarray]:
    """The first step's gradients by plain ``torch.autograd.grad`` (no gradmgr)."""
    ops = torch_ops()
    init, forward, kind = MODELS[model]
    data = make_dataset(seed=seed)
    rows = torch.from_numpy(batches(len(data.labels), batch_size, 1, seed + 1)[0])
    x = torch.from_numpy(getattr(data, kind))[rows]
    y = torch.from_numpy(data.labels)[rows]
    params = {k: torch.from_numpy(v).requires_grad_(True) for k, v in init(seed).items()}
    loss = ops.cross_entropy(forward(ops, params, x), y)
    grads = torch.autograd.grad(loss, list(params.values()))
    return {k: g.numpy() for k, g in zip(params, grads)}


def main(argv: Optional[list] = None) -> int:
    torch.set_num_threads(1)
    return training_main("torch", train, reference_first_step, "torch.autograd.grad",
                         __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
