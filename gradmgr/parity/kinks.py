"""Kink flips: a piecewise layer (ReLU) whose input lies within rounding of its kink can take
a different branch in each framework. Its forward still agrees (the output moves by at most
the input's own rounding), but the gradient of that layer and of every earlier one moves by
whatever the flipped element carried: a flip, not a porting bug.

Where both sides' inputs of an element lie within tolerance of the kink and the branches
differ, the element flipped. A flip whose inputs do not both lie that close is no flip: it is
a forward difference, reported by the forward comparison. Flipped ReLUs are pinned: the step
runs again with side b's ReLU output replaced by ``x * keep_a`` (side a's branch), and every
gradient is compared with the normal tolerance, so a flip can neither fail the check nor hide
a bug behind it. A max-pool picks the largest element of each window: where two candidates lie
within tolerance of each other on both sides and the sides pick different ones, the window
flipped; it is pinned by adding to side b's input a constant that lifts side a's pick just
above side b's (a constant moves no gradient), unless that would change the pick of an
overlapping window too. A flip in a LeakyReLU is not pinned, nor is one at a ReLU whose
counterpart on the other side is not watched (a MegEngine ``F.relu``: only one side's input
is seen, and every element within tolerance of the kink may have flipped; PyTorch's functional
calls are watched, gradmgr/backends/torch/parity_functions.py). A flip that is not
pinned leaves the gradients of its layer and every earlier one unverified on that batch where
they differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .trace import Call

# ("mask", keep, where): the layer's output becomes x * keep where ``where`` holds (a ReLU
# taking side a's branches at the flipped elements, its own output elsewhere);
# ("offset", delta): the layer's input becomes x + delta, a constant that moves no gradient
# (a max-pool whose flipped windows then pick side a's element)
Pin = tuple

# kind -> can be pinned (its output is x * mask); all have their kink at 0
KINKED_AT_ZERO = {"relu": True, "leakyrelu": False}


@dataclass
class Kink:
    """What one aligned pair of piecewise calls did."""

    flipped: int          # branch differs, both inputs within tol of the kink
    beyond: int           # branch differs, an input farther than tol from the kink
    max_input: float      # the largest |x| (max-pool: the largest gap) among the flipped
    pin: Optional[Pin]    # how side b takes side a's branches, or None: it cannot
    tol: float = 0.0      # the tolerance "near" was judged with

    @property
    def pinnable(self) -> bool:
        """Side b can be made to take side a's branches."""
        return self.pin is not None


def find_kink(call_a: Call, call_b: Call, tol: float) -> Optional[Kink]:
    """The flips between two calls of the same piecewise layer, or None where there are none
    (or nothing to compare)."""
    if call_a.kind == "maxpool2d":
        return _max_pool(call_a, call_b, tol)
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
    keep = ("mask", (xa > 0).astype(xa.dtype), flipped) if pinnable else None
    return Kink(int(flipped.sum()), int((differ & ~near).sum()), largest, keep)


def near_kink(call: Call, tol: float) -> Tuple[int, float, np.ndarray]:
    """How many inputs of a piecewise call WITHOUT a counterpart on the other side (a
    functional ``F.relu`` there) lie within ``tol`` of the kink, the largest of them, and
    where they are (flat indices): each may have flipped unseen."""
    if KINKED_AT_ZERO.get(call.kind) is None or call.input is None:
        return 0, 0.0, np.zeros(0, np.int64)
    near = np.abs(call.input) <= tol
    largest = float(np.abs(call.input[near]).max()) if near.any() else 0.0
    return int(near.sum()), largest, np.flatnonzero(near)


def toggle(call: Call, element: int) -> Pin:
    """The pin that sends one input element of a ReLU-like call down the other branch (the
    rest untouched): what a flip of that element would do to the gradients."""
    if call.input is None:  # (only a watched ReLU-like call keeps its input)
        raise ValueError(f"toggle: the call of {call.layer} kept no input to flip")
    shape = call.input.shape
    x = call.input.reshape(-1)
    keep = (x > 0).astype(x.dtype)
    keep[element] = 1 - keep[element]
    where = np.zeros(x.shape, bool)
    where[element] = True
    return ("mask", keep.reshape(shape), where.reshape(shape))


def _windows(call: Call) -> Optional[np.ndarray]:
    """The max-pool's windows of ``call.input``: ``(N, C, H_out, W_out, kh * kw)``, or None
    if the config does not reproduce the recorded output's shape (ceil mode, dilation)."""
    x, config = call.input, call.config
    if x is None or x.ndim != 4 or call.output is None or "kernel_size" not in config:
        return None
    (kh, kw), (sh, sw), (ph, pw) = config["kernel_size"], config["stride"], config["padding"]
    padded = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf)
    view = sliding_window_view(padded, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw]
    if view.shape[:4] != call.output.shape:
        return None
    return view.reshape(*view.shape[:4], kh * kw)


def _max_pool(call_a: Call, call_b: Call, tol: float) -> Optional[Kink]:
    """A max-pool's flip: the two sides pick different elements of a window whose two
    candidates lie within ``tol`` of each other on both sides (a near tie); pinned by an
    offset on side b's input where :func:`_pool_offset` finds one."""
    wa, wb = _windows(call_a), _windows(call_b)
    if wa is None or wb is None or wa.shape != wb.shape:
        return None
    ia, ib = wa.argmax(-1)[..., None], wb.argmax(-1)[..., None]
    differ = (ia != ib)[..., 0]
    if not differ.any():
        return None
    gap_a = (np.take_along_axis(wa, ia, -1) - np.take_along_axis(wa, ib, -1))[..., 0]
    gap_b = (np.take_along_axis(wb, ib, -1) - np.take_along_axis(wb, ia, -1))[..., 0]
    near = (gap_a <= tol) & (gap_b <= tol)
    flipped = differ & near
    largest = float(np.maximum(gap_a, gap_b)[flipped].max()) if flipped.any() else 0.0
    pin = _pool_offset(call_b, wb, ia[..., 0], ib[..., 0], flipped) if flipped.any() else None
    return Kink(int(flipped.sum()), int((differ & ~near).sum()), largest, pin)


def _pool_offset(call_b: Call, wb: np.ndarray, ia: np.ndarray, ib: np.ndarray,
                 flipped: np.ndarray) -> Optional[Pin]:
    """The constant that, added to side b's input, makes each flipped window pick side a's
    element (raised just above b's pick), or None where that would change another window's
    pick too (overlapping windows): checked by pooling the shifted input again."""
    x = call_b.input
    (kh, kw), (sh, sw), (ph, pw) = (call_b.config[k] for k in ("kernel_size", "stride",
                                                               "padding"))
    delta = np.zeros_like(x)
    for n, c, h, w in zip(*np.nonzero(flipped)):
        pick, want = ib[n, c, h, w], ia[n, c, h, w]
        gap = wb[n, c, h, w, pick] - wb[n, c, h, w, want]
        row, col = h * sh + want // kw - ph, w * sw + want % kw - pw
        delta[n, c, row, col] = max(delta[n, c, row, col],
                                    gap + 4 * np.spacing(np.float32(abs(wb[n, c, h, w, pick]))))
    shifted = Call(call_b.layer, call_b.kind, call_b.config, call_b.in_shape, call_b.output,
                   x + delta)
    moved = _windows(shifted)
    if moved is None or not np.array_equal(moved.argmax(-1), ia):
        return None
    return ("offset", delta)
