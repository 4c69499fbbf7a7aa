"""The parity tool's view of a ``paddle.nn.Layer`` (gradmgr.parity.contract.ModelAdapter).

Paddle's conventions are translated into the contract's, and said where they show: a
``paddle.nn.Linear`` weight is stored ``[in, out]`` and seen ``[out, in]`` (its slot says
``transposed``: the weight map and checkpoint files name the translation); BatchNorm's
``momentum`` (the old statistic's weight, as MegEngine's) arrives as ``1 - momentum``; its
running statistics ``_mean`` and ``_variance`` (parameters Paddle never trains) are buffers
with the roles ``running_mean`` and ``running_var``; ``epsilon`` is ``eps``. What no
translation undoes is said in the weight map: Paddle updates its running variance with the
biased batch variance.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import paddle
from paddle import nn

from gradmgr.parity.contract import Post, Pre, Slot
from gradmgr.parity.modules import NamedModules, as_tuple, hooked_too, tied_names

from .parity_functions import watch_functions

# Paddle's names of BatchNorm's running statistics, and the contract's roles for them.
_STATS = {"_mean": "running_mean", "_variance": "running_var"}
_NORMS = (nn.layer.norm._BatchNormBase, nn.BatchNorm)
_RNNS = (nn.layer.rnn.RNNBase,)
# Measured (tests/test_parity_paddle.py): Paddle's kernel, not a setting; nothing translates it.
_BIASED = ("updated with the biased batch variance (divided by N; PyTorch and MegEngine divide "
           "by N - 1): the running variances part as training goes on")


def _config(m: Any) -> Dict[str, Any]:
    """The configuration the parity check compares, in PyTorch's terms where they differ."""
    if isinstance(m, nn.layer.conv._ConvNd):
        n = len(m._kernel_size)
        padding = m._padding if isinstance(m._padding, str) else as_tuple(m._padding, n)
        return {"in_channels": m._in_channels, "out_channels": m._out_channels,
                "kernel_size": as_tuple(m._kernel_size, n), "stride": as_tuple(m._stride, n),
                "padding": padding, "dilation": as_tuple(m._dilation, n),
                "groups": m._groups, "bias": m.bias is not None}
    if isinstance(m, nn.Linear):  # the weight is [in, out]
        return {"in_features": int(m.weight.shape[0]), "out_features": int(m.weight.shape[1]),
                "bias": m.bias is not None}
    if isinstance(m, _NORMS):
        # Paddle keeps the weight of the OLD running statistic: 0.9 there is 0.1 in torch
        return {"num_features": int(m._mean.shape[0]), "eps": m._epsilon,
                "momentum": 1.0 - m._momentum, "affine": m.weight is not None,
                "track_running_stats": getattr(m, "_use_global_stats", None) is None}
    if isinstance(m, nn.LayerNorm):
        return {"normalized_shape": tuple(m._normalized_shape), "eps": m._epsilon,
                "affine": m.weight is not None}
    if isinstance(m, nn.GroupNorm):
        return {"num_groups": m._num_groups, "eps": m._epsilon, "affine": m.weight is not None}
    if isinstance(m, (nn.MaxPool2D, nn.AvgPool2D)):
        stride = m.ksize if m.stride is None else m.stride  # None: the kernel, as torch's
        config: Dict[str, Any] = {"kernel_size": as_tuple(m.ksize, 2),
                                  "stride": as_tuple(stride, 2),
                                  "padding": as_tuple(m.padding, 2)}
        if isinstance(m, nn.AvgPool2D):
            config["count_include_pad"] = not m.exclusive
        return config
    if isinstance(m, nn.Dropout):
        return {"p": m.p}
    if isinstance(m, nn.Embedding):  # kept as given; its forward reads -1 as the last row
        pad = m._padding_idx
        return {"padding_idx": pad if pad is None or pad >= 0 else int(m.weight.shape[0]) + pad}
    if isinstance(m, _RNNS):  # its tolerance's reduction (tolerance.py) reads them
        return {"input_size": m.input_size, "hidden_size": m.hidden_size,
                "num_layers": m.num_layers, "bidirectional": m.num_directions == 2}
    return {}


def _kind(module: Any) -> str:
    """The lower-cased name of the nearest ``paddle.nn`` class (``BatchNorm2D`` ->
    ``batchnorm2d``, torch's name for it; ``Conv2DTranspose`` -> torch's ``convtranspose2d``),
    or of the module's own class."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("paddle.nn.") and cls.__name__ != "Layer":
            return re.sub(r"^conv(\dd)transpose$", r"convtranspose\1", cls.__name__.lower())
    return type(module).__name__.lower()


def _owns(m: Any) -> bool:
    return bool(m.parameters(include_sublayers=False) or m.buffers(include_sublayers=False))


class PaddleParity(NamedModules):
    """A ``paddle.nn.Layer`` for gradmgr.parity."""

    framework = "paddle"

    def __init__(self, model: Any) -> None:
        rnns = {name: m for name, m in model.named_sublayers(include_self=True)
                if isinstance(m, _RNNS)}
        # an RNN's cells hold its parameters again (its state dict lists both names) and are
        # not called: its kernel runs on the RNN's own (weight_ih_l0, as torch's GRU and LSTM)
        cells = {f"{name}.{sub}".lstrip(".") for name, m in rnns.items()
                 for sub, _ in m.named_sublayers()}
        leaves = {name: m for name, m in model.named_sublayers(include_self=True)
                  if (not list(m.children()) or _owns(m)) and name not in cells}
        stats = {f"{name}.{role}".lstrip(".") for name, m in leaves.items()
                 if isinstance(m, _NORMS) for role in _STATS}
        named = dict(model.named_parameters())
        params = {n: p for n, p in named.items() if n not in stats}
        buffers = {n: p for n, p in named.items() if n in stats}
        # not an RNN's _dropout_state: cuDNN's, no weight (empty on a CPU), no state dict's
        buffers.update({n: b for n, b in model.named_buffers()
                        if n.rpartition(".")[::2] not in {(r, "_dropout_state") for r in rnns}})
        # a tied parameter's other names (head.weight -> emb.weight); a statistic has none
        aliases = tied_names(params, model.named_parameters(remove_duplicate=False))
        super().__init__(model, leaves, params, buffers, aliases)
        # the cells' names: the map file's ties (each a name of the file), no slot of a layer
        self.in_cells = {n for n in aliases if n.rpartition(".")[0] in cells}
        self.place = next(iter(params.values())).place
        # Linear weights, stored [in, out]: read, written and differentiated as [out, in].
        # By name: a Linear's weight tied to an Embedding's ([vocab, dim]) is transposed as
        # the Linear's name, not as the Embedding's.
        self.transposed = {f"{name}.weight".lstrip(".") for name, m in leaves.items()
                           if isinstance(m, nn.Linear) and m.weight is not None}
        self.transposed |= {f"{other}.weight" for other, first in self.second.items()
                            if f"{first}.weight" in self.transposed}  # a shared Linear

    def kind(self, module: Any) -> str:
        return _kind(module)

    def config(self, module: Any) -> Dict[str, Any]:
        return _config(module)

    def slots(self) -> List[Slot]:
        found = []
        for slot in super().slots():
            if slot.name in self.in_cells:
                continue
            if slot.name in self.transposed:
                slot = Slot(slot.name, slot.layer, slot.role, tuple(reversed(slot.shape)),
                            slot.trainable, transposed=True)
            elif slot.name in self.buffers and slot.role in _STATS:
                slot = Slot(slot.name, slot.layer, _STATS[slot.role], slot.shape,
                            slot.trainable, note=_BIASED if slot.role == "_variance" else "")
            found.append(slot)
        return found

    def _layout(self, name: str, value: np.ndarray) -> np.ndarray:
        """``value`` between Paddle's layout and the contract's (a transpose is its own
        inverse)."""
        return np.ascontiguousarray(value.T) if name in self.transposed else value

    def read(self, name: str) -> np.ndarray:
        return self._layout(name, self.numpy(self.slot(name)))

    def write(self, name: str, value: np.ndarray) -> None:
        target = self.slot(name)
        array = self._layout(name, np.asarray(value))
        target.set_value(array.astype(target.numpy().dtype).reshape(target.shape))

    def grad(self, name: str) -> Optional[np.ndarray]:
        g = self.params[self.aliases.get(name, name)].grad
        return None if g is None else self._layout(name, self.numpy(g))

    def clear_grads(self) -> None:
        for p in self.params.values():
            p.clear_gradient(False)  # False: no .grad at all, not a zero one

    def hook(self, pre: Pre, post: Post) -> Callable[[], None]:
        """The leaf layers' hooks, and the functional calls that branch
        (:mod:`.parity_functions`)."""
        return hooked_too(self._hook_layers(pre, post),
                          lambda: watch_functions(self.model, self.leaves, pre, post))

    def _hook_layers(self, pre: Pre, post: Post) -> Callable[[], None]:
        handles = []
        for name, m in self.leaves.items():
            handles.append(m.register_forward_pre_hook(
                lambda mod, inputs, name=name: pre(name, inputs)))
            handles.append(m.register_forward_post_hook(
                lambda mod, inputs, out, name=name: post(name, out)))

        def remove() -> None:
            for handle in handles:
                handle.remove()
        return remove

    def tensor(self, array: np.ndarray) -> Any:
        array = np.ascontiguousarray(array)
        # float data in the model's float dtype, as the torch adapter does
        floats = [p.dtype for p in self.params.values() if paddle.is_floating_point(p)]
        tensor = paddle.to_tensor(array, place=self.place)
        if paddle.is_floating_point(tensor) and floats and tensor.dtype != floats[0]:
            tensor = tensor.astype(floats[0])
        return tensor

    def numpy(self, tensor: Any) -> np.ndarray:
        return np.array(tensor.numpy())

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, paddle.Tensor)

    def clone(self, tensor: Any) -> Any:
        return tensor.clone()

    def offset(self, x: Any, delta: np.ndarray) -> Any:
        return x + paddle.to_tensor(delta, dtype=x.dtype, place=x.place)

    def mask(self, x: Any, keep: np.ndarray) -> Any:
        return x * paddle.to_tensor(keep, dtype=x.dtype, place=x.place)

    def mean(self, tensor: Any) -> Any:
        return tensor.mean()

    def step(self, optimizer: Any) -> None:
        optimizer.step()
        optimizer.clear_grad(set_to_zero=False)


def load_state(path: str) -> Dict[str, np.ndarray]:
    """A ``paddle.save``'d state dict as numpy arrays, as stored (a Linear weight
    ``[in, out]``: the map file says where to transpose)."""
    state = paddle.load(path)
    if not isinstance(state, dict) or not all(isinstance(v, (np.ndarray, paddle.Tensor))
                                              for v in state.values()):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict of tensors "
                         f"(paddle.save(layer.state_dict(), path)); save the state dict alone")
    return {str(k): np.array(v.numpy() if isinstance(v, paddle.Tensor) else v)
            for k, v in state.items()}


def save_state(values: Dict[str, np.ndarray], path: str) -> None:
    """``values`` as a state dict of tensors (what ``Layer.state_dict`` returns), written by
    ``paddle.save``."""
    paddle.save({k: paddle.to_tensor(np.ascontiguousarray(v)) for k, v in values.items()},
                path)
