"""Differential tests on PyTorch: scenarios of several managers through gradmgr against the
reference model on plain autograd (:mod:`diff_scenario`, :mod:`diff_scenario_run`).

Several managers attach the same tensors at different times, record alone, as groups or
nested, run part of the forward before ``record()``, freeze, unfreeze and attach again, and
backward (also an attached tensor itself); ops include custom autograd Functions. Every
``.grad`` after every backward must be the reference's bit for bit, with the same ``None``s;
callbacks run as often and get the same gradients; ``requires_grad`` is the user's whenever
nothing records. No tolerance anywhere.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from diff_interp import TorchEngine  # noqa: E402
from diff_scenario import scenarios  # noqa: E402
from diff_scenario_run import check_scenario, reference_scenario, run_scenario  # noqa: E402
from diff_settings import differential_settings  # noqa: E402
from hypothesis import given, note  # noqa: E402

import gradmgr  # noqa: E402
from gradmgr.backends.torch import PreRecordGradientWarning  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::gradmgr.GradMgrWarning")

ENG = TorchEngine()


def run_torch(sc):
    """gradmgr on torch; the pre-record warning is documented behaviour here, not checked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=PreRecordGradientWarning)
        return run_scenario(sc, ENG, gradmgr.GradManager)


@differential_settings(120)
@given(sc=scenarios("torch"))
def test_scenario_matches_reference(sc):
    note(sc.pretty())
    check_scenario(run_torch(sc), reference_scenario(sc), sc)
