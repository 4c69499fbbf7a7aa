"""The parent side of the habit harness: runs every (habit, path) case of
``dist_workers/habit_cases.py`` on 2 gloo ranks and puts each in a column.

Columns: "same as DDP" (every rank's values equal DDP's bit for bit), "clear error" (every
rank raised, each error gradmgr's own, or the one the habit accepts, and the process group
still in step; where the habit names the one rank that can know, ``alone`` or ``ahead``, that
rank), or a failure: "different" (silent), "hang/timeout", "crash" (a rank died, a
raw torch or gloo error, an error on some ranks only, or a group left out of step), and
"DDP failed" (the reference itself raised, hung or died: a harness bug, or DDP's own).

The cases run in as few spawns as possible: one runs them all in order until a case kills a
rank or stops making progress for :data:`CASE_TIMEOUT_S`; that case is put in its column
and a new spawn goes on with the next one.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
from ranks import TESTS, rank_env

SAME, CLEAR = "same as DDP", "clear error"
DIFFERENT, HANG, CRASH, DDP_FAILED = "different", "hang/timeout", "crash", "DDP failed"
WORLD = 2
CASE_TIMEOUT_S = 30  # a case ends within 2 process-group timeouts (10 s each) and a margin
START_S = 60  # importing torch and gradmgr on a loaded machine
TOTAL_S = 600  # every case, hangs included: about 2 minutes here (2 busy cores) on today's code


@dataclass
class Result:
    column: str
    detail: str = ""
    logs: str = ""


def order(habits) -> list:
    """Every ``habit:path`` case: the plain ones first, then those that may hang or crash a
    rank today, the ones that destroy their process group last."""
    def rank(h):
        return 2 if h.teardown else 1 if h.risky else 0
    return [f"{h.name}:{p}" for h in sorted(habits, key=rank) for p in h.paths]


def run_all(habits, outdir, budget_s: float = TOTAL_S) -> dict:
    """``{case: Result}`` for every case of ``habits``; cases not started within
    ``budget_s`` are "hang/timeout" too (not run)."""
    by_name = {h.name: h for h in habits}
    remaining, results, spawn = order(habits), {}, 0
    deadline = time.monotonic() + budget_s
    while remaining and time.monotonic() < deadline:
        spawn += 1
        folder = os.path.join(str(outdir), f"spawn{spawn}")
        os.makedirs(folder)
        codes, killed, done, started, logs = _spawn(folder, remaining)
        ran = []
        while remaining and all(remaining[0] in d for d in done):
            ran.append(remaining.pop(0))
            results[ran[-1]] = classify(by_name[ran[-1].split(":")[0]],
                                        [d[ran[-1]] for d in done], logs)
        # the spawn ended before the next case ended on every rank: blame that case if it
        # started (or nothing ran at all); else the last case ended it (out of step), or a
        # rank hung after it (at exit)
        if remaining and (remaining[0] in started or not ran):
            case = remaining.pop(0)
            results[case] = _unfinished(case, killed, codes, done, started.get(case, []), logs)
        elif killed:
            results[ran[-1]] = Result(HANG, f"a rank hung after this case: {codes}", logs)
    for case in remaining:
        results[case] = Result(HANG, f"not run: the harness's {budget_s} s were spent")
    return results


def _unfinished(case: str, killed: bool, codes: list, done: list, sides: list,
                logs: str) -> Result:
    """The column of a case that did not end on every rank: a hang (the ranks were killed)
    or a crash, unless every rank was in DDP's run (``sides``: what each rank started)."""
    column = HANG if killed else CRASH
    if sides and all(s.endswith(" ddp") for s in sides):
        column = DDP_FAILED  # DDP's own run hung or died: not gradmgr's doing
    why = "no progress" if killed else "rank exit codes"
    seen = _errors_seen([d.get(case, {}) for d in done])
    return Result(column, f"{why}: {codes} (last started: {'; '.join(sides)})\n{seen}", logs)


def _errors_seen(outcomes: list) -> str:
    """The errors the ranks recorded for a case that did not end on every rank."""
    return "\n".join(_error_line(r, o[side]["error"]) for r, o in enumerate(outcomes)
                     for side in ("ddp", "gm") if "error" in o.get(side, {}))


def _spawn(folder: str, cases: list):
    env = rank_env(CUDA_VISIBLE_DEVICES="")  # the script is CPU-only, on any machine
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(os.path.join(folder, f"log{r}.txt"), "w"))
                for r in range(WORLD)]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "dist_workers.habit_harness", str(r), str(WORLD), folder,
             ",".join(cases)], cwd=TESTS, env=env, stdout=logs[r], stderr=subprocess.STDOUT)
            for r in range(WORLD)]
        killed = _watch(procs, [os.path.join(folder, f"rank{r}.pkl") for r in range(WORLD)])
    done, started = [], {}  # {case: "case side" each rank last started}
    for r in range(WORLD):
        with contextlib.suppress(FileNotFoundError), open(f"{folder}/rank{r}.started") as f:
            text = f.read()
            started[text.split()[0]] = started.get(text.split()[0], []) + [f"rank {r}: {text}"]
        path = os.path.join(folder, f"rank{r}.pkl")
        with open(path, "rb") if os.path.exists(path) else contextlib.nullcontext() as f:
            done.append(pickle.load(f) if f else {})
    tails = []
    for r, p in enumerate(procs):
        with open(os.path.join(folder, f"log{r}.txt")) as f:
            tails.append(f"--- rank {r} (exit {p.returncode}):\n{f.read()[-4000:]}")
    return [p.returncode for p in procs], killed, done, started, "\n".join(tails)


def _watch(procs: list, progress: list) -> bool:
    """Wait for ``procs``; kill them all when no rank has finished a case for
    :data:`CASE_TIMEOUT_S` (:data:`START_S` before the first). True if they were killed."""
    last = time.monotonic() + START_S - CASE_TIMEOUT_S
    seen = [0.0] * len(progress)
    while any(p.poll() is None for p in procs):
        for i, path in enumerate(progress):
            stamp = os.path.getmtime(path) if os.path.exists(path) else 0.0
            if stamp != seen[i]:
                seen[i], last = stamp, time.monotonic()
        if time.monotonic() - last > CASE_TIMEOUT_S:
            _stop(procs)
            return True
        time.sleep(0.2)
    return False


def _stop(procs: list) -> None:
    """Kill what still runs, after asking it for its threads' stacks (faulthandler, in the
    rank's log): where a rank hung is the first thing its fix needs."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGUSR1)
    time.sleep(2.0)
    for p in running:
        p.kill()
        p.wait()


# ---------------------------------------------------------------- columns
def is_clear(error: dict, habit) -> bool:
    """gradmgr raised it (not a bare assert), or it is the error the habit accepts."""
    if habit.accept:
        kind, text = habit.accept
        if error["type"] == kind and text in error["message"]:
            return True
    return error["by_gradmgr"] and error["type"] != "AssertionError"


def _error_line(rank: int, error: dict) -> str:
    origin = "gradmgr" if error["by_gradmgr"] else error["site"]
    return f"rank {rank}: {error['type']} (raised in {origin}): {error['message'][:400]}"


def classify(habit, ranks: list, logs: str) -> Result:
    """The column of one completed case, from each rank's outcomes."""
    tracebacks = "\n".join(o[side]["error"]["traceback"] for o in ranks for side in ("ddp", "gm")
                           if side in o and "error" in o[side])
    errors = {r: o["gm"]["error"] for r, o in enumerate(ranks) if "error" in o["gm"]}
    refs = {r: o["ddp"]["error"] for r, o in enumerate(ranks) if "error" in o.get("ddp", {})}
    lines = "\n".join(_error_line(r, e) for r, e in {**refs, **errors}.items())
    if refs:
        return Result(DDP_FAILED, lines, tracebacks)
    if not all(o["in_step"] for o in ranks):
        return Result(CRASH, "the process group was left out of step\n" + lines,
                      tracebacks + "\n" + logs)
    if errors:
        only = habit.alone if habit.alone is not None else habit.ahead
        needed = set(range(len(ranks)) if only is None else [only])
        if not needed <= set(errors):
            return Result(CRASH, f"an error on rank(s) {sorted(errors)} only\n" + lines,
                          tracebacks)
        if all(is_clear(e, habit) for e in errors.values()):
            return Result(CLEAR, lines)
        return Result(CRASH, "not gradmgr's error\n" + lines, tracebacks)
    if not all("ddp" in o for o in ranks):  # no reference ran (habit.reference(path))
        params = [{k: v for k, v in o["gm"]["values"].items() if k.startswith("param")}
                  for o in ranks]
        apart = first_difference(params[1], params[0])
        return Result(DIFFERENT, "no error (DDP is wrong here too); the ranks' parameters "
                      + (f"differ: {apart}" if apart else "agree"))
    for r, o in enumerate(ranks):
        problem = first_difference(o["gm"]["values"], o["ddp"]["values"])
        if problem:
            return Result(DIFFERENT, f"rank {r}: {problem}")
    return Result(SAME)


def first_difference(got: dict, want: dict) -> str:
    """'' when ``got`` equals ``want`` bit for bit (the same keys, dtypes, shapes, values);
    else how the first value differs (in the habit's order: returned values, parameters,
    buffers) and which others do."""
    if sorted(got) != sorted(want):
        return f"other values: {sorted(set(got) ^ set(want))}"
    wrong = [(key, _difference(np.asarray(got[key]), np.asarray(want[key]))) for key in want]
    wrong = [(key, how) for key, how in wrong if how]
    if not wrong:
        return ""
    names = ", ".join(key for key, _ in wrong[:8]) + (", ..." if len(wrong) > 8 else "")
    return f"{wrong[0][0]}: {wrong[0][1]} ({len(wrong)} of {len(want)} values differ: {names})"


def _difference(a: np.ndarray, b: np.ndarray) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{a.shape} where DDP has {b.dtype}{b.shape}"
    if np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
        return ""
    if a.dtype.kind in "fc":
        return f"up to {float(np.max(np.abs(a.astype('f8') - b.astype('f8')))):.3g} from DDP's"
    return f"{a!r} where DDP has {b!r}"
