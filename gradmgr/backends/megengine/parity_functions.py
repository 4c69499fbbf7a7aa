"""The functional calls the parity tool watches in a MegEngine model's forward (``F.relu``,
``F.max_pool2d``, ``F.maximum``...): the MegEngine side of
gradmgr/backends/torch/parity_functions.py, mapped to the same kinds.

MegEngine has no function mode. Its own tracer (``megengine.traced_module``) watches calls by
replacing the functions of ``megengine.functional``'s namespaces and of the globals that bound
them, and putting them back afterwards; gradmgr/parity/function_watch.py does the same for the
calls that branch only, and only while the tool's forward runs. This names what it replaces:
the names in ``megengine.functional`` and its submodules, besides the model's own files and
module attributes (``self.relu = F.relu``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import megengine.functional as F
from megengine import Tensor

from gradmgr.parity import function_watch
from gradmgr.parity.contract import Post

# MegEngine's name -> the kind torch's side gives the same call (its comparisons by torch's
# short names: ``x > 0`` is a ``gt`` there)
KINDS = {"relu": "relu", "leaky_relu": "leakyrelu", "max_pool2d": "maxpool2d",
         "maximum": "maximum", "minimum": "minimum", "max": "max", "min": "min",
         "abs": "abs", "where": "where", "clip": "clamp", "greater": "gt", "less": "lt",
         "greater_equal": "ge", "less_equal": "le", "equal": "eq", "not_equal": "ne"}


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


MEGENGINE = function_watch.Functions(
    package="megengine", kinds=KINDS, namespaces=(F, F.nn, F.elemwise, F.math, F.tensor),
    sources=(F,),
    # the packages whose functions' globals are never searched: none of them is a model's code
    libraries=("megengine", "numpy", "torch", "gradmgr", "builtins", "typing", "functools"),
    is_tensor=lambda value: isinstance(value, Tensor), kind=_kind,
    named_modules=lambda model: model.named_modules(), post_hook="register_forward_hook")


def watch_functions(model: Any, leaves: Dict[str, Any], pre: Callable[..., Any],
                    post: Post) -> Callable[[], None]:
    """Watch ``model``'s functional calls until the returned remover is called."""
    return function_watch.watch_functions(MEGENGINE, model, leaves, pre, post)
