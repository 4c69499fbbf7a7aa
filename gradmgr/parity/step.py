"""One step of two models, compared tensor by tensor (:func:`compare_step`): both sides run,
their rows compared (:mod:`.entries`), the flips that could not be pinned judged
(:mod:`.flips`), and the verdict's first departures and suspects."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .align import align_calls
from .contract import ModelAdapter, adapter_for
from .dump import recorded_loss
from .entries import (
    buffer_entries,
    depths,
    forward_entries,
    grad_entries,
    input_grad_entries,
    loss_entry,
)
from .errors import ParityError
from .flips import Sides, explain, flip_row, unseen_calls
from .mapping import TIED, MappingReport, Transform, build_map, convert
from .progress import bar, grow
from .report import StepReport
from .tolerance import eps
from .trace import Loss, Trace, as_batch, restore, run_step, snapshot


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
    report.findings += [f for f in mapping.findings if f.key == TIED]  # (layers': forward_entries)
    aligned, same_kind = align_calls(ta.calls, tb.calls, mapping.layers, report,
                                     (ad_a.second, ad_b.second))
    depth = depths(ta.calls)
    kinks = forward_entries(ta, tb, aligned, depth, tol_factor, report)
    report.entries.append(loss_entry(ta, tb, depth, tol_factor))
    pins = {j: k.pin for (i, j), k in kinks.items() if k.flipped and k.pin is not None}
    if pin and pins:
        restore(ad_b, before_b)  # the step runs again from the same state
        grow(shown, 1)
        tb = run_step(ad_b, arrays, inputs, loss_b, pins)
        shown.update()
    else:
        pins = {}
    report.flips = [flip_row(ta.calls[i], tb.calls[j], k, pin) for (i, j), k in kinks.items()
                    if k.flipped]
    unseen = unseen_calls(ta, tb, same_kind, depth, tol_factor)
    report.flips += [u.flip for u in unseen]
    unpinned = [i for (i, j), k in kinks.items() if k.flipped and not (pin and k.pinnable)]
    grad_entries(ad_a, ta, tb, mapping, depth, tol_factor, report)
    buffer_entries((ad_a, ad_b), ta, (before_a, before_b), mapping, depth, tol_factor, report)
    input_grad_entries(ta, tb, same_kind, depth, tol_factor, report)
    behind = [e for e in report.entries if e.what == "grad" and e.verdict == "DIFFERS"
              and 0 <= e.index <= max(unpinned + [u.at for u in unseen], default=-1)]
    if behind:
        sides = Sides((ad_a, ad_b), (ta, tb), (before_a, before_b), (loss_a, loss_b),
                      ({}, pins), arrays, inputs, shown)
        explain(behind, max(unpinned, default=-1), unseen, mapping, sides, report)
    bad = [e for e in report.entries if e.what == "grad" and e.verdict == "DIFFERS"]
    report.first_grad = max(bad, key=lambda e: e.index) if bad else None
    if report.first_grad is not None and report.first_forward is None:
        report.suspects = ([f"{report.first_grad.name.removesuffix(': input')} "
                            f"({report.first_grad.kind})"]
                           if report.first_grad.pair is None else
                           _suspects(ta, tb, aligned, report.first_grad.layer, mapping))
    return report


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
