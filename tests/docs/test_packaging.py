"""What a user installs: a wheel built from a clean clone of the committed tree installs, with
its extras (``torch``, ``lightning``, ``parity``), into an empty virtual environment; from
there, with no checkout on the path, every subpackage imports, the docs' code blocks run (the
runner of test_doc_blocks.py, pointed at the installed copy), the metadata is right, and the
package is typed: mypy checks a user script against it without ``import-untyped``, and reports
deliberate type errors in another (so the types are really seen, not ``Any``).

torch is the release this environment has (pip finds the same wheel, from its cache or the
index scripts/setup.sh used). Marked ``docs``: it runs in .venv-latest only (torch 2.13 for
CPU; .venv's torch 2.8 is a CUDA build of several GB). Needs the package index, as CI has.

MegEngine has no wheel for Python 3.11, so the MegEngine blocks (docs/porting.md's among them)
run from the same wheel in a second empty venv, made by .venv's Python 3.10
(``MEGENGINE_PYTHON``), which borrows that interpreter's site-packages for its frameworks
(``installed_megengine``). The wheel is built once per session, for both.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from doc_blocks import RUN, run_block
from docs_helpers import ROOT, run

# The first test also pays for the venv (clone, build, install: minutes on a busy machine),
# and mypy reads torch's types for the user scripts: more than pytest's default 300 s
TIMEOUT_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.docs, pytest.mark.timeout(3 * TIMEOUT_S)]
EXTRAS = "torch,lightning,parity"
# The installed copy alone: no checkout on the path (PYTHONPATH names one in our runs).
INSTALLED_ONLY = {"PYTHONPATH": "", "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1"}
# The Python with MegEngine (3.10): scripts/setup.sh's .venv, or the one this variable names
MEGENGINE_PYTHON = (os.environ.get("GRADMGR_MEGENGINE_PYTHON")
                    or os.path.join(ROOT, ".venv", "bin", "python"))

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
import torch

from gradmgr import GradManager
from gradmgr.distributed import data_parallel, make_allreduce_cb

manager: int = GradManager()
gm = data_parallel(object(), bucket_bytes="25 MB")
cb = make_allreduce_cb("avg")
model = torch.nn.Linear(4, 2)
GradManager().attach(model)
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


SUBPACKAGES = '''\
import importlib, json, pkgutil, sys, gradmgr
found = {}
for info in pkgutil.walk_packages(gradmgr.__path__, "gradmgr."):
    if info.ispkg and not info.name.startswith(("gradmgr.backends.megengine",
                                                "gradmgr.backends.paddle")):
        found[info.name] = importlib.import_module(info.name).__file__
    elif info.ispkg:
        found[info.name] = None  # MegEngine has no wheel for this Python; Paddle is not here
print(json.dumps({"gradmgr": gradmgr.__file__, "prefix": sys.prefix, **found}))
'''


def packages_in_checkout() -> list:
    """gradmgr's packages in the checkout: the folders under gradmgr/ with an __init__.py."""
    return sorted(os.path.relpath(folder, ROOT).replace(os.sep, ".")
                  for folder, _, names in os.walk(os.path.join(ROOT, "gradmgr"))
                  if "__init__.py" in names)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> str:
    """The wheel built from a clean clone of the committed tree, once for both venvs."""
    tmp = tmp_path_factory.mktemp("packaging")
    clone, dist = tmp / "clone", tmp / "dist"
    run(["git", "clone", "--quiet", ROOT, str(clone)], TIMEOUT_S)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist),
         str(clone)], TIMEOUT_S)
    wheels = glob.glob(str(dist / "gradmgr-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel: str, tmp_path_factory) -> str:
    """The python of an empty venv that has the wheel with its extras installed."""
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], TIMEOUT_S)
    python = str(venv / "bin" / "python")
    torch = f"torch=={importlib.metadata.version('torch')}"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
         f"{wheel}[{EXTRAS}]", torch], TIMEOUT_S)
    return python


LENDER = """
import importlib.util, json, sys, sysconfig
print(json.dumps({"purelib": sysconfig.get_paths()["purelib"], "version": sys.version_info[:2],
                  "missing": [n for n in ("megengine", "torch", "numpy", "matplotlib")
                              if importlib.util.find_spec(n) is None]}))
"""


@pytest.fixture(scope="session")
def lender_python() -> dict:
    """MEGENGINE_PYTHON's purelib, checked to have what the MegEngine blocks need; before the
    wheel is built, so a missing interpreter fails at once. (No fixture here is named
    ``megengine_*``: tests/conftest.py deselects the users of those where MegEngine is not
    expected, as in .venv-latest, where this test runs.)"""
    if not os.access(MEGENGINE_PYTHON, os.X_OK):
        pytest.fail(f"no Python with MegEngine at {MEGENGINE_PYTHON}: run `make setup` (it "
                    f"makes .venv) or name one in GRADMGR_MEGENGINE_PYTHON", pytrace=False)
    lender = json.loads(run([MEGENGINE_PYTHON, "-c", LENDER], TIMEOUT_S, cwd="/",
                            **INSTALLED_ONLY).stdout)
    if lender["missing"] or lender["version"] >= [3, 11]:
        pytest.fail(f"{MEGENGINE_PYTHON} (Python {lender['version']}) lacks "
                    f"{lender['missing']} or is newer than MegEngine's 3.10: it cannot run "
                    f"the MegEngine blocks; run `make setup`", pytrace=False)
    return lender


@pytest.fixture(scope="module")
def installed_megengine(lender_python: dict, wheel: str, tmp_path_factory) -> str:
    """The python of an empty venv made by MEGENGINE_PYTHON (3.10) with the wheel alone
    installed (no deps: nothing to fetch, and pip sees no other gradmgr to replace), then
    lent that interpreter's site-packages for torch, MegEngine, numpy and matplotlib by a
    path line in a ``.pth`` file. Such a line only appends the folder to ``sys.path``: the
    ``.pth`` files in it do not run, so the editable gradmgr installed there (its
    ``__editable__`` finder, started by a ``.pth``) stays off, and the venv's own
    site-packages, with the wheel, comes first."""
    venv = tmp_path_factory.mktemp("venv-megengine")
    run([MEGENGINE_PYTHON, "-m", "venv", "--without-pip", str(venv)], TIMEOUT_S)
    python = str(venv / "bin" / "python")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
         "--no-index", wheel], TIMEOUT_S)
    purelib = json.loads(run([python, "-c", LENDER], TIMEOUT_S, cwd="/",
                             **INSTALLED_ONLY).stdout)["purelib"]
    with open(os.path.join(purelib, "lent-by-megengine-python.pth"), "w") as f:
        f.write(lender_python["purelib"] + "\n")
    return python


WHERE_FROM = """
import json, os, sys, gradmgr, gradmgr.backends.megengine as backend, gradmgr.parity
print(json.dumps({"prefix": sys.prefix, "gradmgr": gradmgr.__file__, "backend": backend.__file__,
                  "parity": gradmgr.parity.__file__, "editable finders": [
                      repr(f) for f in sys.meta_path if "editable" in repr(f).lower()],
                  "other gradmgr packages": [p for p in sys.path if os.path.isfile(
                      os.path.join(p or ".", "gradmgr", "__init__.py"))
                                             and not p.startswith(sys.prefix + os.sep)]}))
"""


def test_every_subpackage_imports_from_the_wheel(installed: str) -> None:
    info = json.loads(run([installed, "-c", SUBPACKAGES], TIMEOUT_S, cwd="/",
                          **INSTALLED_ONLY).stdout)
    prefix = info.pop("prefix")
    assert info.pop("gradmgr").startswith(prefix), "gradmgr did not come from the wheel"
    assert sorted(["gradmgr", *info]) == packages_in_checkout()
    for name, file in info.items():
        assert file is None or file.startswith(prefix), (name, file)
    assert {"gradmgr.parity", "gradmgr.integrations", "gradmgr.backends.torch"} <= set(info)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in RUN  # Paddle's: not here
                                   if b.framework not in ("megengine", "paddle")])
def test_doc_block_runs_installed(installed: str, block, tmp_path) -> None:
    run_block(block, tmp_path, python=installed, **INSTALLED_ONLY)


def test_the_megengine_venv_imports_the_wheel_not_the_lenders_gradmgr(
        installed_megengine: str) -> None:
    info = json.loads(run([installed_megengine, "-c", WHERE_FROM], TIMEOUT_S, cwd="/",
                          **INSTALLED_ONLY).stdout)
    for name in ("gradmgr", "backend", "parity"):
        assert info[name].startswith(info["prefix"] + os.sep), (name, info)
    assert info["editable finders"] == [] and info["other gradmgr packages"] == [], info


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in RUN
                                   if b.framework == "megengine"])
def test_megengine_doc_block_runs_installed(installed_megengine: str, block, tmp_path) -> None:
    run_block(block, tmp_path, python=installed_megengine, **INSTALLED_ONLY)


def test_the_env_command_reports_the_installed_copy(installed: str) -> None:
    """The console script ``gradmgr`` (what a bug report asks for) from the venv's bin."""
    command = os.path.join(os.path.dirname(installed), "gradmgr")
    out = run([command, "env"], TIMEOUT_S, cwd="/", **INSTALLED_ONLY).stdout
    lines = {}  # label: value, the columns two spaces apart
    for line in out.splitlines():
        label, _, value = line.strip().partition("  ")
        lines[label] = value.strip()
    prefix = os.path.dirname(os.path.dirname(installed))
    assert lines["location"].startswith(prefix), out
    assert lines["torch backend"] == "imports" and lines["torch.distributed"].startswith(
        "gloo yes"), out
    assert lines["parity"] == lines["lightning"] == "yes", out
    assert lines["gradmgr.parity"] == "imports", out


def test_wheel_metadata(installed: str) -> None:
    info = json.loads(run([installed, "-c", METADATA], TIMEOUT_S, cwd="/",
                          **INSTALLED_ONLY).stdout)
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
    # a module where tensors are expected (a user's habit from DDP(model))
    assert any("[arg-type]" in e and '"attach"' in e and '"Linear"' in e for e in errors), out
    assert proc.returncode == 1, out
