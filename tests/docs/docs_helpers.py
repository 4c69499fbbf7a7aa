"""What the documentation tests share: where things are, and running a script on 2 ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def script_env(**extra: str) -> dict:
    """The environment for a script a test starts: gloo on the loopback, one thread per rank."""
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MPLBACKEND="Agg",
                PYTHONDONTWRITEBYTECODE="1", **extra)


def torchrun(script: str, *args: str, nproc: int = 2, python: str = sys.executable) -> List[str]:
    """The command that runs ``script`` as ``torchrun --standalone --nproc_per_node 2`` would,
    in the environment of ``python``. That venv's ``torchrun`` where there is one; else its
    entry point run by module (``torch.distributed.run``, what the ``torchrun`` script calls).
    ``--standalone``: torchrun's agent holds its rendezvous store on a port the system picks
    (``localhost:0``) and tells the ranks; a port found free beforehand could be taken by
    another program before rank 0 bound it again."""
    exe = os.path.join(os.path.dirname(python), "torchrun")
    launcher = [exe] if os.path.exists(exe) else [python, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc_per_node", str(nproc), script, *args]


def run(cmd: Sequence[str], timeout: float, cwd: str = ROOT,
        **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd``; fail the test, with its output, unless it exits 0 within ``timeout`` s.
    On a timeout the whole process group goes (torchrun's ranks too, not only torchrun)."""
    with subprocess.Popen(list(cmd), cwd=cwd, env=script_env(**env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(
                f"{' '.join(cmd)} ran past {timeout} s\n{_tail(out, err)}") from None
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited with {proc.returncode}\n{_tail(out, err)}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _tail(out: str, err: str) -> str:
    return f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"
