"""MkDocs hook: the API reference pages, generated at build time from the public API.

``PAGES`` orders the public names of ``NAMESPACES`` for a reader: ``api/reference.md`` the
user's API in the order it is met, ``api/backends.md`` what a backend's author needs; each name
is a mkdocstrings ``:::`` block. A name added to an ``__all__`` and not to ``PAGES`` (or listed
twice, or listed and not public) is a warning, so the reference cannot drift from the code.
Each public name must have a docstring with an ``Example:`` section, public methods a
docstring, and functions annotated parameters and return: every gap is logged as a warning,
which ``mkdocs build --strict`` (``make docs``, tests/docs/test_docs_site.py) turns into a
failed build.
"""

# A hook, not mkdocs-gen-files (0.6.1, measured 2026-11-28, issue 37): a gen-files script that
# writes the same pages built byte-identical api/ pages and css, and `--strict` still failed on
# the checks' warnings, but it took a 20-line script, a plugin entry and a dependency for what
# File.generated (mkdocs >= 1.6) does in on_files in two lines; PAGES and the checks stay
# either way.
from __future__ import annotations

import importlib
import inspect
import logging
import re
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from mkdocs.structure.files import File
from pygments.formatters import HtmlFormatter

NAMESPACES = ("gradmgr", "gradmgr.distributed", "gradmgr.parity")
log = logging.getLogger("mkdocs.hooks.api_reference")  # under "mkdocs": counted by --strict
# A Google-style section header: "Example:", "Examples:", "Example (PyTorch):"
_EXAMPLE = re.compile(r"^Examples?\b[^\n]*:$", re.MULTILINE)

# The reference pages: every name of NAMESPACES' ``__all__`` on exactly one of them, in the
# order a user meets it (a name missing here, or listed twice, is a warning: --strict fails).
# The first page is what a user reads; the second, what a backend's author needs.
PAGES = {
    "api/reference.md": (
        "API reference",
        "gradmgr's public API in the order you meet it: the manager and its methods, data "
        "parallel, sharded data parallel, split backward, groups, porting, then the errors. "
        "What only an author of a backend needs is on [its own page](backends.md).",
        [
            ("The gradient manager", ["gradmgr.GradManager"]),
            ("Data parallel", [
                "gradmgr.distributed.data_parallel", "gradmgr.distributed.no_sync",
                "gradmgr.distributed.broadcast", "gradmgr.distributed.make_allreduce_cb",
                "gradmgr.distributed.AllreduceCallback", "gradmgr.distributed.spawn_local",
                "gradmgr.distributed.run_ranks", "gradmgr.distributed.free_port"]),
            ("Sharded data parallel", [
                "gradmgr.distributed.ShardedOptimizer",
                "gradmgr.distributed.get_state_dict", "gradmgr.distributed.set_state_dict",
                "gradmgr.distributed.make_reduce_scatter_cb",
                "gradmgr.distributed.ReduceScatterCallback"]),
            ("Split backward", ["gradmgr.DeferredBackward", "gradmgr.UnfinishedBackwardWarning"]),
            ("Groups", ["gradmgr.GradManagerGroup"]),
            ("Porting between frameworks", [
                "gradmgr.parity.transfer_weights", "gradmgr.parity.compare_step",
                "gradmgr.parity.assert_parity", "gradmgr.parity.train_drift",
                "gradmgr.parity.dump", "gradmgr.parity.load",
                "gradmgr.parity.save_map", "gradmgr.parity.convert_checkpoint",
                "gradmgr.parity.MappingReport", "gradmgr.parity.StepReport",
                "gradmgr.parity.DriftReport",
                "gradmgr.parity.ParityError", "gradmgr.parity.MappingError",
                "gradmgr.parity.ModelTypeError"]),
            ("Inside callbacks", ["gradmgr.Future", "gradmgr.is_future",
                                  "gradmgr.get_backwarding_grad_manager"]),
            ("Errors and warnings", [
                "gradmgr.AttachError", "gradmgr.CallbackResultError",
                "gradmgr.UnsupportedGraphError", "gradmgr.distributed.RankMismatchError",
                "gradmgr.distributed.RankFailedError", "gradmgr.distributed.RanksOutOfStepError",
                "gradmgr.distributed.SparseGradientError",
                "gradmgr.BackendNotFoundError", "gradmgr.UnsupportedBackendError",
                "gradmgr.GradMgrWarning", "gradmgr.CallbackReturnedNoneWarning"]),
        ],
    ),
    "api/backends.md": (
        "For backend authors",
        "The contract a framework's adapter implements (see [The semantic contract]"
        "(../contract.md) and [Architecture](../architecture.md)): a user of PyTorch or "
        "MegEngine never needs these.",
        [
            ("Backends", ["gradmgr.Backend", "gradmgr.Capabilities", "gradmgr.Tape",
                          "gradmgr.register_backend", "gradmgr.get_backend",
                          "gradmgr.backend_for", "gradmgr.AttachSpec"]),
            ("Data-parallel adapters", [
                "gradmgr.distributed.TensorOps", "gradmgr.distributed.Transport",
                "gradmgr.distributed.Handle", "gradmgr.distributed.BucketPlan",
                "gradmgr.distributed.Bucket"]),
        ],
    ),
}
# GradManager's members in the order a user meets them; its registrations (inherited from
# StepHooks, whose name the page does not show) with them. A public member missing here is a
# warning.
MANAGER_MEMBERS = [
    "attach", "record", "backward", "release", "is_recording", "attached_tensors", "reachable",
    "add_gradient", "backward_split", "step", "backend", "register_after_backward_callback",
    "register_record_callback", "register_release_callback", "register_backward_error_callback",
]
_OPTIONS = {"gradmgr.GradManager": ("inherited_members: true", "show_bases: false",
                                    "group_by_category: false",
                                    f"members: [{', '.join(MANAGER_MEMBERS)}]")}


def public_names(namespace: str) -> List[str]:
    """The names ``namespace`` exports, in ``__all__`` order."""
    return list(importlib.import_module(namespace).__all__)


def entry(name: str) -> str:
    """One mkdocstrings block: the object's heading one level under its section's."""
    options = ("heading_level: 3",) + _OPTIONS.get(name, ())
    return f"::: {name}\n    options:\n" + "".join(f"      {o}\n" for o in options)


def api_page(title: str, intro: str, sections: List[Tuple[str, List[str]]]) -> str:
    """Markdown for one reference page: its intro, then each section's entries in order."""
    parts = [f"# {title}\n\n{intro}\n"]
    for heading, names in sections:
        parts.append(f"## {heading}\n\n" + "\n".join(entry(n) for n in names))
    return "\n".join(parts)


def placement_problems(pages: Dict[str, tuple] = PAGES,
                       namespaces: Sequence[str] = NAMESPACES) -> Iterator[str]:
    """Each public name that is on no page or on two, and each listed name that is not
    public."""
    listed = [n for _, _, sections in pages.values() for _, names in sections for n in names]
    public = [f"{ns}.{name}" for ns in namespaces for name in public_names(ns)]
    for name in public:
        if name not in listed:
            yield f"API reference: {name} is public but on no page of PAGES (scripts/docs_hooks.py)"
    for name in sorted({n for n in listed if listed.count(n) > 1}):
        yield f"API reference: {name} is listed twice in PAGES"
    for name in listed:
        if name not in public:
            yield f"API reference: {name} is listed in PAGES but not public"


def member_problems(cls: type, listed: Sequence[str], where: str) -> Iterator[str]:
    """Each public member of ``cls`` that the reference's explicit member list leaves out."""
    for name in sorted(n for n in dir(cls) if not n.startswith("_") and n not in listed):
        yield f"API reference: {where}.{name} is public but not in its member list"


def on_files(files: Any, config: Any) -> Any:
    # The theme's own highlighter loads from a CDN; Pygments colours the code at build time
    css = HtmlFormatter(style="default").get_style_defs(".highlight")
    files.append(File.generated(config, "css/pygments.css", content=css))
    for path, page in PAGES.items():
        files.append(File.generated(config, path, content=api_page(*page)))
    manager = importlib.import_module("gradmgr").GradManager
    for problem in [*placement_problems(),
                    *member_problems(manager, MANAGER_MEMBERS, "gradmgr.GradManager")]:
        log.warning(problem)
    for namespace in NAMESPACES:
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
