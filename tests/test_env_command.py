"""``python -m gradmgr env``: the report a bug report asks for (.github/ISSUE_TEMPLATE). It
runs in a fresh interpreter of this environment and says what is true here: gradmgr's version
and place, Python, each installed framework's version (tested or not) with its backend
importing, torch's distributed backends, and a framework that is missing as missing."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

import gradmgr
from gradmgr import env
from gradmgr.__main__ import main


@pytest.fixture(scope="module")
def report() -> dict:
    proc = subprocess.run([sys.executable, "-m", "gradmgr", "env"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = {}
    for line in proc.stdout.splitlines():
        if line.startswith("  "):
            label, _, value = line.strip().partition("  ")
            lines[label] = value.strip()
    return lines


def test_env_names_gradmgr_and_python(report):
    assert report["version"] == gradmgr.__version__
    assert report["location"] == os.path.dirname(os.path.abspath(gradmgr.__file__))
    assert report["python"].startswith(f"CPython {sys.version.split()[0]} ({sys.executable})")


@pytest.mark.parametrize("framework, dist", [("torch", "torch"), ("megengine", "megengine"),
                                             ("paddle", "paddlepaddle")])
def test_env_reports_each_framework_as_it_is(report, framework, dist):
    if importlib.util.find_spec(framework) is None:
        assert report[f"{framework} version"] == "not installed"
        assert report[f"{framework} backend"].startswith(f"does not import: the {framework!r}")
        return
    version = importlib.metadata.version(dist)  # Paddle's distribution is not its module's name
    assert report[f"{framework} version"].startswith(f"{version} (tested; the tests run ")
    assert report[f"{framework} backend"] == "imports"


def test_env_reports_lightning_fabric(report):
    if importlib.util.find_spec("lightning_fabric") is None:
        assert report["lightning-fabric version"] == "not installed"
    else:
        version = importlib.metadata.version("lightning-fabric")
        assert report["lightning-fabric version"] == f"{version} (tested; the tests run 2.6)"


def test_env_reports_torch_distributed_and_devices(report):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    gloo = "yes" if dist.is_gloo_available() else "no"
    nccl = "yes" if dist.is_nccl_available() else "no"
    assert report["torch.distributed"] == f"gloo {gloo}, nccl {nccl}, mpi " + (
        "yes" if dist.is_mpi_available() else "no")
    devices = torch.cuda.device_count()
    assert report["torch CUDA"].endswith(f"devices: {devices} (" if devices else "devices: none")
    assert report["gradmgr.parity"] == "imports" and report["gradmgr.distributed"] == "imports"


def test_a_release_outside_the_tested_series_is_flagged(monkeypatch):
    monkeypatch.setattr(env.metadata, "version", lambda dist: "2.5.1")
    assert env.version_line("torch") == "2.5.1 (NOT TESTED; the tests run 2.8, 2.13)"
    monkeypatch.setattr(env.metadata, "version", lambda dist: "2.13.0+cu128")
    assert env.version_line("torch") == "2.13.0+cu128 (tested; the tests run 2.8, 2.13)"


def test_extras_say_what_is_missing(monkeypatch):
    class Meta:
        def get_all(self, key):
            return {"Provides-Extra": ["parity"],
                    "Requires-Dist": ['numpy; extra == "parity"',
                                      'no-such-dist>=1; extra == "parity"',
                                      "typing-extensions>=4.0"]}[key]

    monkeypatch.setattr(env.metadata, "metadata", lambda name: Meta())
    assert env.extras() == {"parity": "no (missing: no-such-dist)"}


def test_the_command_needs_a_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    assert "{env}" in capsys.readouterr().err
