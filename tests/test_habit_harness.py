"""Issue 25's habit harness: a small DDP training script (Linear, BatchNorm, Linear; SGD with
momentum; 3 steps; each rank seeded differently and reading its own data) with one habit a
DDP or ZeroRedundancyOptimizer user brings typed in, run on 2 gloo ranks once with DDP and
once on each gradmgr path it applies to (torch's reducer, the default; ``native=False``;
``shard=True`` with ``ShardedOptimizer``; ``shard="full"``, against FSDP2 alone instead of
DDP: ``fully_shard`` on each Linear and the root, rank 0's buffers broadcast after each
synced backward as gradmgr does). Each (habit, path) lands in a column
(habit_runner.py): "same as DDP" (every rank's returned values, parameters and buffers equal
DDP's bit for bit), "clear error" (every rank raised gradmgr's own error, and the process
group is still in step), or a failure: "different", "hang/timeout", "crash", "DDP failed".

The table "Habits, checked" of docs/switching-from-ddp.md says which column each row must
land in (issue 25's target); each habit's test fails, naming the row, the path, the column
expected and got and why, when the harness disagrees. ``python tests/habit_table.py`` prints
the table the harness observes.

Cost: one spawn of 2 ranks runs every case in order; a case that hangs (no progress for
habit_runner.CASE_TIMEOUT_S) or kills a rank costs a new spawn. The whole file: 208 s in
.venv with the full-sharding column's 30 cases (most of it the cases' one spawn), on the
2-core machine at load average 13-15; 85 s with 36 (six habits more) at load average 7.
"""

from __future__ import annotations

import os
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import habit_table  # noqa: E402
from dist_workers.habit_cases import HABITS, Habit  # noqa: E402
from dist_workers.habit_harness import by_gradmgr  # noqa: E402
from habit_runner import (  # noqa: E402
    CLEAR,
    CRASH,
    DDP_FAILED,
    DIFFERENT,
    SAME,
    TOTAL_S,
    classify,
    run_all,
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's Result; the cases run once per module (about 2 minutes)."""
    return run_all(HABITS, tmp_path_factory.mktemp("habits"))


def test_the_docs_table_has_a_row_per_habit():
    documented = habit_table.rows()
    titles = [h.title for h in HABITS]
    assert sorted(documented) == sorted(titles), (
        f"rows only in the docs: {sorted(set(documented) - set(titles))}; habits without a "
        f"row: {sorted(set(titles) - set(documented))}")
    for h in HABITS:
        cells = documented[h.title]
        assert len(cells) == len(habit_table.HEADER) and cells[1], (h.title, cells)
        for path in ("native", "buckets", "sharded", "full"):
            applies = path in h.paths or (path == "native" and "single" in h.paths)
            wanted = habit_table.expected(cells, path)
            assert (wanted != habit_table.NOT_RUN) == applies, (
                f"{h.title}: the {path} cell is {wanted!r}; the harness "
                f"{'runs' if applies else 'does not run'} that path")


@pytest.mark.slow
@pytest.mark.timeout(TOTAL_S + 120)
@pytest.mark.parametrize("habit", HABITS, ids=[h.name for h in HABITS])
def test_habit_lands_in_its_documented_column(results, habit):
    cells = habit_table.rows()[habit.title]
    wrong = []
    for path in habit.paths:
        want, got = habit_table.expected(cells, path), results[f"{habit.name}:{path}"]
        if got.column != want:
            wrong.append(f"[{path}] expected {want!r}, got {got.column!r}: {got.detail}\n"
                         f"{got.logs[-3000:]}")
    assert not wrong, f"habit {habit.name!r} ({habit.title}):\n" + "\n".join(wrong)


# ---------------------------------------------------------------- the columns themselves
def _error(by_gradmgr: bool, kind: str = "RuntimeError", message: str = "use X instead"):
    return {"error": {"type": kind, "message": message, "site": "x.py:1",
                      "by_gradmgr": by_gradmgr, "traceback": ""}}


def _values(**arrays):
    return {"values": {k: np.asarray(v) for k, v in arrays.items()}}


HABIT = HABITS[0]


@pytest.mark.parametrize("ranks, column", [
    ([{"ddp": _values(w=[1.0]), "gm": _values(w=[1.0]), "in_step": True}] * 2, SAME),
    ([{"ddp": _values(w=[1.0]), "gm": _values(w=[1.0]), "in_step": True},
      {"ddp": _values(w=[1.0]), "gm": _values(w=[np.nextafter(1.0, 2.0)]), "in_step": True}],
     DIFFERENT),
    ([{"ddp": _values(w=np.float32(1)), "gm": _values(w=np.float64(1)), "in_step": True}] * 2,
     DIFFERENT),
    ([{"ddp": _values(w=[1.0]), "gm": _error(True), "in_step": True}] * 2, CLEAR),
    ([{"ddp": _values(w=[1.0]), "gm": _error(False), "in_step": True}] * 2, CRASH),
    ([{"ddp": _values(w=[1.0]), "gm": _error(True), "in_step": True},
      {"ddp": _values(w=[1.0]), "gm": _values(w=[1.0]), "in_step": True}], CRASH),
    ([{"ddp": _values(w=[1.0]), "gm": _error(True), "in_step": False}] * 2, CRASH),
    ([{"ddp": _error(False), "gm": _values(w=[1.0]), "in_step": True}] * 2, DDP_FAILED),
])
def test_a_case_lands_in_its_column(ranks, column):
    assert classify(HABIT, ranks, "").column == column


def test_without_a_reference_no_error_is_a_silent_difference():
    broken = Habit("ddp_then_data_parallel", "t", ddp=False)
    ranks = [{"gm": _values(w=[1.0]), "in_step": True}] * 2
    assert classify(broken, ranks, "").column == DIFFERENT


def test_a_call_on_one_rank_needs_its_clear_error_only():
    """``if rank == 0: opt.state_dict()``: rank 0's error suffices, the others go on."""
    habit = Habit("checkpoint_rank0", "t", alone=0)
    ranks = [{"ddp": _values(), "gm": _error(True), "in_step": True},
             {"ddp": _values(), "gm": _values(), "in_step": True}]
    assert classify(habit, ranks, "").column == CLEAR
    assert classify(habit, ranks[::-1], "").column == CRASH


def test_only_the_accepted_foreign_error_counts_as_clear():
    habit = Habit("module_attribute", "t", accept=("AttributeError", "'module'"))
    said = _error(False, "AttributeError", "'Model' object has no attribute 'module'")
    other = _error(False, "AttributeError", "'Model' object has no attribute 'fc9'")
    assert classify(habit, [{"ddp": _values(), "gm": said, "in_step": True}] * 2, "").column \
        == CLEAR
    assert classify(habit, [{"ddp": _values(), "gm": other, "in_step": True}] * 2, "").column \
        == CRASH


def test_gradmgr_raising_is_told_from_torch_raising_through_gradmgr():
    """gradmgr's own ``raise ...(...)`` and classes count; torch's C++ error surfacing in a
    gradmgr line that calls torch, a bare re-raise, or gloo's text do not."""
    import gradmgr
    from gradmgr.distributed import make_allreduce_cb

    inside = os.path.join(os.path.dirname(gradmgr.__file__), "distributed", "x.py")
    frame = traceback.FrameSummary(inside, 1, "f", line="raise ValueError(f'use {x}')")
    assert by_gradmgr(ValueError("use x"), frame)
    for line in ("self._work.wait()", "raise error"):
        assert not by_gradmgr(RuntimeError("x"), traceback.FrameSummary(inside, 1, "f", line=line))
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:535] Read error")
    assert not by_gradmgr(gloo, frame)
    torch_frame = traceback.FrameSummary(torch.__file__, 1, "f", line="raise ValueError('x')")
    assert not by_gradmgr(ValueError("x"), torch_frame)
    with pytest.raises(ValueError) as raised:
        make_allreduce_cb("max")
    assert by_gradmgr(raised.value, traceback.extract_tb(raised.tb)[-1])
