"""Train the small MLP and CNN on PaddlePaddle with a gradmgr GradManager.

The same loop as train_torch.py and train_megengine.py, on Paddle tensors with Paddle's own SGD
optimizer. Running the script checks that the first step's gradients equal those of Paddle's own
``loss.backward()`` (rtol 1e-5, atol 1e-6) and that training lowers the loss; it exits non-zero
otherwise. Needs ``pip install 'gradmgr[paddle]'`` (in this repository: ``.venv-paddle``).

    python examples/train_paddle.py --model both --steps 200
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Callable, Dict, Optional

import numpy as np

with warnings.catch_warnings():  # Paddle's import warns that it found no ccache: harmless here
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle
from models import (  # noqa: E402
    LEARNING_RATES,
    MODELS,
    TrainLog,
    batches,
    make_dataset,
    paddle_ops,
    training_main,
)

from gradmgr import GradManager  # noqa: E402


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
    paddle.set_device("cpu")
    ops = paddle_ops()
    init, forward, kind = MODELS[model]
    data = make_dataset(seed=seed)
    inputs, labels = getattr(data, kind), data.labels
    params = {name: ops.parameter(value) for name, value in init(seed).items()}
    opt = paddle.optimizer.SGD(learning_rate=lr or LEARNING_RATES[model],
                               parameters=list(params.values()))
    gm = GradManager().attach(params.values())
    log = TrainLog("paddle", model)
    start = time.perf_counter()
    for step, index in enumerate(batches(len(labels), batch_size, steps, seed + 1)):
        x, y = paddle.to_tensor(inputs[index]), paddle.to_tensor(labels[index])
        if fresh_manager:
            with GradManager() as step_gm:
                step_gm.attach(params.values())
                loss = ops.cross_entropy(forward(ops, params, x), y)
                step_gm.backward(loss)
        else:
            with gm:
                loss = ops.cross_entropy(forward(ops, params, x), y)
                gm.backward(loss)
        log.losses.append(float(loss.item()))
        if step % log_every == 0 or step == steps - 1:
            log.grads[step] = {k: p.grad.numpy().copy() for k, p in params.items()}
        opt.step()
        opt.clear_grad()
        if progress is not None:
            progress(1)
    log.seconds = time.perf_counter() - start
    log.params = {k: ops.numpy(p).copy() for k, p in params.items()}
    return log


def reference_first_step(model: str, batch_size: int = 64, seed: int = 0) -> Dict[str, np.ndarray]:
    """The first step's gradients by Paddle's own ``loss.backward()`` (no gradmgr)."""
    paddle.set_device("cpu")
    ops = paddle_ops()
    init, forward, kind = MODELS[model]
    data = make_dataset(seed=seed)
    rows = batches(len(data.labels), batch_size, 1, seed + 1)[0]
    x = paddle.to_tensor(getattr(data, kind)[rows])
    y = paddle.to_tensor(data.labels[rows])
    params = {k: ops.parameter(v) for k, v in init(seed).items()}
    ops.cross_entropy(forward(ops, params, x), y).backward()
    return {k: p.grad.numpy() for k, p in params.items()}


def main(argv: Optional[list] = None) -> int:
    return training_main("paddle", train, reference_first_step, "Paddle's loss.backward()",
                         __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
