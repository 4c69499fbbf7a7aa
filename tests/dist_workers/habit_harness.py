"""One rank of the habit harness: ``python -m dist_workers.habit_harness RANK WORLD OUTDIR
CASES`` with CASES ``habit:path,habit:path,...`` (habit_cases.py), run in that order.

For each case the rank runs the habit on DDP (the reference, unless the habit says DDP is
wrong too) and on the gradmgr path, and keeps what each returned or how it failed
(:func:`outcome`). After each case it checks that the process group is still in step (one
small allreduce; a case that left it out of step ends this run) and rewrites
``OUTDIR/rank{RANK}.pkl`` with every case so far, so the parent knows how far each rank got
when one hangs or dies. The process groups start from files in OUTDIR with a short timeout
(:data:`PG_TIMEOUT_S`), and again after a habit that destroyed its group, or one that left a
rank a step ahead (``RanksOutOfStepError`` says to start a new group).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from .habit_sides import REFERENCE

PG_TIMEOUT_S = 10
OUT_OF_STEP = 3  # the exit status of a rank whose process group was left out of step


def _gradmgr_dirs() -> tuple:
    """gradmgr's source folders: the core, and the backends (installed as gradmgr.backends,
    a folder of their own in a checkout)."""
    import gradmgr.backends  # binds gradmgr too

    return tuple(os.path.realpath(os.path.dirname(m.__file__))
                 for m in (gradmgr, gradmgr.backends))


def by_gradmgr(error: BaseException, frame) -> bool:
    """gradmgr made this error: its class is gradmgr's, or gradmgr's source raised it with a
    ``raise`` that builds it (not torch's C++ called from gradmgr, not a re-raise of torch's
    or gloo's error as it came)."""
    if type(error).__module__.split(".")[0] == "gradmgr":
        return True
    if frame is None or "third_party/gloo" in str(error):
        return False
    line = (frame.line or "").strip()
    return (os.path.realpath(frame.filename).startswith(_gradmgr_dirs())
            and line.startswith("raise ") and "(" in line)


def describe(error: BaseException) -> dict:
    """An exception as the parent needs it: type, text, where it was raised, whether gradmgr
    raised it (:func:`by_gradmgr`)."""
    frames = traceback.extract_tb(error.__traceback__)
    frame = frames[-1] if frames else None
    return {
        "type": type(error).__name__,
        "message": str(error)[:1500],
        "site": f"{frame.filename}:{frame.lineno}" if frame else "",
        "by_gradmgr": by_gradmgr(error, frame),
        "traceback": "".join(traceback.format_exception(type(error), error,
                                                          error.__traceback__))[-2500:],
    }


def outcome(fn, kind: str, rank: int, world: int) -> dict:
    """``{"values": {...}}`` what the habit returned, or ``{"error": describe(...)}``."""
    try:
        values = fn(kind, rank, world)
    except Exception as error:  # noqa: BLE001 - every failure is the harness's data
        return {"error": describe(error)}
    return {"values": {k: torch.as_tensor(v).numpy() if not hasattr(v, "dtype") else v
                       for k, v in values.items()}}


class Group:
    """The default process group, started from a new file each time it is (re)started."""

    def __init__(self, rank: int, world: int, outdir: str) -> None:
        self.rank, self.world, self.outdir, self.count = rank, world, outdir, 0
        self.start()

    def start(self) -> None:
        self.count += 1
        if self.count == 1:
            self._wait_for_every_rank()
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(self.outdir, f'store{self.count}')}",
            rank=self.rank, world_size=self.world,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))

    def _wait_for_every_rank(self, limit_s: float = 120) -> None:
        """Every rank has imported torch and gradmgr: the short timeout is the process
        group's, not a slow import's."""
        open(os.path.join(self.outdir, f"ready{self.rank}"), "w").close()
        deadline = time.monotonic() + limit_s
        while not all(os.path.exists(os.path.join(self.outdir, f"ready{r}"))
                      for r in range(self.world)) and time.monotonic() < deadline:
            time.sleep(0.05)

    def restart_if_gone(self) -> None:
        if not dist.is_initialized():
            self.start()

    def renew(self) -> None:
        """A new process group, as a program does after ``RanksOutOfStepError``."""
        dist.destroy_process_group()
        self.start()

    def in_step(self, index: int) -> bool:
        """One allreduce every rank makes after case ``index``: equal on all, or the group
        is out of step (a rank made one collective more than the other)."""
        check = torch.tensor([float(index), 1.0])
        try:
            dist.all_reduce(check)
        except RuntimeError:
            return False
        return check.tolist() == [index * self.world, float(self.world)]


def run_case(habit, path: str, rank: int, world: int, group: Group, started: str) -> dict:
    """The habit on DDP, then on gradmgr's ``path``; ``started`` names the side now running
    (for the parent, if this rank hangs or dies)."""
    result = {}
    reference = REFERENCE.get(path, "ddp")  # under the key "ddp" whichever it is
    for side, kind in (("ddp", reference), ("gm", path)) if habit.reference(path) else (
            ("gm", path),):
        with open(started, "w") as f:
            f.write(f"{habit.name}:{path} {side}")
        result[side] = outcome(habit.fn, kind, rank, world)
        group.restart_if_gone()
    return result


def main(argv: list) -> None:
    rank, world, outdir, cases = int(argv[0]), int(argv[1]), argv[2], argv[3].split(",")
    from .habit_cases import BY_NAME

    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's "where are you?"
    group = Group(rank, world, outdir)
    path, done = os.path.join(outdir, f"rank{rank}.pkl"), {}
    for index, case in enumerate(cases):
        name, kind = case.split(":")
        habit = BY_NAME[name]
        done[case] = result = run_case(habit, kind, rank, world, group,
                                       os.path.join(outdir, f"rank{rank}.started"))
        result["in_step"] = group.in_step(index)
        if habit.ahead is not None and result["in_step"]:
            group.renew()
        with open(path + ".tmp", "wb") as f:
            pickle.dump(done, f)
        os.replace(path + ".tmp", path)
        if not result["in_step"]:
            sys.stdout.flush()
            os._exit(OUT_OF_STEP)  # no teardown: a group out of step may hang in it
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
