"""Run every gradmgr benchmark in its own process and print a summary of the results.

    python bench/run_all.py [--quick]

Each benchmark prints its own table, the machine and the versions; lines starting with
``RESULT`` (and the ``ratio`` lines of bench_ddp.py) are repeated in the summary at the end.
A benchmark whose framework is not installed, or whose file is absent, is skipped with a note.
The exit status is non-zero only if a benchmark crashed; a missed target is reported, not fatal.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from typing import List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import RESULT_PREFIX, machine_info  # noqa: E402

# (script, frameworks it needs)
BENCHMARKS: List[Tuple[str, Tuple[str, ...]]] = [
    ("bench_torch.py", ("torch",)),
    ("bench_megengine.py", ("megengine",)),
    ("bench_tensor_count.py", ("torch",)),
    ("bench_memory.py", ("torch",)),
    ("bench_ddp.py", ("torch",)),
    ("bench_split.py", ("torch",)),
    ("bench_zero.py", ("torch",)),
    ("bench_memory_budget.py", ("torch",)),
    ("bench_compile.py", ("torch",)),
    ("bench_parity.py", ("torch", "megengine")),
    ("bench_scaling.py", ("torch",)),
    ("cost_model.py", ()),
]
TIMEOUT_S = 1200


def arguments(path: str, quick: bool) -> List[str]:
    """``--quick`` where the script takes it; bench_ddp.py takes ``--steps`` instead."""
    if not quick:
        return []
    with open(path) as f:
        source = f.read()
    if '"--quick"' in source:
        return ["--quick"]
    if '"--steps"' in source:
        return ["--steps", "20"]
    return []


def run(path: str, args: List[str]) -> Tuple[int, List[str]]:
    """Run one benchmark, echoing its stdout live; return (status, summary lines)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, path, *args], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=os.path.dirname(HERE))
    summary = []
    deadline = time.monotonic() + TIMEOUT_S
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.startswith(RESULT_PREFIX) or line.startswith("ratio"):
            summary.append(line.rstrip())
        if time.monotonic() > deadline:
            proc.kill()
            print(f"killed after {TIMEOUT_S} s", flush=True)
            break
    return proc.wait(), summary


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description="run all gradmgr benchmarks")
    parser.add_argument("--quick", action="store_true", help="fewer samples (noisier)")
    args = parser.parse_args(argv)
    print(machine_info())
    summary: List[str] = []
    crashed = []
    for script, needs in BENCHMARKS:
        path = os.path.join(HERE, script)
        print(f"\n===== {script} =====", flush=True)
        missing = [m for m in needs if importlib.util.find_spec(m) is None]
        if not os.path.exists(path):
            print("skipped: file absent")
            summary.append(f"{script}: skipped (file absent)")
            continue
        if missing:
            print(f"skipped: {', '.join(missing)} not installed")
            summary.append(f"{script}: skipped ({', '.join(missing)} not installed)")
            continue
        start = time.perf_counter()
        status, lines = run(path, arguments(path, args.quick))
        took = time.perf_counter() - start
        summary.append(f"{script}: exit {status}, {took:.0f} s")
        summary.extend(f"  {line}" for line in lines)
        if status != 0:
            crashed.append(script)
    print("\n===== summary =====")
    print(machine_info())
    print("\n".join(summary))
    misses = sum(1 for line in summary if line.rstrip().endswith("MISS"))
    targets = sum(1 for line in summary if "(target" in line)
    print(f"\n{targets - misses} of {targets} targets met" + (f"; crashed: {crashed}"
                                                               if crashed else ""))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
