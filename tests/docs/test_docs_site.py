"""The documentation site: ``mkdocs build --strict`` (what ``make docs`` runs) passes, and the
built pages render in a real headless browser (Chromium) with their code blocks, and the API
reference shows every public name.

Needs the docs tools, installed into .venv-latest by scripts/setup.sh (the ``docs`` marker:
tests/docs/conftest.py deselects these tests elsewhere), and Chromium, which scripts/setup.sh
installs from Debian's packages when run as root on Debian.
"""

from __future__ import annotations

import html
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from typing import Dict, List

import pytest
from doc_blocks import blocks, read
from docs_helpers import ROOT

pytestmark = [pytest.mark.docs, pytest.mark.slow]

GUIDES = ["index.md", "contract.md", "pytorch.md", "megengine.md", "data-parallel.md",
          "switching-from-ddp.md", "sharded.md", "split-backward.md", "glossary.md",
          "internals.md"]
API_PAGES = ["api/reference.html", "api/backends.html"]  # the user's first
NAMESPACES = ["gradmgr", "gradmgr.distributed"]
BUILD_TIMEOUT_S, BROWSER_TIMEOUT_S = 300, 60


def mkdocs_build(config: str, site: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", config,
         "--site-dir", site], cwd=os.path.dirname(config), capture_output=True, text=True,
        timeout=BUILD_TIMEOUT_S)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple:
    """(site folder, the build's process). mkdocs writes every page before it counts the
    warnings, so the pages are there to look at even when the strict build fails."""
    site = str(tmp_path_factory.mktemp("site"))
    return site, mkdocs_build(os.path.join(ROOT, "mkdocs.yml"), site)


def test_site_builds_strictly(built) -> None:
    """A warning (a broken link or reference, a public name without a docstring, an example
    or types: scripts/docs_hooks.py lists them) fails the build."""
    _, proc = built
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(
        warnings or proc.stderr.splitlines()[-20:])


@pytest.mark.parametrize("added, named", [
    ("[a broken link](no-such-page.md)", "no-such-page.md"),
    ("[a broken cross-reference][gradmgr.NoSuchName]", "gradmgr.NoSuchName"),
    ("::: gradmgr.no_such_name", "gradmgr.no_such_name"),
], ids=["link", "cross-reference", "api-block"])
def test_strict_build_fails_on_a_broken_reference(tmp_path, added: str, named: str) -> None:
    """The same configuration, one guide given a broken reference: the build fails naming it."""
    for folder in ("docs", "scripts"):
        shutil.copytree(os.path.join(ROOT, folder), tmp_path / folder)
    shutil.copy(os.path.join(ROOT, "mkdocs.yml"), tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "contract.md", "a", encoding="utf-8") as f:
        f.write(f"\n{added}\n")
    proc = mkdocs_build(str(tmp_path / "mkdocs.yml"), str(tmp_path / "site"))
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr[-3000:]


# ------------------------------------------------------------------------ in the browser
def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("Chromium was not found: the docs browser test needs it. `make setup` installs "
                "Debian's chromium package when run as root on Debian; elsewhere install "
                "Chromium and put `chromium` on PATH.")


def rendered_dom(page: str, site: str) -> str:
    """The page's DOM after Chromium loaded it (scripts run) from file://."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", f"--user-data-dir={profile}", "--dump-dom",
             "file://" + os.path.join(site, page)],
            capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert proc.returncode == 0 and "</html>" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout


class Page(HTMLParser):
    """What the checks read from a DOM: element ids, the text of each <pre>, the <h1>."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.ids: List[str] = []
        self.pres: List[str] = []
        self.h1 = ""
        self._in: Dict[str, int] = {"pre": 0, "h1": 0}
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.ids += [v for k, v in attrs if k == "id" and v]
        if tag in self._in:
            self._in[tag] += 1
            if tag == "pre":
                self.pres.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._in:
            self._in[tag] -= 1

    def handle_data(self, data: str) -> None:
        if self._in["pre"]:
            self.pres[-1] += data
        if self._in["h1"]:
            self.h1 += data


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_renders_with_its_code_blocks(built, guide: str) -> None:
    site, _ = built
    page = Page(rendered_dom(guide.replace(".md", ".html"), site))
    source = blocks(os.path.join("docs", guide))
    title = next(line for line in read(os.path.join("docs", guide)).splitlines()
                 if line.startswith("# "))
    assert page.h1.strip().rstrip("¶").strip() == title[2:].strip().strip("`")
    assert len(page.pres) == len(source), f"{len(page.pres)} code blocks, {len(source)} in source"
    for block, shown in zip(source, page.pres):
        first = next(line for line in block.text.splitlines() if line.strip())
        assert first.strip() in html.unescape(shown), f"{block.id} is not shown: {first!r}"
    assert not any("```" in text for text in page.pres)


@pytest.fixture(scope="module")
def api_ids(built) -> Dict[str, List[str]]:
    """Each reference page's element ids in document order, as Chromium rendered it."""
    site, _ = built
    return {page: Page(rendered_dom(page, site)).ids for page in API_PAGES}


def test_api_reference_lists_every_public_name(api_ids) -> None:
    shown = {i for ids in api_ids.values() for i in ids}
    names = [f"{ns}.{name}" for ns in NAMESPACES for name in importlib.import_module(ns).__all__]
    missing = [name for name in names if name not in shown]
    assert not missing, f"the reference lacks {missing}"
    assert len(names) >= 30


def test_api_reference_starts_with_the_manager_and_its_methods(api_ids) -> None:
    """The first entry a reader meets is GradManager, then its methods (every register_*
    among them, though inherited), before anything of data parallel; the backend authors'
    adapters are on their own page."""
    from gradmgr import GradManager

    entries = [i for i in api_ids["api/reference.html"] if i.startswith("gradmgr.")]
    assert entries[0] == "gradmgr.GradManager", entries[:5]
    first_other = next(i for i, e in enumerate(entries) if not e.startswith("gradmgr.GradM"))
    methods = [e.rsplit(".", 1)[1] for e in entries[1:first_other]]
    assert methods[:3] == ["attach", "record", "backward"], methods
    registrations = sorted(n for n in dir(GradManager) if n.startswith("register_"))
    assert len(registrations) >= 4 and set(registrations) <= set(methods), methods
    assert entries[first_other] == "gradmgr.distributed.data_parallel"
    assert "gradmgr.distributed.TensorOps" not in entries
    assert "gradmgr.distributed.TensorOps" in api_ids["api/backends.html"]
