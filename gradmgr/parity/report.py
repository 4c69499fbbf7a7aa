"""The results of a compared step, and the text a human reads: a table of every compared
tensor (layer, kind, max abs, max rel, tolerance, verdict), the first divergence forward and
backward, the kink flips, the tensors left unmapped and the configuration findings. The rows
both reports share (``Unmapped``, ``ConfigFinding``) live here, below :mod:`.mapping`, which
imports them: no import circle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass(frozen=True)
class Unmapped:
    """A tensor with no counterpart (``side`` is ``"src"`` or ``"dst"``), and why."""

    side: str
    name: str
    reason: str


@dataclass(frozen=True)
class ConfigFinding:
    """Two mapped layers configured differently (BatchNorm momentum compared in PyTorch's
    convention): a porting bug unless meant."""

    layer_src: str
    layer_dst: str
    key: str
    src: Any
    dst: Any

    def __str__(self) -> str:
        text = (f"{self.layer_src} / {self.layer_dst}: {self.key} is {_shown(self.src)} on "
                f"one side, {_shown(self.dst)} on the other")
        if self.key == "momentum":  # MegEngine's and Paddle's m arrives as 1 - m
            text += (" (in PyTorch's convention, the new batch's weight: MegEngine's and "
                     "PaddlePaddle's is 1 - it)")
        return text


def _shown(value: Any) -> str:
    """A config value as written: MegEngine's momentum 0.9 arrives as 1 - 0.9, shown as 0.1
    (12 significant digits), not 0.09999999999999998."""
    if isinstance(value, float):
        return f"{value:.12g}"
    return repr(value)


@dataclass
class Entry:
    """One compared tensor: ``what`` is ``forward`` (a layer's output), ``loss``, ``grad``
    (a parameter's gradient) or ``buffer`` (one as the step left it); ``verdict`` is ``ok``,
    ``DIFFERS``, or ``unverified`` (a flip that could not be pinned lies behind it)."""

    what: str
    name: str
    layer: str
    kind: str
    max_abs: float
    max_rel: float
    tol: float
    verdict: str
    note: str = ""
    index: int = -1  # side a's call of the layer (a gradient: its layer's first call)
    pair: Any = field(default=None, repr=False)  # a gradient's weight pair (mapping.Pair)

    @property
    def ok(self) -> bool:
        """Within tolerance."""
        return self.verdict == "ok"


@dataclass
class Flip:
    """Elements of a piecewise layer that took different branches on the two sides while
    both inputs lay within ``tol`` of the kink: rounding, not a bug. ``pinned`` says whether
    the gradients were checked again with the branch pinned to side a's."""

    layer_a: str
    layer_b: str
    kind: str
    count: int
    max_input: float
    tol: float
    pinned: bool
    seen: bool = True  # False: one side's layer has no counterpart the tool can watch


@dataclass
class StepReport:
    """The comparison of one step of two models (:func:`gradmgr.parity.compare_step`).

    Example:
        >>> import torch
        >>> from gradmgr.parity import compare_step
        >>> torch.manual_seed(0) and None
        >>> a = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        >>> b = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        >>> b.load_state_dict(a.state_dict())
        <All keys matched successfully>
        >>> import numpy as np
        >>> report = compare_step(a, b, np.ones((2, 4), np.float32))
        >>> report.ok, report.first_forward, report.first_grad
        (True, None, None)
    """

    a: str
    b: str
    entries: List[Entry] = field(default_factory=list)
    flips: List[Flip] = field(default_factory=list)
    unmatched: List[str] = field(default_factory=list)
    unmapped: List[Unmapped] = field(default_factory=list)
    findings: List[ConfigFinding] = field(default_factory=list)
    first_forward: Optional[Entry] = None
    first_grad: Optional[Entry] = None
    weights: List[str] = field(default_factory=list)  # mapped parameters unequal before it
    # where a backward-only difference lies when every forward agrees: the watched places
    # (modules and functional calls, "a / b") fed by first_grad's layer, up to the next layer
    # with tensors
    suspects: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every tensor within tolerance and verified, every tensor mapped, every layer
        configured alike."""
        return (all(e.ok for e in self.entries) and not self.unmapped and not self.findings)

    @property
    def unverified(self) -> List[Entry]:
        """The gradients a flip that could not be pinned left unchecked on this batch."""
        return [e for e in self.entries if e.verdict == "unverified"]

    def failures(self) -> List[Entry]:
        """The entries beyond tolerance."""
        return [e for e in self.entries if e.verdict == "DIFFERS"]

    def text(self, all_rows: bool = True) -> str:
        """The report as a table; ``all_rows=False`` shows only the rows that are not ok."""
        return step_text(self, all_rows)

    __str__ = text


def _row(e: Entry, width: int, kinds: int) -> str:
    # names whole: the end of a deep name ("... / layer3.0.downsample.0.weight") is the
    # part that tells which of the port's layers it is
    return (f"{e.what:<8} {e.name:<{width}} {e.kind:<{kinds}} {e.max_abs:>10.3g} "
            f"{e.max_rel:>10.3g} {e.tol:>10.3g}  {e.verdict}{'  ' + e.note if e.note else ''}")


def _unseen_line(flips: List[Flip]) -> str:
    """The possible flips at ReLUs watched on one side only, in one line."""
    counts: dict = {}
    for f in flips:
        layer = f"{f.layer_a} (a)" if f.layer_a != "?" else f"{f.layer_b} (b)"
        counts.setdefault(layer, []).append(str(f.count))
    listed = ", ".join(f"{layer}: {'+'.join(n)}" for layer, n in counts.items())
    return (f"possible kink flips at ReLUs watched on one side only (the other side's is a "
            f"function, e.g. F.relu): inputs within tolerance of the kink at {listed}; they "
            f"cannot be compared or pinned: a gradient behind them that differs is "
            f"unverified on this batch where their flips can explain it, DIFFERS where not")


def _flip_line(f: Flip) -> str:
    if f.kind.startswith("maxpool"):
        what = (f"{f.count} window(s) of {f.kind} {f.layer_a} / {f.layer_b} picked different "
                f"elements of a near tie (gaps within {f.tol:.3g}, largest {f.max_input:.3g})")
    else:
        what = (f"{f.count} element(s) of {f.kind} {f.layer_a} / {f.layer_b} took different "
                f"branches with inputs within {f.tol:.3g} of the kink (largest "
                f"{f.max_input:.3g})")
    verdict = ("gradients checked again with the branch pinned" if f.pinned else
               "cannot be pinned: gradients of this layer and earlier unverified on this batch")
    return f"kink flip (rounding, not a bug): {what}; {verdict}"


def verdict(report: StepReport) -> str:
    """``PARITY OK``, ``NOT VERIFIED`` (nothing beyond tolerance, but gradients a flip left
    unchecked) or ``PARITY BROKEN``."""
    if report.ok:
        return "PARITY OK"
    clean = not report.failures() and not report.findings and not report.unmapped
    return "NOT VERIFIED" if clean else "PARITY BROKEN"


def step_text(report: StepReport, all_rows: bool = True) -> str:
    """The text of a :class:`StepReport`."""
    lines = [f"{verdict(report)}: {report.a} (a) against {report.b} (b), one step"]
    if report.first_forward is not None:
        e = report.first_forward
        lines.append(f"first forward divergence: layer {e.name} ({e.kind}): "
                     + (e.note or f"max abs {e.max_abs:.3g} > tol {e.tol:.3g}"))
    if report.first_grad is not None:
        e = report.first_grad
        lines.append(f"first gradient divergence (backward order): {e.name} of layer "
                     f"{e.layer} ({e.kind}): "
                     + (e.note or f"max abs {e.max_abs:.3g} > tol {e.tol:.3g}"))
    moved = [e for e in report.entries if e.what == "buffer" and e.verdict == "DIFFERS"]
    if moved:
        lines.append(f"buffers after the step: {len(moved)} differ ("
                     f"{', '.join(e.name for e in moved[:3])}"
                     f"{', ...' if len(moved) > 3 else ''}): {moved[0].note}")
    if report.weights:
        shown = ", ".join(report.weights[:3]) + (", ..." if len(report.weights) > 3 else "")
        lines.append(f"weights: {len(report.weights)} mapped parameter(s) differ before the "
                     f"step ({shown}): transfer the weights first (transfer_weights(a, b, "
                     f"probe=batch)), unless the port changes them on purpose")
    lines += [f"config: {finding}" for finding in report.findings]
    lines += [f"unmapped ({u.side}) {u.name}: {u.reason}" for u in report.unmapped]
    lines += [_flip_line(f) for f in report.flips if f.seen]
    if any(not f.seen for f in report.flips):
        lines.append(_unseen_line([f for f in report.flips if not f.seen]))
    if all_rows:
        lines += [f"no counterpart: {u}" for u in report.unmatched]
    elif report.unmatched:
        lines.append(f"no counterpart: {len(report.unmatched)} call(s) (text() lists them)")
    if report.first_grad is not None and report.first_forward is None:
        lines.append(_backward_only(report))
    rows = [e for e in report.entries if all_rows or not e.ok]
    if rows:
        width = max([40] + [len(e.name) for e in rows])
        kinds = max([12] + [len(e.kind) for e in rows])
        lines.append(f"{'tensor':<8} {'layer / name':<{width}} {'kind':<{kinds}} "
                     f"{'max abs':>10} {'max rel':>10} {'tol':>10}  verdict")
        lines += [_row(e, width, kinds) for e in rows]
    return "\n".join(lines)



def _backward_only(report: StepReport) -> str:
    """Where a backward-only difference lies: at a watched call whose input's gradient
    differs while every later one agrees, or at or after a layer whose gradients differ."""
    e = report.first_grad
    if e is None:
        raise ValueError("_backward_only needs a report whose first_grad is set")
    head = ("every forward agrees but a gradient differs beyond what a kink flip can move it: "
            "a backward-only difference (a hand-written backward, a detach) ")
    if e.pair is None:  # a watched call's input (step._place_grads)
        return head + (f"in the backward of {report.suspects[0]}: the gradient at its input "
                       f"differs and at every later watched call's input agrees (or in a "
                       f"function the tool does not watch between it and the next)")
    return head + (f"at or after layer {e.layer}'s output, "
                   + (f"in the backward of {', '.join(report.suspects)} or of a function the "
                      f"tool does not watch" if report.suspects else
                      "in a layer or function the tool does not watch"))
