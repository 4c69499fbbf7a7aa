"""Checking what ``backward(y, dy)`` was given."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .backend import Backend
from .registry import backend_for, backend_of_output


def as_list(value: Any) -> List[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def check_outputs(y: Any, dy: Any,
                  backend: Optional[Backend]) -> Tuple[List[Any], List[Any], Optional[Backend]]:
    """``(ys, dys, backend)``: the outputs, their seeds (ones where ``dy`` is None) and their
    backend (``backend``, the manager's if known, or the outputs')."""
    ys = [y] if backend_of_output(y) is not None else as_list(y)  # (an output may be a tuple)
    if not ys:
        if dy is not None and as_list(dy):
            raise ValueError("dy was given but y is empty")
        return [], [], backend
    backend = _backend_of(ys, backend)
    if dy is None:
        if any(not backend.is_tensor(t) for t in ys):
            raise ValueError("a y that is not a tensor (a GradientEdge) needs its dy: "
                             "backward(edge, dy)")
        return ys, [backend.ones_like(t) for t in ys], backend
    dys = as_list(dy)
    if len(dys) != len(ys):
        raise ValueError(f"got {len(ys)} tensors as y but {len(dys)} as dy; give one dy per y")
    for i, (t, d) in enumerate(zip(ys, dys)):
        if backend_for(d) is not backend:
            raise TypeError(f"dy[{i}] must be a {backend.name} tensor, got {type(d).__name__}")
        problem = backend.seed_problem(t, d)
        if problem is not None:
            raise ValueError(f"dy[{i}] {problem} (y[{i}]); each dy must match its y")
    return ys, dys, backend


def _backend_of(ys: List[Any], backend: Optional[Backend]) -> Backend:
    """The backend of every output in ``ys`` (not empty), which must be ``backend`` if given."""
    for t in ys:
        found = backend_of_output(t)
        if found is None:
            raise TypeError(f"backward() expects tensors as y, got {type(t).__name__}")
        if backend is not None and found is not backend:
            raise TypeError(
                f"y is a {found.name} tensor but this manager holds {backend.name} tensors"
            )
        backend = found
    if backend is None:
        raise ValueError("backward(): no output to differentiate")
    return backend
