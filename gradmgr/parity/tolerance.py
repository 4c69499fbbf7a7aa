"""How far apart two frameworks' float results may be: from the dtype and the reductions.

A float sum of ``K`` terms carries a rounding error of about ``eps * sqrt(K)`` times the size
of its terms when the errors are independent (each addition rounds by at most ``eps / 2``
relative, and independent errors add in quadrature); two frameworks that sum in different
orders (blocked GEMMs, different convolution algorithms, pairwise against sequential
reductions) therefore differ by that much, not by ``eps``. Errors made in earlier layers reach
later ones, so the reduction length behind an element is the sum of the reductions of every
layer it crossed:

    tol = C * eps(dtype) * sqrt(K) * scale

``scale`` is the largest magnitude of the compared tensor (so a relative error is measured
against the tensor, not against elements that cancel to nearly zero), ``K``:

* the forward output of layer ``L``: the sum of the reduction lengths of every layer called up
  to and including ``L`` (a Conv's fan-in ``C_in/groups * prod(kernel)``, a Linear's
  ``in_features``, a BatchNorm's ``N*H*W``, a LayerNorm's normalized size, an average
  pooling's window, a GRU's or LSTM's one time step through all its layers (below), 1 for
  elementwise layers);
* the loss: the whole forward's ``K`` plus the loss's own reduction (the output's size), its
  scale at least the mean magnitude of the output (a mean of outputs cancels);
* a parameter's gradient: the whole forward's ``K`` (the backward crosses every layer again,
  with reductions of the same lengths) plus the batch reduction of that gradient (the layer's
  output size over its output channels).

A GRU or LSTM counts the gate matmuls of one time step of each of its layers, ``sum over
layers of (layer input + hidden)`` (above a two-way layer, the input is ``2 * hidden``), not
of every step an output element depends on: between PyTorch and Paddle its output's
difference grew with the layers and little with the sequence (1.5-7.4 ``eps * scale`` over 5
to 1,280 steps; its ratio to that ``sqrt(K)`` at most 1.16, at 3 -> 4, and 0.35 from 32 ->
64 up: the recurrence damps older steps' rounding; ``bench/parity_tolerance_rnn.py``). Its
gradients need nothing more: their batch reduction already counts every time step.

``C`` (forward outputs) and ``C_GRAD`` (the loss, gradients) were measured (docs/porting.md,
"How tolerances are chosen"; ``bench/parity_tolerance.py``): the largest
``|a - b| / (eps * sqrt(K) * scale)`` seen between PyTorch and MegEngine float32 on
ResNet-18-sized layers and a wide MLP, times a safety factor.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Sequence

import numpy as np

C = 4.0
"""The constant of the formula for forward outputs (module docstring): 8x the largest
measured ratio (0.5, a convolution's output)."""

C_GRAD = 16.0
"""The constant for the loss and the gradients: about 3x the largest measured ratio (4.7, a
BatchNorm's gradient; the backward of a training-mode BatchNorm subtracts two means from the
upstream gradient, so its result is smaller than the terms whose rounding it carries)."""


def eps(dtype: Any) -> float:
    """Machine epsilon of a floating dtype (float32: 1.19e-7).

    Example:
        >>> from gradmgr.parity.tolerance import eps
        >>> eps("float32") == 2.0 ** -23
        True
    """
    with warnings.catch_warnings():  # numpy warns of a zero subnormal under flush-to-zero
        warnings.simplefilter("ignore")
        return float(np.finfo(np.dtype(dtype)).eps)


def tolerance(dtype: Any, reduction: float, scale: float, factor: float = 1.0,
              c: float = C) -> float:
    """``c * eps(dtype) * sqrt(reduction) * scale * factor``: the largest absolute difference
    accepted between two frameworks' values of a tensor whose largest magnitude is ``scale``
    and behind whose elements lie float sums of ``reduction`` terms in all.

    Example:
        >>> from gradmgr.parity.tolerance import tolerance
        >>> round(tolerance("float32", reduction=10_000, scale=1.0) / 2.0 ** -23)
        400
    """
    return c * eps(dtype) * math.sqrt(max(1.0, reduction)) * max(scale, 1e-30) * factor


def layer_reduction(kind: str, config: Dict[str, Any], in_shape: Sequence[int],
                    out_shape: Sequence[int]) -> int:
    """The reduction length of one layer's forward (its fan-in, or what a norm averages)."""
    if kind.startswith("conv"):
        return int(config.get("in_channels", 1) // max(1, config.get("groups", 1))
                   * np.prod(config.get("kernel_size", (1,))))
    if kind == "linear":
        return int(config.get("in_features", 1))
    if kind.startswith("batchnorm") and len(out_shape) >= 2:
        return int(np.prod(out_shape)) // max(1, int(out_shape[1]))
    if kind == "layernorm":
        return int(np.prod(config.get("normalized_shape", (1,))))
    if kind.startswith(("avgpool", "adaptiveavgpool")):
        return max(1, int(np.prod(in_shape)) // max(1, int(np.prod(out_shape))))
    if kind in RECURRENT:
        return recurrent_reduction(config, in_shape, out_shape)
    return 1


RECURRENT = ("gru", "lstm")
"""The recurrent kinds whose forward difference was measured (module docstring)."""


def recurrent_reduction(config: Dict[str, Any], in_shape: Sequence[int],
                        out_shape: Sequence[int]) -> int:
    """One time step of every layer of a GRU or LSTM: ``sum of (layer input + hidden)``.
    Without its configuration (a port's own class): one layer, the sizes from the shapes.

    Example:
        >>> from gradmgr.parity.tolerance import recurrent_reduction
        >>> recurrent_reduction({"input_size": 32, "hidden_size": 64, "num_layers": 2,
        ...                      "bidirectional": False}, (4, 20, 32), (4, 20, 64))
        224
    """
    inp = int(config.get("input_size", in_shape[-1] if len(in_shape) else 1))
    hidden = int(config.get("hidden_size", out_shape[-1] if len(out_shape) else 1))
    above = (2 if config.get("bidirectional") else 1) * hidden  # a deeper layer's input
    return inp + hidden + (int(config.get("num_layers", 1)) - 1) * (above + hidden)


def grad_reduction(param_shape: Sequence[int], out_shape: Sequence[int]) -> int:
    """The batch reduction behind a parameter's gradient: the layer's output elements per
    output channel (a Linear's batch, a Conv's batch times its output pixels)."""
    dims = [d for d in param_shape if d != 1] or [1]
    return max(1, int(np.prod(out_shape)) // max(1, int(dims[0])))
