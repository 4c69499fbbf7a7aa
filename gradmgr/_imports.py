"""Running code right after a module is imported (or at once, if it already is): how gradmgr
reacts to a framework, or a part of one, that is imported later than gradmgr itself, without
importing it first."""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

_waiting: Dict[str, List[Callable[[], None]]] = {}
_lock = threading.Lock()


def call_after_import(module: str, fn: Callable[[], None]) -> None:
    """Call ``fn()`` now if ``module`` is imported, else right after its import finishes."""
    if module in sys.modules:
        fn()
        return
    with _lock:
        _waiting.setdefault(module, []).append(fn)
        if not any(isinstance(finder, _Watcher) for finder in sys.meta_path):
            sys.meta_path.insert(0, _Watcher())


def _run_waiting(module: str) -> None:
    with _lock:
        fns = _waiting.pop(module, [])
    for fn in fns:
        fn()


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for a watched module, wraps the loader the other finders give so
    that the waiting functions run once the module has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Optional[Any]:
        if name not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenRun(spec.loader, name)
                return spec
        return None


class _ThenRun(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _run_waiting(self._name)

    def __getattr__(self, name: str) -> Any:  # the rest of the loader's interface
        return getattr(self._loader, name)
