"""The functional calls the parity tool watches in a Paddle model's forward
(``F.relu``, ``F.max_pool2d``, ``paddle.maximum``...): the Paddle side of
gradmgr/backends/torch/parity_functions.py, mapped to the same kinds.

Paddle has no function mode either, so this does what the MegEngine side does
(gradmgr/backends/megengine/parity_functions.py): the functions that branch are replaced, only
while the tool's forward runs (the remover puts every name back, also after an error), in
``paddle``, ``paddle.nn.functional`` and ``paddle.tensor``, in the globals of the model's own
classes' functions (a file's ``from paddle.nn.functional import relu``) and of the functions
those globals hold, and in the model's layer attributes holding one (``self.act = F.relu``).
Not seen: a function bound anywhere else (a ``functools.partial``), a Tensor method
(``x.abs()``, ``x > 0``) and the in-place ``F.relu_`` (a replaced input would not be the
tensor the model reads afterwards): their calls stay unwatched.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any, Callable, Dict, Iterable, List, Tuple

import paddle
import paddle.nn.functional as F

from gradmgr.parity.contract import Layer, Post
from gradmgr.parity.modules import as_tuple

# Paddle's name -> the kind torch's side gives the same call (its comparisons by torch's
# short names: ``x > 0`` is a ``gt`` there)
KINDS = {"relu": "relu", "leaky_relu": "leakyrelu", "max_pool2d": "maxpool2d",
         "maximum": "maximum", "minimum": "minimum", "max": "max", "min": "min",
         "amax": "amax", "amin": "amin", "abs": "abs", "where": "where", "clip": "clamp",
         "hardtanh": "hardtanh", "greater_than": "gt", "less_than": "lt",
         "greater_equal": "ge", "less_equal": "le", "equal": "eq", "not_equal": "ne"}
NAMESPACES = (paddle, F, paddle.tensor)
# the packages whose functions' globals are never searched: none of them is a model's code
LIBRARIES = ("paddle", "numpy", "torch", "megengine", "gradmgr", "builtins", "typing",
             "functools")


def _kind(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    """The kind a call is watched as: ``paddle.clip(x, 0)`` is a ReLU, flips and all (torch's
    side reads ``x.clamp(min=0)`` so)."""
    low = kwargs.get("min", args[1] if len(args) > 1 else None)
    high = kwargs.get("max", args[2] if len(args) > 2 else None)
    if name == "clip" and isinstance(low, (int, float)) and not isinstance(low, bool) \
            and low == 0 and high is None:
        return "relu"
    return KINDS[name]


def _pool_config(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``F.max_pool2d``'s arguments as ``nn.MaxPool2D``'s configuration reads (parity.py)."""
    names = ("kernel_size", "stride", "padding")
    given = dict(zip(names, args[1:]))
    given.update({k: v for k, v in kwargs.items() if k in names})
    kernel = as_tuple(given.get("kernel_size"), 2)
    return {"kernel_size": kernel, "stride": as_tuple(given.get("stride") or kernel, 2),
            "padding": as_tuple(given.get("padding", 0), 2)}


class _Watch:
    """Wraps each watched function: a call made by the model's own code, on this thread,
    outside every leaf layer and every other watched call, goes to ``pre``/``post`` (the
    parity trace's), which may replace its input and its output (a pinned flip). A call
    Paddle makes itself is that function's: torch's side sees none inside its own functions
    either."""

    def __init__(self, pre: Callable[..., Any], post: Post, stack: List[Tuple[str, bool]]):
        self.pre, self.post, self.stack = pre, post, stack
        self.thread, self.busy = threading.get_ident(), False

    def wrap(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not self._watching(args) or caller.split(".")[0] == "paddle":
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
                and isinstance(args[0], paddle.Tensor)
                and threading.get_ident() == self.thread)


def _originals() -> Dict[int, str]:
    """The watched functions by identity: the one function under each of its names."""
    found = {}
    for space in NAMESPACES:
        found.update({id(getattr(space, name)): name for name in KINDS
                      if isinstance(getattr(space, name, None), types.FunctionType)})
    return found


def _model_globals(model: Any) -> List[Dict[str, Any]]:
    """The globals of the model's own classes' functions, and of the functions and classes
    those globals hold (a helper module's ``act``): where ``from paddle.nn.functional import
    relu`` binds ``relu``. The library's own files are left alone."""
    seen: Dict[int, Dict[str, Any]] = {}
    classes = {type(m) for m in model.sublayers(include_self=True)}
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
    layer's forward keeps a stack of where the model is, and the wrapped functions read it."""
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
        for name, layer in model.named_sublayers(include_self=True):
            is_leaf = name in leaves
            handles.append(layer.register_forward_pre_hook(
                lambda mod, inputs, name=name, is_leaf=is_leaf: stack.append((name, is_leaf))))
            handles.append(layer.register_forward_post_hook(
                lambda mod, inputs, out: stack.pop() and None))
        watch, originals = _Watch(pre, post, stack), _originals()
        spaces = [vars(space) for space in NAMESPACES] + _model_globals(model)
        spaces += [vars(m) for m in model.sublayers(include_self=True)]
        for space in spaces:
            for key, value in list(space.items()):
                if id(value) in originals and not key.startswith("__"):
                    replaced.append((space, key, value))
                    space[key] = watch.wrap(originals[id(value)], value)
    except BaseException:
        remove()
        raise
    return remove
