"""The errors data parallelism raises."""

from __future__ import annotations

from typing import Sequence


class RankMismatchError(RuntimeError):
    """The ranks planned different tensors for one allreduce callback; raised on every rank."""


class RankFailedError(RuntimeError):
    """Another rank's backward raised during this data-parallel step: the step's reduced
    gradients are incomplete, so no rank uses them (``.grad`` keeps what it held before)."""


class SparseGradientError(TypeError):
    """The allreduce callback reduces dense gradients only; a tensor got a sparse one."""


def sparse_message(shape: Sequence[int]) -> str:
    return (f"the allreduce callback reduces dense gradients only, and a tensor of shape "
            f"{list(shape)} got a sparse one (nn.Embedding(sparse=True) or "
            f"F.embedding(..., sparse=True)?): make it dense (sparse=False), or reduce that "
            f"tensor with DDP, which handles sparse gradients")
