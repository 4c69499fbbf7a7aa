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


def test_the_page_lists_all_of_all_in_order(docs_hooks, fake_api: str) -> None:
    assert docs_hooks.api_page(fake_api) == (
        "# `fake_api`\n\nThe fake API.\n\n"
        "::: fake_api.documented\n\n::: fake_api.bare\n\n::: fake_api.NoExample\n")
