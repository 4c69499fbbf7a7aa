"""scripts/docs_hooks.py: the API pages follow ``__all__``, and the docstring check names every
public name that lacks a docstring, an example or types."""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest
from docs_helpers import ROOT

pytestmark = pytest.mark.docs


@pytest.fixture
def docs_hooks(monkeypatch):
    """The hook module, imported only where the docs tools are (it imports mkdocs)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    return importlib.import_module("docs_hooks")


def documented(x: int) -> int:
    """Twice ``x``.

    Examples:
        >>> documented(2)
        4
    """
    return 2 * x


def bare(x, y: int):
    return x


class NoExample:
    """A class."""

    def method(self) -> None:
        pass

    def typed(self, value: int) -> int:
        """Documented and typed."""
        return value


@pytest.fixture
def fake_api(monkeypatch) -> str:
    module = types.ModuleType("fake_api", "The fake API.\n\nMore text.")
    module.documented, module.bare, module.NoExample = documented, bare, NoExample
    module.__all__ = ["documented", "bare", "NoExample"]
    monkeypatch.setitem(sys.modules, "fake_api", module)
    return "fake_api"


def test_each_gap_is_named(docs_hooks, fake_api: str) -> None:
    assert list(docs_hooks.docstring_problems(fake_api)) == [
        "API reference: fake_api.bare has no docstring",
        "API reference: fake_api.bare has parameters without a type: x",
        "API reference: fake_api.bare has no return type",
        "API reference: fake_api.NoExample's docstring has no 'Example:' section",
        "API reference: fake_api.NoExample.method has no docstring",
    ]


def test_a_page_lists_its_sections_in_order(docs_hooks) -> None:
    page = docs_hooks.api_page("Title", "Intro.", [("First", ["m.a", "m.b"]), ("Then", ["m.c"])])
    assert page.index("# Title") < page.index("## First") < page.index("::: m.a\n")
    assert page.index("::: m.a\n") < page.index("::: m.b\n") < page.index("## Then")
    assert page.index("## Then") < page.index("::: m.c\n")


def test_every_public_name_is_placed_once(docs_hooks, fake_api: str) -> None:
    pages = {"p.md": ("P", "", [("S", ["fake_api.documented", "fake_api.bare",
                                        "fake_api.documented", "fake_api.gone"])])}
    assert list(docs_hooks.placement_problems(pages, [fake_api])) == [
        "API reference: fake_api.NoExample is public but on no page of PAGES "
        "(scripts/docs_hooks.py)",
        "API reference: fake_api.documented is listed twice in PAGES",
        "API reference: fake_api.gone is listed in PAGES but not public",
    ]


def test_the_real_pages_place_every_public_name(docs_hooks) -> None:
    """What the build checks: nothing public is left off the reference, the manager's member
    list included, and GradManager opens the first page."""
    import gradmgr

    assert list(docs_hooks.placement_problems()) == []
    assert list(docs_hooks.member_problems(gradmgr.GradManager, docs_hooks.MANAGER_MEMBERS,
                                           "gradmgr.GradManager")) == []
    first_page = next(iter(docs_hooks.PAGES.values()))
    assert first_page[2][0][1][0] == "gradmgr.GradManager"


def test_a_public_member_left_off_the_list_is_named(docs_hooks) -> None:
    assert list(docs_hooks.member_problems(NoExample, ["typed"], "m.NoExample")) == [
        "API reference: m.NoExample.method is public but not in its member list"]
