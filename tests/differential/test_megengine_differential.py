"""Differential tests on MegEngine: gradmgr against MegEngine's own GradManager.

The same generated programs as on PyTorch (without what only PyTorch has: leaf layouts,
float64, the ``clone`` callback, freezing, threads, checkpointing, backward inside a callback)
run through ``gradmgr.GradManager`` on MegEngine tensors and through the native
``megengine.autodiff.GradManager``, driven by the same runner with the same callbacks (Future
links return their value directly for the native manager, which resolves only MegEngine's own
Future type). Both use MegEngine's engine, so ``.grad`` must be bit-identical, with the same
``None``s, the same callback arguments and the same after-backward observations. When the native
manager raises, gradmgr must raise the same exception type. No tolerance anywhere.

MegEngine runs synchronously here (``async_level = 0``): MegEngine 1.13 has CPU kernels that
fail on some layouts (a strided matmul operand; a broadcasting division, which used to abort the
whole process, so the generator no longer broadcasts divisions on MegEngine); synchronously such
a failure is an ordinary exception, raised the same way for both managers.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megengine")

from diff_harness import (  # noqa: E402
    check_after_backward,
    check_bystander,
    check_callbacks,
    check_grads,
    check_outcome,
    check_some_gradient,
    check_unattached,
    run_managed,
    run_two_managers,
)
from diff_interp import MgeEngine  # noqa: E402
from diff_program import inplace_on_attached, programs, two_manager_cases  # noqa: E402
from diff_reference import native_megengine  # noqa: E402
from diff_settings import differential_settings  # noqa: E402
from hypothesis import given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mge_sync import mge_synchronous  # noqa: F401 (autouse: MegEngine synchronous)

import gradmgr  # noqa: E402
from gradmgr import _state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::gradmgr.GradMgrWarning")

ENG = MgeEngine()


def compare(program, schedule, after_backward=True, bystander=None):
    native = run_managed(program, ENG, schedule, native_megengine, eager=True,
                         check_backwarding=False, after_backward=after_backward,
                         bystander=bystander)
    got = run_managed(program, ENG, schedule, gradmgr.GradManager,
                      after_backward=after_backward, bystander=bystander)
    check_outcome(got, native)
    check_some_gradient(native)
    check_grads(got, native)
    check_unattached(got, native)
    check_callbacks(got, native, "gm", "gm")
    check_bystander(native)  # the harness's own sanity
    check_bystander(got)
    if after_backward and native.error is None:
        check_after_backward(native, len(schedule))  # the harness's own sanity
        check_after_backward(got, len(schedule))
    assert not _state.state.recording and not _state.state.backwarding, "state left behind"


BYSTANDERS = st.sampled_from((None, None, "idle", "outer", "inner"))


@differential_settings(70)
@given(program=programs("megengine"), bystander=BYSTANDERS)
def test_program_matches_native_grad_manager(program, bystander):
    """``bystander``: another manager attached to the same tensors that never backwards."""
    note(program.pretty())
    compare(program, ["start"], bystander=bystander)


@differential_settings(25)
@given(program=programs("megengine", inplace_attached=True).filter(inplace_on_attached))
def test_inplace_on_an_attached_intermediate(program):
    """S8 on MegEngine: an in-place op on an attached intermediate after its attach."""
    note(program.pretty())
    compare(program, ["start"])


@differential_settings(35)
@given(data=st.data(), after_backward=st.booleans(), bystander=BYSTANDERS)
def test_accumulation_over_steps(data, after_backward, bystander):
    program = data.draw(programs("megengine"), label="program")
    schedule = ["start"] + data.draw(
        st.lists(st.sampled_from(("keep", "none", "zero")), min_size=1, max_size=3),
        label="schedule")
    note(program.pretty())
    compare(program, schedule, after_backward, bystander)


@differential_settings(40)
@given(case=two_manager_cases("megengine"))
def test_two_managers_match_native(case):
    """Nested managers, groups and two managers backwarding one ``y``, as on PyTorch."""
    note(case.pretty())
    native = run_two_managers(case, ENG, native_megengine, eager=True, check_backwarding=False)
    got = run_two_managers(case, ENG, gradmgr.GradManager)
    check_outcome(got, native)
    check_some_gradient(native)
    check_grads(got, native)
    check_unattached(got, native)
    check_callbacks(got, native, "m1", "m1")
    check_callbacks(got, native, "m2", "m2")
