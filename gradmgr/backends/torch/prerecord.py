"""The pre-record check: gradient that flows through operations done before ``record()``.

Autograd records operations on a ``requires_grad`` tensor whether or not a manager is recording,
so on PyTorch such operations contribute gradient where MegEngine ignores them (S9, and S8 for
tensors attached mid-recording). The check finds them from node sequence numbers and warns
where the result differs from MegEngine's while the recording computed part of the outputs.

Autograd numbers nodes per thread, so a node another thread made inside the recording can look
older than it; nodes carry no thread. So the recording remembers how many threads had been
started when it began (counted by a profile function that ``threading`` gives each new thread,
which removes itself at the thread's first call), and the check is skipped where one was
started since: a forward in a worker thread, a pool's first task. A thread started before the
recording (a pool reused across steps) is not seen: its nodes can still look older.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any, Dict, List, Optional

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
    cost to later steps; ``"always"`` checks every backward (a Python walk over the whole
    graph, every step; no bench times it); ``"off"`` never warns. (Each manager's first
    backward is walked once in every mode, to refuse reentrant activation checkpointing.)

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


_started = 0  # threads started through `threading` since the counting began
# (threading.getprofile is Python 3.10's; before, the attribute it reads)
_profile_of_new_threads = getattr(threading, "getprofile", lambda: threading._profile_hook)


def _count_start(frame: Any, event: str, arg: Any) -> None:
    """A new thread's profile function: counts it, then removes itself (one call a thread)."""
    global _started
    _started += 1
    sys.setprofile(None)


def thread_mark() -> Optional[int]:
    """At ``record()``: the threads started so far (those started from now on are counted);
    None where they cannot be counted (another profile function for new threads)."""
    profile = _profile_of_new_threads()
    if profile is not _count_start:
        if profile is not None:
            return None  # a profiler's
        threading.setprofile(_count_start)
    return _started


def alone_since(mark: Optional[int]) -> bool:
    """Whether no thread was started since ``mark`` (:func:`thread_mark`)."""
    return mark is not None and _started == mark and _profile_of_new_threads() is _count_start


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
