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

Importing it imports no framework: each model's backend supplies its adapter
(:mod:`gradmgr.parity.contract`).
"""

from .drift import DriftReport, train_drift
from .errors import MappingError, ModelTypeError, ParityError
from .mapping import ConfigFinding, MappingReport, Pair, Unmapped, transfer_weights
from .report import Entry, Flip, StepReport
from .step import compare_step
from .testing import assert_parity

__all__ = [
    "ConfigFinding",
    "DriftReport",
    "Entry",
    "Flip",
    "MappingError",
    "MappingReport",
    "ModelTypeError",
    "Pair",
    "ParityError",
    "StepReport",
    "Unmapped",
    "assert_parity",
    "compare_step",
    "train_drift",
    "transfer_weights",
]
