"""The architecture page (docs/architecture.md) and the README's layout stay true to the code:
every module of the core and of the backends is in the page's module table, and nothing that
no longer exists is. And the house's rules: distributed/ in rooms by job, no module over 500
lines, no import circle (type-only ones included)."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _modules() -> set:
    found = set()
    for path in (ROOT / "gradmgr").rglob("*.py"):
        found.add(str(path.relative_to(ROOT)))
    return {m for m in found if m != "gradmgr/backends/__init__.py"}


def _documented() -> set:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return set(re.findall(r"^\| `(gradmgr/[^`]+\.py)` \|", page, re.MULTILINE))


def test_every_module_is_in_the_architecture_table_and_nothing_else():
    modules, documented = _modules(), _documented()
    assert sorted(modules - documented) == [], "modules missing from docs/architecture.md"
    assert sorted(documented - modules) == [], "docs/architecture.md names modules that are gone"


def test_the_readme_layout_names_every_top_level_entry():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    for entry in ("gradmgr/", "gradmgr/distributed/", "gradmgr/backends/", "tests/", "examples/",
                  "docs/", "bench/", "scripts/"):
        assert re.search(rf"^{re.escape(entry)}\s", layout, re.MULTILINE), entry
        assert (ROOT / entry).is_dir(), entry


# ---------------------------------------------------------------------- the house's rules
# gradmgr/distributed/ has a room (a package) per job; only these modules lie at its top:
# what every room shares (the adapter contract, errors, transports, the plan check, the
# parameters' broadcast) and the entry points (the launcher, data_parallel). The contract is
# three modules: contract.py (TensorOps, and what it hands out for the wrapped model: the
# forward watch with ArmedHooks), reducing.py (its protocols for reducing: reduce/ and sharded/
# both use them, so neither room is their home) and collectives.py (the transports').
DISTRIBUTED_TOP = {"__init__.py", "contract.py", "reducing.py", "collectives.py", "errors.py",
                   "transport.py", "consistency.py", "broadcasting.py", "launch.py", "wrap.py"}
DISTRIBUTED_ROOMS = {"reduce", "sharded", "join"}

MAX_LINES = 500
# Modules over MAX_LINES, each with why it may be (none today: a module that grows past it is
# split in the same change; the list may only shrink).
TOO_LONG: dict = {}

def test_distributed_has_a_room_per_job_and_only_the_listed_modules_at_its_top():
    base = ROOT / "gradmgr" / "distributed"
    entries = {p.name for p in base.iterdir() if p.name != "__pycache__"}
    rooms = {name for name in entries if (base / name).is_dir()}
    assert rooms == DISTRIBUTED_ROOMS, "distributed/'s rooms changed: update this test and " \
                                       "docs/architecture.md together"
    assert entries - rooms == DISTRIBUTED_TOP, "a module at distributed/'s top that is no " \
                                               "room's: move it into its room"
    for room in rooms:
        assert (base / room / "__init__.py").is_file(), room
        inside = [p for p in (base / room).iterdir() if p.name != "__pycache__"]
        assert all(p.suffix == ".py" for p in inside), f"{room}/ holds a folder or a non-module"


def _line_counts() -> dict:
    return {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
            for p in (ROOT / "gradmgr").rglob("*.py")}


def _too_long(counts: dict, allowed: dict) -> tuple:
    """The modules over MAX_LINES that are not allowed, and the allowed ones no longer over."""
    over = {path for path, n in counts.items() if n > MAX_LINES}
    return sorted(over - set(allowed)), sorted(set(allowed) - over)


def test_no_module_is_over_500_lines_except_the_listed_ones_on_their_way_down():
    new, done = _too_long(_line_counts(), TOO_LONG)
    assert new == [], f"over {MAX_LINES} lines: split them"
    assert done == [], f"{MAX_LINES} lines or fewer now (or gone): delete them from TOO_LONG"


def test_the_line_count_rule_catches_a_long_module_and_a_stale_exception():
    counts = {"gradmgr/x.py": MAX_LINES + 1, "gradmgr/y.py": MAX_LINES, "gradmgr/z.py": 900}
    assert _too_long(counts, {"gradmgr/y.py": "", "gradmgr/z.py": ""}) == (
        ["gradmgr/x.py"], ["gradmgr/y.py"])


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, package: str, source: str, modules: set) -> set:
    """The modules among ``modules`` that module ``name`` (of ``package``) imports: anywhere
    in ``source`` (at the top, under ``if TYPE_CHECKING:``, inside a function), relative or
    absolute; ``from pkg import sub`` imports the submodule, not the package."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = [f"{base}.{alias.name}" for alias in node.names]
            targets = [sub if sub in modules else base for sub in subs]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _circles(graph: dict) -> set:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    circles = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while True:
                w = stack.pop()
                members.add(w)
                if w == v:
                    break
            if len(members) > 1:
                circles.add(frozenset(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def _import_graph() -> dict:
    paths = {_module_name(p): p for p in (ROOT / "gradmgr").rglob("*.py")}
    modules = set(paths)
    return {name: _imports(name, name if path.name == "__init__.py" else name.rpartition(".")[0],
                           path.read_text(encoding="utf-8"), modules)
            for name, path in paths.items()}


def test_no_import_circle_among_gradmgrs_modules_type_only_ones_included():
    assert sorted(map(sorted, _circles(_import_graph()))) == [], "import circles"


def test_the_circle_finder_sees_a_type_only_circle_and_a_lazy_import():
    sources = {
        "gradmgr.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "gradmgr.b": "def f():\n    from . import a\n",
        "gradmgr.c": "from .a import x\nimport gradmgr.b\n",
    }
    graph = {name: _imports(name, "gradmgr", source, set(sources))
             for name, source in sources.items()}
    assert graph["gradmgr.c"] == {"gradmgr.a", "gradmgr.b"}
    assert _circles(graph) == {frozenset({"gradmgr.a", "gradmgr.b"})}
