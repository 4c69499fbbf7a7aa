"""The ``parity`` extra (numpy, matplotlib, tqdm): where one is missing, gradmgr.parity and
DriftReport.plot say which, and the install line, instead of a bare ``No module named``.
A module is made missing as Python does for a name set to None in ``sys.modules``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gradmgr.parity import DriftReport

INSTALL = 'pip install "gradmgr[parity]"'


def test_parity_without_numpy_names_the_extra():
    code = "import sys; sys.modules['numpy'] = None; import gradmgr.parity"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: gradmgr.parity needs numpy"), proc.stderr
    assert INSTALL in last, proc.stderr


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    report = DriftReport("torch", "torch", [1.0, 0.5], [1.0, 0.5], [0.0, 0.0], [0.0, 0.0])
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"DriftReport\.plot needs matplotlib, which is not "
                                          r"installed .*gradmgr\[parity\]") as caught:
        report.plot(str(tmp_path / "drift.png"))
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)
    assert not (tmp_path / "drift.png").exists()

