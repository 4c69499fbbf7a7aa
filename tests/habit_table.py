"""The "Habits, checked" table of docs/switching-from-ddp.md, read for the habit harness: one
row per habit, its title, what DDP does, and the column each gradmgr path must land in.

``python tests/habit_table.py`` runs the harness and prints the table it observed (the DDP
column copied from the docs), to paste into the page once the results are what they should
be.
"""

from __future__ import annotations

import os
import sys

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "switching-from-ddp.md")
SECTION = "## Habits, checked"
HEADER = ["Habit", "What DDP does", "gradmgr", "`native=False`", "`shard=True`",
          '`shard="full"`']
COLUMN = {"native": 2, "single": 2, "buckets": 3, "sharded": 4, "full": 5}  # one process: 2
NOT_RUN = "—"  # a path the habit does not apply to
CELLS = ("same as DDP", "clear error", NOT_RUN)
# Full sharding's reference is FSDP2 alone; "not checked": the habit applies, the harness
# does not run it (the cell says why)
ALIASES = {"same as FSDP2": CELLS[0], "not checked": NOT_RUN}


def rows(path: str = DOCS) -> dict:
    """``{title: [cells]}`` of the table in the section :data:`SECTION`."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    lines = [ln for ln in text[start:end if end > 0 else None].splitlines()
             if ln.startswith("|")]
    header = _cells(lines[0])
    if header != HEADER:
        raise ValueError(f"{path}: the habit table's header is {header}, not {HEADER}")
    return {cells[0]: cells for cells in map(_cells, lines[2:])}


def _cells(line: str) -> list:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def expected(cells: list, path: str) -> str:
    """The column a row's cell for ``path`` names: one of :data:`CELLS`, the words that
    start it (a cell may go on: "clear error: `RankMismatchError`"), or of :data:`ALIASES`."""
    cell = cells[COLUMN[path]]
    for name in CELLS:
        if cell.startswith(name):
            return name
    for name, column in ALIASES.items():
        if cell.startswith(name):
            return column
    raise ValueError(f"the cell {cell!r} names none of {CELLS}")


def observed(habits, results: dict, documented: dict) -> str:
    """The table as the harness found it, the DDP column from ``documented``."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    for h in habits:
        cells = [h.title, documented.get(h.title, ["", "?"])[1]] + [NOT_RUN] * 4
        for path in h.paths:
            column = results[f"{h.name}:{path}"].column
            cells[COLUMN[path]] = "same as FSDP2" if path == "full" and column == CELLS[0] \
                else column
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    import tempfile

    root = os.path.dirname(os.path.dirname(DOCS))  # this checkout's gradmgr, in the ranks too
    os.environ["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = [root, os.path.dirname(os.path.abspath(__file__))]
    from dist_workers.habit_cases import HABITS
    from habit_runner import run_all

    results = run_all(HABITS, tempfile.mkdtemp(prefix="habits-"))
    print(observed(HABITS, results, rows()))


if __name__ == "__main__":
    main()
