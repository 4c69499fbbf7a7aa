"""The pre-record check: gradient that flows through operations done before ``record()``.

Autograd records operations on a ``requires_grad`` tensor whether or not a manager is recording,
so on PyTorch such operations contribute gradient where MegEngine ignores them (S9, and S8 for
tensors attached mid-recording). The check finds them from node sequence numbers and warns.
"""

from __future__ import annotations

import warnings
from typing import List

import torch

from gradmgr.errors import GradMgrWarning

from .graph import pre_record_paths


class PreRecordGradientWarning(GradMgrWarning):
    """Gradient reached an attached tensor through operations done before it was recorded."""


_MODES = ("always", "first", "off")
_mode = "first"


def set_pre_record_check(mode: str) -> None:
    """How often backward checks for gradient paths through pre-``record()`` operations.

    ``"first"`` (default) walks the graph of each manager's first backward, which catches the
    usual cause (a value computed from parameters once, outside the loop) at no cost to later
    steps; ``"always"`` walks every backward (a Python walk over the graph: about 1 us per
    node); ``"off"`` never checks.

    Example:
        >>> set_pre_record_check("first")
        >>> set_pre_record_check("always")
    """
    global _mode
    if mode not in _MODES:
        raise ValueError(f"pre-record check mode must be one of {_MODES}, not {mode!r}")
    _mode = mode


def check_mode() -> str:
    return _mode


def warn_if_pre_record(outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                       since: List[int]) -> bool:
    """Warn if gradient reaches one of ``inputs`` through a node older than its ``since``
    sequence number; return whether it warned."""
    stale = pre_record_paths(outputs, inputs, since)
    if not stale:
        return False
    shapes = ", ".join(str(tuple(t.shape)) for t in stale[:4])
    warnings.warn(
        f"gradmgr: gradient reaches {len(stale)} attached tensor(s) (shapes {shapes}) "
        "through operations done before record() or before attach(); MegEngine ignores "
        "those, PyTorch cannot, so they contribute here. Compute them inside the "
        "recording, or .detach() their results if they should be constants. "
        "(warned once per manager)",
        PreRecordGradientWarning,
        stacklevel=5,
    )
    return True
