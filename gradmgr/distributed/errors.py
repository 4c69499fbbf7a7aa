"""The errors data parallelism raises."""

from __future__ import annotations

from typing import Sequence


class RankMismatchError(RuntimeError):
    """The ranks planned different tensors for one allreduce callback (or
    :func:`data_parallel` was given modules that differ); raised on every rank, naming the
    first difference.

    Example:
        >>> # try:
        >>> #     gm = data_parallel(model)       # rank 1's model has a layer of another size
        >>> # except RankMismatchError as error:
        >>> #     print(error)                    # "... fc2.weight (float32[8, 16]) ..."
    """


class RankFailedError(RuntimeError):
    """Another rank's backward raised during this data-parallel step (or its recording ended
    without one: a skipped batch): the step's reduced gradients are incomplete, so no rank
    uses them (``.grad`` keeps what it held before).

    Example:
        >>> # for x, y in loader:
        >>> #     try:
        >>> #         with gm:
        >>> #             gm.backward(loss_fn(model(x), y))
        >>> #     except (RankFailedError, BadBatch):    # every rank skips the step
        >>> #         opt.zero_grad()
        >>> #         continue
        >>> #     opt.step(); opt.zero_grad()
    """


class SparseGradientError(TypeError):
    """The allreduce callback reduces dense gradients only; a tensor got a sparse one.

    Example:
        >>> # emb = torch.nn.Embedding(100, 8, sparse=True)  # SparseGradientError at backward:
        >>> # emb = torch.nn.Embedding(100, 8)               # dense gradients are reduced
    """


def sparse_message(shape: Sequence[int]) -> str:
    return (f"the allreduce callback reduces dense gradients only, and a tensor of shape "
            f"{list(shape)} got a sparse one (nn.Embedding(sparse=True) or "
            f"F.embedding(..., sparse=True)?): make it dense (sparse=False), or reduce that "
            f"tensor with DDP, which handles sparse gradients")
