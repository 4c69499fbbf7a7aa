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



def _linear_pair():
    import numpy as np
    import torch

    from gradmgr.parity import transfer_weights

    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    transfer_weights(a, b)
    return a, b, np.ones((3, 4), np.float32)


def test_compare_step_and_assert_parity_draw_a_bar_when_asked(capsys):
    """Issue 36: ``progress=`` as ``train_drift`` takes it: tqdm's bar on stderr with
    ``progress=True`` (the runs of the models: a's and b's), nothing with ``False``, nor by
    default where stderr is not a terminal (pytest's capture)."""
    from gradmgr.parity import assert_parity, compare_step

    a, b, x = _linear_pair()
    assert compare_step(a, b, x, progress=True).ok
    err = capsys.readouterr().err
    assert "compare_step" in err and "2/2" in err and "run" in err, err
    assert_parity(a, b, [x, x], progress=True)  # verified on the first of two batches
    err = capsys.readouterr().err
    assert "assert_parity" in err and "1/2" in err and "batch" in err, err
    assert "compare_step" not in err  # one bar: the batches'
    for progress in (False, None):
        assert compare_step(a, b, x, progress=progress).ok
        assert_parity(a, b, x, progress=progress)
        assert capsys.readouterr().err == ""


def test_progress_without_tqdm_names_the_extra(monkeypatch):
    from gradmgr.parity import compare_step

    a, b, x = _linear_pair()
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(ImportError, match=r"compare_step\(progress=True\) needs tqdm"):
        compare_step(a, b, x, progress=True)
    assert compare_step(a, b, x).ok  # the default: no bar, no error


def test_a_pinned_rerun_is_counted_on_the_bar(capsys):
    """The bar's total grows by the re-run a pinned flip adds (b's step again)."""
    import torch
    from test_parity_functional import WIDTH, Flat, FlatFunctions, X

    from gradmgr.parity import compare_step, transfer_weights

    shift = torch.zeros(WIDTH)
    shift[3] = 2e-8  # fc1's unit 3: +1e-8 on side a, -1e-8 on side b, a flip
    torch.manual_seed(0)
    a, b = Flat(), FlatFunctions(shift)
    transfer_weights(a, b, probe=X)
    with torch.no_grad():
        for m in (a, b):
            m.fc1.weight[3] = 0
            m.fc1.bias[3] = 1e-8
    report = compare_step(a, b, X, progress=True)
    assert report.ok and [f.pinned for f in report.flips] == [True], report.text()
    assert "3/3" in capsys.readouterr().err
