"""Command line shared by the framework-generic examples.

Each example defines one function per framework that prints what it shows and raises
``AssertionError`` when its numeric check fails; :func:`run` calls those whose framework is
installed and turns failures into a non-zero exit status.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from typing import Callable, Dict, Optional


def run(description: str, runners: Dict[str, Callable[[], None]],
        argv: Optional[list] = None) -> int:
    """Run ``runners[framework]()`` for the chosen framework(s); return the exit status.

    ``--framework all`` (the default) skips frameworks that are not installed; naming a missing
    framework explicitly is an error (status 2).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--framework", choices=[*runners, "all"], default="all")
    args = parser.parse_args(argv)
    names = list(runners) if args.framework == "all" else [args.framework]
    failures = ran = 0
    for name in names:
        if importlib.util.find_spec(name) is None:
            if args.framework != "all":
                print(f"{name} is not installed here", file=sys.stderr)
                return 2
            print(f"[{name}] skipped: not installed")
            continue
        print(f"[{name}]")
        ran += 1
        try:
            runners[name]()
        except AssertionError:
            traceback.print_exc()
            print(f"FAIL [{name}]", file=sys.stderr)
            failures += 1
    if not ran:
        print("no framework available", file=sys.stderr)
        return 2
    return 1 if failures else 0


def expect(condition: bool, message: str) -> None:
    """Raise AssertionError with ``message`` unless ``condition`` (unlike ``assert``, this also
    checks under ``python -O``)."""
    if not condition:
        raise AssertionError(message)


def assert_close(name: str, got, want, rtol: float = 1e-5, atol: float = 1e-6) -> float:
    """Assert two array-likes agree within ``atol + rtol*|want|``; print and return max |diff|."""
    import numpy as np

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} != reference shape {want.shape}")
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        raise AssertionError(f"{name}: max |diff| {diff:.3g} exceeds rtol={rtol}, atol={atol}")
    print(f"  check {name}: matches reference (max |diff| {diff:.2e}, rtol={rtol}, atol={atol})")
    return diff
