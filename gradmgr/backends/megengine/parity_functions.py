"""The functional calls the parity tool watches in a MegEngine model's forward (``F.relu``,
``F.max_pool2d``, ``F.maximum``...): the MegEngine side of
gradmgr/backends/torch/parity_functions.py, mapped to the same kinds.

MegEngine has no function mode. Its own tracer (``megengine.traced_module``) watches calls by
replacing the functions of ``megengine.functional``'s namespaces and of the globals that bound
them, and putting them back afterwards; this does the same for the calls that branch only,
and only while the tool's forward runs (the remover puts every name back, also after an
error). Replaced: the names in ``megengine.functional`` and its submodules, the globals of
the model's own classes' functions (a file's ``from megengine.functional import relu``) and of
the functions those globals hold, and the model's module attributes holding one
(``self.relu = F.relu``). A function bound anywhere else (a ``functools.partial``, a closure
over ``F.relu`` made before the step) is not seen: its calls stay unwatched.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any, Callable, Dict, Iterable, List, Tuple

import megengine.functional as F
from megengine import Tensor

from gradmgr.parity.contract import Layer, Post
from gradmgr.parity.modules import as_tuple

# MegEngine's name -> the kind torch's side gives the same call (its comparisons by torch's
# short names: ``x > 0`` is a ``gt`` there)
KINDS = {"relu": "relu", "leaky_relu": "leakyrelu", "max_pool2d": "maxpool2d",
         "maximum": "maximum", "minimum": "minimum", "max": "max", "min": "min",
         "abs": "abs", "where": "where", "clip": "clamp", "greater": "gt", "less": "lt",
         "greater_equal": "ge", "less_equal": "le", "equal": "eq", "not_equal": "ne"}
NAMESPACES = (F, F.nn, F.elemwise, F.math, F.tensor)
# the packages whose functions' globals are never searched: none of them is a model's code
LIBRARIES = ("megengine", "numpy", "torch", "gradmgr", "builtins", "typing", "functools")


def _kind(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    """The kind a call is watched as: ``F.maximum(x, 0)`` and ``F.clip(x, 0)`` are ReLUs,
    flips and all (torch's side reads ``x.clamp(min=0)`` so)."""
    second = kwargs.get("y", kwargs.get("lower", args[1] if len(args) > 1 else None))
    upper = kwargs.get("upper", args[2] if len(args) > 2 else None)
    if name in ("maximum", "clip") and _is_zero(second) and upper is None:
        return "relu"
    return KINDS[name]


def _is_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _pool_config(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``F.max_pool2d``'s arguments as ``M.MaxPool2d``'s configuration reads."""
    given = dict(zip(("kernel_size", "stride", "padding"), args[1:]))
    given.update({k: v for k, v in kwargs.items() if k in ("kernel_size", "stride", "padding")})
    kernel = as_tuple(given.get("kernel_size"), 2)
    return {"kernel_size": kernel, "stride": as_tuple(given.get("stride") or kernel, 2),
            "padding": as_tuple(given.get("padding", 0), 2)}


class _Watch:
    """Wraps each watched function: a call made by the model's own code, on this thread,
    outside every leaf module and every other watched call, goes to ``pre``/``post`` (the
    parity trace's), which may replace its input and its output (a pinned flip). A call
    MegEngine makes itself (``F.normalize`` calls ``F.abs`` and ``F.clip``) is that
    function's: torch's side sees none inside its own functions either."""

    def __init__(self, pre: Callable[..., Any], post: Post, stack: List[Tuple[str, bool]]):
        self.pre, self.post, self.stack = pre, post, stack
        self.thread, self.busy = threading.get_ident(), False

    def wrap(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not self._watching(args) or caller.split(".")[0] == "megengine":
                return func(*args, **kwargs)
            self.busy = True
            try:
                return self._call(name, func, args, kwargs)
            finally:
                self.busy = False
        watched.__wrapped__ = func  # type: ignore[attr-defined]
        return watched

    def _call(self, name: str, func: Callable[..., Any], args: Tuple[Any, ...],
              kwargs: Dict[str, Any]) -> Any:
        kind = _kind(name, args, kwargs)
        owner = self.stack[-1][0]
        place = f"{owner}:{name}()" if owner else f"{name}()"
        config = _pool_config(args, kwargs) if kind == "maxpool2d" else {}
        new = self.pre(place, tuple(args), Layer(place, kind, config))
        out = func(*(args if new is None else tuple(new)), **kwargs)
        pinned = self.post(place, out)
        return out if pinned is None else pinned

    def _watching(self, args: Tuple[Any, ...]) -> bool:
        return (not self.busy and bool(self.stack) and not self.stack[-1][1] and bool(args)
                and isinstance(args[0], Tensor) and threading.get_ident() == self.thread)


def _originals() -> Dict[int, str]:
    """The watched functions by identity: the one function under each of its names."""
    return {id(getattr(F, name)): name for name in KINDS if hasattr(F, name)}


def _model_globals(model: Any) -> List[Dict[str, Any]]:
    """The globals of the model's own classes' functions, and of the functions and classes
    those globals hold (a helper module's ``act``): where ``from megengine.functional import
    relu`` binds ``relu``. The library's own files are left alone."""
    seen: Dict[int, Dict[str, Any]] = {}
    classes = {type(m) for m in model.modules()}
    functions = [f for cls in classes for klass in cls.__mro__ for f in _functions(klass)]
    for depth in range(2):
        found = []
        for function in functions:
            space = function.__globals__
            if id(space) not in seen and not _library(space.get("__name__", "")):
                seen[id(space)] = space
                found.append(space)
        functions = [f for space in found for value in list(space.values())
                     for f in _functions(value)] if depth == 0 else []
    return list(seen.values())


def _functions(value: Any) -> Iterable[types.FunctionType]:
    """The Python functions of a function or a class (its own methods)."""
    if isinstance(value, types.FunctionType):
        return [value]
    if isinstance(value, type) and not _library(getattr(value, "__module__", "")):
        return [getattr(v, "__func__", v) for v in vars(value).values()
                if isinstance(getattr(v, "__func__", v), types.FunctionType)]
    return []


def _library(module: str) -> bool:
    return module.split(".")[0] in LIBRARIES


def watch_functions(model: Any, leaves: Dict[str, Any], pre: Callable[..., Any],
                    post: Post) -> Callable[[], None]:
    """Watch ``model``'s functional calls until the returned remover is called: every
    module's forward keeps a stack of where the model is, and the wrapped functions read it."""
    stack: List[Tuple[str, bool]] = []
    handles: List[Any] = []
    replaced: List[Tuple[Dict[str, Any], str, Any]] = []

    def remove() -> None:
        try:
            for space, key, original in reversed(replaced):
                space[key] = original
        finally:
            replaced.clear()
            stack.clear()
            for handle in handles:
                handle.remove()

    try:
        for name, module in model.named_modules():
            is_leaf = name in leaves
            handles.append(module.register_forward_pre_hook(
                lambda mod, inputs, name=name, is_leaf=is_leaf: stack.append((name, is_leaf))))
            handles.append(module.register_forward_hook(
                lambda mod, inputs, out: stack.pop() and None))
        watch, originals = _Watch(pre, post, stack), _originals()
        spaces = [vars(space) for space in NAMESPACES] + _model_globals(model)
        spaces += [vars(m) for m in model.modules()]
        for space in spaces:
            for key, value in list(space.items()):
                if id(value) in originals and not key.startswith("__"):
                    replaced.append((space, key, value))
                    space[key] = watch.wrap(originals[id(value)], value)
    except BaseException:
        remove()
        raise
    return remove
