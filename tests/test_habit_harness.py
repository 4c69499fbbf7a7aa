"""Issue 25's habit harness: a small DDP training script (Linear, BatchNorm, Linear; SGD with
momentum; 3 steps; each rank seeded differently and reading its own data) with one habit a
DDP or ZeroRedundancyOptimizer user brings typed in, run on 2 gloo ranks once with DDP and
once on each gradmgr path it applies to (torch's reducer, the default; ``native=False``;
``shard=True`` with ``ShardedOptimizer``). Each (habit, path) lands in a column
(habit_runner.py): "same as DDP" (every rank's returned values, parameters and buffers equal
DDP's bit for bit), "clear error" (every rank raised gradmgr's own error, and the process
group is still in step), or a failure: "different", "hang/timeout", "crash", "DDP failed".

The table "Habits, checked" of docs/switching-from-ddp.md says which column each row must
land in (issue 25's target); each habit's test fails, naming the row, the path, the column
expected and got and why, when the harness disagrees. ``python tests/habit_table.py`` prints
the table the harness observes.

Cost: one spawn of 2 ranks runs every case in order; a case that hangs (no progress for
habit_runner.CASE_TIMEOUT_S) or kills a rank costs a new spawn. About 70 s on today's code.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import habit_table  # noqa: E402
from dist_workers.habit_cases import HABITS  # noqa: E402
from habit_runner import TOTAL_S, run_all  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TOTAL_S + 120)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
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
        for path in ("native", "buckets", "sharded"):
            applies = path in h.paths or (path == "native" and "single" in h.paths)
            wanted = habit_table.expected(cells, path)
            assert (wanted != habit_table.NOT_RUN) == applies, (
                f"{h.title}: the {path} cell is {wanted!r}; the harness "
                f"{'runs' if applies else 'does not run'} that path")


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
