"""Differential tests on PyTorch: random programs through gradmgr against plain autograd.

Each test builds the same generated program twice, once recorded by ``gradmgr.GradManager`` and
once differentiated by ``torch.autograd.grad`` (see :mod:`diff_reference`), and requires
bit-identical ``.grad`` (the same kernels run on the same data), the same ``None``s, callbacks run
once per reached tensor with the reference's gradient, no ``.grad`` sharing storage with another
or with a tensor user code was handed, and ``.grad`` laid out as AccumulateGrad lays it out.
There is no tolerance anywhere in this file.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from diff_harness import (  # noqa: E402
    check_callbacks,
    check_grads,
    check_layout,
    check_outcome,
    check_run,
    check_some_gradient,
    check_storage,
    check_unattached,
    resolve,
    run_managed,
    run_two_managers,
)
from diff_interp import TorchEngine  # noqa: E402
from diff_program import Program, inplace_on_attached, programs, two_manager_cases  # noqa: E402
from diff_reference import reference_program, reference_two_managers  # noqa: E402
from diff_settings import differential_settings  # noqa: E402
from hypothesis import given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gradmgr  # noqa: E402
from gradmgr import _state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::gradmgr.GradMgrWarning")

ENG = TorchEngine()


@st.composite
def schedules(draw, program: Program, torch_only: bool = True) -> list:
    """Steps after the first: accumulate, zero_grad(set_to_none), in-place zeroing, and (torch)
    freezing / unfreezing a parameter other than v0 (so some tensor always gets a gradient)."""
    actions: list = ["keep", "none", "zero"]
    if torch_only:
        params = [v for v in program.attached_leaves() if program.leaves[v].kind == "param"
                  and v != 0]
        actions += [(verb, v) for v in params for verb in ("freeze", "unfreeze")]
    return ["start"] + draw(st.lists(st.sampled_from(actions), min_size=1, max_size=3))


BYSTANDERS = st.sampled_from((None, None, "idle", "outer", "inner"))


@differential_settings(100)
@given(program=programs("torch"), after_backward=st.booleans(), bystander=BYSTANDERS)
def test_program_matches_autograd(program, after_backward, bystander):
    """One backward; ``bystander``: another manager attached to the same leaves that never
    backwards (idle, recording around this one: higher order, or recording inside it)."""
    note(program.pretty())
    ref = reference_program(program, ["start"])
    got = run_managed(program, ENG, ["start"], gradmgr.GradManager,
                      after_backward=after_backward, bystander=bystander)
    check_run(got, ref, 1, after_backward, program)


@differential_settings(30)
@given(program=programs("torch", inplace_attached=True).filter(inplace_on_attached),
       after_backward=st.booleans())
def test_inplace_on_an_attached_intermediate_uses_its_snapshot(program, after_backward):
    """S8: attaching snapshots the tensor; an in-place op on it afterwards is an operation on
    the snapshot, so its gradient is the snapshot's (MegEngine's native manager agrees, see
    test_megengine_differential.py). The reference differentiates the gradient edge taken at
    attach time."""
    note(program.pretty())
    ref = reference_program(program, ["start"])
    got = run_managed(program, ENG, ["start"], gradmgr.GradManager,
                      after_backward=after_backward)
    check_run(got, ref, 1, after_backward, program)


@differential_settings(50)
@given(data=st.data(), after_backward=st.booleans(), bystander=BYSTANDERS)
def test_accumulation_over_steps(data, after_backward, bystander):
    """Several steps on the same leaves: accumulation, both zero_grad styles, frozen params;
    the after-backward callback sees every step's ``.grad`` still untouched."""
    program = data.draw(programs("torch"), label="program")
    schedule = data.draw(schedules(program), label="schedule")
    note(program.pretty())
    ref = reference_program(program, schedule)
    got = run_managed(program, ENG, schedule, gradmgr.GradManager,
                      after_backward=after_backward, bystander=bystander)
    check_run(got, ref, len(schedule), after_backward, program)


@differential_settings(60)
@given(case=two_manager_cases("torch"))
def test_two_managers(case):
    """Nested managers (second derivatives through the inner ``.grad``), groups (members do
    not see each other's backward), and two managers backwarding the same ``y``."""
    note(case.pretty())
    ref = reference_two_managers(case)
    got = run_two_managers(case, ENG, gradmgr.GradManager)
    check_outcome(got, ref)
    check_some_gradient(ref)
    check_grads(got, ref)
    check_unattached(got, ref)
    check_callbacks(got, ref, "m1", "m1")
    check_callbacks(got, ref, "m2", "m2")
    check_storage(got)
    check_layout(got)


@differential_settings(30)
@given(program=programs("torch"))
def test_recording_under_no_grad(program):
    """A recording inside ``torch.no_grad()`` either gives the reference's gradients or
    raises; it never silently leaves ``.grad`` None."""
    note(program.pretty())
    ref = reference_program(program, ["start"])
    with torch.no_grad():
        got = run_managed(program, ENG, ["start"], gradmgr.GradManager)
        assert not torch.is_grad_enabled(), "grad mode not restored after the recording"
    if got.error is not None:
        assert isinstance(got.error, RuntimeError), f"unexpected error: {got.error!r}"
        assert not _state.state.recording, "a failed recording left state behind"
        return
    check_run(got, ref, 1, program=program)


@differential_settings(30)
@given(outer=programs("torch", force_leaf0_term=True), inner=programs("torch"),
       first=st.booleans())
def test_backward_inside_a_callback(outer, inner, first):
    """Manager A's callback on v0 runs manager B's whole ``with gmB: gmB.backward(...)``
    (``backward_in_callback=True`` on torch): B's gradients are the reference's, and A's too."""
    note(f"A:\n{outer.pretty()}\nB:\n{inner.pretty()}\nB runs {'first' if first else 'last'} "
         "in v0's chain")
    assert gradmgr.get_backend("torch").capabilities.backward_in_callback
    ref_a = reference_program(outer, ["start"])
    ref_b = reference_program(inner, ["start"])
    inner_runs = []

    def run_b(tensor, grad):
        inner_runs.append(run_managed(inner, ENG, ["start"], gradmgr.GradManager))
        return grad

    def wrap(vid, chain):
        if vid != 0:
            return chain
        return [run_b] + chain if first else chain + [run_b]

    got_a = run_managed(outer, ENG, ["start"], gradmgr.GradManager, wrap_chain=wrap)
    check_outcome(got_a, ref_a)
    assert len(inner_runs) == 1, f"v0's callbacks ran {len(inner_runs)} times"
    got_b = inner_runs[0]
    check_outcome(got_b, ref_b)
    check_some_gradient(ref_b)
    check_grads(got_b, ref_b, "B (inside A's callback): ")
    check_unattached(got_b, ref_b)
    check_callbacks(got_b, ref_b)
    check_storage(got_b)
    check_grads(got_a, ref_a, "A: ")
    check_callbacks(got_a, ref_a)
    check_storage(got_a)


BAD_RESULTS = ("extra_dim", "reduced", "dtype", "device", "not_a_tensor")


def _bad(kind: str, g):
    if kind == "extra_dim":
        return g.unsqueeze(0)
    if kind == "reduced":  # broadcastable to the gradient's shape
        return g.sum() if g.dim() else g.reshape(1)
    if kind == "dtype":
        return g.to(torch.float64 if g.dtype == torch.float32 else torch.float32)
    if kind == "device":
        return g.to("meta")
    return 1.0


@differential_settings(30)
@given(program=programs("torch", force_leaf0_term=True), kind=st.sampled_from(BAD_RESULTS),
       existing=st.booleans(), as_future=st.booleans())
def test_bad_callback_result_raises(program, kind, existing, as_future):
    """A callback result that cannot be the tensor's gradient (wrong shape, dtype or device,
    not a tensor) raises ``gradmgr.CallbackResultError``, whether ``.grad`` exists or not and
    whether it came directly or through a Future; nothing is broadcast or cast silently."""
    note(program.pretty())

    def bad(tensor, grad):
        value = _bad(kind, resolve(grad))
        return gradmgr.Future.resolved(value) if as_future else value

    def prepare(leaves):
        if existing:
            leaves[0].grad = torch.zeros_like(leaves[0])

    got = run_managed(program, ENG, ["start"], gradmgr.GradManager, prepare=prepare,
                      wrap_chain=lambda vid, chain: chain + [bad] if vid == 0 else chain)
    assert isinstance(got.error, gradmgr.CallbackResultError), (
        f"a callback returning {kind} gave {got.error!r}")
    assert not _state.state.recording and not _state.state.backwarding
