"""Train the small MLP and CNN on MegEngine with a gradmgr GradManager.

The same loop as train_torch.py, on MegEngine tensors with MegEngine's own SGD optimizer.
Running the script checks that the first step's gradients equal those of MegEngine's native
``megengine.autodiff.GradManager`` (rtol 1e-5, atol 1e-6) and that training lowers the loss;
it exits non-zero otherwise.

    python examples/train_megengine.py --model both --steps 200
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Dict, Optional

import megengine
import megengine.optimizer as optim
import numpy as np
from megengine.autodiff import GradManager as NativeGradManager
from models import (
    LEARNING_RATES,
    MODELS,
    TrainLog,
    batches,
    make_dataset,
    megengine_ops,
    training_main,
)
from quiet_megengine import import_megengine

from gradmgr import GradManager

import_megengine()  # before the first tensor: no CUDA banner on a machine without a GPU


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
    ops = megengine_ops()
    init, forward, kind = MODELS[model]
    data = make_dataset(seed=seed)
    inputs, labels = getattr(data, kind), data.labels
    params = {name: ops.parameter(value) for name, value in init(seed).items()}
    opt = optim.SGD(list(params.values()), lr=lr or LEARNING_RATES[model])
    gm = GradManager().attach(params.values())
    log = TrainLog("megengine", model)
    start = time.perf_counter()
    for step, index in enumerate(batches(len(labels), batch_size, steps, seed + 1)):
        x, y = megengine.tensor(inputs[index]), megengine.tensor(labels[index])
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
            log.grads[step] = {k: p.grad.numpy() for k, p in params.items()}
        opt.step()
        opt.clear_grad()
        if progress is not None:
            progress(1)
    log.seconds = time.perf_counter() - start
    log.params = {k: ops.numpy(p).copy() for k, p in params.items()}
    return log


def reference_first_step(model: str, batch_size: int = 64, seed: int = 0) -> Dict[str, np.ndarray]:
    """The first step's gradients by MegEngine's native GradManager (no gradmgr)."""
    ops = megengine_ops()
    init, forward, kind = MODELS[model]
    data = make_dataset(seed=seed)
    rows = batches(len(data.labels), batch_size, 1, seed + 1)[0]
    x = megengine.tensor(getattr(data, kind)[rows])
    y = megengine.tensor(data.labels[rows])
    params = {k: ops.parameter(v) for k, v in init(seed).items()}
    gm = NativeGradManager().attach(list(params.values()))
    with gm:
        gm.backward(ops.cross_entropy(forward(ops, params, x), y))
    return {k: p.grad.numpy() for k, p in params.items()}


def main(argv: Optional[list] = None) -> int:
    return training_main("megengine", train, reference_first_step, "native GradManager",
                         __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
