"""Activation checkpointing through gradmgr on PyTorch.

A generated program runs a contiguous slice of its ops inside
``torch.utils.checkpoint.checkpoint``, some of the values it reads passed as arguments and the
others captured by the segment function. The reference is the same program run inline and
differentiated by ``torch.autograd.grad``; no tolerance.

* ``use_reentrant=False``: gradmgr must give the reference's gradients bit for bit.
* ``use_reentrant=True``: bit-identical, or ``gradmgr.UnsupportedGraphError``; never other
  gradients, missing ones, or a ``.grad`` on a tensor that is not attached (reentrant
  checkpointing runs an inner ``backward`` of its own).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from diff_harness import check_run, run_managed  # noqa: E402
from diff_interp import TorchEngine  # noqa: E402
from diff_program import Leaf, Op, Output, Program, programs  # noqa: E402
from diff_reference import reference_program  # noqa: E402
from diff_settings import differential_settings  # noqa: E402
from hypothesis import example, given, note  # noqa: E402

import gradmgr  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::gradmgr.GradMgrWarning")

ENG = TorchEngine()
CHECKPOINTED = programs("torch", checkpoint=True, output_kinds=("loss", "loss_dy", "tensors")
                        ).filter(lambda p: p.segment is not None)

# The checkpoint's argument requires grad but leads to no attached tensor (v1 is not
# attached); the attached parameter v0 is captured by the segment function.
NO_ATTACHED_ARGUMENT = Program(
    leaves=(Leaf((3,), "param"), Leaf((3,), "free")),
    ops=(Op("mul", (1, 0)), Op("sin", (2,))),
    output=Output("loss", (3,), ("sum",)),
    segment=(0, 2),
    closure=(0,),
)
# The same with the attached parameter passed as the argument.
ATTACHED_ARGUMENT = Program(
    leaves=(Leaf((3,), "param"), Leaf((3,), "free")),
    ops=(Op("mul", (1, 0)), Op("sin", (2,))),
    output=Output("loss", (3,), ("sum",)),
    segment=(0, 2),
    closure=(1,),
)


def _run(program, mode):
    """gradmgr's run, and whether PyTorch warned that no argument of the checkpointed segment
    requires grad: reentrant checkpointing then differentiates nothing inside the segment, in
    a plain loss.backward() too (PyTorch's documented behaviour, announced by that warning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_managed(program, ENG, ["start"], gradmgr.GradManager, checkpoint=mode)
    for w in caught:
        if issubclass(w.category, gradmgr.GradMgrWarning):
            raise AssertionError(f"unexpected gradmgr warning: {w.message}")
    constants_only = any("None of the inputs" in str(w.message) for w in caught)
    return got, constants_only


@differential_settings(50)
@example(program=NO_ATTACHED_ARGUMENT)
@example(program=ATTACHED_ARGUMENT)
@given(program=CHECKPOINTED)
def test_non_reentrant_checkpoint_matches_plain_backward(program):
    assert program.segment is not None
    note(program.pretty())
    ref = reference_program(program, ["start"])
    got, _ = _run(program, "non_reentrant")
    check_run(got, ref, 1, program=program)


@differential_settings(50)
@example(program=NO_ATTACHED_ARGUMENT)
@example(program=ATTACHED_ARGUMENT)
@given(program=CHECKPOINTED)
def test_reentrant_checkpoint_is_exact_or_refused(program):
    assert program.segment is not None
    note(program.pretty())
    ref = reference_program(program, ["start"])
    got, constants_only = _run(program, "reentrant")
    if isinstance(got.error, gradmgr.UnsupportedGraphError):
        assert "use_reentrant=False" in str(got.error)
        return
    if constants_only:
        # PyTorch itself gives the segment no gradient here, and warned; what gradmgr must not
        # do is raise something unclear or write .grad of tensors that are not attached.
        assert got.error is None or "no gradient path" in str(got.error), got.error
        return
    check_run(got, ref, 1, program=program)
