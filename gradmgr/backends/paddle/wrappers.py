"""Where a ``paddle.DataParallel`` (or a subclass) wraps a layer that ``data_parallel``
reduces: around it, running its forward, or inside it, around one of its sublayers.

Either way the wrapper's forward readies Paddle's own reducer (``prepare_for_backward``) for
a backward that gradmgr runs instead, with ``paddle.grad``, which never runs that reducer. A
parameter with a ``register_hook`` gets its gradient through its accumulation node once more
(leaf_hooks.py), which reports it to that reducer: left waiting for the others, the reducer
fails the next forward (``PreconditionNotMet``, measured on Paddle 3.3.1 for each place below),
so each is refused at once, with or without a hook. A wrapper once built stays hooked to the
parameters: dropped, its reducer crashed the next ``loss.backward()`` through them, and
gradmgr's backward where a parameter has a ``register_hook`` (a segmentation fault, measured
on 2 gloo ranks), hence the refusals' advice to build none rather than to drop one.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Optional, Set

import paddle

_STOP = (
    "readies Paddle's own reducer for the backward while gradmgr's data-parallel manager "
    "reduces the gradients itself: with a register_hook on a parameter, Paddle's reducer is "
    "left waiting and the next forward fails in it (PreconditionNotMet). "
)
_BUILD_NONE = (
    ". Build no paddle.DataParallel for the model or its layers rather than dropping one: a "
    "dropped wrapper leaves its reducer hooked to the parameters, and a later "
    "loss.backward(), or gradmgr's backward with a register_hook on a parameter, crashed the "
    "process in it (Paddle 3.3.1)"
)

DATA_PARALLEL_AROUND = (
    "data_parallel(): this layer's forward runs inside a paddle.DataParallel's forward, which "
    + _STOP + "Train without the paddle.DataParallel wrapper: data_parallel(model) does what "
    "it did (broadcast, gradient averaging, no_sync); call model(x) itself and "
    "gm.backward(loss) inside `with gm:`" + _BUILD_NONE
)

DATA_PARALLEL_WRAPPER = (
    "data_parallel() was given a paddle.DataParallel wrapper: Paddle's reducer reduces every "
    "gradient over the ranks, and gradmgr's manager would reduce it again. Pass the model "
    "itself (net._layers): data_parallel(model) does what paddle.DataParallel did; then call "
    "model(x) itself and gm.backward(loss) inside `with gm:`" + _BUILD_NONE
)

DATA_PARALLEL_INSIDE = (
    "{who} a paddle.DataParallel at sublayer {name!r}, whose forward " + _STOP + "Use the "
    "layer it wraps (its ._layers) there instead: data_parallel(model) averages every "
    "parameter's gradient over the ranks, that layer's too" + _BUILD_NONE
)

def _forward_codes() -> Set[int]:
    """The ids of the code of ``paddle.DataParallel.forward`` and of each subclass's own
    ``forward`` (a subclass defined since the last call included; through ``__wrapped__``, a
    decorated one's too, as ``functools.wraps`` leaves it): a wrapper's forward runs under one
    of them. Matching frames by code reads a frame's locals only where it matches
    (reading the ``self`` of every ``Layer.__call__`` frame instead cost about 1.3 µs a nested
    layer, one probe)."""
    codes, classes = set(), [paddle.DataParallel]
    while classes:
        cls = classes.pop()
        forward = cls.__dict__.get("forward")
        while forward is not None:  # a decorated forward: the decorator's and the one it wraps
            code = getattr(forward, "__code__", None)
            if code is not None:
                codes.add(id(code))
            forward = getattr(forward, "__wrapped__", None)
        classes.extend(cls.__subclasses__())
    return codes


def inside_data_parallel(layer: Any) -> bool:
    """A ``paddle.DataParallel`` around ``layer`` (or around a layer holding it) is running its
    forward. Paddle marks no running wrapper (torch's DDP does), so its frames on the stack
    tell; looked for once per forward of the watched layer, a walk of the stack's frames."""
    codes = _forward_codes()
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if id(frame.f_code) in codes:
            wrapper = frame.f_locals.get("self")
            if isinstance(wrapper, paddle.DataParallel) and any(
                    s is layer for s in wrapper._layers.sublayers(include_self=True)):
                return True
        frame = frame.f_back
    return False


def wrapped_sublayer(layer: Any) -> Optional[str]:
    """The name of a ``paddle.DataParallel`` among ``layer``'s sublayers (not ``layer``), as
    ``named_sublayers`` names it; None: none. A walk of the sublayers' dictionaries (at each
    forward until one finds none, see forwards.py): at 1,250 sublayers 0.3 to 0.5 ms, where
    ``isinstance`` over ``sublayers()`` took 0.75 to 1.2 ms and that model's forward (1,000
    tiny layers, CPU) 14 to 27 ms (probes on a loaded machine, not a benchmark).
    """
    stack = [("", layer)]
    seen = {id(layer)}
    while stack:
        prefix, parent = stack.pop()
        for name, sub in parent._sub_layers.items():
            if sub is None or id(sub) in seen:
                continue
            if isinstance(sub, paddle.DataParallel):
                return prefix + name
            seen.add(id(sub))
            if sub._sub_layers:  # most layers have none: no name built for them
                stack.append((prefix + name + ".", sub))
    return None


def forward_problem(layer: Any, walk: bool = True) -> Optional[str]:
    """Why a forward of ``layer`` with gradients enabled is refused under ``data_parallel``:
    a ``paddle.DataParallel`` around it, or (where ``walk``) inside it; None: neither."""
    if inside_data_parallel(layer):
        return DATA_PARALLEL_AROUND
    name = wrapped_sublayer(layer) if walk else None
    return None if name is None else DATA_PARALLEL_INSIDE.format(who="data_parallel(): this "
                                                                 "layer holds", name=name)


def given_problem(module: Any) -> Optional[str]:
    """Why ``data_parallel(module)`` refuses ``module``: a ``paddle.DataParallel``, or a layer
    holding one; None: neither."""
    if isinstance(module, paddle.DataParallel):
        return DATA_PARALLEL_WRAPPER
    name = wrapped_sublayer(module) if isinstance(module, paddle.nn.Layer) else None
    return None if name is None else DATA_PARALLEL_INSIDE.format(
        who="data_parallel() was given a layer that holds", name=name)
