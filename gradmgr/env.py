"""``python -m gradmgr env`` (or ``gradmgr env``): what a bug report needs, in the shape of
``python -m torch.utils.collect_env``: gradmgr's version and place, Python, the platform, each
framework's version against the releases the project tests, which backends import, which
extras are installed and which subpackages import, and each backend's distributed backends
and devices (:meth:`gradmgr.Backend.environment`).

It imports a framework only through its backend, as a user's first tensor would.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import pkgutil
import platform
import re
import sys
from typing import Dict, List, Optional, Tuple

import gradmgr

from .errors import BackendNotFoundError
from .registry import get_backend, known_backends

TESTED: Dict[str, Tuple[str, ...]] = {
    "torch": ("2.8", "2.13"),
    "megengine": ("1.13",),
    "paddlepaddle": ("3.3",),
    "lightning-fabric": ("2.6",),
}
"""The release series the project's test environments run (CONTRIBUTING.md, Set-up)."""


def version_line(dist: str) -> str:
    """``dist``'s version, and whether its series is one the project tests."""
    try:
        found = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
    series = ".".join(re.split(r"[.+]", found)[:2])
    tested = TESTED.get(dist, ())
    verdict = "tested" if series in tested else "NOT TESTED"
    return f"{found} ({verdict}; the tests run {', '.join(tested)})" if tested else found


def extras() -> Dict[str, str]:
    """Each extra of gradmgr's metadata: ``yes``, or what it needs that is missing."""
    try:
        meta = metadata.metadata("gradmgr")
    except metadata.PackageNotFoundError:
        return {"(metadata)": "gradmgr is not installed, only on the path: extras unknown"}
    needs: Dict[str, List[str]] = {name: [] for name in meta.get_all("Provides-Extra") or []}
    for requirement in meta.get_all("Requires-Dist") or []:
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if extra and extra.group(1) in needs:
            needs[extra.group(1)].append(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0])
    report = {}
    for name, dists in needs.items():
        missing = sorted({d for d in dists if not _installed(d)})
        report[name] = "yes" if not missing else f"no (missing: {', '.join(missing)})"
    return report


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def subpackages() -> Dict[str, str]:
    """Each public subpackage outside the backends (reported with their frameworks):
    ``imports``, or the error importing it raises."""
    report = {}
    for info in pkgutil.walk_packages(gradmgr.__path__, "gradmgr.", onerror=lambda _: None):
        name = info.name
        if not info.ispkg or name.startswith("gradmgr.backends") or "._" in name:
            continue
        report[name] = _import_problem(name) or "imports"
    return report


def _import_problem(name: str) -> Optional[str]:
    try:
        importlib.import_module(name)
    except Exception as error:  # a report, not a program: say what happened and go on
        return f"FAILS: {type(error).__name__}: {error}"
    return None


def backends() -> Dict[str, str]:
    """Each registered backend: its framework's version, and whether the backend imports,
    then what the backend reports of its environment."""
    report = {}
    for name in known_backends():
        report[f"{name} version"] = version_line(_distribution(name))
        try:
            backend = get_backend(name)
        except BackendNotFoundError as error:
            report[f"{name} backend"] = f"does not import: {error}"
            continue
        report[f"{name} backend"] = "imports"
        report.update(backend.environment())
    return report


def _distribution(module: str) -> str:
    """The distribution that installs the top-level module ``module``: ``module`` itself where
    one has its name, else the one that installs it (PaddlePaddle's), else ``module``."""
    if _installed(module):
        return module
    try:
        found = metadata.packages_distributions().get(module)  # Python 3.10 on
    except AttributeError:
        return module
    return found[0] if found else module


def sections() -> List[Tuple[str, Dict[str, str]]]:
    """The report, by section."""
    here = os.path.dirname(os.path.abspath(gradmgr.__file__))
    return [
        ("gradmgr", {"version": gradmgr.__version__, "location": here}),
        ("system", {"python": f"{platform.python_implementation()} {sys.version.split()[0]} "
                              f"({sys.executable})",
                    "platform": platform.platform()}),
        ("frameworks and backends",
         {**backends(), "lightning-fabric version": version_line("lightning-fabric")}),
        ("extras", extras()),
        ("subpackages", subpackages()),
    ]


def render(report: List[Tuple[str, Dict[str, str]]]) -> str:
    """The report as text, one ``label: value`` line each, under section headings."""
    width = max(len(label) for _, items in report for label in items)
    lines: List[str] = []
    for title, items in report:
        lines += [f"{title}:"] + [f"  {label:<{width}}  {value}" for label, value in items.items()]
    return "\n".join(lines)
