"""One step of two models, compared tensor by tensor (:func:`compare_step`)."""

from __future__ import annotations

import difflib
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .contract import Layer, ModelAdapter, adapter_for, squeezed
from .kinks import Kink, find_kink, near_kink
from .mapping import MappingReport, Transform, build_map, config_findings, convert
from .report import Entry, Flip, StepReport
from .tolerance import C_GRAD, C, eps, grad_reduction, layer_reduction, tolerance
from .trace import Call, Loss, Trace, as_batch, restore, run_step, snapshot


def compare_step(a: Any, b: Any, batch: Any, *, loss_a: Optional[Loss] = None,
                 loss_b: Optional[Loss] = None, inputs: int = 1,
                 name_map: Optional[Mapping[str, str]] = None,
                 transforms: Optional[Mapping[str, Transform]] = None,
                 tol_factor: float = 1.0, pin: bool = True) -> StepReport:
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
    ad_a, ad_b = adapter_for(a), adapter_for(b)
    arrays = as_batch(batch)
    before_a, before_b = snapshot(ad_a), snapshot(ad_b)
    try:
        ta = run_step(ad_a, arrays, inputs, loss_a, {})
        tb = run_step(ad_b, arrays, inputs, loss_b, {})
    except BaseException:  # b failed after a stepped: leave neither a step ahead of the other
        restore(ad_a, before_a)
        restore(ad_b, before_b)
        raise
    ta.dtype = max(ta.dtype, tb.dtype, key=eps)  # a float64 reference against a float32 port
    mapping = build_map(ad_a, ad_b, name_map, transforms=transforms,
                        order_a=ta.order, order_b=tb.order)
    report = StepReport(ad_a.framework, ad_b.framework, unmapped=list(mapping.unmapped))
    aligned = _align(ta.calls, tb.calls, mapping.layers, report)
    depth = _depths(ta.calls)
    kinks = _forward(ta, tb, aligned, depth, tol_factor, report)
    report.entries.append(_loss_entry(ta, tb, depth, tol_factor))
    pins = {j: k.pin for (i, j), k in kinks.items() if k.flipped and k.pin is not None}
    if pin and pins:
        restore(ad_b, before_b)  # the step runs again from the same state
        tb = run_step(ad_b, arrays, inputs, loss_b, pins)
    report.flips = [_flip(ta.calls[i], tb.calls[j], k, pin) for (i, j), k in kinks.items()
                    if k.flipped]
    unseen = _unseen(ta, tb, aligned, depth, tol_factor)
    report.flips += [flip for _, flip in unseen]
    unpinned = [i for (i, j), k in kinks.items() if k.flipped and not (pin and k.pinnable)]
    unpinned += [i for i, _ in unseen]
    _grads(ad_a, ta, tb, mapping, depth, tol_factor, max(unpinned, default=-1), report)
    return report


def _align(ca: List[Call], cb: List[Call], layers: List[Tuple[str, str]],
           report: StepReport) -> List[Tuple[int, int]]:
    """Pair the two forwards' calls: the k-th call of a mapped layer with the k-th call of its
    counterpart; between those anchors, the calls of layers without tensors (activations,
    pooling) by kind, as ``diff`` pairs lines. The rest are listed as without counterpart."""
    anchors: List[Tuple[int, int]] = []
    for la, lb in layers:
        anchors += zip([i for i, c in enumerate(ca) if c.layer == la],
                       [j for j, c in enumerate(cb) if c.layer == lb])
    anchors.sort()
    chain, last = [], -1  # the anchors in the same order on both sides bound the segments
    for i, j in anchors:
        if j > last:
            chain.append((i, j))
            last = j
    used_a, used_b = {i for i, _ in anchors}, {j for _, j in anchors}
    pairs = set(anchors)
    bounds = [(-1, -1)] + chain + [(len(ca), len(cb))]
    for (i0, j0), (i1, j1) in zip(bounds, bounds[1:]):
        seg_a = [i for i in range(i0 + 1, i1) if i not in used_a]
        seg_b = [j for j in range(j0 + 1, j1) if j not in used_b]
        matcher = difflib.SequenceMatcher(None, [ca[i].kind for i in seg_a],
                                          [cb[j].kind for j in seg_b], autojunk=False)
        pairs |= {(seg_a[blk.a + k], seg_b[blk.b + k]) for blk in matcher.get_matching_blocks()
                  for k in range(blk.size)}
    left_a = sorted(set(range(len(ca))) - {i for i, _ in pairs})
    left_b = sorted(set(range(len(cb))) - {j for _, j in pairs})
    report.unmatched += [f"a {ca[i].layer} ({ca[i].kind}), call {i}" for i in left_a]
    report.unmatched += [f"b {cb[j].layer} ({cb[j].kind}), call {j}" for j in left_b]
    return sorted(pairs)


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
        kink = find_kink(ca, cb, tol)
        if kink is not None:
            kink.tol = tol
            kinks[(i, j)] = kink
            if kink.beyond:
                note = f"{kink.beyond} element(s) on different sides of the kink"
        if ca.config.get("training") != cb.config.get("training") and diff > tol:
            modes = ["training" if c.config.get("training") else "eval" for c in (ca, cb)]
            note = (f"a in {modes[0]} mode, b in {modes[1]} mode: call .train() or .eval() "
                    f"on both models")
        if ca.kind.startswith("dropout") and diff > tol and not note:
            note = "each framework draws its own dropout mask: use eval() or p=0 to compare"
        entry = Entry("forward", f"{ca.layer} / {cb.layer}", ca.layer, ca.kind, diff, rel, tol,
                      "ok" if diff <= tol and not note else "DIFFERS", note)
        report.entries.append(entry)
        if not entry.ok and report.first_forward is None:
            report.first_forward = entry
    return kinks


def _unseen(ta: Trace, tb: Trace, aligned: List[Tuple[int, int]], depth: List[float],
            factor: float) -> List[Tuple[int, Flip]]:
    """Piecewise calls on one side only (the other side's is a function): the elements near
    their kink, placed at the index of side a's nearest call before them."""
    found = []
    for side, calls, matched in (("a", ta.calls, {i for i, _ in aligned}),
                                 ("b", tb.calls, {j for _, j in aligned})):
        for index, call in enumerate(calls):
            if index in matched or call.input is None:
                continue
            at = index if side == "a" else max((i for i, j in aligned if j <= index),
                                               default=-1)
            scale = float(np.abs(call.input).max(initial=0.0))
            tol = tolerance(ta.dtype, depth[at] if at >= 0 else 1.0, scale, factor, C)
            count, largest = near_kink(call, tol)
            if count:
                names = (call.layer, "?") if side == "a" else ("?", call.layer)
                found.append((max(at, 0), Flip(*names, call.kind, count, largest, tol, False,
                                               seen=False)))
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
           depth: List[float], factor: float, unpinned: int, report: StepReport) -> None:
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
    worst: Optional[Tuple[int, Entry]] = None
    for pair in mapping.pairs:
        if pair.src not in ta.grads:
            continue  # a buffer
        layer = layers[pair.src]
        index = first_call.get(layer, -1)
        entry = _grad_entry(pair, ta, tb, layer, kinds.get(layer, ""), index, total, factor,
                            floors.get(layer, 0.0))
        if entry.verdict == "DIFFERS" and 0 <= index <= unpinned:
            entry.verdict, entry.note = "unverified", "behind a kink flip that cannot be pinned"
        report.entries.append(entry)
        if entry.verdict == "DIFFERS" and (worst is None or index > worst[0]):
            worst = (index, entry)
    report.first_grad = worst[1] if worst else None


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
        return Entry("grad", name, layer, kind, 0.0, 0.0, 0.0, verdict, note)
    out = ta.calls[index].output if index >= 0 else None
    reduction = total + grad_reduction(pair.src_shape, out.shape if out is not None else ())
    diff, rel, tol, note = _compare(convert(pair, ga), gb, ta.dtype, reduction, factor, floor,
                                    C_GRAD)
    return Entry("grad", name, layer, kind, diff, rel, tol,
                 "ok" if diff <= tol and not note else "DIFFERS", note)
