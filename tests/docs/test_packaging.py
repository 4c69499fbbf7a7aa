"""What a user installs: a wheel built from a clean clone of the committed tree installs into an
empty virtual environment, reports its version, licence and URLs, and is typed: mypy checks a
user script against it without ``import-untyped``, and reports a deliberate type error in
another (so the types are really seen, not ``Any``).

Needs the package index for the build's setuptools and for typing-extensions, as CI has.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys

import pytest
from docs_helpers import ROOT, run

pytestmark = pytest.mark.slow
TIMEOUT_S = 300

USER_SCRIPT = '''\
"""A user's training helpers, type-checked against the installed gradmgr."""
from typing import Any, List

import gradmgr
from gradmgr import GradManager
from gradmgr.distributed import data_parallel, make_allreduce_cb, no_sync


def make_manager(params: List[Any]) -> GradManager:
    return GradManager().attach(params, callbacks=[make_allreduce_cb("mean")])


def step(gm: GradManager, loss: Any) -> None:
    with no_sync(gm), gm:
        gm.backward(loss)


def wrap(model: Any) -> GradManager:
    return data_parallel(model, broadcast_buffers=False, bucket_bytes=2**20)


version: str = gradmgr.__version__
'''

WRONG_SCRIPT = '''\
from gradmgr import GradManager
from gradmgr.distributed import data_parallel, make_allreduce_cb

manager: int = GradManager()
gm = data_parallel(object(), bucket_bytes="25 MB")
cb = make_allreduce_cb("avg")
'''

METADATA = '''\
import importlib.metadata as m, importlib.util, json, sys, gradmgr
meta = m.metadata("gradmgr")
files = [str(f) for f in m.files("gradmgr")]
print(json.dumps({
    "version": m.version("gradmgr"), "__version__": gradmgr.__version__,
    "license": meta["License-Expression"], "classifiers": meta.get_all("Classifier"),
    "urls": meta.get_all("Project-URL"), "files": files,
    "frameworks imported": [n for n in ("torch", "megengine") if n in sys.modules],
}))
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    """The python of an empty venv that has the wheel (and typing-extensions) installed."""
    tmp = tmp_path_factory.mktemp("packaging")
    clone, dist, venv = tmp / "clone", tmp / "dist", tmp / "venv"
    run(["git", "clone", "--quiet", ROOT, str(clone)], TIMEOUT_S)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist),
         str(clone)], TIMEOUT_S)
    wheels = glob.glob(str(dist / "gradmgr-*.whl"))
    assert len(wheels) == 1, wheels
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], TIMEOUT_S)
    python = str(venv / "bin" / "python")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", wheels[0]],
        TIMEOUT_S)
    return python


def test_wheel_metadata(installed: str) -> None:
    info = json.loads(run([installed, "-c", METADATA], TIMEOUT_S, cwd="/").stdout)
    assert info["version"] == info["__version__"]
    assert info["license"] == "Apache-2.0"
    assert "Typing :: Typed" in info["classifiers"]
    assert any(url.endswith("https://github.com/gradmgr/gradmgr") for url in info["urls"])
    assert "gradmgr/py.typed" in info["files"]
    assert any(f.endswith("licenses/LICENSE") for f in info["files"]), info["files"]
    assert info["frameworks imported"] == []


def test_mypy_sees_the_types(installed: str, tmp_path) -> None:
    (tmp_path / "train.py").write_text(USER_SCRIPT)
    (tmp_path / "wrong.py").write_text(WRONG_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", installed, "--no-error-summary",
         "--cache-dir", str(tmp_path / "cache"), "--show-error-codes", "train.py", "wrong.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert "import-untyped" not in out and "import-not-found" not in out, out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert errors and all(line.startswith("wrong.py:") for line in errors), out
    assert any("[assignment]" in e and '"GradManager"' in e for e in errors), out
    assert any("[arg-type]" in e and "bucket_bytes" in e for e in errors), out
    # a string option is a Literal: a misspelt one fails the check, not the run
    assert any("[arg-type]" in e and "make_allreduce_cb" in e and "'avg'" in e
               for e in errors), out
    assert proc.returncode == 1, out
