"""The architecture page (docs/architecture.md) and the README's layout stay true to the code:
every module of the core and of the backends is in the page's module table, and nothing that
no longer exists is."""

from __future__ import annotations

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
