"""One step of two models, compared tensor by tensor (:func:`compare_step`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .align import align_calls
from .contract import Layer, ModelAdapter, adapter_for, family, squeezed
from .dump import recorded_loss
from .errors import ParityError
from .kinks import Kink, find_kink, near_kink, toggle
from .mapping import TIED, MappingReport, Transform, build_map, config_findings, convert
from .progress import bar, grow
from .report import Entry, Flip, StepReport
from .tolerance import C_GRAD, C, eps, grad_reduction, layer_reduction, tolerance
from .trace import Call, Loss, Trace, as_batch, restore, run_step, snapshot


def compare_step(a: Any, b: Any, batch: Any, *, loss_a: Optional[Loss] = None,
                 loss_b: Optional[Loss] = None, inputs: int = 1,
                 name_map: Optional[Mapping[str, str]] = None,
                 transforms: Optional[Mapping[str, Transform]] = None,
                 tol_factor: float = 1.0, pin: bool = True,
                 progress: Optional[bool] = None) -> StepReport:
    """Run one batch through ``a`` and ``b`` (PyTorch or MegEngine modules holding the same
    weights: :func:`transfer_weights`), each under its own gradmgr ``GradManager``, and
    compare every layer's forward output, the loss and every parameter's gradient.

    Args:
        a: the reference model.
        b: the port.
        batch: a numpy array or a tuple of them; the first ``inputs`` items go to the models,
            the rest to the losses.
        loss_a: ``loss_a(output, *targets) -> scalar tensor`` in ``a``'s framework (targets
            are the rest of the batch, as that framework's tensors); default the output's mean.
        loss_b: the same for ``b``.
        inputs: how many leading batch items the models take.
        name_map: ``{a_name: b_name}`` for the parameters, as :func:`transfer_weights` takes.
        transforms: declared layout changes, as :func:`transfer_weights` takes.
        tol_factor: multiplies every tolerance (:mod:`gradmgr.parity.tolerance`).
        pin: re-run ``b`` with flipped ReLUs pinned to ``a``'s branch (:mod:`.kinks`).
        progress: a progress bar of the models' runs on stderr (tqdm), as
            :func:`train_drift` takes it (default: when stderr is a terminal).

    Returns:
        A :class:`StepReport`; ``report.ok`` is the verdict, ``str(report)`` the table.
        The models are left as one training step leaves them (BatchNorm running statistics
        updated once, gradients in ``.grad``).

    Example:
        >>> import numpy as np, torch
        >>> from gradmgr.parity import compare_step, transfer_weights
        >>> a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> b = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> _ = transfer_weights(a, b)
        >>> with torch.no_grad():
        ...     _ = b[2].bias.add_(0.1)         # a porting bug in the last layer
        >>> report = compare_step(a, b, np.ones((3, 4), np.float32))
        >>> report.ok, report.first_forward.layer
        (False, '2')
    """
    with bar(2, progress, "compare_step", "run") as shown:
        return _step(a, b, batch, (loss_a, loss_b), inputs, name_map, transforms, tol_factor,
                     pin, shown)


def _step(a: Any, b: Any, batch: Any, losses: Tuple[Any, Any], inputs: int, name_map: Any,
          transforms: Any, tol_factor: float, pin: bool, shown: Any) -> StepReport:
    (loss_a, loss_b), ad_a, ad_b = losses, adapter_for(a), adapter_for(b)
    _check_losses((recorded_loss(ad_a), recorded_loss(ad_b)), (loss_a, loss_b))
    pin = pin and recorded_loss(ad_b) is None  # a dump's step cannot run again, pinned
    arrays = as_batch(batch)
    before_a, before_b = snapshot(ad_a), snapshot(ad_b)
    weights_a, weights_b = _weights(ad_a), _weights(ad_b)
    try:
        ta = run_step(ad_a, arrays, inputs, loss_a, {})
        shown.update()
        tb = run_step(ad_b, arrays, inputs, loss_b, {})
        shown.update()
    except BaseException:  # b failed after a stepped: leave neither a step ahead of the other
        restore(ad_a, before_a)
        restore(ad_b, before_b)
        raise
    ta.dtype = max(ta.dtype, tb.dtype, key=eps)  # a float64 reference against a float32 port
    mapping = build_map(ad_a, ad_b, name_map, transforms=transforms,
                        order_a=ta.order, order_b=tb.order)
    report = StepReport(ad_a.framework, ad_b.framework, unmapped=list(mapping.unmapped))
    report.weights = _weights_differ(mapping, weights_a, weights_b)
    report.findings += [f for f in mapping.findings if f.key == TIED]  # (layers': _forward)
    aligned, same_kind = align_calls(ta.calls, tb.calls, mapping.layers, report)
    depth = _depths(ta.calls)
    kinks = _forward(ta, tb, aligned, depth, tol_factor, report)
    report.entries.append(_loss_entry(ta, tb, depth, tol_factor))
    pins = {j: k.pin for (i, j), k in kinks.items() if k.flipped and k.pin is not None}
    if pin and pins:
        restore(ad_b, before_b)  # the step runs again from the same state
        grow(shown, 1)
        tb = run_step(ad_b, arrays, inputs, loss_b, pins)
        shown.update()
    else:
        pins = {}
    report.flips = [_flip(ta.calls[i], tb.calls[j], k, pin) for (i, j), k in kinks.items()
                    if k.flipped]
    unseen = _unseen(ta, tb, same_kind, depth, tol_factor)
    report.flips += [u.flip for u in unseen]
    unpinned = [i for (i, j), k in kinks.items() if k.flipped and not (pin and k.pinnable)]
    _grads(ad_a, ta, tb, mapping, depth, tol_factor, report)
    _place_grads(ta, tb, same_kind, depth, tol_factor, report)
    behind = [e for e in report.entries if e.what == "grad" and e.verdict == "DIFFERS"
              and 0 <= e.index <= max(unpinned + [u.at for u in unseen], default=-1)]
    if behind:
        sides = Sides((ad_a, ad_b), (ta, tb), (before_a, before_b), (loss_a, loss_b),
                      ({}, pins), arrays, inputs, shown)
        _explain(behind, max(unpinned, default=-1), unseen, mapping, sides, report)
    bad = [e for e in report.entries if e.what == "grad" and e.verdict == "DIFFERS"]
    report.first_grad = max(bad, key=lambda e: e.index) if bad else None
    if report.first_grad is not None and report.first_forward is None:
        report.suspects = ([f"{report.first_grad.name.removesuffix(': input')} "
                            f"({report.first_grad.kind})"]
                           if report.first_grad.pair is None else
                           _suspects(ta, tb, aligned, report.first_grad.layer, mapping))
    return report


def _place_grads(ta: Trace, tb: Trace, aligned: List[Tuple[int, int]], depth: List[float],
                 factor: float, report: StepReport) -> None:
    """The gradient each paired piecewise call sends to its input, where both sides tapped
    it (trace.py): a backward-only bug in the call itself (a ReLU without its mask) differs
    here first."""
    total = max(depth, default=0.0)
    for i, j in aligned:
        ca, cb = ta.calls[i], tb.calls[j]
        if ca.grad_in is None or cb.grad_in is None:
            continue
        diff, rel, tol, note = _compare(ca.grad_in, cb.grad_in, ta.dtype, total, factor,
                                        c=C_GRAD)
        report.entries.append(Entry(
            "grad", f"{ca.layer} / {cb.layer}: input", ca.layer, ca.kind, diff, rel, tol,
            "ok" if diff <= tol and not note else "DIFFERS", note, index=i))


def _suspects(ta: Trace, tb: Trace, aligned: List[Tuple[int, int]], layer: str,
              mapping: MappingReport) -> List[str]:
    """The calls after ``layer``'s last call, up to the next call of a layer with tensors:
    where a backward-only difference behind ``layer``'s gradient can lie. Paired calls first,
    then those of one side only (a port's module whose counterpart is a function the tool
    does not watch)."""
    counterpart = dict(mapping.layers).get(layer)
    span_a = _span(ta.calls, layer, {la for la, _ in mapping.layers})
    span_b = _span(tb.calls, counterpart, {lb for _, lb in mapping.layers})
    if span_a is None:
        return []
    paired = [f"{ta.calls[i].layer} / {tb.calls[j].layer} ({ta.calls[i].kind})"
              for i, j in aligned if span_a[0] < i < span_a[1]]
    alone = [f"{ta.calls[i].layer} ({ta.calls[i].kind}, side a only)"
             for i in range(span_a[0] + 1, span_a[1]) if i not in {p for p, _ in aligned}]
    if span_b is not None:
        alone += [f"{tb.calls[j].layer} ({tb.calls[j].kind}, side b only)"
                  for j in range(span_b[0] + 1, span_b[1]) if j not in {q for _, q in aligned}]
    return list(dict.fromkeys(paired + alone))


def _span(calls: List[Any], layer: Optional[str], owners: set) -> Optional[Tuple[int, int]]:
    """The index of ``layer``'s last call and of the next call of a layer with tensors."""
    last = max((i for i, c in enumerate(calls) if c.layer == layer), default=None)
    if last is None:
        return None
    end = next((i for i in range(last + 1, len(calls)) if calls[i].layer in owners),
               len(calls))
    return last, end


def _check_losses(recorded: Tuple[Optional[str], Optional[str]],
                  losses: Tuple[Optional[Loss], Optional[Loss]]) -> None:
    """Both sides' losses the output's mean, or both their own: a dump's (dump.py) is
    recorded with it, ``"mean"`` or ``"custom"``."""
    names = ("loss_a", "loss_b")
    for side, (kept, loss) in enumerate(zip(recorded, losses)):
        if kept is not None and loss is not None:
            raise ParityError(f"{names[side]} given for a parity dump: its loss was recorded "
                              f"with it ({kept}); pass the live model's loss only")
    custom = [kept == "custom" if kept is not None else loss is not None
              for kept, loss in zip(recorded, losses)]
    if custom[0] != custom[1]:
        given, missing = names if custom[0] else names[::-1]
        if recorded[names.index(given)] is not None:
            raise ParityError(f"the parity dump was recorded with its own loss: give "
                              f"{missing} (the same loss in the live model's framework)")
        raise ParityError(f"{given} given without {missing}: each model needs its own "
                          f"framework's loss (or neither, for the output's mean)")


def _weights(adapter: ModelAdapter) -> Dict[str, np.ndarray]:
    """The trainable tensors' values before the step."""
    return {s.name: adapter.read(s.name) for s in adapter.slots() if s.trainable}


def _weights_differ(mapping: MappingReport, wa: Dict[str, np.ndarray],
                    wb: Dict[str, np.ndarray]) -> List[str]:
    """The mapped parameters whose values differ before the step (in the coarser dtype: a
    float64 reference against its float32 port holds the same values)."""
    found = []
    for p in mapping.pairs:
        if p.src in wa and p.dst in wb:
            x, y = convert(p, wa[p.src]), wb[p.dst]
            dtype = min(x.dtype, y.dtype, key=lambda d: np.finfo(d).bits
                        if d.kind == "f" else 64)
            if not np.array_equal(x.astype(dtype), y.reshape(x.shape).astype(dtype)):
                found.append(f"{p.src} / {p.dst}")
    return found


def _depths(calls: List[Call]) -> List[float]:
    """The reduction length behind each call's output (tolerance.py): a running sum over the
    calls in the order they return (a module that owns tensors returns after its children)."""
    total, found = 0.0, [0.0] * len(calls)
    for index in sorted(range(len(calls)), key=lambda i: calls[i].done):
        c = calls[index]
        out_shape = c.output.shape if c.output is not None else ()
        total += layer_reduction(c.kind, c.config, c.in_shape, out_shape)
        found[index] = total
    return found


def _compare(x: np.ndarray, y: np.ndarray, dtype: Any, reduction: float,
             factor: float, floor: float = 0.0, c: float = C) -> Tuple[float, float, float, str]:
    if squeezed(x.shape) != squeezed(y.shape):
        return float("inf"), float("inf"), 0.0, f"shapes {x.shape} and {y.shape}"
    x64, y64 = x.astype(np.float64), y.reshape(x.shape).astype(np.float64)
    scale = float(max(np.abs(x64).max(initial=0.0), np.abs(y64).max(initial=0.0), floor))
    diff = float(np.abs(x64 - y64).max(initial=0.0))
    tol = tolerance(dtype, reduction, scale, factor, c)
    return diff, diff / scale if scale else 0.0, tol, ""


def _dropout_note(ca: Any, cb: Any) -> str:
    """Why a dropout's outputs differ: the masks each framework draws, or, where neither side
    draws one (p=0, or eval mode), its input, from code before it the tool does not watch."""
    if any(c.config.get("training", True) and c.config.get("p", 1.0) > 0 for c in (ca, cb)):
        return "each framework draws its own dropout mask: use eval() or p=0 to compare"
    return ("this dropout draws no mask (p=0 or eval mode) and passes its input on: the "
            "difference comes from the code before it that the tool does not watch (a "
            "function inside the module that calls it)")


def _forward(ta: Trace, tb: Trace, aligned: List[Tuple[int, int]], depth: List[float],
             factor: float, report: StepReport) -> Dict[Tuple[int, int], Kink]:
    kinks, seen = {}, set()
    for i, j in sorted(aligned, key=lambda pair: ta.calls[pair[0]].done):
        ca, cb = ta.calls[i], tb.calls[j]
        if (ca.layer, cb.layer) not in seen:
            seen.add((ca.layer, cb.layer))
            report.findings += config_findings(_as_layer(ca), _as_layer(cb))
        if ca.output is None or cb.output is None:
            continue
        diff, rel, tol, note = _compare(ca.output, cb.output, ta.dtype, depth[i], factor)
        kink = find_kink(ca, cb, tol) if family(ca.kind) == family(cb.kind) else None
        if kink is not None:
            kink.tol = tol
            kinks[(i, j)] = kink
            if kink.beyond:
                note = f"{kink.beyond} element(s) on different sides of the kink"
        if ca.config.get("training") != cb.config.get("training") and diff > tol:
            modes = ["training" if c.config.get("training") else "eval" for c in (ca, cb)]
            note = (f"a in {modes[0]} mode, b in {modes[1]} mode: call .train() or .eval() "
                    f"on both models")
        if family(ca.kind) != family(cb.kind) and (diff > tol or note):
            note = (f"a {ca.kind} on side a, a {cb.kind} on side b: a substituted layer"
                    + (f" ({note})" if note else ""))
        if ca.kind.startswith("dropout") and diff > tol and not note:
            note = _dropout_note(ca, cb)
        kind = ca.kind if ca.kind == cb.kind else f"{ca.kind} / {cb.kind}"
        entry = Entry("forward", f"{ca.layer} / {cb.layer}", ca.layer, kind, diff, rel, tol,
                      "ok" if diff <= tol and not note else "DIFFERS", note, index=i)
        report.entries.append(entry)
        if not entry.ok and report.first_forward is None:
            report.first_forward = entry
            entry.note = _one_sided_before(ta, tb, aligned, i, j) or entry.note
    return kinks


def _one_sided_before(ta: Trace, tb: Trace, aligned: List[Tuple[int, int]], i: int,
                      j: int) -> str:
    """Where the first departing call's input passed through calls of one side only (a ReLU
    module written as a function on the other side, a layer substituted by one the other side
    computes inside a function): they are where the difference may start, so say so."""
    def between(calls: List[Any], paired: set, end: int) -> List[str]:
        start = max((k for k in paired if k < end), default=-1)
        return [f"{calls[k].layer} ({calls[k].kind})" for k in range(start + 1, end)
                if k not in paired]
    alone = [f"{name} on side a" for name in between(ta.calls, {p for p, _ in aligned}, i)]
    alone += [f"{name} on side b" for name in between(tb.calls, {q for _, q in aligned}, j)]
    if not alone:
        return ""
    return (f"its input came through {', '.join(alone)}, with no counterpart on the other side "
            f"(a function there, or a substituted layer): the difference may start there")


@dataclass
class Unseen:
    """A piecewise call with no counterpart on the other side: where (``side``, ``call``),
    the index of side a's call it is placed at, the elements near its kink, its flip row."""

    side: int
    call: int
    at: int
    elements: np.ndarray
    flip: Flip


def _unseen(ta: Trace, tb: Trace, aligned: List[Tuple[int, int]], depth: List[float],
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


def _as_layer(call: Call) -> Layer:
    return Layer(call.layer, call.kind, call.config)


def _loss_entry(ta: Trace, tb: Trace, depth: List[float], factor: float) -> Entry:
    last = max(ta.calls, key=lambda c: c.done).output if ta.calls else None
    total = max(depth, default=0.0) + (last.size if last is not None else 1)
    floor = float(np.abs(last).mean()) if last is not None and last.size else 0.0
    diff, rel, tol, _ = _compare(np.array([ta.loss]), np.array([tb.loss]), ta.dtype, total,
                                 factor, floor, C_GRAD)
    return Entry("loss", "loss", "", "", diff, rel, tol, "ok" if diff <= tol else "DIFFERS")


def _flip(ca: Call, cb: Call, kink: Kink, pin: bool) -> Flip:
    return Flip(ca.layer, cb.layer, ca.kind, kink.flipped, kink.max_input, kink.tol,
                pin and kink.pinnable)


def _grads(ad_a: ModelAdapter, ta: Trace, tb: Trace, mapping: MappingReport,
           depth: List[float], factor: float, report: StepReport) -> None:
    first_call: Dict[str, int] = {}
    for index, call in enumerate(ta.calls):
        first_call.setdefault(call.layer, index)
    layers = {slot.name: slot.layer for slot in ad_a.slots()}
    kinds = {layer.name: layer.kind for layer in ad_a.layers()}
    # A gradient that cancels to nearly nothing (a bias before a training-mode BatchNorm)
    # sums terms as large as its layer's other gradients: compare it at the layer's scale.
    floors: Dict[str, float] = {}
    for name, g in ta.grads.items():
        if g is not None and name in layers:
            floors[layers[name]] = max(floors.get(layers[name], 0.0), float(np.abs(g).max()))
    total = max(depth, default=0.0)
    for pair in mapping.pairs:
        if pair.src not in ta.grads:
            continue  # a buffer
        layer = layers[pair.src]
        index = first_call.get(layer, -1)
        entry = _grad_entry(pair, ta, tb, layer, kinds.get(layer, ""), index, total, factor,
                            floors.get(layer, 0.0))
        entry.pair = pair
        report.entries.append(entry)


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


def _explain(behind: List[Entry], unpinned: int, unseen: List[Unseen],
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


def _grad_entry(pair: Any, ta: Trace, tb: Trace, layer: str, kind: str, index: int,
                total: float, factor: float, floor: float) -> Entry:
    ga, gb = ta.grads.get(pair.src), tb.grads.get(pair.dst)
    name = f"{pair.src} / {pair.dst}"
    if ga is None or gb is None:
        verdict = "ok" if ga is None and gb is None else "DIFFERS"
        none = "b" if gb is None else "a"
        note = "no gradient on either side" if verdict == "ok" else (
            f"gradient only on side {'ab'.replace(none, '')}: {none}'s is frozen "
            f"(requires_grad=False) or not reached by its loss; freeze it on both sides, or "
            f"compare it trainable on both (the tool attaches every parameter: a MegEngine "
            f"model frozen by leaving it out of its GradManager is not seen)")
        return Entry("grad", name, layer, kind, 0.0, 0.0, 0.0, verdict, note, index=index)
    out = ta.calls[index].output if index >= 0 else None
    reduction = total + grad_reduction(pair.src_shape, out.shape if out is not None else ())
    diff, rel, tol, note = _compare(convert(pair, ga), gb, ta.dtype, reduction, factor, floor,
                                    C_GRAD)
    return Entry("grad", name, layer, kind, diff, rel, tol,
                 "ok" if diff <= tol and not note else "DIFFERS", note, index=index)
