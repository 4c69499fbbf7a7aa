"""``import gradmgr`` must not import any framework: the backend is loaded lazily on the first
tensor of its kind. Checked in a fresh interpreter, since this test process may hold torch."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

REPORT = """
import json, sys
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in
                ("torch", "megengine", "paddle", "lightning_fabric", "lightning",
                 "pytorch_lightning"))
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


def test_import_gradmgr_distributed_loads_no_framework():
    result = _run(
        """
        import gradmgr, gradmgr.distributed
        from gradmgr.distributed import data_parallel, make_allreduce_cb, ShardedOptimizer
        make_allreduce_cb("mean")
        """
    )
    assert result == {"loaded": []}


def test_import_gradmgr_integrations_loads_no_framework_nor_lightning():
    result = _run(
        """
        import gradmgr, gradmgr.integrations
        import gradmgr.integrations.lightning as lightning
        extra = {"names": dir(lightning)}
        """
    )
    assert result == {"loaded": [], "names": ["GradmgrModule", "GradmgrStrategy"]}


@pytest.mark.torch
def test_the_lightning_strategy_imports_lightning_fabric_when_asked_for():
    pytest.importorskip("lightning_fabric")
    result = _run(
        """
        from gradmgr.integrations.lightning import GradmgrStrategy
        from lightning_fabric.strategies import DDPStrategy
        extra = {"ddp": issubclass(GradmgrStrategy, DDPStrategy)}
        """
    )
    assert result["ddp"] is True
    assert "lightning_fabric" in result["loaded"] and "torch" in result["loaded"]


# ------------------------------------------------------------------ the shape of the core
CORE = pathlib.Path(__file__).resolve().parent.parent / "gradmgr"
ADAPTERS = CORE / "backends"  # inside the package, but not the core: where frameworks are used
# A trainer's integration is no core either: it runs on its framework (imported lazily, see
# test_import_gradmgr_integrations_loads_no_framework_nor_lightning)
INTEGRATIONS = CORE / "integrations"
FRAMEWORK_IMPORT = re.compile(r"^\s*(import|from)\s+(torch|megengine|paddle)\b", re.MULTILINE)


def test_the_core_has_no_framework_import_statement():
    """Framework code lives in its backend; the core reaches it through Backend alone (not
    even a lazy import inside a function)."""
    offenders = [f"{path.relative_to(CORE.parent)}:{source[:match.start()].count(chr(10)) + 1}"
                 for path in sorted(CORE.rglob("*.py"))
                 if ADAPTERS not in path.parents and INTEGRATIONS not in path.parents
                 for source in [path.read_text(encoding="utf-8")]
                 for match in FRAMEWORK_IMPORT.finditer(source)]
    assert offenders == []


def _runtime_imports(path: pathlib.Path) -> set:
    """The gradmgr modules ``path`` imports when it runs (not under TYPE_CHECKING)."""
    module = ".".join(path.relative_to(CORE.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        module = module[:-len(".__init__")]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("gradmgr"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gradmgr"))
    return found


def test_no_import_cycles_inside_the_core():
    modules = {}
    for path in CORE.rglob("*.py"):
        name = ".".join(path.relative_to(CORE.parent).with_suffix("").parts)
        modules[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    graph = {name: {m for m in _runtime_imports(path) if m in modules and m != name}
             for name, path in modules.items()}
    # a package's __init__ re-exporting its modules is not a cycle of theirs
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def _find_cycle(graph: dict):
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path + [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None
