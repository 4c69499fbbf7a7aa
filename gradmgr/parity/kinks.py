"""Kink flips: a piecewise layer (ReLU) whose input lies within rounding of its kink can take
a different branch in each framework. Its forward still agrees (the output moves by at most
the input's own rounding), but the gradient of that layer and of every earlier one moves by
whatever the flipped element carried: a flip, not a porting bug.

Where both sides' inputs of an element lie within tolerance of the kink and the branches
differ, the element flipped. A flip whose inputs do not both lie that close is no flip: it is
a forward difference, reported by the forward comparison. Flipped ReLUs are pinned: the step
runs again with side b's ReLU output replaced by ``x * keep_a`` (side a's branch), and every
gradient is compared with the normal tolerance, so a flip can neither fail the check nor hide
a bug behind it. A flip that cannot be pinned leaves the gradients of its layer and every
earlier one unverified on that batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .trace import Call

# kind -> can be pinned (its output is x * mask); all have their kink at 0
KINKED_AT_ZERO = {"relu": True, "leakyrelu": False}


@dataclass
class Kink:
    """What one aligned pair of piecewise calls did."""

    flipped: int          # branch differs, both inputs within tol of the kink
    beyond: int           # branch differs, an input farther than tol from the kink
    max_input: float      # the largest |x| among the flipped elements
    keep: np.ndarray      # side a's branch (1.0 where a's ReLU passes the input)
    pinnable: bool


def find_kink(call_a: Call, call_b: Call, tol: float) -> Optional[Kink]:
    """The flips between two calls of the same piecewise layer, or None where there are none
    (or nothing to compare)."""
    pinnable = KINKED_AT_ZERO.get(call_a.kind)
    if pinnable is None or call_a.input is None or call_b.input is None:
        return None
    xa = call_a.input
    xb = call_b.input.reshape(xa.shape) if call_b.input.size == xa.size else None
    if xb is None:
        return None
    differ = (xa > 0) != (xb > 0)
    if not differ.any():
        return None
    near = (np.abs(xa) <= tol) & (np.abs(xb) <= tol)
    flipped = differ & near
    largest = float(np.maximum(np.abs(xa), np.abs(xb))[flipped].max()) if flipped.any() else 0.0
    return Kink(int(flipped.sum()), int((differ & ~near).sum()), largest,
                (xa > 0).astype(xa.dtype), pinnable)
