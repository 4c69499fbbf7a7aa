"""MkDocs hook: the API reference pages, generated at build time from the public API.

For each namespace in ``NAMESPACES`` a page ``api/<namespace>.md`` lists every name of its
``__all__`` as a mkdocstrings ``:::`` block, so the reference follows the code when names are
added, moved or removed (a hand-written list would drift). Each public name must have a
docstring with an ``Example:`` section, public methods a docstring, and functions annotated
parameters and return: every gap is logged as a warning, which ``mkdocs build --strict``
(``make docs``, tests/docs/test_docs_site.py) turns into a failed build.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from typing import Any, Iterator, List

from mkdocs.structure.files import File
from pygments.formatters import HtmlFormatter

NAMESPACES = ("gradmgr", "gradmgr.distributed")
log = logging.getLogger("mkdocs.hooks.api_reference")  # under "mkdocs": counted by --strict
# A Google-style section header: "Example:", "Examples:", "Example (PyTorch):"
_EXAMPLE = re.compile(r"^Examples?\b[^\n]*:$", re.MULTILINE)


def public_names(namespace: str) -> List[str]:
    """The names ``namespace`` exports, in ``__all__`` order."""
    return list(importlib.import_module(namespace).__all__)


def api_page(namespace: str) -> str:
    """Markdown for one namespace: its summary, then one ``:::`` block per public name."""
    module = importlib.import_module(namespace)
    summary = (inspect.getdoc(module) or "").split("\n\n")[0]
    blocks = [f"::: {namespace}.{name}" for name in public_names(namespace)]
    return f"# `{namespace}`\n\n{summary}\n\n" + "\n\n".join(blocks) + "\n"


def on_files(files: Any, config: Any) -> Any:
    # The theme's own highlighter loads from a CDN; Pygments colours the code at build time
    css = HtmlFormatter(style="default").get_style_defs(".highlight")
    files.append(File.generated(config, "css/pygments.css", content=css))
    for namespace in NAMESPACES:
        files.append(File.generated(config, f"api/{namespace}.md", content=api_page(namespace)))
        for problem in docstring_problems(namespace):
            log.warning(problem)
    return files


# ------------------------------------------------------------------ what a public name owes
def docstring_problems(namespace: str) -> Iterator[str]:
    """One line per public name of ``namespace`` lacking a docstring, an example or types."""
    module = importlib.import_module(namespace)
    for name in public_names(namespace):
        obj = getattr(module, name)
        where = f"{namespace}.{name}"
        doc = obj.__doc__ if inspect.isclass(obj) or callable(obj) else None
        if not doc or not doc.strip():
            yield f"API reference: {where} has no docstring"
        elif not _EXAMPLE.search(inspect.cleandoc(doc)):
            yield f"API reference: {where}'s docstring has no 'Example:' section"
        if inspect.isfunction(obj):
            yield from _annotation_problems(where, obj)
        elif inspect.isclass(obj):
            yield from _member_problems(where, obj)


def _member_problems(where: str, cls: type) -> Iterator[str]:
    """Public methods defined with the class (not typing's Protocol ``__init__`` and the like)
    need a docstring and annotations."""
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        func = func.fget if isinstance(func, property) else func
        if not inspect.isfunction(func) or func.__module__ != cls.__module__:
            continue  # typing's Protocol.__init__ and the like
        if name != "__init__" and not (func.__doc__ or "").strip():
            yield f"API reference: {where}.{name} has no docstring"
        yield from _annotation_problems(f"{where}.{name}", func)


def _annotation_problems(where: str, func: Any) -> Iterator[str]:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return
    bare = [p.name for i, p in enumerate(sig.parameters.values())
            if p.annotation is inspect.Parameter.empty
            and not (i == 0 and p.name in ("self", "cls"))]
    if bare:
        yield f"API reference: {where} has parameters without a type: {', '.join(bare)}"
    if sig.return_annotation is inspect.Signature.empty and func.__name__ != "__init__":
        yield f"API reference: {where} has no return type"
