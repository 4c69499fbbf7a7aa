"""Deterministic data and weights shared by workers and the parent's references."""

from __future__ import annotations

import numpy as np

SIZES = (6, 16, 8, 3)
BATCH = 8  # global batch; each of the 2 ranks takes half


def weights(seed: int = 0) -> list:
    """[w1, b1, w2, b2, w3, b3] of an MLP with tanh, ``w`` of shape (out, in)."""
    rng = np.random.default_rng(seed)
    out = []
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:]):
        out.append((rng.standard_normal((fan_out, fan_in)) / np.sqrt(fan_in)).astype("float32"))
        out.append((0.1 * rng.standard_normal(fan_out)).astype("float32"))
    return out


def batch(step: int, seed: int = 1) -> tuple:
    rng = np.random.default_rng(seed + 1000 * step)
    x = rng.standard_normal((BATCH, SIZES[0])).astype("float32")
    y = rng.standard_normal((BATCH, SIZES[-1])).astype("float32")
    return x, y


def shard(array: np.ndarray, rank: int, world: int) -> np.ndarray:
    n = len(array) // world
    return array[rank * n:(rank + 1) * n]
