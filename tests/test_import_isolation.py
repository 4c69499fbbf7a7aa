"""``import gradmgr`` must not import any framework: the backend is loaded lazily on the first
tensor of its kind. Checked in a fresh interpreter, since this test process may hold torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

REPORT = """
import json, sys
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "megengine"))
print(json.dumps({"loaded": loaded, **globals().get("extra", {})}))
"""


def _run(code: str) -> dict:
    """Run ``code`` and then REPORT in a new interpreter; return REPORT's dict."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code) + REPORT],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_gradmgr_loads_no_framework():
    result = _run(
        """
        import gradmgr
        import gradmgr.backends
        from gradmgr import GradManager, get_backwarding_grad_manager
        """
    )
    assert result == {"loaded": []}


def test_using_the_core_without_tensors_loads_no_framework():
    result = _run(
        """
        import gradmgr

        class LooksLikeTorch:  # named after torch's module, but torch was never imported
            __module__ = "torch.nn"

        gm = gradmgr.GradManager().attach([])
        with gm:
            gm.backward()
        objs = (1.0, [1.0], LooksLikeTorch())
        extra = {"none": [gradmgr.backend_for(o) is None for o in objs]}
        """
    )
    assert result == {"loaded": [], "none": [True, True, True]}


@pytest.mark.torch
def test_the_check_itself_sees_an_imported_framework():
    pytest.importorskip("torch")
    result = _run("import torch  # noqa: F401\n")
    assert "torch" in result["loaded"]
