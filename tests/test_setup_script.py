"""scripts/setup.sh's fallback for a wheel that torch 2.8 pins (nvidia-*, triton) and that cannot
be downloaded, run with pip replaced by stubs: no network, no install. CI once failed when one
such wheel stopped at the same byte on every retry; the fallback must then take a neighbouring
release of the same series, nearest first, and stop with a clear message when none arrives."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "scripts", "setup.sh")

AVAILABLE = {
    "nvidia-cudnn-cu12": "9.28.0.42, 9.12.0rc1, 9.11.0.98, 9.10.2.21, 9.10.1.4, 9.10.0.56, "
    "8.9.7.29",
    "nvidia-cusparselt-cu12": "0.8.0, 0.7.2, 0.7.1, 0.7.0, 0.6.3",
}


@pytest.fixture
def fake_python(tmp_path):
    """A 'python' that answers `-m pip index versions NAME` from AVAILABLE and runs the real
    interpreter (which has pip's vendored packaging) for everything else."""
    lines = [f'  {name}) echo "Available versions: {found}";;' for name, found in AVAILABLE.items()]
    script = tmp_path / "python"
    script.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1 $2 $3 $4" = "-m pip index versions" ]; then\n'
        '  case "$5" in\n' + "\n".join(lines) + "\n  esac\n  exit 0\nfi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def run_setup_functions(body: str, tmp_path) -> subprocess.CompletedProcess:
    """Sources setup.sh (which then only defines its functions) and runs `body` after it."""
    program = f"source {SETUP}\n" + textwrap.dedent(body)
    return subprocess.run(
        ["bash", "-c", program], capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
        env={**os.environ, "PIP_LOG": str(tmp_path / "pip.log")},
    )


def test_neighbours_are_the_same_series_nearest_first(fake_python, tmp_path):
    out = run_setup_functions(
        f"""
        neighbour_releases {fake_python} nvidia-cudnn-cu12 9.10.2.21
        neighbour_releases {fake_python} nvidia-cusparselt-cu12 0.7.1
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    # 9.x only (8.9 ships libcudnn.so.8), no pre-release; 0.7.x only for a 0.x series.
    assert out.stdout.splitlines() == ["9.11.0.98 9.10.1.4 9.28.0.42", "0.7.2 0.7.0"]


STUBS = """
torch_requirements() {
  printf '%s\\n' filelock 'sympy>=1.13.3' nvidia-cublas-cu12==12.8.4.1 \\
    nvidia-cudnn-cu12==9.10.2.21 triton==3.4.0
}
pip_install() {  # records each call; the listed wheels "stop at the same byte"
  shift
  echo "$*" >>"$PIP_LOG"
  case " $* " in FAILING) return 1;; esac
}
sleep() { :; }
"""


def pip_calls(tmp_path) -> list[str]:
    return (tmp_path / "pip.log").read_text().splitlines()


def run_fallback(fake_python, tmp_path, failing: str, project: str):
    """install_legacy_torch_piecewise with pip calls matching the case pattern `failing` failing."""
    return run_setup_functions(
        STUBS.replace("FAILING", failing)
        + f"install_legacy_torch_piecewise {fake_python} torch==2.8.0 -e '{project}'\n",
        tmp_path,
    )


def test_a_pinned_wheel_that_never_arrives_is_replaced_by_its_nearest(fake_python, tmp_path):
    failing = '*" nvidia-cudnn-cu12==9.10.2.21 "*|*" nvidia-cudnn-cu12==9.11.0.98 "*'
    out = run_fallback(fake_python, tmp_path, failing, ".[megengine]")
    assert out.returncode == 0, out.stderr
    assert pip_calls(tmp_path) == [
        "--no-deps torch==2.8.0",
        "filelock sympy>=1.13.3 -e .[megengine]",
        "--no-deps nvidia-cublas-cu12==12.8.4.1",
        "--no-deps nvidia-cudnn-cu12==9.10.2.21",
        "--no-deps nvidia-cudnn-cu12==9.11.0.98",
        "--no-deps nvidia-cudnn-cu12==9.10.1.4",
        "--no-deps triton==3.4.0",
    ]
    said = "FALLBACK used: nvidia-cudnn-cu12 9.10.1.4 instead of the 9.10.2.21 torch pins"
    assert said in out.stdout


def test_no_neighbour_arriving_stops_with_what_to_do(fake_python, tmp_path):
    out = run_fallback(fake_python, tmp_path, '*" nvidia-cudnn-cu12=="*', ".")
    assert out.returncode == 1
    assert "neither nvidia-cudnn-cu12==9.10.2.21 nor a neighbouring release" in out.stderr
    assert "run 'make setup' again" in out.stderr
    tried = [f"--no-deps nvidia-cudnn-cu12=={v}" for v in ("9.11.0.98", "9.10.1.4", "9.28.0.42")]
    assert pip_calls(tmp_path)[-3:] == tried


def test_a_download_is_tried_again_then_given_up_with_a_status(tmp_path):
    """with_retries (pip's and apt's downloads): a command that fails twice and then succeeds
    passes with three attempts; one that always fails gives up after them with its status."""
    flaky = tmp_path / "flaky"
    flaky.write_text(
        "#!/usr/bin/env bash\n"
        f'n=$(cat "{tmp_path}/count" 2>/dev/null || echo 0); echo $((n + 1)) >"{tmp_path}/count"\n'
        '[ "$n" -ge 2 ]\n'
    )
    flaky.chmod(flaky.stat().st_mode | stat.S_IEXEC)
    out = run_setup_functions(
        f"""
        sleep() {{ echo "slept $1"; }}
        with_retries 3 "the flaky download" {flaky} && echo "passed"
        rm "{tmp_path}/count"
        with_retries 2 "the flaky download" {flaky} || echo "gave up"
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    said = [line.split("\x1b[0m ", 1)[-1] for line in out.stdout.splitlines()]  # after [setup]
    assert said == [
        "the flaky download failed (attempt 1 of 3, usually the network): trying again in 20 s",
        "slept 20",
        "the flaky download failed (attempt 2 of 3, usually the network): trying again in 40 s",
        "slept 40",
        "passed",
        "the flaky download failed (attempt 1 of 2, usually the network): trying again in 20 s",
        "slept 20",
        "gave up",
    ]
