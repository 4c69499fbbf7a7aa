"""``SyncBatchNorm`` on ranks over gloo, built from MegEngine's ordinary operators.

MegEngine's ``sync_batch_norm`` computes with "subgraph" operators (``SyncBnStage0`` ...
``SyncBnSplitStats``) whose backward on a CPU now and then returns wrong numbers, with
``async_level = 0`` too and with no collective or gradmgr involved: in one process, its
distributed path with the sum over ranks replaced by ``stat * 2``, MegEngine's own
GradManager, 1 to 21 of 300 steps (2026-11-29, bench/probe_megengine_syncbn_subgraph.py). The
same formulas in ordinary operators: 0 of 1,500. MegEngine's own collectives need a GPU, so
on a CPU this path runs only on ranks gradmgr's launcher started: :func:`install` (called by
``world.install``) puts :func:`sync_batch_norm` where ``SyncBatchNorm`` and
``megengine.functional`` look it up.
"""

from __future__ import annotations

from typing import Any, Optional

import megengine.functional as F
import megengine.functional.nn as fnn
import megengine.module.batchnorm as mbatchnorm

_NATIVE = fnn.sync_batch_norm


def install() -> None:
    for module in (fnn, F, mbatchnorm):
        module.sync_batch_norm = sync_batch_norm


def sync_batch_norm(inp: Any, running_mean: Any, running_var: Any, weight: Optional[Any] = None,
                    bias: Optional[Any] = None, training: bool = False,
                    momentum: Any = 0.9, eps: float = 1e-5, eps_mode: str = "additive",
                    group: Any = None) -> Any:
    """MegEngine's ``sync_batch_norm`` (same arguments and results): the statistics of a
    4-d input summed over ranks by ``all_reduce_sum``, in ordinary operators. What MegEngine
    computes without its subgraph operators (not training with ``eps_mode="additive"``; other
    than 4 dimensions, which it refuses; mixed precision) is left to MegEngine."""
    from megengine.core.tensor import amp  # (where MegEngine's sync_batch_norm reads it)

    native = eps_mode.lower() == "additive" and not training
    if native or inp.ndim != 4 or amp._enabled:
        return _NATIVE(inp, running_mean, running_var, weight, bias, training=training,
                       momentum=momentum, eps=eps, eps_mode=eps_mode,
                       **({} if group is None else {"group": group}))
    if eps_mode.lower() not in ("additive", "max"):
        raise ValueError(f"sync_batch_norm: eps_mode must be 'additive' or 'max', not "
                         f"{eps_mode!r}")
    if training:
        mean, var, unbiased = _batch_stats(inp, group)
        if running_mean is not None and running_var is not None:
            running_mean[...] = running_mean * momentum + mean.detach() * (1 - momentum)
            running_var[...] = running_var * momentum + unbiased.detach() * (1 - momentum)
    else:
        mean, var = running_mean, running_var
    denom = var + eps if eps_mode.lower() == "additive" else F.maximum(var, eps)
    scale = denom ** -0.5
    if weight is not None:
        scale = scale * weight.reshape(1, -1, 1, 1)
    out = (inp - mean) * scale
    return out if bias is None else out + bias.reshape(1, -1, 1, 1)


def _batch_stats(inp: Any, group: Any) -> Any:
    """The mean, the variance and the unbiased variance over every rank's batch, each of
    shape ``(1, C, 1, 1)``."""
    from megengine.functional.distributed import all_reduce_sum

    channels = inp.shape[1]
    count = F.full((1,), inp.size // channels, dtype=inp.dtype, device=inp.device)
    x1 = F.sum(inp, axis=(0, 2, 3))
    x2 = F.sum(inp * inp, axis=(0, 2, 3))
    stat = all_reduce_sum(F.concat([count, x1, x2]), **({} if group is None else {"group": group}))
    n = stat[0]
    s1, s2 = stat[1:channels + 1].reshape(1, -1, 1, 1), stat[channels + 1:].reshape(1, -1, 1, 1)
    mean = s1 / n
    var = s2 / n - mean * mean
    return mean, var, var * (n / (n - 1))
