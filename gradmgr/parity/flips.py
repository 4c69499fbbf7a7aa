"""The kink flips a compared step could not pin (:mod:`.kinks` pins the others): piecewise
calls watched on one side only, and the verdict on the gradients that differ behind such a
flip: unverified where a flip can explain the difference, a difference where it cannot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .contract import ModelAdapter
from .dump import recorded_loss
from .kinks import Kink, near_kink, toggle
from .mapping import MappingReport, convert
from .progress import grow
from .report import Entry, Flip, StepReport
from .tolerance import C, tolerance
from .trace import Call, Loss, Trace, restore, run_step


@dataclass
class Unseen:
    """A piecewise call with no counterpart on the other side: where (``side``, ``call``),
    the index of side a's call it is placed at, the elements near its kink, its flip row."""

    side: int
    call: int
    at: int
    elements: np.ndarray
    flip: Flip


def unseen_calls(ta: Trace, tb: Trace, aligned: List[Tuple[int, int]], depth: List[float],
                 factor: float) -> List[Unseen]:
    """Piecewise calls on one side only (the other side's is a function, or a layer of
    another kind): the elements near their kink, placed at the index of side a's nearest
    call before them."""
    found = []
    for side, calls, matched in ((0, ta.calls, {i for i, _ in aligned}),
                                 (1, tb.calls, {j for _, j in aligned})):
        for index, call in enumerate(calls):
            if index in matched or call.input is None:
                continue
            at = index if side == 0 else max((i for i, j in aligned if j <= index),
                                             default=-1)
            scale = float(np.abs(call.input).max(initial=0.0))
            tol = tolerance(ta.dtype, depth[at] if at >= 0 else 1.0, scale, factor, C)
            count, largest, elements = near_kink(call, tol)
            if count:
                names = (call.layer, "?") if side == 0 else ("?", call.layer)
                found.append(Unseen(side, index, max(at, 0), elements, Flip(
                    *names, call.kind, count, largest, tol, False, seen=False)))
    return found


def flip_row(ca: Call, cb: Call, kink: Kink, pin: bool) -> Flip:
    """The report's row of a kink flip at a paired call (pinned where ``pin`` could)."""
    return Flip(ca.layer, cb.layer, ca.kind, kink.flipped, kink.max_input, kink.tol,
                pin and kink.pinnable)


@dataclass
class Sides:
    """What re-running one side's step needs: per side (a, b) its adapter, trace, buffers
    before the step, loss and pins; the batch."""

    adapters: Tuple[ModelAdapter, ModelAdapter]
    traces: Tuple[Trace, Trace]
    before: Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]
    losses: Tuple[Optional[Loss], Optional[Loss]]
    pins: Tuple[Dict[int, Any], Dict[int, Any]]
    batch: Tuple[np.ndarray, ...]
    inputs: int
    shown: Any  # the progress bar (progress.py)


MAX_TOGGLES = 48
"""The most near-kink elements whose flips :func:`_flip_bound` sizes (one step of one side
each); beyond, the gradients behind them are left unverified."""


def explain(behind: List[Entry], unpinned: int, unseen: List[Unseen],
            mapping: MappingReport, sides: Sides, report: StepReport) -> None:
    """Decide the gradients beyond tolerance that lie behind a flip the tool could not pin: a
    difference is unverified only where a flip can explain it. Once a forward has departed
    the flip explains nothing; a possible flip at a ReLU watched on one side only moves a
    gradient by at most what sending each of its near-kink elements down the other branch
    moves it (summed, element by element); a difference beyond that is a difference."""
    if report.first_forward is not None:
        for e in behind:
            e.note = (f"the forward already departed at {report.first_forward.name}: not a "
                      f"kink flip")
        return
    bound = _flip_bound(unseen, mapping, sides) if any(
        e.index > unpinned for e in behind) else None
    for e in behind:
        if e.index <= unpinned or bound is None or e.pair is None or e.pair.src not in bound:
            e.verdict = "unverified"
            e.note = ("behind a kink flip that cannot be pinned" if e.index <= unpinned else
                      f"behind more than {MAX_TOGGLES} elements near a kink watched on one "
                      f"side only: too many to size what their flips can move")
            continue
        ga, gb = sides.traces[0].grads[e.pair.src], sides.traces[1].grads[e.pair.dst]
        if ga is None or gb is None:  # (an entry compared two gradients: not expected)
            e.verdict, e.note = "unverified", "no gradient on one side to size a flip against"
            continue
        diff = np.abs(convert(e.pair, ga).astype(np.float64) - gb.reshape(
            e.pair.dst_shape).astype(np.float64))
        limit = bound[e.pair.src]
        if np.all(diff <= e.tol + limit * 1.01):
            e.verdict = "unverified"
            e.note = (f"within what the possible kink flips at ReLUs watched on one side only "
                      f"can move it (up to {float(limit.max()):.3g})")
        else:
            e.note = (f"beyond what the possible kink flips can move it (up to "
                      f"{float(limit.max()):.3g}): not a flip")


def _flip_bound(unseen: List[Unseen], mapping: MappingReport,
                sides: Sides) -> Optional[Dict[str, np.ndarray]]:
    """Per parameter (in side b's layout, by side a's name), the sum over every element near
    a kink watched on one side only of how far sending that element down the other branch
    moves the gradient: one step of that side per element. None where there are too many
    elements, or a kink the toggle cannot model (a LeakyReLU)."""
    if sum(len(u.elements) for u in unseen) > MAX_TOGGLES or any(
            u.flip.kind != "relu" for u in unseen):
        return None
    if any(recorded_loss(sides.adapters[u.side]) is not None for u in unseen):
        return None  # a dump's side cannot run again with an element toggled
    to_a, from_a = {p.dst: p for p in mapping.pairs}, {p.src: p for p in mapping.pairs}
    bound = {p.src: np.zeros(p.dst_shape) for p in mapping.pairs}
    grow(sides.shown, sum(len(u.elements) for u in unseen) + len({u.side for u in unseen}))
    for side in (0, 1):
        mine = [u for u in unseen if u.side == side]
        if not mine:
            continue
        adapter, trace = sides.adapters[side], sides.traces[side]
        try:
            for u in mine:
                for element in u.elements:
                    restore(adapter, sides.before[side])
                    pins = dict(sides.pins[side])
                    pins[u.call] = toggle(trace.calls[u.call], int(element))
                    moved = run_step(adapter, sides.batch, sides.inputs, sides.losses[side],
                                     pins).grads
                    sides.shown.update()
                    for name, g in moved.items():
                        pair = to_a.get(name) if side else from_a.get(name)
                        base = trace.grads.get(name)
                        if pair is None or g is None or base is None:
                            continue
                        delta = np.abs(g.astype(np.float64) - base.astype(np.float64))
                        bound[pair.src] += (convert(pair, delta) if side == 0
                                            else delta.reshape(pair.dst_shape))
        finally:  # leave the side as its compared step left it
            restore(adapter, sides.before[side])
            run_step(adapter, sides.batch, sides.inputs, sides.losses[side], sides.pins[side])
            sides.shown.update()
    return bound
