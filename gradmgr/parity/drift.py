"""Training drift: both models trained side by side, each with its own framework's optimizer,
and the distance between their parameters after every step (:func:`train_drift`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ._extra import require
from .contract import ModelAdapter, adapter_for
from .errors import MappingError, ParityError
from .mapping import Pair, Transform, build_map, convert
from .progress import bar
from .trace import Loss, as_batch, train_step

Batches = Union[Sequence[Any], Callable[[int], Any]]


@dataclass
class DriftReport:
    """Per step: each side's loss, the largest absolute difference between mapped parameters
    and their relative L2 distance ``||a - b|| / ||a||`` over all of them; the same two for
    the mapped buffers (BatchNorm's running statistics), which a wrong momentum moves while
    the parameters still agree. With a ``baseline`` (:func:`train_drift`), ``baseline_max_abs``
    and ``baseline_rel_l2``: how far a copy of ``a`` trained on the same batches with their rows
    reversed drifts from ``a``, which is the drift rounding alone gives this model.

    Example:
        >>> import numpy as np, torch
        >>> from gradmgr.parity import train_drift, transfer_weights
        >>> a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
        >>> _ = transfer_weights(a, b)
        >>> report = train_drift(a, b, torch.optim.SGD(a.parameters(), lr=0.1),
        ...                      torch.optim.SGD(b.parameters(), lr=0.1),
        ...                      [np.ones((2, 4), np.float32)] * 3)
        >>> report.steps, max(report.max_abs)
        (3, 0.0)
    """

    a: str
    b: str
    loss_a: List[float] = field(default_factory=list)
    loss_b: List[float] = field(default_factory=list)
    max_abs: List[float] = field(default_factory=list)
    rel_l2: List[float] = field(default_factory=list)
    buffer_max_abs: List[float] = field(default_factory=list)
    buffer_rel_l2: List[float] = field(default_factory=list)
    baseline_max_abs: List[float] = field(default_factory=list)
    baseline_rel_l2: List[float] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """How many steps ran."""
        return len(self.loss_a)

    def text(self) -> str:
        """One line per step."""
        base = bool(self.baseline_rel_l2)
        lines = [f"drift {self.a} (a) against {self.b} (b), {self.steps} steps",
                 f"{'step':>5} {'loss a':>12} {'loss b':>12} {'max abs':>10} {'rel L2':>10} "
                 f"{'buf max abs':>12} {'buf rel L2':>11}" + (f" {'rounding rel L2':>15}"
                                                               if base else "")]
        rows = zip(self.loss_a, self.loss_b, self.max_abs, self.rel_l2, self.buffer_max_abs,
                   self.buffer_rel_l2, self.baseline_rel_l2 or [0.0] * self.steps)
        lines += [f"{i:>5} {la:>12.6g} {lb:>12.6g} {m:>10.3g} {r:>10.3g} {bm:>12.3g} "
                  f"{br:>11.3g}" + (f" {z:>15.3g}" if base else "")
                  for i, (la, lb, m, r, bm, br, z) in enumerate(rows)]
        if base:
            lines.append("rounding: a copy of a trained on the same batches with their rows "
                         "reversed, against a (the drift rounding alone gives this model)")
        return "\n".join(lines)

    __str__ = text

    def plot(self, path: str) -> str:
        """Write a PNG of both losses and both distances against the step to ``path``
        (matplotlib, imported now: the ``parity`` extra); returns ``path``."""
        matplotlib = require("matplotlib", "DriftReport.plot")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # MegEngine sets flush-to-zero; numpy warns when the log axis asks for float limits
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The value of the smallest subnormal")
            fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
            left.plot(self.loss_a, color="tab:red", lw=2.5, alpha=0.6, label=f"{self.a} (a)")
            left.plot(self.loss_b, color="tab:blue", lw=1.2, ls="--", label=f"{self.b} (b)")
            left.set(title="loss", xlabel="step")
            right.plot(self.max_abs, label="max |a - b|")
            right.plot(self.rel_l2, label="||a - b|| / ||a||")
            if any(self.buffer_rel_l2):
                right.plot(self.buffer_rel_l2, ls=":", label="buffers ||a - b|| / ||a||")
            if self.baseline_rel_l2:
                right.plot(self.baseline_rel_l2, color="gray", ls="-.",
                           label="rounding (a against itself, rows reversed)")
            right.set_yscale("log", nonpositive="mask")
            right.set(title="parameter drift (zeros not drawn)", xlabel="step")
            for ax in (left, right):
                ax.legend()
                ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
        return path


def train_drift(a: Any, b: Any, opt_a: Any, opt_b: Any, batches: Batches, *,
                loss_a: Optional[Loss] = None, loss_b: Optional[Loss] = None,
                steps: Optional[int] = None, inputs: int = 1,
                name_map: Optional[Mapping[str, str]] = None,
                transforms: Optional[Mapping[str, Transform]] = None,
                baseline: Optional[Tuple[Any, Any]] = None,
                progress: Optional[bool] = None) -> DriftReport:
    """Train ``a`` and ``b`` side by side for ``steps`` steps, each under a gradmgr
    ``GradManager`` with its own framework's optimizer (``opt_a``, ``opt_b``: give them the
    same settings), and measure after each step how far apart the parameters are.

    Args:
        a: the reference model.
        b: the port, holding the same weights (:func:`transfer_weights`).
        opt_a: ``a``'s optimizer (``step()`` then ``zero_grad()`` / ``clear_grad()``).
        opt_b: ``b``'s optimizer.
        batches: a sequence of batches (each a numpy array or a tuple of them) or a function
            ``step -> batch``.
        loss_a: ``loss_a(output, *targets) -> scalar tensor``; default the output's mean
            (which training drives down without end: pass a real loss to read its curve).
        loss_b: the same for ``b``.
        steps: how many steps (default: every batch of the sequence).
        inputs: how many leading batch items the models take.
        name_map: ``{a_name: b_name}``, as :func:`transfer_weights` takes.
        transforms: declared layout changes, as :func:`transfer_weights` takes.
        baseline: ``(copy, optimizer)``: a second model of ``a``'s framework holding ``a``'s
            weights, and its optimizer with ``opt_a``'s settings. It trains on every batch
            with the batch's rows reversed, which sums every reduction over the batch (the
            loss's mean, the gradients, BatchNorm's statistics) in another order; its
            distance from ``a`` is how far rounding alone moves this model, the yardstick for
            the port's drift (``DriftReport.baseline_rel_l2``).
        progress: a progress bar on stderr (tqdm); default: when stderr is a terminal and
            tqdm is installed.

    Raises:
        MappingError: a tensor of either model is not mapped (its report the message): its
            drift could not be measured.

    Example:
        >>> import numpy as np, torch
        >>> from gradmgr.parity import train_drift
        >>> a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)   # different weights
        >>> report = train_drift(a, b, torch.optim.SGD(a.parameters(), lr=0.1),
        ...                      torch.optim.SGD(b.parameters(), lr=0.1),
        ...                      lambda step: np.ones((2, 4), np.float32), steps=2)
        >>> report.rel_l2[-1] > 0.01
        True
    """
    if (loss_a is None) != (loss_b is None):
        raise ParityError("loss_a and loss_b go together: each model needs its own "
                          "framework's loss (or neither, for the output's mean)")
    ad_a, ad_b = adapter_for(a), adapter_for(b)
    if hasattr(batches, "shape"):  # an array is a sequence too: of rows, one per step
        raise ParityError(
            f"train_drift takes a list of batches or a function step -> batch, not one "
            f"{type(batches).__name__} (it would train on one row per step): for the same "
            f"batch every step, [batch] * steps")
    _holds(opt_a, ad_a, "a")
    _holds(opt_b, ad_b, "b")
    count = steps if steps is not None else len(batches)  # type: ignore[arg-type]
    mapping = build_map(ad_a, ad_b, name_map, transforms=transforms, inputs=inputs,
                        probe=batches(0) if callable(batches) else batches[0])
    if mapping.unmapped:  # a distance over the mapped tensors only would hide the others'
        raise MappingError(f"train_drift measures mapped tensors only:\n{mapping.text()}",
                           mapping)
    trainable = {s.name for s in ad_a.slots() if s.trainable}
    trained = [p for p in mapping.pairs if p.src in trainable]
    buffers = [p for p in mapping.pairs if p.src not in trainable]
    twin = _baseline(baseline, ad_a)
    if twin is not None:  # refuse a batch it cannot reverse before any model steps
        _reversed_rows(as_batch(batches(0) if callable(batches) else batches[0]))
    same = [Pair(s.name, s.name, s.shape, s.shape, "copy") for s in ad_a.slots()
            if s.trainable]
    report = DriftReport(ad_a.framework, ad_b.framework)
    with bar(count, progress, "train_drift", "step") as shown:
        for step in range(count):
            batch = as_batch(batches(step) if callable(batches) else batches[step])
            report.loss_a.append(train_step(ad_a, batch, inputs, loss_a))
            report.loss_b.append(train_step(ad_b, batch, inputs, loss_b))
            ad_a.step(opt_a)
            ad_b.step(opt_b)
            for pairs, largest, rel in ((trained, report.max_abs, report.rel_l2),
                                        (buffers, report.buffer_max_abs, report.buffer_rel_l2)):
                worst, relative = _distance(ad_a, ad_b, pairs)
                largest.append(worst)
                rel.append(relative)
            if twin is not None:
                train_step(twin[0], _reversed_rows(batch), inputs, loss_a)
                twin[0].step(twin[1])
                worst, relative = _distance(ad_a, twin[0], same)
                report.baseline_max_abs.append(worst)
                report.baseline_rel_l2.append(relative)
            shown.update()
    return report


def _baseline(baseline: Optional[Tuple[Any, Any]],
              ad_a: ModelAdapter) -> Optional[Tuple[ModelAdapter, Any]]:
    """The baseline's adapter and optimizer, refused unless it is ``a``'s framework and holds
    ``a``'s values exactly (a baseline that starts apart measures that, not rounding)."""
    if baseline is None:
        return None
    if not isinstance(baseline, (tuple, list)) or len(baseline) != 2:
        raise ParityError("baseline= takes (model, optimizer): a copy of a holding a's "
                          "weights, and its optimizer with opt_a's settings")
    model, optimizer = baseline
    twin = adapter_for(model)
    if twin.framework != ad_a.framework or model is ad_a.model:
        raise ParityError(
            f"the baseline must be a second {ad_a.framework} model, a copy of a (got "
            f"{'a itself' if model is ad_a.model else twin.framework}): copy.deepcopy(a)")
    _holds(optimizer, twin, "baseline")
    theirs = {s.name: s for s in twin.slots()}
    for slot in ad_a.slots():
        other = theirs.get(slot.name)
        if other is None or not np.array_equal(ad_a.read(slot.name), twin.read(slot.name)):
            raise ParityError(
                f"the baseline does not hold a's {slot.name} exactly: it must start as a copy "
                f"of a (copy.deepcopy(a), or transfer_weights(a, copy))")
    return twin, optimizer


def _reversed_rows(batch: Sequence[np.ndarray]) -> Tuple[np.ndarray, ...]:
    """The batch with its rows in reverse order: the same samples, summed in another order."""
    rows = {item.shape[0] if item.ndim else None for item in batch}
    if len(rows) != 1 or None in rows:
        raise ParityError(
            f"baseline= reverses the rows of every batch item, so every item needs the same "
            f"leading (batch) dimension; these have {[item.shape for item in batch]}")
    return tuple(np.ascontiguousarray(item[::-1]) for item in batch)


def _distance(ad_a: ModelAdapter, ad_b: ModelAdapter, pairs: Sequence[Pair]) -> tuple:
    """The largest absolute difference between the mapped tensors, and ``||a - b|| / ||a||``
    over all of them."""
    diffs = [(convert(p, ad_a.read(p.src)).astype(np.float64),
              ad_b.read(p.dst).astype(np.float64)) for p in pairs]
    worst = max((float(np.abs(x - y).max()) for x, y in diffs), default=0.0)
    norm = np.sqrt(sum(float((x * x).sum()) for x, _ in diffs))
    dist = np.sqrt(sum(float(((x - y) ** 2).sum()) for x, y in diffs))
    return worst, float(dist / norm) if norm else 0.0


def _holds(optimizer: Any, adapter: ModelAdapter, side: str) -> None:
    """Refuse an optimizer that holds none of its model's parameters (opt_a and opt_b swapped,
    or one built before the model was replaced): it would step nothing, and the drift
    measured would be one model training against a frozen one."""
    try:  # both frameworks' optimizers keep param_groups of {"params": [...]}
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    except (AttributeError, KeyError, TypeError):
        return  # an optimizer of another shape: trusted
    if not held & {id(p) for p in adapter.parameters()}:
        raise ParityError(
            f"opt_{side} ({type(optimizer).__name__}) holds none of {side}'s parameters: build "
            f"opt_{side} from {side}.parameters() of this very model (not swapped with the "
            f"other side's, not from a model since copied or replaced)")
