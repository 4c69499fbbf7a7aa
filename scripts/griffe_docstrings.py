"""Griffe extension for the API reference: reads gradmgr's docstrings as the renderer expects.

* An ``Example:`` header (the spelling gradmgr's docstrings use, as Napoleon accepts), or one
  with a note in brackets (``Example (PyTorch):``, the note then the section's first line),
  becomes Google style's ``Examples:`` section. Griffe parses only the latter as examples;
  the former would be an admonition whose ``>>>`` lines render as nested Markdown quotes, not code.
* Sphinx roles (``:class:`x```, ``:func:`~m.f```) become plain code: the pages are Markdown,
  where a role would show as literal text.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# "Example:", "Examples:", "Example (PyTorch; MegEngine the same):"; the note in brackets,
# which Google style's parser does not take in a header, becomes the section's first line.
_HEADER = re.compile(r"^([ \t]*)Examples?(?:[ \t]*\(([^)\n]*)\))?:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")


def _examples_header(match: re.Match) -> str:
    indent, note = match.group(1), match.group(2)
    return f"{indent}Examples:" + (f"\n{indent}    {note}:" if note else "")


def markdown_docstring(text: str) -> str:
    return _ROLE.sub(r"`\1`", _HEADER.sub(_examples_header, text))


class GradmgrDocstrings(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
