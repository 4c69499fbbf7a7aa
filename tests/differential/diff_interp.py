"""Builds a :class:`diff_program.Program` on one framework.

:class:`TorchEngine` and :class:`MgeEngine` are small op tables; :func:`build` runs a program's
ops on given leaves, calling ``on_attach(vid, tensor)`` right after each value that the program
attaches is created (and for late leaves before any op), and :func:`outputs` makes ``y`` and
``dy`` in the form ``backward()`` takes them. Both the gradmgr run and the reference run go
through these same functions, so both sides execute the same kernels on the same data.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import numpy as np
from diff_program import INPLACE, Leaf, Op, Program, segment_io

OnAttach = Callable[[int, Any], None]


class Engine:
    """The op table of one framework."""

    name: str

    def leaf(self, data: np.ndarray, leaf: Leaf, requires_grad: bool) -> Any:
        raise NotImplementedError

    def tensor(self, data: np.ndarray) -> Any:
        raise NotImplementedError

    def seed(self, data: np.ndarray, layout: str) -> Any:
        """A ``dy`` with the given values, laid out as asked where the framework can."""
        return self.tensor(data)

    def apply(self, op: Op, args: List[Any]) -> Any:
        raise NotImplementedError

    def reduce(self, kind: str, t: Any) -> Any:
        raise NotImplementedError

    def ones_like(self, t: Any) -> Any:
        raise NotImplementedError

    def numpy(self, t: Any) -> np.ndarray:
        raise NotImplementedError

    def grad(self, t: Any) -> Any:
        """The ``.grad`` object of ``t`` (None if unset)."""
        return t.grad

    def requires_grad(self, t: Any) -> bool:
        return True

    def scale(self, g: Any, c: float) -> Any:
        return g * c

    def clone(self, g: Any) -> Any:
        raise NotImplementedError

    def zeros_like(self, t: Any) -> Any:
        raise NotImplementedError


class TorchEngine(Engine):
    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def leaf(self, data, leaf, requires_grad):
        torch = self.torch
        if leaf.layout == "transposed":  # dense but not contiguous: strides (1, rows)
            t = torch.tensor(np.ascontiguousarray(data.T)).t().detach()
        elif leaf.layout == "strided":  # every second element of a larger buffer
            base = torch.zeros(data.shape[:-1] + (2 * data.shape[-1],), dtype=_dtype(data))
            base[..., ::2] = torch.tensor(data)
            t = base[..., ::2].detach()
        else:
            t = torch.tensor(data)
        return t.requires_grad_(requires_grad)

    def tensor(self, data):
        return self.torch.tensor(np.asarray(data))

    def seed(self, data, layout):
        if layout == "expanded" and data.ndim:  # every row equal: stride 0 on dim 0
            return self.torch.tensor(data[:1]).expand(data.shape)
        if layout == "transposed" and data.ndim == 2:
            return self.torch.tensor(np.ascontiguousarray(data.T)).t()
        return self.tensor(data)

    def index(self, values, shape=None):
        t = self.torch.tensor(np.asarray(values, dtype=np.int64))
        return t if shape is None else t.reshape(shape)

    def apply(self, op, args):
        torch, name, p = self.torch, op.name, op.params
        x = args[0]
        if name == "neg":
            return -x
        if name in ("exp", "sin", "tanh", "sigmoid", "relu"):
            return getattr(torch, name)(x)
        if name in _ARITHMETIC:
            return _ARITHMETIC[name](x, args, p)
        if name == "matmul":
            return x @ args[1]
        if name == "sum_all":
            return x.sum()
        if name == "mean_all":
            return x.mean()
        if name == "sum_axis":
            return x.sum(p[0], keepdim=p[1])
        if name == "mean_axis":
            return x.mean(p[0], keepdim=p[1])
        if name == "reshape":
            return x.reshape(p[0])
        if name == "transpose":
            return x.transpose(p[0], p[1])
        if name == "slice":
            return x[_slicer(p)]
        if name == "expand":
            return x.expand(p[0])
        if name == "index_select":
            return torch.index_select(x, p[0], self.index(p[1]))
        if name == "gather":
            return torch.gather(x, p[0], self.index(p[2], p[1]))
        if name == "add_const_":
            return x.add_(p[0])
        if name == "mul_const_":
            return x.mul_(p[0])
        if name == "add_":
            return x.add_(args[1])
        raise ValueError(name)

    def reduce(self, kind, t):
        return t.sum() if kind == "sum" else t.mean()

    def ones_like(self, t):
        return self.torch.ones_like(t)

    def numpy(self, t):
        return t.detach().cpu().numpy().copy()

    def grad(self, t):
        if t.is_leaf:
            return t.grad
        with warnings.catch_warnings():  # reading .grad of a non-leaf warns
            warnings.simplefilter("ignore")
            return t.grad

    def requires_grad(self, t):
        return t.requires_grad

    def clone(self, g):
        return g.clone()

    def zeros_like(self, t):
        return self.torch.zeros_like(t)


class MgeEngine(Engine):
    name = "megengine"

    def __init__(self) -> None:
        import megengine
        import megengine.functional as F

        self.mge = megengine
        self.F = F

    def leaf(self, data, leaf, requires_grad):
        cls = self.mge.Parameter if leaf.kind in ("param", "free") else self.mge.Tensor
        return cls(np.array(data, copy=True))  # (np.ascontiguousarray makes 0-d arrays 1-d)

    def tensor(self, data):
        return self.mge.Tensor(np.asarray(data))

    def index(self, values, shape=None):
        arr = np.asarray(values, dtype=np.int32)
        return self.mge.Tensor(arr if shape is None else arr.reshape(shape))

    def apply(self, op, args):
        F, name, p = self.F, op.name, op.params
        x = args[0]
        if name in ("neg", "exp", "sin", "tanh", "sigmoid", "relu"):
            return getattr(F, name)(x)
        if name in _ARITHMETIC:
            return _ARITHMETIC[name](x, args, p)
        if name == "matmul":
            return F.matmul(x, args[1])
        if name == "sum_all":
            return F.sum(x)
        if name == "mean_all":
            return F.mean(x)
        if name == "sum_axis":
            return F.sum(x, axis=p[0], keepdims=p[1])
        if name == "mean_axis":
            return F.mean(x, axis=p[0], keepdims=p[1])
        if name == "reshape":
            return F.reshape(x, p[0])
        if name == "transpose":
            perm = list(range(x.ndim))
            perm[p[0]], perm[p[1]] = perm[p[1]], perm[p[0]]
            return F.transpose(x, perm)
        if name == "slice":
            return x[_slicer(p)]
        if name == "expand":
            return F.broadcast_to(x, p[0])
        if name == "index_select":
            return x[(slice(None),) * p[0] + (self.index(p[1]),)]
        if name == "gather":
            return F.gather(x, p[0], self.index(p[2], p[1]))
        if name == "add_const_":
            x += p[0]
            return x
        if name == "mul_const_":
            x *= p[0]
            return x
        if name == "add_":
            x += args[1]
            return x
        raise ValueError(name)

    def reduce(self, kind, t):
        return self.F.sum(t) if kind == "sum" else self.F.mean(t)

    def ones_like(self, t):
        return self.F.ones_like(t)

    def numpy(self, t):
        return np.array(t.numpy(), copy=True)

    def clone(self, g):
        return self.F.copy(g)

    def zeros_like(self, t):
        return self.F.zeros_like(t)


# Ops written with Python operators, the same on both frameworks.
_ARITHMETIC = {
    "square": lambda x, args, p: x * x,
    "scale": lambda x, args, p: x * p[0],
    "shift": lambda x, args, p: x + p[0],
    "add": lambda x, args, p: x + args[1],
    "sub": lambda x, args, p: x - args[1],
    "mul": lambda x, args, p: x * args[1],
    "div": lambda x, args, p: x / (args[1] * args[1] + 1),
}


def _dtype(data: np.ndarray):
    import torch

    return {np.dtype("float32"): torch.float32, np.dtype("float64"): torch.float64}[data.dtype]


def _slicer(p) -> tuple:
    axis, start, stop, step = p
    return (slice(None),) * axis + (slice(start, stop, step),)


def make_engine(name: str) -> Engine:
    return TorchEngine() if name == "torch" else MgeEngine()


# --------------------------------------------------------------------------- building
def make_leaves(program: Program, eng: Engine, *, reference: bool) -> List[Any]:
    """Fresh leaves with the program's data. gradmgr's side gets ``requires_grad`` as the user
    would set it (``input`` leaves off: gradmgr turns them on); the reference turns it on for
    every leaf it differentiates."""
    wants = ("param", "free", "input") if reference else ("param", "free")
    return [eng.leaf(data, leaf, leaf.kind in wants)
            for data, leaf in zip(program.leaf_data(), program.leaves)]


@dataclass
class Built:
    values: List[Any]
    y: Any  # as passed to backward(): a tensor or a list
    dy: Any  # None (default ones), a tensor or a list
    ys: List[Any]  # always lists, for the reference
    dys: List[Any]


def build(
    program: Program,
    eng: Engine,
    leaves: List[Any],
    on_attach: Optional[OnAttach] = None,
    checkpoint: Optional[str] = None,
    on_made: Optional[OnAttach] = None,
) -> Built:
    """Run the program's ops on ``leaves`` and make its outputs.

    ``on_attach(vid, tensor)`` is called for late-attached leaves before any op and for every
    attached op result right after its op. ``checkpoint`` (torch): None runs the segment
    inline, ``"reentrant"`` / ``"non_reentrant"`` run it through ``torch.utils.checkpoint``.
    ``on_made(vid, tensor)`` is called for every op result once its hooks are registered.
    """
    values: List[Any] = list(leaves)
    if on_attach is not None:
        for vid in program.attached_leaves():
            if program.leaves[vid].late:
                on_attach(vid, values[vid])
    seg = program.segment if checkpoint else None
    i = 0
    while i < len(program.ops):
        if seg is not None and i == seg[0]:
            _run_checkpointed(program, eng, values, checkpoint)
            i = seg[1]
            continue
        _run_op(program, eng, values, i, on_attach, on_made)
        i += 1
    return outputs(program, eng, values)


def _run_op(program, eng, values, i, on_attach, on_made=None) -> None:
    op = program.ops[i]
    result = eng.apply(op, [values[a] for a in op.args])
    values.append(result)
    vid = program.vid_of_op(i)
    hook = program.hook_of(vid)
    if hook is not None and hook[1]:
        add_hook(result, hook[0])
    if op.attach and on_attach is not None:
        on_attach(vid, result)
    if hook is not None and not hook[1]:
        add_hook(result, hook[0])
    if on_made is not None:
        on_made(vid, result)


def add_hook(t: Any, factor: float) -> None:
    """A user's tensor hook (torch) that scales the gradient (skipped on a tensor that does not
    require grad, say one made from a frozen parameter: torch refuses a hook there)."""
    if t.requires_grad:
        t.register_hook(lambda g: g * factor)


def add_leaf_hooks(program: Program, leaves: List[Any], before: Optional[bool] = None) -> None:
    """The program's hooks on leaves: those registered before attach() (``before=True``),
    after it (``False``), or all (None)."""
    for vid, factor, first in program.hooks:
        if vid < program.n_leaves and before in (None, first):
            add_hook(leaves[vid], factor)


def _run_checkpointed(program: Program, eng: Engine, values: List[Any], mode: str) -> None:
    from torch.utils.checkpoint import checkpoint

    start, stop = program.segment
    ins, outs = segment_io(program)
    passed = [v for v in ins if v not in program.closure]
    snapshot = list(values)  # the closure sees these

    def segment(*args):
        local = list(snapshot)
        for v, t in zip(passed, args):
            local[v] = t
        for i in range(start, stop):
            _run_op(program, eng, local, i, None)
        return tuple(local[v] for v in outs)

    results = checkpoint(segment, *[values[v] for v in passed],
                         use_reentrant=(mode == "reentrant"))
    if not isinstance(results, tuple):
        results = (results,)
    # values made inside the segment but not used after it are never read: fill with None
    made = dict(zip(outs, results))
    for i in range(start, stop):
        values.append(made.get(program.vid_of_op(i)))


def outputs(program: Program, eng: Engine, values: List[Any]) -> Built:
    out = program.output
    dy_data = program.dy_data()
    if out.kind.startswith("loss"):
        loss = None
        for t, r in zip(out.terms, out.reductions):
            term = eng.reduce(r, values[t])
            loss = term if loss is None else loss + term
        if out.kind == "loss":
            return Built(values, loss, None, [loss], [eng.ones_like(loss)])
        dy = eng.tensor(dy_data[0])
        return Built(values, loss, dy, [loss], [dy])
    ys = [values[t] for t in out.terms]
    dys = [eng.seed(d, out.dy_layout) for d in dy_data]
    if out.kind == "tensor":
        return Built(values, ys[0], dys[0], ys, dys)
    return Built(values, ys, dys, ys, dys)


def is_inplace(op: Op) -> bool:
    return op.name in INPLACE
