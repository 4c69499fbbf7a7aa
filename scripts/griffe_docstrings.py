"""Griffe extension for the API reference: reads gradmgr's docstrings as the renderer expects.

* An ``Example:`` header (the spelling gradmgr's docstrings use, as Napoleon accepts) becomes
  Google style's ``Examples:`` section. Griffe parses only the latter as examples; the former
  would be an admonition whose ``>>>`` lines render as nested Markdown quotes, not code.
* Sphinx roles (``:class:`x```, ``:func:`~m.f```) become plain code: the pages are Markdown,
  where a role would show as literal text.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADER = re.compile(r"^(\s*)Example(\b[^:\n]*:[ \t]*)$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")


def markdown_docstring(text: str) -> str:
    return _ROLE.sub(r"`\1`", _HEADER.sub(r"\1Examples\2", text))


class GradmgrDocstrings(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
