"""Skipping communication for gradient accumulation: ``no_sync``, DDP's, whether a manager is
inside it, and what a window refuses (a split backward's gradients that would stay on one
rank)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, List

from ...manager import GradManager

_paused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

OVERTAKEN = (
    "a split backward's finish() for a micro-batch recorded inside no_sync(gm) came after a "
    "micro-batch recorded later, outside no_sync, had reduced the gradients: this one's "
    "weight gradients would miss that reduction and stay on this rank alone, so the ranks' "
    ".grad would differ. Call finish() on the no_sync micro-batches' deferred backwards "
    "before the synced one's (its reduction takes what .grad holds then); nothing of this "
    "finish() was accumulated"
)

@contextlib.contextmanager
def no_sync(gm: GradManager) -> Iterator[None]:
    """Recordings of ``gm`` that start inside only accumulate gradients locally: no allreduce
    callback attached to ``gm`` communicates (``DistributedDataParallel.no_sync()``).

    The flag is read when a recording starts (``record()`` / ``with gm``), as DDP reads it at
    the forward: put the whole ``with gm:`` block inside. The next synced backward reduces
    what ``.grad`` holds plus its own gradient, so every rank ends with bit-identical
    gradients, equal to DDP's.

    Entered while ``gm`` records (``with gm, no_sync(gm):``), it raises ``RuntimeError``: that
    recording already started as a synced one.

    Example:
        Two micro-batches, the first without communication (here a process group of one
        rank):

        >>> import torch
        >>> import torch.distributed as dist
        >>> from gradmgr.distributed import free_port
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> import contextlib
        >>> from gradmgr.distributed import data_parallel
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> gm = data_parallel(model)
        >>> for micro in range(2):
        ...     with no_sync(gm) if micro == 0 else contextlib.nullcontext(), gm:
        ...         gm.backward(model(torch.ones(1, 2)).sum())
        >>> model.weight.grad                  # both micro-batches, reduced once
        tensor([[2., 2.]])
        >>> del gm
        >>> dist.destroy_process_group()
    """
    if gm.is_recording:
        raise RuntimeError(
            "no_sync(gm) was entered while gm is recording: it applies to recordings that "
            "start inside it, and this one already started as a synced step. Enter it first: "
            "`with no_sync(gm), gm:`"
        )
    _paused[gm] = _paused.get(gm, 0) + 1
    try:
        yield
    finally:
        _paused[gm] -= 1
        if not _paused[gm]:
            del _paused[gm]


def is_paused(gm: GradManager) -> bool:
    """True inside :func:`no_sync` for ``gm``."""
    return gm in _paused


__all__: List[str] = ["OVERTAKEN", "is_paused", "no_sync"]
