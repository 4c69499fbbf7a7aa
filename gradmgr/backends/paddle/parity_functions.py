"""The functional calls the parity tool watches in a Paddle model's forward
(``F.relu``, ``F.max_pool2d``, ``paddle.maximum``...): the Paddle side of
gradmgr/backends/torch/parity_functions.py, mapped to the same kinds.

Paddle has no function mode either, so this does what the MegEngine side does, through
gradmgr/parity/function_watch.py: the functions that branch are replaced, only while the
tool's forward runs (the remover puts every name back, also after an error), in ``paddle``,
``paddle.nn.functional`` and ``paddle.tensor``, in the globals of the model's own classes'
functions (a file's ``from paddle.nn.functional import relu``) and of the functions those
globals hold, and in the model's layer attributes holding one (``self.act = F.relu``).
Not seen: a function bound anywhere else (a ``functools.partial``), a Tensor method
(``x.abs()``, ``x > 0``) and the in-place ``F.relu_`` (a replaced input would not be the
tensor the model reads afterwards): their calls stay unwatched.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import paddle
import paddle.nn.functional as F

from gradmgr.parity import function_watch
from gradmgr.parity.contract import Post

# Paddle's name -> the kind torch's side gives the same call (its comparisons by torch's
# short names: ``x > 0`` is a ``gt`` there)
KINDS = {"relu": "relu", "leaky_relu": "leakyrelu", "max_pool2d": "maxpool2d",
         "maximum": "maximum", "minimum": "minimum", "max": "max", "min": "min",
         "amax": "amax", "amin": "amin", "abs": "abs", "where": "where", "clip": "clamp",
         "hardtanh": "hardtanh", "greater_than": "gt", "less_than": "lt",
         "greater_equal": "ge", "less_equal": "le", "equal": "eq", "not_equal": "ne"}
NAMESPACES = (paddle, F, paddle.tensor)


def _kind(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    """The kind a call is watched as: ``paddle.clip(x, 0)`` is a ReLU, flips and all (torch's
    side reads ``x.clamp(min=0)`` so)."""
    low = kwargs.get("min", args[1] if len(args) > 1 else None)
    high = kwargs.get("max", args[2] if len(args) > 2 else None)
    if name == "clip" and isinstance(low, (int, float)) and not isinstance(low, bool) \
            and low == 0 and high is None:
        return "relu"
    return KINDS[name]


PADDLE = function_watch.Functions(
    package="paddle", kinds=KINDS, namespaces=NAMESPACES, sources=NAMESPACES,
    # the packages whose functions' globals are never searched: none of them is a model's code
    libraries=("paddle", "numpy", "torch", "megengine", "gradmgr", "builtins", "typing",
               "functools"),
    is_tensor=lambda value: isinstance(value, paddle.Tensor), kind=_kind,
    named_modules=lambda model: model.named_sublayers(include_self=True),
    post_hook="register_forward_post_hook")


def watch_functions(model: Any, leaves: Dict[str, Any], pre: Callable[..., Any],
                    post: Post) -> Callable[[], None]:
    """Watch ``model``'s functional calls until the returned remover is called."""
    return function_watch.watch_functions(PADDLE, model, leaves, pre, post)
