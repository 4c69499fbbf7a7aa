"""The pytest helper: :func:`assert_parity`, an ``assert_close`` for two models."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Set, Union

from .mapping import Transform
from .progress import bar
from .report import StepReport
from .step import compare_step
from .trace import Loss

Batches = Union[Any, Sequence[Any], Callable[[int], Any]]


def assert_parity(a: Any, b: Any, batches: Batches, *, loss_a: Optional[Loss] = None,
                  loss_b: Optional[Loss] = None, inputs: int = 1, tries: int = 5,
                  name_map: Optional[Mapping[str, str]] = None,
                  transforms: Optional[Mapping[str, Transform]] = None,
                  tol_factor: float = 1.0, progress: Optional[bool] = None) -> StepReport:
    """Assert that one step of ``a`` and ``b`` agrees layer by layer (:func:`compare_step`);
    the ``AssertionError``'s message is the report.

    ``batches`` is one batch (a numpy array or a tuple of them), a list of batches, or a
    function ``i -> batch``. A gradient left unverified by a kink flip that cannot be pinned
    must be verified on a later batch (up to ``tries`` from a function; every batch of a
    list); any tensor beyond tolerance, unmapped tensor or configuration finding fails at once.
    Returns the last report. ``progress``: a bar of the batches on stderr (tqdm), as
    :func:`train_drift` takes it (default: when stderr is a terminal).

    Example:
        >>> import numpy as np, torch
        >>> from gradmgr.parity import assert_parity
        >>> a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
        >>> try:
        ...     assert_parity(a, b, np.ones((3, 4), np.float32))   # weights never copied
        ... except AssertionError as error:
        ...     print(str(error).splitlines()[0])
        PARITY BROKEN: torch (a) against torch (b), one step (batch 0)
    """
    count = tries if callable(batches) else (len(batches) if isinstance(batches, list) else 1)
    pending: Optional[Set[str]] = None
    report = None
    with bar(count, progress, "assert_parity", "batch") as shown:
        for i in range(count):
            batch = batches(i) if callable(batches) else (
                batches[i] if isinstance(batches, list) else batches)
            report = compare_step(a, b, batch, loss_a=loss_a, loss_b=loss_b, inputs=inputs,
                                  name_map=name_map, transforms=transforms,
                                  tol_factor=tol_factor, progress=False)
            shown.update()
            if report.failures() or report.findings or report.unmapped:
                first, _, rest = report.text().partition("\n")
                raise AssertionError(f"{first} (batch {i})\n{rest}")
            left = {e.name for e in report.unverified}
            pending = left if pending is None else pending & left
            if not pending:
                return report
    raise AssertionError(
        f"NOT VERIFIED: gradients left unverified by kink flips that cannot be pinned on "
        f"every one of {count} batch(es): {', '.join(sorted(pending or ()))}; give more batches "
        f"(a function i -> batch, tries=...)\n{report.text() if report else ''}")
