"""The rows of a compared step (:func:`~gradmgr.parity.step.compare_step`): each paired
call's forward output, the loss, each mapped parameter's gradient and the gradient each paired
piecewise call sends to its input, each compared within its tolerance (:mod:`.tolerance`)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np

from .contract import Layer, ModelAdapter, family, squeezed
from .dump import after_step
from .kinks import Kink, find_kink
from .mapping import MappingReport, config_findings, convert
from .report import Entry, StepReport
from .tolerance import C_GRAD, C, grad_reduction, layer_reduction, tolerance
from .trace import Call, Trace


def depths(calls: List[Call]) -> List[float]:
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


def forward_entries(ta: Trace, tb: Trace, aligned: List[Tuple[int, int]],
                    depth: List[float], factor: float,
                    report: StepReport) -> Dict[Tuple[int, int], Kink]:
    """A forward row per paired call (its first departure ``report.first_forward``) and the
    paired layers' configuration findings; returns the kinks found at paired calls."""
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
        modes = [c.config.get("training") for c in (ca, cb)]
        if None not in modes and modes[0] != modes[1] and diff > tol:
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


def _dropout_note(ca: Any, cb: Any) -> str:
    """Why a dropout's outputs differ: the masks each framework draws, or, where neither side
    draws one (p=0, or eval mode), its input, from code before it the tool does not watch."""
    if any(c.config.get("training", True) and c.config.get("p", 1.0) > 0 for c in (ca, cb)):
        return "each framework draws its own dropout mask: use eval() or p=0 to compare"
    return ("this dropout draws no mask (p=0 or eval mode) and passes its input on: the "
            "difference comes from the code before it that the tool does not watch (a "
            "function inside the module that calls it)")


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


def _as_layer(call: Call) -> Layer:
    return Layer(call.layer, call.kind, call.config)


def loss_entry(ta: Trace, tb: Trace, depth: List[float], factor: float) -> Entry:
    """The loss row."""
    last = max(ta.calls, key=lambda c: c.done).output if ta.calls else None
    total = max(depth, default=0.0) + (last.size if last is not None else 1)
    floor = float(np.abs(last).mean()) if last is not None and last.size else 0.0
    diff, rel, tol, _ = _compare(np.array([ta.loss]), np.array([tb.loss]), ta.dtype, total,
                                 factor, floor, C_GRAD)
    return Entry("loss", "loss", "", "", diff, rel, tol, "ok" if diff <= tol else "DIFFERS")


def grad_entries(ad_a: ModelAdapter, ta: Trace, tb: Trace, mapping: MappingReport,
                 depth: List[float], factor: float, report: StepReport) -> None:
    """A gradient row per mapped parameter, placed at its layer's first call."""
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
    # per output channel: a grouped weight's first dim is its groups (mapping.grouped), so
    # the shape with fewer dims is the one read, the same tolerance in both directions
    shape = min((pair.src_shape, pair.dst_shape), key=lambda s: len(squeezed(s)))
    reduction = total + grad_reduction(shape, out.shape if out is not None else ())
    diff, rel, tol, note = _compare(convert(pair, ga), gb, ta.dtype, reduction, factor, floor,
                                    C_GRAD)
    return Entry("grad", name, layer, kind, diff, rel, tol,
                 "ok" if diff <= tol and not note else "DIFFERS", note, index=index)


def buffer_entries(sides: Tuple[ModelAdapter, ModelAdapter], ta: Trace,
                   before: Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]],
                   mapping: MappingReport, depth: List[float], factor: float,
                   report: StepReport) -> None:
    """A row per mapped buffer as the step left it (BatchNorm's running statistics): a port
    that normalizes right but updates them wrong agrees on every output and gradient of the
    step, and parts at the next step or in eval mode. Not a buffer one framework updates
    otherwise by design (its slot's note: Paddle's biased running variance), which the
    weight map says. Compared like a gradient, at its layer's largest buffer's scale."""
    ad_a, ad_b = sides
    first_call: Dict[str, int] = {}
    kinds = {y.name: y.kind for y in ad_a.layers()}
    for index, call in enumerate(ta.calls):
        first_call.setdefault(call.layer, index)
    slots_a, slots_b = {s.name: s for s in ad_a.slots()}, {s.name: s for s in ad_b.slots()}
    pairs = [p for p in mapping.pairs if not slots_a[p.src].trainable
             and not (slots_a[p.src].note or slots_b[p.dst].note)]
    after = {p.src: (convert(p, after_step(ad_a, p.src)), after_step(ad_b, p.dst))
             for p in pairs}
    floors: Dict[str, float] = {}
    for p in pairs:
        layer = slots_a[p.src].layer
        floors[layer] = max([floors.get(layer, 0.0)] + [float(np.abs(v).max(initial=0.0))
                                                        for v in after[p.src]])
    for p in pairs:
        layer, (x, y) = slots_a[p.src].layer, after[p.src]
        index = first_call.get(layer, -1)
        diff, rel, tol, note = _compare(x, y, ta.dtype, depth[index] if index >= 0 else 1.0,
                                        factor, floors[layer], C_GRAD)
        if diff > tol and not np.array_equal(convert(p, before[0][p.src]).reshape(-1),
                                             before[1][p.dst].reshape(-1)):
            note = "it differed before the step too: transfer the weights first"
        report.entries.append(Entry(
            "buffer", f"{p.src} / {p.dst}", layer, kinds.get(layer, ""), diff, rel, tol,
            "ok" if diff <= tol and not note else "DIFFERS",
            note or ("" if diff <= tol else "its update differs (a momentum, a statistic), "
                     "which the next step and eval mode read"), index=index))


def input_grad_entries(ta: Trace, tb: Trace, aligned: List[Tuple[int, int]],
                       depth: List[float], factor: float, report: StepReport) -> None:
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
