"""Watching a model's functional calls (``F.relu``, ``F.max_pool2d``...) in a framework that
has no function mode (MegEngine, Paddle): the watched functions' names are replaced while the
parity tool's forward runs, and the remover puts every name back, also after an error. This is
what MegEngine's own tracer (``megengine.traced_module``) does; torch's side uses a function
mode instead (gradmgr/backends/torch/parity_functions.py).

Replaced: the names in the framework's namespaces, in the globals of the model's own classes'
functions (a file's ``from megengine.functional import relu``) and of the functions those
globals hold, and in the model's module attributes holding one (``self.act = F.relu``). A
function bound anywhere else (a ``functools.partial``, a closure made before the step) is not
seen: its calls stay unwatched. What names a framework is given by each backend's
``parity_functions.py`` as a :class:`Functions`; this module imports no framework.
"""

from __future__ import annotations

import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Tuple

from .contract import Layer, Post
from .modules import as_tuple

Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]


def pool_config(args: Args, kwargs: Kwargs) -> Dict[str, Any]:
    """``F.max_pool2d(x, kernel_size, stride, padding)``'s arguments as the max-pool module's
    configuration reads (the backends' ``parity.py``)."""
    names = ("kernel_size", "stride", "padding")
    given = dict(zip(names, args[1:]))
    given.update({k: v for k, v in kwargs.items() if k in names})
    kernel = as_tuple(given.get("kernel_size"), 2)
    return {"kernel_size": kernel, "stride": as_tuple(given.get("stride") or kernel, 2),
            "padding": as_tuple(given.get("padding", 0), 2)}


@dataclass(frozen=True)
class Functions:
    """What one framework tells the watcher.

    ``package``: its top package (a call made from its own files is that function's: torch's
    side sees none inside its own functions either). ``kinds``: each watched name -> the kind
    torch's side gives the same call. ``namespaces``: the modules whose names are replaced;
    ``sources``: those whose functions are the watched ones. ``libraries``: the packages whose
    globals are never searched (none is a model's code). ``kind(name, args, kwargs)``: the kind
    of one call (``clip(x, 0)`` is a ReLU). ``named_modules(model)``: ``(name, module)`` for the
    model and each submodule. ``post_hook``: the name of the method registering a forward
    post-hook (the pre-hook's is ``register_forward_pre_hook`` on both)."""

    package: str
    kinds: Dict[str, str]
    namespaces: Tuple[Any, ...]
    sources: Tuple[Any, ...]
    libraries: Tuple[str, ...]
    is_tensor: Callable[[Any], bool]
    kind: Callable[[str, Args, Kwargs], str]
    named_modules: Callable[[Any], Iterable[Tuple[str, Any]]]
    post_hook: str
    pool_config: Callable[[Args, Kwargs], Dict[str, Any]] = pool_config


class _Watch:
    """Wraps each watched function: a call made by the model's own code, on this thread,
    outside every leaf module and every other watched call, goes to ``pre``/``post`` (the
    parity trace's), which may replace its input and its output (a pinned flip)."""

    def __init__(self, fw: Functions, pre: Callable[..., Any], post: Post,
                 stack: List[Tuple[str, bool]]):
        self.fw, self.pre, self.post, self.stack = fw, pre, post, stack
        self.thread, self.busy = threading.get_ident(), False

    def wrap(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not self._watching(args) or caller.split(".")[0] == self.fw.package:
                return func(*args, **kwargs)
            self.busy = True
            try:
                return self._call(name, func, args, kwargs)
            finally:
                self.busy = False
        watched.__wrapped__ = func  # type: ignore[attr-defined]
        return watched

    def _call(self, name: str, func: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        kind = self.fw.kind(name, args, kwargs)
        owner = self.stack[-1][0]
        place = f"{owner}:{name}()" if owner else f"{name}()"
        config = self.fw.pool_config(args, kwargs) if kind == "maxpool2d" else {}
        new = self.pre(place, tuple(args), Layer(place, kind, config))
        out = func(*(args if new is None else tuple(new)), **kwargs)
        pinned = self.post(place, out)
        return out if pinned is None else pinned

    def _watching(self, args: Args) -> bool:
        return (not self.busy and bool(self.stack) and not self.stack[-1][1] and bool(args)
                and self.fw.is_tensor(args[0]) and threading.get_ident() == self.thread)


def _originals(fw: Functions) -> Dict[int, str]:
    """The watched functions by identity: the one function under each of its names."""
    found = {}
    for space in fw.sources:
        found.update({id(getattr(space, name)): name for name in fw.kinds
                      if isinstance(getattr(space, name, None), types.FunctionType)})
    return found


def _model_globals(fw: Functions, model: Any) -> List[Dict[str, Any]]:
    """The globals of the model's own classes' functions, and of the functions and classes
    those globals hold (a helper module's ``act``): where ``from <framework> import relu``
    binds ``relu``. The libraries' own files are left alone."""
    seen: Dict[int, Dict[str, Any]] = {}
    classes = {type(m) for _, m in fw.named_modules(model)}
    functions = [f for cls in classes for klass in cls.__mro__
                 for f in _functions(fw, klass)]
    for depth in range(2):
        found = []
        for function in functions:
            space = function.__globals__
            if id(space) not in seen and not _library(fw, space.get("__name__", "")):
                seen[id(space)] = space
                found.append(space)
        functions = [f for space in found for value in list(space.values())
                     for f in _functions(fw, value)] if depth == 0 else []
    return list(seen.values())


def _functions(fw: Functions, value: Any) -> Iterable[types.FunctionType]:
    """The Python functions of a function or a class (its own methods)."""
    if isinstance(value, types.FunctionType):
        return [value]
    if isinstance(value, type) and not _library(fw, getattr(value, "__module__", "")):
        return [getattr(v, "__func__", v) for v in vars(value).values()
                if isinstance(getattr(v, "__func__", v), types.FunctionType)]
    return []


def _library(fw: Functions, module: str) -> bool:
    return module.split(".")[0] in fw.libraries


def watch_functions(fw: Functions, model: Any, leaves: Dict[str, Any],
                    pre: Callable[..., Any], post: Post) -> Callable[[], None]:
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
        modules = list(fw.named_modules(model))
        for name, module in modules:
            is_leaf = name in leaves
            handles.append(module.register_forward_pre_hook(
                lambda mod, inputs, name=name, is_leaf=is_leaf: stack.append((name, is_leaf))))
            handles.append(getattr(module, fw.post_hook)(
                lambda mod, inputs, out: stack.pop() and None))
        watch, originals = _Watch(fw, pre, post, stack), _originals(fw)
        spaces = [vars(space) for space in fw.namespaces] + _model_globals(fw, model)
        spaces += [vars(m) for _, m in modules]
        for space in spaces:
            for key, value in list(space.items()):
                if id(value) in originals and not key.startswith("__"):
                    replaced.append((space, key, value))
                    space[key] = watch.wrap(originals[id(value)], value)
    except BaseException:
        remove()
        raise
    return remove
