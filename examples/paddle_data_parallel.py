"""Two-rank data-parallel training of a Paddle model with gradmgr, over Paddle's own
collectives (gloo on a CPU); docs/paddle.md shows this file, tests/test_paddle_distributed.py
runs its fit() on its ranks."""

import sys

import numpy as np
import paddle
import paddle.distributed as dist

from gradmgr.distributed import data_parallel, spawn_local


def fit(rank, world, steps):
    paddle.seed(rank)  # different weights: data_parallel broadcasts rank 0's
    model = paddle.nn.Linear(4, 1)
    gm = data_parallel(model)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    for _ in range(steps):
        x = paddle.randn([8, 4])  # each rank its own batch
        with gm:
            gm.backward(model(x).square().mean())  # .grad: the mean over the ranks
        opt.step()
        opt.clear_grad()
    weights = []
    dist.all_gather(weights, model.weight)
    assert np.array_equal(weights[0].numpy(), weights[1].numpy())


def train(rank, world, port, steps):
    dist.init_parallel_env()  # spawn_local set what it reads (gloo on a CPU)
    fit(rank, world, steps)


if __name__ == "__main__":
    sys.exit(spawn_local(train, 2, 3))  # train(rank, 2, port, 3) in 2 new processes
