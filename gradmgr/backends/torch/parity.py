"""The parity tool's view of a ``torch.nn.Module`` (gradmgr.parity.contract.ModelAdapter)."""

from __future__ import annotations

from typing import Any, Callable, Dict

import numpy as np
import torch

from gradmgr.parity.contract import Post, Pre
from gradmgr.parity.errors import ParityError
from gradmgr.parity.modules import (
    NamedModules,
    as_tuple,
    hooked_too,
    nearest_kind,
    tied_names,
)

from .parity_functions import watch_functions


def _config(module: torch.nn.Module) -> Dict[str, Any]:
    """The configuration the parity check compares, in framework-neutral terms."""
    m = module
    if isinstance(m, torch.nn.modules.conv._ConvNd):
        n = len(m.kernel_size)
        padding = m.padding if not isinstance(m.padding, str) else m.padding
        return {"in_channels": m.in_channels, "out_channels": m.out_channels,
                "kernel_size": as_tuple(m.kernel_size, n), "stride": as_tuple(m.stride, n),
                "padding": as_tuple(padding, n) if not isinstance(padding, str) else padding,
                "dilation": as_tuple(m.dilation, n), "groups": m.groups,
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
        config: Dict[str, Any] = {
            "kernel_size": as_tuple(m.kernel_size, 2), "stride": as_tuple(m.stride, 2),
            "padding": as_tuple(m.padding, 2)}
        if isinstance(m, torch.nn.AvgPool2d):
            config["count_include_pad"] = m.count_include_pad
        return config
    if isinstance(m, torch.nn.Dropout):
        return {"p": m.p}
    if isinstance(m, torch.nn.Embedding):  # the padding row gets no gradient
        return {"padding_idx": m.padding_idx}
    if isinstance(m, torch.nn.RNNBase):  # its tolerance's reduction (tolerance.py) reads them
        return {"input_size": m.input_size, "hidden_size": m.hidden_size,
                "num_layers": m.num_layers, "bidirectional": m.bidirectional}
    return {}


class TorchParity(NamedModules):
    """A ``torch.nn.Module`` for gradmgr.parity."""

    framework = "torch"

    def __init__(self, model: Any) -> None:
        leaves = {name: m for name, m in model.named_modules()
                  if not any(True for _ in m.children())
                  or any(True for _ in m.parameters(recurse=False))
                  or any(True for _ in m.buffers(recurse=False))}
        params = dict(model.named_parameters())
        aliases = tied_names(params, model.named_parameters(remove_duplicate=False))
        super().__init__(model, leaves, params, dict(model.named_buffers()), aliases)

    def kind(self, module: Any) -> str:
        return nearest_kind(module, "torch.nn.")

    def config(self, module: Any) -> Dict[str, Any]:
        return _config(module)

    def hook(self, pre: Pre, post: Post) -> Callable[[], None]:
        """The leaf modules' hooks, and the functional calls that branch
        (:mod:`.parity_functions`)."""
        given: Dict[str, list] = {}  # an in-place module's input, where pre replaced it

        def pre_module(name: str, args: Any) -> Any:
            new = pre(name, args)
            if new is not None and getattr(self.leaves[name], "inplace", False):
                given.setdefault(name, []).append(args[0])
            return new

        def post_module(name: str, out: Any) -> Any:
            pinned = post(name, out)
            if not given.get(name):
                return pinned
            # the model may read the tensor it gave an in-place ReLU, not what it returned
            return given[name].pop().copy_(out if pinned is None else pinned)

        remove_modules = super().hook(pre_module, post_module)
        return hooked_too(remove_modules,
                          lambda: watch_functions(self.model, self.leaves, pre, post))

    def tap(self, x: Any, keep: Callable[[Any], None]) -> Any:
        """A copy of ``x`` whose gradient goes to ``keep``: only what the call given it sends
        back (a hook on ``x`` would see every use of ``x``)."""
        copy = x.clone()
        if not copy.requires_grad:  # (or inside a custom Function's forward: grad is off)
            return None
        copy.register_hook(lambda grad: keep(grad))
        return copy

    def write(self, name: str, value: np.ndarray) -> None:
        target = self.slot(name)
        with torch.no_grad():
            target.copy_(torch.as_tensor(np.asarray(value)).to(target.dtype))

    def tensor(self, array: np.ndarray) -> Any:
        tensor = torch.as_tensor(np.ascontiguousarray(array)).to(self.device)
        # float data in the model's float dtype (a float64 model fed the float32 batch its
        # float32 port takes), as MegEngine converts its own
        floats = [p.dtype for p in self.params.values() if p.is_floating_point()]
        if tensor.is_floating_point() and floats and tensor.dtype != floats[0]:
            tensor = tensor.to(floats[0])
        return tensor

    def numpy(self, tensor: Any) -> np.ndarray:
        if tensor.dtype == torch.bfloat16:  # (torch's .numpy() raises a bare TypeError)
            raise ParityError(
                f"the parity tool reads tensors as numpy arrays, and numpy has no bfloat16 "
                f"(a {tuple(tensor.shape)} tensor of the {type(self.model).__name__} model): "
                f"compare the models in float32 (model.float(), without autocast to bfloat16)")
        return tensor.detach().cpu().numpy().copy()

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

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


def load_state(path: str) -> Dict[str, np.ndarray]:
    """A ``torch.save``'d state dict as numpy arrays (gradmgr.parity.checkpoint); only
    tensors are read (``weights_only``: no code in the file runs)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict of tensors "
                         f"(torch.save(model.state_dict(), path)); save the state dict alone")
    return {str(k): v.detach().cpu().numpy().copy() for k, v in state.items()}


def save_state(values: Dict[str, np.ndarray], path: str) -> None:
    """``values`` as a state dict of tensors, written by ``torch.save``."""
    torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in values.items()}, path)
