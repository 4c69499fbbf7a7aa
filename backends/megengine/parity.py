"""The parity tool's view of a ``megengine.module.Module`` (gradmgr.parity.contract)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import megengine as mge
import megengine.functional as F
import megengine.module as M
import numpy as np

from gradmgr.parity.contract import Layer, Post, Pre, Slot


def _tuple(value: Any, n: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def _kind(module: Any) -> str:
    """The lower-cased name of the nearest megengine.module class: a port's subclass of a
    Linear with its own forward is still a ``linear``."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("megengine.module.") and cls.__name__ != "Module":
            return cls.__name__.lower()
    return type(module).__name__.lower()


def _config(m: M.Module) -> Dict[str, Any]:
    """The configuration the parity check compares, in PyTorch's terms where they differ."""
    if isinstance(m, M.Conv2d):
        return {"in_channels": m.in_channels, "out_channels": m.out_channels,
                "kernel_size": _tuple(m.kernel_size, 2), "stride": _tuple(m.stride, 2),
                "padding": _tuple(m.padding, 2), "dilation": _tuple(m.dilation, 2),
                "groups": m.groups, "bias": m.bias is not None}
    if isinstance(m, M.Linear):
        return {"in_features": m.in_features, "out_features": m.out_features,
                "bias": m.bias is not None}
    if isinstance(m, (M.BatchNorm1d, M.BatchNorm2d)):
        # MegEngine keeps the weight of the OLD running statistic: 0.9 there is 0.1 in torch
        return {"num_features": m.num_features, "eps": m.eps, "momentum": 1.0 - m.momentum,
                "affine": m.affine, "track_running_stats": m.track_running_stats}
    if isinstance(m, M.LayerNorm):
        return {"normalized_shape": tuple(m.normalized_shape), "eps": m.eps,
                "affine": m.affine}
    if isinstance(m, M.GroupNorm):
        return {"num_groups": m.num_groups, "eps": m.eps, "affine": m.affine}
    if isinstance(m, (M.MaxPool2d, M.AvgPool2d)):
        config = {"kernel_size": _tuple(m.kernel_size, 2), "stride": _tuple(m.stride, 2),
                  "padding": _tuple(m.padding, 2)}
        if isinstance(m, M.AvgPool2d):
            config["count_include_pad"] = m.mode == "average"
        return config
    if isinstance(m, M.Dropout):
        return {"p": m.drop_prob}
    return {}


class MegEngineParity:
    """A ``megengine.module.Module`` for gradmgr.parity."""

    framework = "megengine"

    def __init__(self, model: M.Module) -> None:
        self.model = model
        # the leaves, and every module that owns a tensor itself (a model's position
        # embedding): no tensor may belong to no layer
        self._leaves = {name: m for name, m in model.named_modules()
                        if not any(True for _ in m.children())
                        or any(True for _ in m.parameters(recursive=False))
                        or any(True for _ in m.buffers(recursive=False))}
        self._params = dict(model.named_parameters())
        self._buffers = dict(model.named_buffers())
        self._device = next(iter(self._params.values())).device

    def layers(self) -> List[Layer]:
        return [Layer(name, _kind(m), _config(m))
                for name, m in self._leaves.items()]

    def slots(self) -> List[Slot]:
        found = []
        for table, trainable in ((self._params, True), (self._buffers, False)):
            for name, t in table.items():
                layer, _, role = name.rpartition(".")
                found.append(Slot(name, layer, role, tuple(t.shape), trainable))
        return found

    def _get(self, name: str) -> mge.Tensor:
        return self._params[name] if name in self._params else self._buffers[name]

    def read(self, name: str) -> np.ndarray:
        return self.numpy(self._get(name))

    def write(self, name: str, value: np.ndarray) -> None:
        target = self._get(name)
        target._reset(mge.tensor(np.asarray(value, dtype=target.dtype), device=target.device))

    def parameters(self) -> List[Any]:
        return list(self._params.values())

    def grad(self, name: str) -> Optional[np.ndarray]:
        g = self._params[name].grad
        return None if g is None else self.numpy(g)

    def clear_grads(self) -> None:
        for p in self._params.values():
            p.grad = None

    def tensor(self, array: np.ndarray) -> Any:
        return mge.tensor(np.ascontiguousarray(array), device=self._device)

    def numpy(self, tensor: Any) -> np.ndarray:
        return np.array(tensor.numpy())

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, mge.Tensor)

    def hook(self, pre: Pre, post: Post) -> Callable[[], None]:
        handles = []
        for name, m in self._leaves.items():
            handles.append(m.register_forward_pre_hook(
                lambda mod, inputs, name=name: pre(name, inputs)))
            handles.append(m.register_forward_hook(
                lambda mod, inputs, out, name=name: post(name, out)))

        def remove() -> None:
            for handle in handles:
                handle.remove()
        return remove

    def clone(self, tensor: Any) -> Any:
        return F.copy(tensor)

    def offset(self, x: Any, delta: np.ndarray) -> Any:
        return x + mge.tensor(delta.astype(np.float32), device=x.device)

    def mask(self, x: Any, keep: np.ndarray) -> Any:
        return x * mge.tensor(keep.astype(np.float32), device=x.device)

    def mean(self, tensor: Any) -> Any:
        return tensor.mean()

    def step(self, optimizer: Any) -> None:
        optimizer.step()
        optimizer.clear_grad()
