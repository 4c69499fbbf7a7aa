"""The progress bar of the parity tool's longer runs (``train_drift``, ``compare_step``,
``assert_parity``): tqdm on stderr, from the ``parity`` extra."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional

from ._extra import require


class _Quiet:
    """What a bar not drawn answers: counts nothing, shows nothing."""

    total = 0

    def update(self, n: int = 1) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def bar(total: int, progress: Optional[bool], desc: str, unit: str) -> Any:
    """A tqdm bar of ``total`` units on stderr when ``progress`` asks for one (None: when
    stderr is a terminal and tqdm is installed; True without tqdm: ImportError naming the
    extra), else one that shows nothing. Both are context managers with ``update()``, and a
    ``total`` that may grow (:func:`grow`)."""
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return _Quiet()
    if progress is None:
        try:
            tqdm = importlib.import_module("tqdm")
        except ImportError:
            return _Quiet()
    else:
        tqdm = require("tqdm", f"{desc}(progress=True)")
    return tqdm.tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)


def grow(shown: Any, more: int) -> None:
    """``more`` units of work found on the way (a pinned re-run)."""
    shown.total += more
    shown.refresh()
