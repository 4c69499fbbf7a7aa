"""Cross-framework parity for a porting user: copy the weights of a MegEngine model into its
PyTorch port (or back), run one step on both under a GradManager each, and see, layer by
layer, where they part and whether that is rounding, a kink flip, or a bug (docs/porting.md).

Example:
    >>> import numpy as np, torch
    >>> from gradmgr import parity
    >>> a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    >>> _ = parity.transfer_weights(a, b)
    >>> parity.compare_step(a, b, np.ones((3, 4), np.float32)).ok
    True

The rows of the reports (``Pair`` in :mod:`gradmgr.parity.mapping`; ``Unmapped``,
``ConfigFinding``, ``Entry``, ``Flip`` in :mod:`gradmgr.parity.report`, which both reports
use; ``gradmgr.parity.mapping`` still offers the first two) are
dataclasses read through the reports' attributes. Importing it imports no framework: each
model's backend supplies its adapter (:mod:`gradmgr.parity.contract`).
"""

from . import _extra  # noqa: F401  (first: says which extra is missing)
from .checkpoint import convert_checkpoint, save_map
from .drift import DriftReport, train_drift
from .dump import dump, load
from .errors import MappingError, ModelTypeError, ParityError
from .mapping import MappingReport, transfer_weights
from .report import StepReport
from .step import compare_step
from .testing import assert_parity

__all__ = [
    "DriftReport",
    "MappingError",
    "MappingReport",
    "ModelTypeError",
    "ParityError",
    "StepReport",
    "assert_parity",
    "compare_step",
    "convert_checkpoint",
    "dump",
    "load",
    "save_map",
    "train_drift",
    "transfer_weights",
]
