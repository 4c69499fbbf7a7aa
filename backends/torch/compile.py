"""Keeping ``torch.compile`` out of gradmgr's own code.

A compiled function that records or backwards a manager (``with gm: ...`` inside it) would
have Dynamo trace gradmgr: thread-local state, weak references, thread identities, reference
counts and autograd nodes, which it cannot trace (it warns, breaks the graph, and once rewrote
the tape's weak references into the tensors themselves). So gradmgr's directories go on
Dynamo's skip list: Dynamo then runs gradmgr's frames as they are, at no cost outside
compilation (``torch.compiler.disable`` would cost every call a frame switch).

Dynamo is not imported with ``torch`` (importing it takes about a second), so where it is not
imported yet, the skip list is filled the moment it is.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Optional

_DYNAMO = "torch._dynamo"
_done = False


def keep_dynamo_out() -> None:
    """Put gradmgr on Dynamo's skip list now, or as soon as Dynamo is imported."""
    if _DYNAMO in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterDynamoImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())


def _register() -> None:
    global _done
    if _done:
        return
    _done = True
    try:
        from torch._dynamo import trace_rules
    except ImportError:  # a torch without Dynamo: nothing traces gradmgr
        return
    add = getattr(trace_rules, "add", None)  # torch >= 2.2
    if add is None:
        return
    for package in ("gradmgr", "gradmgr.backends"):  # backends/ may live outside gradmgr/
        add(package)


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when ``torch._dynamo`` is imported, wraps its loader so that the
    skip list is filled right after the module ran."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Optional[Any]:
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)  # once; and the search below must not find this finder
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfter(spec.loader)
                return spec
        return None


class _RegisterAfter(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name: str) -> Any:  # the rest of the loader's interface
        return getattr(self._loader, name)
