"""The pre-record check: gradient that flows through operations done before ``record()``.

Autograd records operations on a ``requires_grad`` tensor whether or not a manager is recording,
so on PyTorch such operations contribute gradient where MegEngine ignores them (S9, and S8 for
tensors attached mid-recording). The check finds them from node sequence numbers and warns
where the result differs from MegEngine's while the recording computed part of the outputs.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

import torch

from gradmgr.errors import GradMgrWarning

from .graph import pre_record_paths


class PreRecordGradientWarning(GradMgrWarning):
    """Gradient reached an attached tensor through operations done before it was recorded."""


_MODES = ("always", "first", "off")
_mode = "first"
every_backward = False
"""Whether the mode is "always" (read by every backward: an attribute costs less than a call)."""


def set_pre_record_check(mode: str) -> None:
    """How often backward checks for gradient paths through pre-``record()`` operations.

    The check warns (:class:`PreRecordGradientWarning`) when an attached tensor's gradient
    flows from operations of the recording through older ones, where MegEngine's result
    would differ. ``"first"`` (default) checks each manager's first backward, which
    catches the usual cause (a value computed from parameters once, outside the loop) at no
    cost to later steps; ``"always"`` checks every backward (a Python walk over the graph:
    about 1 us per node); ``"off"`` never warns. (Each manager's first backward is walked once
    in every mode, to refuse reentrant activation checkpointing.)

    Example:
        >>> set_pre_record_check("first")
        >>> set_pre_record_check("always")
    """
    global _mode, every_backward
    if mode not in _MODES:
        raise ValueError(f"pre-record check mode must be one of {_MODES}, not {mode!r}")
    _mode = mode
    every_backward = mode == "always"


def check_mode() -> str:
    return _mode


def warn_if_pre_record(parents: Dict[Any, List[Any]], inputs: List[torch.Tensor],
                       since: List[int], base: int) -> bool:
    """Warn if an attached tensor's gradient goes through older operations below recorded ones
    (see :func:`.graph.pre_record_paths`); return whether it warned."""
    found = pre_record_paths(parents, inputs, since, base)
    if not found:
        return False
    lines = []
    for i, older in found[:4]:
        ops = ", ".join(sorted(set(older))[:4])
        lines.append(f"  attached tensor #{i} (shape {tuple(inputs[i].shape)}) through {ops}")
    more = f"\n  ... and {len(found) - 4} more" if len(found) > 4 else ""
    warnings.warn(
        f"gradmgr: the gradient of {len(found)} attached tensor(s) flows from operations "
        "recorded in this recording through operations done before record() (or before the "
        "tensor was attached):\n" + "\n".join(lines) + more + "\n"
        "PyTorch differentiates those older operations too (as loss.backward() would); "
        "MegEngine treats their results as constants, so the gradients differ from "
        "MegEngine's. Compute those values inside the recording, or .detach() them if they "
        "should be constants. (Warned once per manager; see set_pre_record_check.)",
        PreRecordGradientWarning,
        stacklevel=5,
    )
    return True
