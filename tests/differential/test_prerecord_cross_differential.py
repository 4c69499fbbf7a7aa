"""gradmgr on PyTorch against MegEngine's own GradManager, on the same scenarios
(:mod:`diff_scenario`, MegEngine's subset: no freezing, float32): where PyTorch's gradients
differ from MegEngine's, gradmgr must have said so (issue 29 item 3).

The scenarios run part of the forward before ``record()``, attach tensors inside recordings
after using them, and drop recording managers. MegEngine ignores operations before a tensor's
snapshot (contract point 9); PyTorch's autograd differentiates them, and gradmgr promises a
``PreRecordGradientWarning`` wherever that changes a gradient, except where the whole forward
ran before ``record()`` (then it gives ``loss.backward()``'s, as documented). The two engines
run different kernels, so values are compared with a tolerance (rtol 1e-4, atol 1e-5); a
``None`` against a gradient is a difference. The check runs every backward
(``set_pre_record_check("always")``).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
from diff_interp import MgeEngine, TorchEngine
from diff_reference import native_megengine
from diff_scenario import scenarios
from diff_scenario_run import run_scenario
from diff_settings import differential_settings
from hypothesis import given, note
from mge_sync import mge_synchronous  # noqa: F401 (autouse: MegEngine synchronous)

import gradmgr

pytestmark = pytest.mark.megengine
torch = pytest.importorskip("torch")

RTOL, ATOL = 1e-4, 1e-5


@functools.cache
def engines():
    return TorchEngine(), MgeEngine()


def _differences(got, native) -> list:
    found = []
    for step, (a, b) in enumerate(zip(got.steps, native.steps)):
        for v in sorted(set(a.grads) | set(b.grads)):
            x, y = a.grads.get(v), b.grads.get(v)
            if (x is None) != (y is None) or (
                    x is not None and not np.allclose(x, y.reshape(x.shape), RTOL, ATOL)):
                found.append(f"backward #{step}: v{v} torch {x} megengine {y}")
    return found


def run_torch(sc):
    from gradmgr.backends.torch import PreRecordGradientWarning, set_pre_record_check

    set_pre_record_check("always")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trace = run_scenario(sc, engines()[0], gradmgr.GradManager)
    finally:
        set_pre_record_check("first")
    return trace, any(issubclass(c.category, PreRecordGradientWarning) for c in caught)


def _documented_difference(sc) -> bool:
    """Some backward differs from MegEngine's as documented, without a warning: its ``y`` is
    an attached tensor itself (MegEngine gives it no gradient, PyTorch ``dy``), or was
    computed entirely before the manager's ``record()`` (the literal port of a PyTorch loop:
    ``loss.backward()``'s gradients; MegEngine's are None)."""
    attached, started, made = set(), {}, {}
    value = sc.n_leaves
    for i, ev in enumerate(sc.events):
        if ev.kind == "attach":
            attached.add(ev.value)
        elif ev.kind == "record":
            started.update((m, i) for m in ev.managers)
        elif ev.kind == "op":
            made[value], value = i, value + 1
        elif ev.kind == "backward" and (
                attached & set(ev.output.terms)
                or all(made.get(t, -1) < started[ev.manager] for t in ev.output.terms)):
            return True
    return False


@differential_settings(60)
@given(sc=scenarios("megengine"))
def test_torch_differs_from_megengine_only_with_a_warning(sc):
    note(sc.pretty())
    if _documented_difference(sc):
        return
    got, warned = run_torch(sc)
    native = run_scenario(sc, engines()[1], native_megengine, eager=True,
                          check_backwarding=False)
    if got.error is not None or native.error is not None or warned:
        return  # (outcomes are compared per framework by the scenario suites)
    differences = _differences(got, native)
    assert not differences, "\n".join(["PyTorch differs from MegEngine without a warning:"]
                                      + differences)
