"""Fixtures shared by the suites. ``fw`` parametrizes a test over every backend, so a failure
names its backend (``test_x[torch]``, ``test_x[megengine]``)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from frameworks import make_framework  # noqa: E402

BACKENDS = ["torch", "megengine", "paddle"]


def pytest_configure(config):
    """MegEngine runs synchronously in the test process (``async_level = 0``): its default
    asynchronous CPU execution now and then hands a backward garbage (about 1 in 150 on a
    batch-norm-shaped program, natively too; none of 1,800 synchronous runs), and a test that
    compares with the engine would fail on MegEngine's race, not gradmgr's.
    bench/probe_megengine_cpu_reduce.py measures it; docs/megengine.md says what users do."""
    try:
        import megengine
    except ImportError:
        return
    megengine.config.async_level = 0


def _require(name: str) -> None:
    pytest.importorskip(name, reason=f"{name} is not installed in this environment")


@pytest.fixture(params=BACKENDS)
def fw(request):
    """The op table of one framework, on the CPU."""
    _require(request.param)
    return make_framework(request.param)


@pytest.fixture
def torch_fw():
    _require("torch")
    return make_framework("torch")


@pytest.fixture
def mge_fw():
    _require("megengine")
    return make_framework("megengine")


@pytest.fixture
def paddle_fw():
    _require("paddle")
    return make_framework("paddle")


@pytest.fixture
def gloo_one_rank():
    """torch.distributed's default group: one gloo rank in this process, destroyed after."""
    _require("torch")
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# ------------------------------------------------------------------ run policy (run_tests.sh)
# GRADMGR_FRAMEWORKS=torch,megengine names the frameworks this environment must have (default:
#   torch and megengine, and paddle where it is installed: an optional extra). Tests of any
#   other framework are deselected at collection, never skipped:
#   params named in FRAMEWORK_PARAMS whose value is that framework's name (`fw[megengine]`),
#   tests marked `@pytest.mark.megengine` (or torch), tests using a fixture whose name starts
#   with a prefix in FRAMEWORK_FIXTURES (mge_fw, megengine_ranks), and the files named for it
#   in FRAMEWORK_FILES (not even imported: they import the framework at module level).
# GRADMGR_STRICT_SKIPS=1 turns every skip whose reason does not start with "CUDA" into a
#   failure, so a missing or broken expected framework cannot pass as "skipped".
FRAMEWORK_FIXTURES = {"torch": ("torch_",), "megengine": ("megengine_", "mge_"),
                      "paddle": ("paddle_",)}
FRAMEWORK_PARAMS = ("fw", "framework", "backend")
FRAMEWORK_FILES = {
    "test_torch_*.py": {"torch"},
    "test_megengine_*.py": {"megengine"},
    "test_paddle_*.py": {"paddle"},
    "test_parity*.py": {"torch", "megengine"},
    "test_parity_paddle*.py": {"paddle", "torch", "megengine"},
}


def _expected_frameworks() -> set:
    names = {n.strip() for n in os.environ.get("GRADMGR_FRAMEWORKS", "").split(",") if n.strip()}
    unknown = names - set(BACKENDS)
    if unknown:
        raise pytest.UsageError(f"GRADMGR_FRAMEWORKS names unknown frameworks {sorted(unknown)}")
    if names:
        return names
    import importlib.util

    optional = {"paddle"}
    return {n for n in BACKENDS if n not in optional or importlib.util.find_spec(n) is not None}


def pytest_ignore_collect(collection_path, config):
    import fnmatch

    for pattern, needs in FRAMEWORK_FILES.items():
        if fnmatch.fnmatch(collection_path.name, pattern) and not needs <= _expected_frameworks():
            return True
    return None


def pytest_collection_modifyitems(config, items):
    missing = set(BACKENDS) - _expected_frameworks()
    if not missing:
        return
    keep, drop = [], []
    for item in items:
        needs = {m.name for m in item.iter_markers() if m.name in BACKENDS}
        params = getattr(item, "callspec", None)
        params = params.params if params is not None else {}
        needs |= {v for k, v in params.items() if k in FRAMEWORK_PARAMS and isinstance(v, str)}
        needs |= {n for n, prefixes in FRAMEWORK_FIXTURES.items()
                  if any(f.startswith(prefixes) for f in item.fixturenames)}
        (drop if needs & missing else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _fail_non_cuda_skip(report) -> None:
    if not (os.environ.get("GRADMGR_STRICT_SKIPS") == "1" and report.skipped):
        return
    if hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
    if not reason.startswith("CUDA"):
        report.outcome = "failed"
        report.longrepr = (
            f"GRADMGR_STRICT_SKIPS: skipped for a reason that does not start with 'CUDA' in an "
            f"environment expecting {sorted(_expected_frameworks())}: {reason}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_non_cuda_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_non_cuda_skip(outcome.get_result())
