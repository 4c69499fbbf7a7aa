"""Running a suite of ``tests/dist_workers`` on several local ranks (processes over gloo), with
bounded timeouts: a rank that fails or hangs fails the test with every rank's log."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


def rank_env(**extra: str) -> dict:
    """The environment of a rank process: loopback gloo, one thread, ``tests/`` importable."""
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]), **extra)


@contextlib.contextmanager
def rendezvous(world: int):
    """A port the ranks meet at, and what their environment needs for it: a store this
    process holds open until the block ends (what ``gradmgr.distributed.spawn_local`` and
    torchrun's agent do), so no other program can take the port in between, as it could one
    found free by binding and releasing it. Every rank is a client of the store
    (``TORCHELASTIC_USE_AGENT_STORE``): ``init_process_group`` with ``tcp://`` or ``env://``,
    or ``TCPStore(..., is_master=False)``."""
    from gradmgr.backends.torch.rendezvous import hold

    store, port, env = hold(world)
    try:
        yield port, env
    finally:
        del store


def wait_all(procs: list, timeout: float) -> None:
    """Wait for ``procs`` until ``timeout`` seconds have passed; kill what still runs."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def spawn(suite: str, outdir, world: int = 2, backend: str = "gloo", timeout: float = 240,
          **env_extra: str) -> list:
    """Run ``dist_workers.<suite>`` on ``world`` ranks; return what each rank saved
    (``rank{r}.npz`` as a dict of arrays, or ``rank{r}.pkl`` unpickled)."""
    with contextlib.ExitStack() as stack:
        port, held = stack.enter_context(rendezvous(world))
        env = rank_env(**held, **env_extra)
        logs = [stack.enter_context(open(os.path.join(outdir, f"log{r}.txt"), "w"))
                for r in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "dist_workers.run", suite, str(r), str(world),
                 str(port), str(outdir), backend],
                cwd=TESTS, env=env, stdout=logs[r], stderr=subprocess.STDOUT,
            )
            for r in range(world)
        ]
        wait_all(procs, timeout)
    codes = [p.returncode for p in procs]
    if codes != [0] * world:
        tails = []
        for r in range(world):
            with open(os.path.join(outdir, f"log{r}.txt")) as f:
                tails.append(f"--- rank {r} (exit {codes[r]}):\n" + f.read()[-3000:])
        pytest.fail(f"{suite} ranks failed or timed out after {timeout} s:\n" + "\n".join(tails))
    return [_load(outdir, r) for r in range(world)]


def spawn_local_ranks(module: str, function: str, outdir, what: str, timeout: float = 400,
                      world: int = 2) -> list:
    """Run ``dist_workers.<module>.<function>(rank, world, port, outdir)`` on ``world`` ranks
    started as a user starts them, by ``gradmgr.distributed.spawn_local`` (it sets what
    ``paddle.distributed.init_parallel_env()`` reads); return what each rank pickled to
    ``OUTDIR/rank{r}.pkl``. ``what`` names the ranks in a failure."""
    launch = (f"import sys; from gradmgr.distributed import spawn_local; "
              f"from dist_workers import {module}; "
              f"sys.exit(spawn_local({module}.{function}, {world}, sys.argv[1]))")
    try:
        done = subprocess.run([sys.executable, "-c", launch, str(outdir)], cwd=TESTS,
                              env=rank_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the {what} ranks did not finish in {timeout} s:\n{str(e.stderr)[-4000:]}")
    assert done.returncode == 0, done.stderr[-4000:]
    results = []
    for r in range(world):
        with open(os.path.join(outdir, f"rank{r}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def _load(outdir, rank: int):
    pickled = os.path.join(outdir, f"rank{rank}.pkl")
    if os.path.exists(pickled):
        with open(pickled, "rb") as f:
            return pickle.load(f)
    return dict(np.load(os.path.join(outdir, f"rank{rank}.npz")))


class Ranks:
    """What the ranks of one scenario spawn left: exit codes, saved arrays (possibly partial,
    saved after each scenario), the ends of their logs."""

    def __init__(self, outdir, codes: list) -> None:
        self.codes = codes
        self.outs, self.logs = [], []
        for r in range(len(codes)):
            path = os.path.join(outdir, f"rank{r}.npz")
            self.outs.append(dict(np.load(path)) if os.path.exists(path) else {})
            with open(os.path.join(outdir, f"log{r}.txt")) as f:
                self.logs.append(f.read()[-3000:])

    def scenario(self, name: str) -> list:
        """Each rank's arrays, once every rank completed scenario ``name``; else fail with
        the exit codes (-6: SIGABRT inside gloo) and the ends of the logs."""
        if all(out.get(f"{name}_done") for out in self.outs):
            return self.outs
        tails = "\n".join(f"--- rank {r} (exit {c}):\n{log}"
                          for r, (c, log) in enumerate(zip(self.codes, self.logs)))
        pytest.fail(f"scenario {name} did not complete on every rank:\n{tails}")


def spawn_scenarios(worker: str, outdir, scenarios: list, world: int = 2,
                    timeout: float = 200, **env: str) -> Ranks:
    """Run the named ``scenarios`` of ``dist_workers.<worker>`` (its main:
    ``dist_workers.scenarios.run_named``) on ``world`` gloo ranks (gloo's timeout: 60 s, see
    dist_workers/run.py); never raises for a rank that failed: see :meth:`Ranks.scenario`."""
    with contextlib.ExitStack() as stack:
        port, held = stack.enter_context(rendezvous(world))
        env = rank_env(HABITS_SCENARIOS=",".join(scenarios), **held, **env)
        logs = [stack.enter_context(open(os.path.join(outdir, f"log{r}.txt"), "w"))
                for r in range(world)]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "dist_workers.run", worker, str(r), str(world), str(port),
             str(outdir), "gloo"],
            cwd=TESTS, env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
        wait_all(procs, timeout)
    return Ranks(outdir, [p.returncode for p in procs])

