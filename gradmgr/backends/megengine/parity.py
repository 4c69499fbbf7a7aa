"""The parity tool's view of a ``megengine.module.Module`` (gradmgr.parity.contract)."""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Iterable, Tuple

import megengine as mge
import megengine.functional as F
import megengine.module as M
import numpy as np

from gradmgr.parity.contract import Post, Pre
from gradmgr.parity.modules import (
    NamedModules,
    as_tuple,
    hooked_too,
    nearest_kind,
    tied_names,
)

from .parity_functions import watch_functions


def _config(m: M.Module) -> Dict[str, Any]:
    """The configuration the parity check compares, in PyTorch's terms where they differ."""
    if isinstance(m, M.Conv2d):
        return {"in_channels": m.in_channels, "out_channels": m.out_channels,
                "kernel_size": as_tuple(m.kernel_size, 2), "stride": as_tuple(m.stride, 2),
                "padding": as_tuple(m.padding, 2), "dilation": as_tuple(m.dilation, 2),
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
        config = {"kernel_size": as_tuple(m.kernel_size, 2), "stride": as_tuple(m.stride, 2),
                  "padding": as_tuple(m.padding, 2)}
        if isinstance(m, M.AvgPool2d):
            config["count_include_pad"] = m.mode == "average"
        return config
    if isinstance(m, M.Dropout):
        return {"p": m.drop_prob}
    if isinstance(m, M.Embedding):  # MegEngine 1.13 refuses a padding_idx: every row trains
        return {"padding_idx": getattr(m, "padding_idx", None)}
    if isinstance(m, M.rnn.RNNBase):  # its tolerance's reduction (tolerance.py) reads them
        return {"input_size": m.input_size, "hidden_size": m.hidden_size,
                "num_layers": m.num_layers, "bidirectional": m.bidirectional}
    return {}


def _natural(pairs: Iterable[Tuple[str, Any]]) -> Dict[str, Any]:
    """``(name, value)`` pairs by name with numbers compared as numbers: MegEngine sorts its
    attribute names as strings, so an ``M.Sequential``'s ``10`` comes before its ``2``; in
    natural order a Sequential's layers (and ``layer1``..``layer12``) are in the order
    written, which the weight map falls back on without a probe."""
    def key(item: Tuple[str, Any]) -> tuple:
        return tuple(tuple((0, int(t), "") if t.isdigit() else (1, 0, t)
                           for t in re.split(r"(\d+)", part))
                     for part in item[0].split("."))
    return dict(sorted(pairs, key=key))


class _NothingSeen(set):
    """The ``seen`` of MegEngine's module walk that has seen nothing: its ``named_children``
    and ``named_parameters`` skip an object already listed under another name
    (``self.b = self.a``, ``self.w2 = self.w``). Both hand their keyword arguments to
    ``Module._flatten``, whose ``seen`` is that set (MegEngine 1.13's module.py, read: its
    only test is ``id(leaf) in seen``); tests/test_parity_tool.py's shared-layer and
    one-module tie tests fail if a MegEngine stops honouring it."""

    def __contains__(self, item: object) -> bool:
        return False


def _every_parameter(module: M.Module, prefix: str = "",
                     above: Tuple[int, ...] = ()) -> Iterable[Tuple[str, Any]]:
    """Every ``(name, parameter)`` of ``module``, a tied parameter under each of its names:
    MegEngine's ``named_parameters`` lists one once and has no option to list duplicates
    (torch's ``remove_duplicate=False``), so each module's own are listed without recursion
    (one under two attributes of one module under both) and its children (a shared one under
    each name) walked by hand (``above``: the modules on the path, against a cycle)."""
    above = above + (id(module),)
    for name, p in module.named_parameters(recursive=False, seen=_NothingSeen()):
        yield prefix + name, p
    for name, child in module.named_children(seen=_NothingSeen()):
        if id(child) not in above:
            yield from _every_parameter(child, f"{prefix}{name}.", above)


class MegEngineParity(NamedModules):
    """A ``megengine.module.Module`` for gradmgr.parity."""

    framework = "megengine"

    def __init__(self, model: Any) -> None:
        leaves = _natural((name, m) for name, m in model.named_modules()
                          if not any(True for _ in m.children())
                          or any(True for _ in m.parameters(recursive=False))
                          or any(True for _ in m.buffers(recursive=False)))
        params = _natural(model.named_parameters())
        # a tied parameter's other names (head.weight -> emb.weight)
        aliases = tied_names(params, _every_parameter(model))
        super().__init__(model, leaves, params, _natural(model.named_buffers()), aliases)
        if aliases:  # a layer shared under two names is listed once (keep_var: no copies)
            tied = set(aliases) | set(aliases.values())
            self.unlisted = sorted(tied - set(model.state_dict(keep_var=True)))

    def kind(self, module: Any) -> str:
        return nearest_kind(module, "megengine.module.")

    def config(self, module: Any) -> Dict[str, Any]:
        return _config(module)

    def hook(self, pre: Pre, post: Post) -> Callable[[], None]:
        """The leaf modules' hooks, and the functional calls that branch
        (:mod:`.parity_functions`)."""
        remove_modules = super().hook(pre, post)
        return hooked_too(remove_modules,
                          lambda: watch_functions(self.model, self.leaves, pre, post))

    def write(self, name: str, value: np.ndarray) -> None:
        target = self.slot(name)
        target._reset(mge.tensor(np.asarray(value, dtype=target.dtype), device=target.device))

    def tensor(self, array: np.ndarray) -> Any:
        return mge.tensor(np.ascontiguousarray(array), device=self.device)

    def numpy(self, tensor: Any) -> np.ndarray:
        return np.array(tensor.numpy())

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, mge.Tensor)

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


def load_state(path: str) -> Dict[str, np.ndarray]:
    """A ``megengine.save``'d state dict as numpy arrays (gradmgr.parity.checkpoint)."""
    state = mge.load(path, map_location="cpu0")
    if not isinstance(state, dict) or not all(isinstance(v, (np.ndarray, mge.Tensor))
                                              for v in state.values()):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict of arrays "
                         f"(megengine.save(module.state_dict(), path)); save the state dict "
                         f"alone")
    return {str(k): np.array(v.numpy() if isinstance(v, mge.Tensor) else v)
            for k, v in state.items()}


def save_state(values: Dict[str, np.ndarray], path: str) -> None:
    """``values`` as a state dict of numpy arrays (what ``Module.state_dict`` returns),
    written by ``megengine.save``."""
    mge.save({k: np.ascontiguousarray(v) for k, v in values.items()}, path)
