"""Differential tests on MegEngine: scenarios of several managers (:mod:`diff_scenario`)
through gradmgr against MegEngine's own ``megengine.autodiff.GradManager``.

The same scripts as on PyTorch, without what MegEngine lacks (``requires_grad``: no freezing,
no float64, no torch-only callbacks): managers attach the same tensors at different times,
record alone, as groups or nested, run part of the forward before ``record()`` (ignored for
differentiation there, contract point 9), backward (also an attached tensor itself) or
release; ops include custom ``megengine.autodiff.Function``s. Both managers run on MegEngine's
engine, so every ``.grad`` after every backward must be bit-identical, with the same ``None``s
and the same callback calls; when the native manager raises, gradmgr must raise the same type.
"""

from __future__ import annotations

import functools

import pytest
from diff_interp import MgeEngine
from diff_reference import native_megengine
from diff_scenario import scenarios
from diff_scenario_run import check_scenario, run_scenario
from diff_settings import differential_settings
from hypothesis import given, note
from mge_sync import mge_synchronous  # noqa: F401 (autouse: MegEngine synchronous)

import gradmgr

# Marked rather than skipped where MegEngine is missing: tests/conftest.py deselects marked
# tests in an environment not expecting MegEngine, also when this file is named on the
# command line (a skip would fail there, under GRADMGR_STRICT_SKIPS).
pytestmark = [pytest.mark.megengine,
              pytest.mark.filterwarnings("error::gradmgr.GradMgrWarning")]


@functools.cache
def engine() -> MgeEngine:
    return MgeEngine()  # imports MegEngine


def compare_with_native(sc):
    from megengine.core.autodiff.grad import Grad

    entered = len(Grad.stack)
    try:
        native = run_scenario(sc, engine(), native_megengine, eager=True,
                              check_backwarding=False)
    finally:  # a native manager dropped while recording leaves its Grad there: not ours
        del Grad.stack[entered:]
    got = run_scenario(sc, engine(), gradmgr.GradManager)
    assert len(Grad.stack) == entered, "a manager of gradmgr's left its Grad on the stack"
    check_scenario(got, native, sc, torch_checks=False)


@differential_settings(80)
@given(sc=scenarios("megengine"))
def test_scenario_matches_native_grad_manager(sc):
    note(sc.pretty())
    compare_with_native(sc)
