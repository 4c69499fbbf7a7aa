"""The functional calls the parity tool watches in a torch model's forward (``F.relu``,
``torch.max``, ``x > 0``...), seen through torch's own mechanism: a
``torch.overrides.TorchFunctionMode`` entered around the forward the tool runs.

Only the calls that branch are watched (their flips are what a module-only watch cannot pin),
and only where the model itself makes them: a call inside a watched leaf module (``nn.ReLU``
calls ``F.relu``) is that module's, and a call outside the model's forward (the loss) is not
the model's. Each watched call is a place of the forward named after the module whose forward
made it: ``layer1.0:relu()`` (the model's own forward: ``relu()``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from gradmgr.parity.contract import Layer, Post
from gradmgr.parity.modules import as_tuple

# What a watched call is compared as: ReLUs and max-pools are the kinds whose flips the tool
# pins (gradmgr/parity/kinks.py); the others are compared forward only.
RELU = ("relu", "relu_")
COMPARED = ("max", "min", "amax", "amin", "maximum", "minimum", "abs", "abs_", "where",
            "gt", "lt", "ge", "le", "eq", "ne", "greater", "less", "greater_equal",
            "less_equal", "clamp", "clamp_", "clip", "clamp_min", "clamp_max", "hardtanh")


def _kind(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
    """The kind a call of the function named ``name`` is watched as, or None."""
    if name in RELU:
        return "relu"
    if name == "max_pool2d":
        return "maxpool2d"
    if name in ("leaky_relu", "leaky_relu_"):
        return "leakyrelu"  # (a flip there is found, not pinned: kinks.py)
    if name in ("clamp", "clamp_", "clip", "clamp_min") and _is_relu_clamp(name, args, kwargs):
        return "relu"  # x.clamp(min=0) is a ReLU, flips and all
    return name.rstrip("_") if name in COMPARED else None


def _is_relu_clamp(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    low = kwargs.get("min", args[1] if len(args) > 1 else None)
    high = kwargs.get("max", args[2] if len(args) > 2 and name != "clamp_min" else None)
    return isinstance(low, (int, float)) and low == 0 and high is None


def _pool_config(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``F.max_pool2d``'s arguments as ``nn.MaxPool2d``'s configuration reads."""
    names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
    given = dict(zip(names, args[1:]))
    given.update({k: v for k, v in kwargs.items() if k in names})
    kernel = as_tuple(given.get("kernel_size"), 2)
    stride = given.get("stride") or kernel  # (None or () mean the kernel size)
    config: Dict[str, Any] = {"kernel_size": kernel, "stride": as_tuple(stride, 2),
              "padding": as_tuple(given.get("padding", 0), 2)}
    if as_tuple(given.get("dilation", 1), 2) != (1, 1) or given.get("ceil_mode"):
        config["dilation"] = as_tuple(given.get("dilation", 1), 2)
        config["ceil_mode"] = bool(given.get("ceil_mode"))
    return config


def _in_place(name: str, kwargs: Dict[str, Any]) -> bool:
    return name.endswith("_") or bool(kwargs.get("inplace"))


class _Watch(TorchFunctionMode):
    """Reports each watched call made by the model's own code to ``pre``/``post`` (the
    parity trace's), which may replace its input and its output (a pinned flip)."""

    def __init__(self, pre: Callable[..., Any], post: Post, stack: List[Tuple[str, bool]]):
        super().__init__()
        self.pre, self.post, self.stack = pre, post, stack

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        kind = _kind(name, args, kwargs) if self._watching(args) else None
        if kind is None:
            return func(*args, **kwargs)
        owner = self.stack[-1][0]
        place = f"{owner}:{name}()" if owner else f"{name}()"
        config = _pool_config(args, kwargs) if kind == "maxpool2d" else {}
        new = self.pre(place, tuple(args), Layer(place, kind, config))
        given = args
        if new is not None:
            args = tuple(new)
        out = func(*args, **kwargs)
        pinned = self.post(place, out)
        result = out if pinned is None else pinned
        if new is not None and _in_place(name, kwargs):  # the model may read its tensor
            return given[0].copy_(result)
        return result

    def _watching(self, args: Tuple[Any, ...]) -> bool:
        """Inside the model's forward, outside every leaf module, on a tensor."""
        return (bool(self.stack) and not self.stack[-1][1] and bool(args)
                and isinstance(args[0], torch.Tensor))


def watch_functions(model: torch.nn.Module, leaves: Dict[str, Any],
                    pre: Callable[..., Any], post: Post) -> Callable[[], None]:
    """Watch ``model``'s functional calls until the returned remover is called: every
    module's forward keeps a stack of where the model is, and the function mode reads it."""
    stack: List[Tuple[str, bool]] = []
    handles = []
    for name, module in model.named_modules():
        is_leaf = name in leaves
        handles.append(module.register_forward_pre_hook(
            lambda mod, inputs, name=name, is_leaf=is_leaf: stack.append((name, is_leaf))))
        handles.append(module.register_forward_hook(
            lambda mod, inputs, out: stack.pop() and None))
    mode = _Watch(pre, post, stack)
    mode.__enter__()

    def remove() -> None:
        try:
            mode.__exit__(None, None, None)
        finally:
            stack.clear()
            for handle in handles:
                handle.remove()
    return remove
