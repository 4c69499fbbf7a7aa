"""Differential tests on Paddle: gradmgr against ``paddle.grad`` on the same generated programs
(diff_program.py, without what Paddle's table lacks: in-place ops, indexing, MegEngine's odd
seed shapes), with the callback chains applied by hand. The same kernels run on the same data,
so every attached tensor's ``.grad`` must be bit-identical (compared as raw bits), with the same
``None``s; the leaves not attached keep ``.grad is None``, every ``stop_gradient`` flag is the
user's again. Runs only where Paddle is installed (tests/conftest.py: the ``paddle`` marker)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("paddle")

from diff_paddle import PaddleEngine, run_gradmgr, run_reference  # noqa: E402
from diff_program import ALL_OPS, INDEXING, INPLACE, programs  # noqa: E402
from diff_settings import differential_settings  # noqa: E402
from hypothesis import given, note  # noqa: E402

from gradmgr import _state  # noqa: E402

pytestmark = [pytest.mark.paddle, pytest.mark.filterwarnings("error::gradmgr.GradMgrWarning")]

ENG = PaddleEngine()
OPS = tuple(op for op in ALL_OPS if op not in INPLACE + INDEXING)


def same_bits(got, expected) -> bool:
    got = np.asarray(got, dtype=np.float32).reshape(np.shape(expected))
    return np.array_equal(got.view(np.uint32), np.asarray(expected).view(np.uint32))


@differential_settings(60)
@given(program=programs("paddle", ops=OPS))
def test_program_matches_paddle_grad(program):
    program = dataclasses.replace(program,
                                  output=dataclasses.replace(program.output, odd_dy=False))
    note(program.pretty())
    expected = run_reference(program, ENG)
    got = run_gradmgr(program, ENG)
    for vid, want in expected.items():
        grad = got["grads"][vid]
        if want is None:
            assert grad is None, f"v{vid}: paddle.grad gives None, gradmgr {grad}"
        else:
            assert grad is not None, f"v{vid}: gradmgr gives None"
            assert same_bits(ENG.numpy(grad), want), (vid, ENG.numpy(grad), want)
    assert all(g is None for g in got["others"])
    kinds = [leaf.kind for leaf in program.leaves]
    assert got["flags"] == [kind not in ("param", "free") for kind in kinds]
    assert not _state.state.recording and not _state.state.backwarding, "state left behind"
