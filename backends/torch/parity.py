"""The parity tool's view of a ``torch.nn.Module`` (gradmgr.parity.contract.ModelAdapter)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from gradmgr.parity.contract import Layer, Post, Pre, Slot


def _tuple(value: Any, n: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def _kind(module: Any) -> str:
    """The lower-cased name of the nearest torch.nn class: a port's subclass of a Linear with
    its own forward is still a ``linear``."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.nn.") and cls.__name__ != "Module":
            return cls.__name__.lower()
    return type(module).__name__.lower()


def _config(module: torch.nn.Module) -> Dict[str, Any]:
    """The configuration the parity check compares, in framework-neutral terms."""
    m = module
    if isinstance(m, torch.nn.modules.conv._ConvNd):
        n = len(m.kernel_size)
        padding = m.padding if not isinstance(m.padding, str) else m.padding
        return {"in_channels": m.in_channels, "out_channels": m.out_channels,
                "kernel_size": _tuple(m.kernel_size, n), "stride": _tuple(m.stride, n),
                "padding": _tuple(padding, n) if not isinstance(padding, str) else padding,
                "dilation": _tuple(m.dilation, n), "groups": m.groups,
                "bias": m.bias is not None}
    if isinstance(m, torch.nn.Linear):
        return {"in_features": m.in_features, "out_features": m.out_features,
                "bias": m.bias is not None}
    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
        return {"num_features": m.num_features, "eps": m.eps, "momentum": m.momentum,
                "affine": m.affine, "track_running_stats": m.track_running_stats}
    if isinstance(m, torch.nn.LayerNorm):
        return {"normalized_shape": tuple(m.normalized_shape), "eps": m.eps,
                "affine": m.elementwise_affine}
    if isinstance(m, torch.nn.GroupNorm):
        return {"num_groups": m.num_groups, "eps": m.eps, "affine": m.affine}
    if isinstance(m, (torch.nn.MaxPool2d, torch.nn.AvgPool2d)):
        config = {"kernel_size": _tuple(m.kernel_size, 2), "stride": _tuple(m.stride, 2),
                  "padding": _tuple(m.padding, 2)}
        if isinstance(m, torch.nn.AvgPool2d):
            config["count_include_pad"] = m.count_include_pad
        return config
    if isinstance(m, torch.nn.Dropout):
        return {"p": m.p}
    return {}


class TorchParity:
    """A ``torch.nn.Module`` for gradmgr.parity."""

    framework = "torch"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # the leaves, and every module that owns a tensor itself (an attention's in_proj_weight,
        # a model's position embedding): no tensor may belong to no layer
        self._leaves = {name: m for name, m in model.named_modules()
                        if not any(True for _ in m.children())
                        or any(True for _ in m.parameters(recurse=False))
                        or any(True for _ in m.buffers(recurse=False))}
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

    def _get(self, name: str) -> torch.Tensor:
        return self._params[name] if name in self._params else self._buffers[name]

    def read(self, name: str) -> np.ndarray:
        return self.numpy(self._get(name))

    def write(self, name: str, value: np.ndarray) -> None:
        target = self._get(name)
        with torch.no_grad():
            target.copy_(torch.as_tensor(np.asarray(value)).to(target.dtype))

    def parameters(self) -> List[Any]:
        return list(self._params.values())

    def grad(self, name: str) -> Optional[np.ndarray]:
        g = self._params[name].grad
        return None if g is None else self.numpy(g)

    def clear_grads(self) -> None:
        for p in self._params.values():
            p.grad = None

    def tensor(self, array: np.ndarray) -> Any:
        return torch.as_tensor(np.ascontiguousarray(array)).to(self._device)

    def numpy(self, tensor: Any) -> np.ndarray:
        return tensor.detach().cpu().numpy().copy()

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

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
        return tensor.clone()

    def offset(self, x: Any, delta: np.ndarray) -> Any:
        return x + torch.as_tensor(delta, dtype=x.dtype, device=x.device)

    def mask(self, x: Any, keep: np.ndarray) -> Any:
        return x * torch.as_tensor(keep, dtype=x.dtype, device=x.device)

    def mean(self, tensor: Any) -> Any:
        return tensor.mean()

    def step(self, optimizer: Any) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
