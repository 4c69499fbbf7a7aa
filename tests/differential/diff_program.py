"""Random small programs for the differential tests: the data model and hypothesis strategies.

A :class:`Program` is a straight-line list of operations over a few leaves. It holds only plain
data (shapes, op names, constants, a data seed), so the very same program can be built on
PyTorch or MegEngine, once through gradmgr and once through the engine alone
(:mod:`diff_interp` builds it, :mod:`diff_reference` runs the references).

Values are numbered: leaves first (``v0`` .. ``v{L-1}``), then one value per op in order. Leaf
kinds:

* ``param``: requires grad, attached (leaf ``v0`` is always ``param`` or ``input``, so that
  every program has an attached tensor the output can reach);
* ``input``: ``requires_grad=False`` but attached (gradmgr turns the flag on while recording);
* ``free``: requires grad, *not* attached: its ``.grad`` must stay ``None``;
* ``const``: no gradient at all.

An op result may be attached right after it is created, inside the recording (S8), with its own
callback chain. In-place ops (``add_const_``, ``mul_const_``, ``add_``) only target non-leaf
values that nothing has used yet and whose producer does not save its output for backward
(otherwise autograd would refuse the program on both sides); the old value number is dead
afterwards. With ``inplace_attached`` the target may also be an attached intermediate (and one
follows every attach of a value that allows it): MegEngine's semantics (S8) say the gradient is
then the one of the *snapshot* taken at attach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from hypothesis import strategies as st

Shape = Tuple[int, ...]

LEAF_KINDS = ("param", "input", "free", "const")
ATTACHED_KINDS = ("param", "input")

UNARY = ("neg", "exp", "sin", "tanh", "sigmoid", "relu", "square", "scale", "shift")
BINARY = ("add", "sub", "mul", "div")
REDUCE = ("sum_all", "mean_all", "sum_axis", "mean_axis")
VIEWS = ("reshape", "transpose", "slice", "expand")
INDEXING = ("index_select", "gather")
INPLACE = ("add_const_", "mul_const_", "add_")
ALL_OPS = UNARY + BINARY + ("matmul",) + REDUCE + VIEWS + INDEXING + INPLACE

# Ops whose backward uses their own output: an in-place op on that output breaks autograd.
SAVES_OUTPUT = ("exp", "tanh", "sigmoid", "relu")

CALLBACK_KINDS = ("identity", "scale", "clone", "future_resolved", "future_lazy", "scale_t")
TORCH_ONLY_CALLBACKS = ("clone", "scale_t")
CONSTANTS = (2.0, 0.5, -1.0, 3.0, 0.1)


@dataclass(frozen=True)
class Leaf:
    shape: Shape
    kind: str
    layout: str = "contiguous"  # torch only: "transposed" (dense, not contiguous), "strided"
    late: bool = False  # attached inside the recording, before any use (instead of before)


@dataclass(frozen=True)
class Op:
    name: str
    args: Tuple[int, ...]
    params: Tuple = ()
    attach: bool = False


@dataclass(frozen=True)
class Output:
    """``loss``: sum of per-term reductions, default dy; ``loss_dy``: the same with an explicit
    0-d dy; ``tensors``: each term is a y with a random dy of its shape (lists);
    ``tensor``: one y and its dy passed as single tensors. ``odd_dy`` (MegEngine): each seed of
    a 0-d y has shape (1,) and vice versa, which MegEngine's native manager accepts."""

    kind: str
    terms: Tuple[int, ...]
    reductions: Tuple[str, ...] = ()
    odd_dy: bool = False  # MegEngine only: a dy of shape (1,) for a 0-d y and () for a (1,) y
    dy_layout: str = "contiguous"  # torch: "expanded" (stride 0 on dim 0), "transposed"


@dataclass(frozen=True)
class Callback:
    """One link of a callback chain: ``identity`` returns the gradient it got, ``scale``
    returns ``g * c``, ``clone`` a copy, ``future_resolved`` ``Future.resolved(g * c)``,
    ``future_lazy`` ``Future(lambda: g * c)``, ``scale_t`` (torch) ``g * c`` laid out
    transposed. Every link accepts a Future from the link before it (and then returns a lazy
    Future). ``keep`` (torch): whether the user's code keeps the argument and result objects,
    nothing (gradmgr may then store the result as ``.grad`` without a copy), or a view of the
    result (it may not)."""

    kind: str
    c: float = 1.0
    keep: str = "object"  # what user code keeps: "object", "none", "view" (of its result)


@dataclass(frozen=True)
class Program:
    leaves: Tuple[Leaf, ...]
    ops: Tuple[Op, ...]
    output: Output
    callbacks: Tuple[Tuple[int, Tuple[Callback, ...]], ...] = ()
    seed: int = 0
    dtype: str = "float32"
    # checkpointing (torch only): ops[start:stop] run inside torch.utils.checkpoint; the values
    # in ``closure`` are captured by the segment function instead of passed as arguments
    segment: Optional[Tuple[int, int]] = None
    closure: Tuple[int, ...] = ()
    # torch: user tensor hooks (vid, factor, registered before attach()) that scale the
    # gradient, and post-accumulate-grad hooks on every leaf that requires grad
    hooks: Tuple[Tuple[int, float, bool], ...] = ()
    post_hooks: bool = False
    split_attach: bool = False  # each chain attached in two attach() calls (S2: appended)

    # -- derived facts ------------------------------------------------------------------
    @property
    def n_leaves(self) -> int:
        return len(self.leaves)

    def vid_of_op(self, i: int) -> int:
        return self.n_leaves + i

    def chain(self, vid: int) -> Tuple[Callback, ...]:
        return dict(self.callbacks).get(vid, ())

    def attached_leaves(self) -> List[int]:
        return [i for i, leaf in enumerate(self.leaves) if leaf.kind in ATTACHED_KINDS]

    def attached_ops(self) -> List[int]:
        return [self.vid_of_op(i) for i, op in enumerate(self.ops) if op.attach]

    def attached(self) -> List[int]:
        """Attached value numbers in attach order: early leaves, late leaves, then op results."""
        leaves = self.attached_leaves()
        early = [v for v in leaves if not self.leaves[v].late]
        late = [v for v in leaves if self.leaves[v].late]
        return early + late + self.attached_ops()

    def shapes(self) -> List[Shape]:
        shapes = [leaf.shape for leaf in self.leaves]
        for op in self.ops:
            shapes.append(op_shape(op, [shapes[a] for a in op.args]))
        return shapes

    def leaf_data(self) -> List[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        return [(rng.standard_normal(leaf.shape) * 0.8).astype(self.dtype)
                for leaf in self.leaves]

    def dy_data(self) -> List[np.ndarray]:
        """One seed per output term (``loss_dy`` uses the first, as a 0-d array)."""
        rng = np.random.default_rng(self.seed + 1)
        shapes = self.shapes()
        odd = {(): (1,), (1,): ()} if self.output.odd_dy else {}
        if self.output.kind == "loss_dy":
            return [np.full(odd.get((), ()), rng.choice([0.5, -2.0, 3.0]), dtype=self.dtype)]
        dys = [rng.standard_normal(odd.get(shapes[t], shapes[t])).astype(self.dtype)
               for t in self.output.terms]
        if self.output.dy_layout == "expanded":  # equal rows: built as an expanded row
            dys = [np.broadcast_to(d[:1], d.shape).copy() if d.ndim else d for d in dys]
        return dys

    def pretty(self) -> str:
        """A readable listing (hypothesis notes it when a test fails)."""
        shapes = self.shapes()
        lines = [f"# {self.dtype}, data seed {self.seed}"]
        for v, leaf in enumerate(self.leaves):
            extra = [leaf.layout] if leaf.layout != "contiguous" else []
            extra += ["attached late"] if leaf.late else []
            lines.append(f"v{v} = leaf{leaf.shape} {leaf.kind} {' '.join(extra)}"
                         f"{_chain_text(self.chain(v))}".rstrip())
        for i, op in enumerate(self.ops):
            v = self.vid_of_op(i)
            args = ", ".join(f"v{a}" for a in op.args)
            params = f" {op.params}" if op.params else ""
            seg = ""
            if self.segment and self.segment[0] <= i < self.segment[1]:
                seg = "  [checkpointed]"
            attach = "  attach" if op.attach else ""
            lines.append(f"v{v} = {op.name}({args}){params} -> {shapes[v]}{attach}"
                         f"{_chain_text(self.chain(v))}{seg}")
        out = self.output
        if out.kind.startswith("loss"):
            body = " + ".join(f"{r}(v{t})" for t, r in zip(out.terms, out.reductions))
            lines.append(f"{out.kind}: {body}")
        else:
            lines.append(f"{out.kind}: y = {[f'v{t}' for t in out.terms]} with random dy")
        if out.odd_dy:
            lines.append("(dy of shape (1,) for a 0-d y and () for a (1,) y)")
        if out.dy_layout != "contiguous":
            lines.append(f"(dy laid out {out.dy_layout})")
        if self.closure:
            lines.append(f"checkpoint closure: {[f'v{v}' for v in self.closure]}")
        for v, factor, before in self.hooks:
            lines.append(f"v{v}.register_hook(lambda g: g * {factor}) "
                         f"{'before' if before else 'after'} attach()")
        if self.post_hooks:
            lines.append("post-accumulate-grad hooks on the leaves that require grad")
        if self.split_attach:
            lines.append("each callback chain attached in two attach() calls")
        return "\n".join(lines)

    def hook_of(self, vid: int) -> Optional[Tuple[float, bool]]:
        for v, factor, before in self.hooks:
            if v == vid:
                return factor, before
        return None


def _chain_text(chain: Sequence[Callback]) -> str:
    if not chain:
        return ""
    def text(cb):
        base = cb.kind if cb.kind in ("identity", "clone") else f"{cb.kind}({cb.c})"
        return base + ("" if cb.keep == "object" else f"[keeps {cb.keep}]")

    return "  callbacks: " + " -> ".join(text(cb) for cb in chain)


# ------------------------------------------------------------------------------ shapes
def broadcast(a: Shape, b: Shape) -> Optional[Shape]:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        return None


def op_shape(op: Op, shapes: Sequence[Shape]) -> Shape:
    name, p = op.name, op.params
    if name in UNARY or name in ("add_const_", "mul_const_", "add_"):
        return shapes[0]
    if name in BINARY:
        return broadcast(shapes[0], shapes[1])
    if name == "matmul":
        a, b = shapes
        return tuple(a[:-1]) + tuple(b[1:])
    if name in ("sum_all", "mean_all"):
        return ()
    if name in ("sum_axis", "mean_axis"):
        axis, keepdim = p
        s = list(shapes[0])
        if keepdim:
            s[axis] = 1
        else:
            del s[axis]
        return tuple(s)
    if name == "reshape":
        return tuple(p[0])
    if name == "transpose":
        i, j = p
        s = list(shapes[0])
        s[i], s[j] = s[j], s[i]
        return tuple(s)
    if name == "slice":
        axis, start, stop, step = p
        s = list(shapes[0])
        s[axis] = len(range(start, stop, step))
        return tuple(s)
    if name == "expand":
        return tuple(p[0])
    if name == "index_select":
        axis, idx = p
        s = list(shapes[0])
        s[axis] = len(idx)
        return tuple(s)
    if name == "gather":
        axis, idx_shape, _ = p
        return tuple(idx_shape)
    raise ValueError(name)


# ------------------------------------------------------------------------------ strategies
@dataclass
class _State:
    shapes: List[Shape] = field(default_factory=list)
    consumed: List[bool] = field(default_factory=list)
    dead: List[bool] = field(default_factory=list)
    inplace_ok: List[bool] = field(default_factory=list)
    attached: List[bool] = field(default_factory=list)
    reach: List[bool] = field(default_factory=list)  # depends on an attached tensor
    # depends on a tensor that requires grad when it is made (torch makes others leaves)
    graph: List[bool] = field(default_factory=list)
    leafy: List[bool] = field(default_factory=list)  # attached but made of constants only
    reach_op: List[bool] = field(default_factory=list)  # reach through at least one op
    in_segment: List[bool] = field(default_factory=list)

    def add(self, shape, *, inplace_ok, attached, reach, graph, leafy=False,
            in_segment=False):
        self.shapes.append(shape)
        self.graph.append(graph)
        self.leafy.append(leafy)
        self.reach_op.append(reach)
        self.consumed.append(False)
        self.dead.append(False)
        self.inplace_ok.append(inplace_ok)
        self.attached.append(attached)
        self.reach.append(reach or attached)
        self.in_segment.append(in_segment)

    def live(self) -> List[int]:
        return [v for v in range(len(self.shapes)) if not self.dead[v]]


def _numel(shape: Shape) -> int:
    return int(math.prod(shape))


def _reshapes(shape: Shape) -> List[Shape]:
    n = _numel(shape)
    options = {(n,), (1,) + tuple(shape)}
    for d in range(2, n):
        if n % d == 0:
            options.add((n // d, d))
    options.discard(tuple(shape))
    return sorted(options)


def _draw_op(draw, name: str, s: _State, framework: str, in_segment: bool,
             segment_start: int) -> Optional[Tuple[Tuple[int, ...], Tuple]]:
    live = s.live()
    ranked = {r: [v for v in live if len(s.shapes[v]) >= r] for r in (0, 1, 2)}
    sample = st.sampled_from
    if name in UNARY:
        v = draw(sample(live))
        params = (draw(sample(CONSTANTS)),) if name in ("scale", "shift") else ()
        return (v,), params
    if name in BINARY:
        a = draw(sample(live))
        partners = [w for w in live if broadcast(s.shapes[a], s.shapes[w]) is not None]
        if name == "div" and framework == "megengine":
            # MegEngine 1.13 aborts the process on some broadcasting divisions, e.g.
            # x[:, 3:4] / x for x of shape (4, 4, 2) ("only imp for nchw44/nchw88")
            partners = [w for w in partners if s.shapes[w] == s.shapes[a]]
        return (a, draw(sample(partners))), ()
    if name == "matmul":
        pairs = [(a, b) for a in live for b in live
                 if 1 <= len(s.shapes[a]) <= 2 and 1 <= len(s.shapes[b]) <= 2
                 and not (len(s.shapes[a]) == 1 and len(s.shapes[b]) == 1)
                 and s.shapes[a][-1] == s.shapes[b][0]]
        return (draw(sample(pairs)), ()) if pairs else None
    if name in ("sum_all", "mean_all"):
        return (draw(sample(live)),), ()
    if name in ("sum_axis", "mean_axis"):
        if not ranked[1]:
            return None
        v = draw(sample(ranked[1]))
        return (v,), (draw(st.integers(0, len(s.shapes[v]) - 1)), draw(st.booleans()))
    if name == "reshape":
        cands = [v for v in live if _reshapes(s.shapes[v])]
        if not cands:
            return None
        v = draw(sample(cands))
        return (v,), (draw(sample(_reshapes(s.shapes[v]))),)
    if name == "transpose":
        if not ranked[2]:
            return None
        v = draw(sample(ranked[2]))
        rank = len(s.shapes[v])
        i = draw(st.integers(0, rank - 2))
        return (v,), (i, draw(st.integers(i + 1, rank - 1)))
    if name == "slice":
        if not ranked[1]:
            return None
        v = draw(sample(ranked[1]))
        axis = draw(st.integers(0, len(s.shapes[v]) - 1))
        n = s.shapes[v][axis]
        start = draw(st.integers(0, n - 1))
        stop = draw(st.integers(start + 1, n))
        return (v,), (axis, start, stop, draw(st.sampled_from((1, 2))))
    if name == "expand":
        v = draw(sample(live))
        shape = s.shapes[v]
        options = [(r,) + tuple(shape) for r in (2, 3)] if len(shape) < 3 else []
        options += [shape[:i] + (r,) + shape[i + 1:] for i, d in enumerate(shape) if d == 1
                    for r in (2, 3)]
        return ((v,), (draw(sample(options)),)) if options else None
    if name == "index_select":
        if not ranked[1]:
            return None
        v = draw(sample(ranked[1]))
        axis = draw(st.integers(0, len(s.shapes[v]) - 1))
        n = s.shapes[v][axis]
        idx = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4))
        return (v,), (axis, tuple(idx))
    if name == "gather":
        if not ranked[1]:
            return None
        v = draw(sample(ranked[1]))
        shape = s.shapes[v]
        axis = draw(st.integers(0, len(shape) - 1))
        k = draw(st.integers(1, 4))
        idx_shape = shape[:axis] + (k,) + shape[axis + 1:]
        flat = draw(st.lists(st.integers(0, shape[axis] - 1), min_size=_numel(idx_shape),
                             max_size=_numel(idx_shape)))
        return (v,), (axis, idx_shape, tuple(flat))
    if name in INPLACE:
        # inside a checkpoint only values made there; after it, none made there
        targets = [v for v in live if s.inplace_ok[v] and not s.consumed[v]
                   and (v >= segment_start if in_segment else not s.in_segment[v])]
        if not targets:
            return None
        t = draw(sample(targets))
        if name == "add_":
            others = [w for w in live if w != t
                      and broadcast(s.shapes[t], s.shapes[w]) == s.shapes[t]]
            return ((t, draw(sample(others))), ()) if others else None
        return (t,), (draw(sample(CONSTANTS)),)
    raise ValueError(name)


@st.composite
def callback_chains(draw, framework: str = "torch", max_len: int = 3) -> Tuple[Callback, ...]:
    torch = framework == "torch"
    kinds = CALLBACK_KINDS if torch else tuple(
        k for k in CALLBACK_KINDS if k not in TORCH_ONLY_CALLBACKS)
    chain = draw(st.lists(st.sampled_from(kinds), max_size=max_len))
    return tuple(Callback(k, draw(st.sampled_from(CONSTANTS)) if k not in ("identity", "clone")
                          else 1.0,
                          draw(st.sampled_from(("object", "none", "view"))) if torch
                          else "object")
                 for k in chain)


@st.composite
def programs(
    draw,
    framework: str = "torch",
    max_leaves: int = 4,
    max_ops: int = 8,
    ops: Sequence[str] = ALL_OPS,
    callbacks: bool = True,
    output_kinds: Sequence[str] = ("loss", "loss", "loss_dy", "tensors", "tensor"),
    inplace_attached: bool = False,
    attach_ops: bool = True,
    leaf_kinds: Sequence[str] = LEAF_KINDS,
    force_leaf0_term: bool = False,
    checkpoint: bool = False,
    late_leaves: bool = True,
    hooks: bool = True,
) -> Program:
    """A random program. ``framework`` restricts what only one framework has (leaf layouts,
    float64, the ``clone`` callback, tensor hooks are torch only)."""
    torch = framework == "torch"
    a, b, c = (draw(st.integers(1, 4)) for _ in range(3))
    pool = [(a,), (b,), (a, b), (b, c), (b, a), (1, b), (a, 1), (), (a, b, c)]
    n_leaves = draw(st.integers(1, max_leaves))
    s = _State()
    leaves = []
    for i in range(n_leaves):
        shape = draw(st.sampled_from(pool))
        kind = draw(st.sampled_from(ATTACHED_KINDS if i == 0 else tuple(leaf_kinds)))
        layout = "contiguous"
        if torch and len(shape) >= 1:
            layouts = ("contiguous", "contiguous", "strided") + (
                ("transposed",) if len(shape) == 2 else ())
            layout = draw(st.sampled_from(layouts))
        late = late_leaves and kind in ATTACHED_KINDS and draw(st.integers(0, 5)) == 5
        leaves.append(Leaf(shape, kind, layout, late))
        s.add(shape, inplace_ok=False, attached=kind in ATTACHED_KINDS, reach=False,
              graph=kind != "const")

    n_ops = draw(st.integers(1 if not checkpoint else 2, max_ops))
    segment = None
    if checkpoint:
        start = draw(st.integers(0, n_ops - 1))
        stop = draw(st.integers(start + 1, n_ops))
        segment = (start, stop)
    op_list: List[Op] = []
    attempts = 0
    while len(op_list) < n_ops and attempts < 4 * n_ops:
        attempts += 1
        i = len(op_list)
        in_seg = segment is not None and segment[0] <= i < segment[1]
        seg_start_vid = n_leaves + (segment[0] if segment else 0)
        name = draw(st.sampled_from(tuple(ops)))
        drawn = _draw_op(draw, name, s, framework, in_seg, seg_start_vid)
        if drawn is None:
            continue
        args, params = drawn
        op = Op(name, args, params)
        shape = op_shape(op, [s.shapes[v] for v in args])
        if 0 in shape:
            continue
        target_attached = name in INPLACE and s.attached[args[0]]
        if name in INPLACE and s.leafy[args[0]]:
            continue  # an attached tensor made from constants only is a leaf on torch
        if target_attached and not inplace_attached:
            continue
        for v in args:
            s.consumed[v] = True
        if name in INPLACE:
            s.dead[args[0]] = True
            ok = s.inplace_ok[args[0]]
        else:
            ok = name not in SAVES_OUTPUT and name not in VIEWS
        reach = any(s.reach[v] for v in args)
        can_attach = attach_ops and not in_seg and not target_attached
        attach = can_attach and draw(st.integers(0, 1 if inplace_attached else 3)) >= 1 + \
            (0 if inplace_attached else 2)
        graph = any(s.graph[v] for v in args)
        leafy = (attach and not graph) or (name in INPLACE and s.leafy[args[0]])
        s.add(shape, inplace_ok=ok, attached=attach or target_attached, reach=reach,
              graph=graph or attach, leafy=leafy, in_segment=in_seg)
        op_list.append(Op(name, args, params, attach))
        if inplace_attached and attach and ok and not leafy and segment is None:
            # the case in point: an in-place op right on the attached tensor
            vid = len(s.shapes) - 1
            s.consumed[vid] = s.dead[vid] = True
            s.add(shape, inplace_ok=True, attached=True, reach=True, graph=True)
            op_list.append(Op(draw(st.sampled_from(("mul_const_", "add_const_"))), (vid,),
                              (draw(st.sampled_from(CONSTANTS)),)))
    n_ops = len(op_list)
    if segment is not None:
        segment = (min(segment[0], max(n_ops - 1, 0)), min(segment[1], n_ops))
        if segment[0] >= segment[1]:
            segment = None  # every op was drawn before the segment: nothing to checkpoint

    live = s.live()
    kind = draw(st.sampled_from(tuple(output_kinds)))
    # outputs are mostly values nothing used yet (the ends of the graph), latest first
    sinks = [v for v in reversed(live) if v >= n_leaves and not s.consumed[v]]
    order = sinks + [v for v in reversed(live) if v not in sinks]
    terms = draw(st.lists(st.sampled_from(order), min_size=1, max_size=3, unique=True))
    if not torch and not kind.startswith("loss") and (
            force_leaf0_term or not any(s.reach_op[v] for v in live)):
        kind = "loss"  # MegEngine gives no gradient to a y that is an attached tensor itself

    def reaches(t):
        return s.reach[t] if torch or kind.startswith("loss") else s.reach_op[t]

    if not any(reaches(t) for t in terms):
        terms.append(max(v for v in live if reaches(v)))
    if force_leaf0_term:  # first, so that a single-output kind keeps it
        terms = [0] + [t for t in terms if t != 0]
    if segment is not None:
        seg_vids = range(n_leaves + segment[0], n_leaves + segment[1])
        used = {a for op in op_list[segment[1]:] for a in op.args} | set(terms)
        if not used & set(seg_vids):
            terms.append(seg_vids[-1])  # a checkpoint whose result nobody uses is no test
    if kind == "tensor":
        terms = terms[:1] if reaches(terms[0]) else [t for t in terms if reaches(t)][:1]
    reductions = tuple(draw(st.sampled_from(("sum", "mean"))) for _ in terms) \
        if kind.startswith("loss") else ()
    odd_dy = not torch and kind != "loss" and draw(st.integers(0, 3)) == 3
    dy_layout = draw(st.sampled_from(("contiguous", "contiguous", "expanded", "transposed"))) \
        if torch and kind in ("tensor", "tensors") else "contiguous"
    output = Output(kind, tuple(terms), reductions, odd_dy, dy_layout)

    chains: List[Tuple[int, Tuple[Callback, ...]]] = []
    if callbacks:
        for v in range(len(s.shapes)):
            is_attached = (v < n_leaves and leaves[v].kind in ATTACHED_KINDS) or (
                v >= n_leaves and op_list[v - n_leaves].attach)
            if is_attached:
                chain = draw(callback_chains(framework))
                if chain:
                    chains.append((v, chain))

    closure: Tuple[int, ...] = ()
    if segment is not None:
        outside = {a for op in op_list[segment[0]:segment[1]] for a in op.args
                   if a < n_leaves + segment[0]}
        closure = tuple(sorted(v for v in outside if draw(st.booleans())))

    hook_specs: List[Tuple[int, float, bool]] = []
    post_hooks = False
    if torch and hooks:
        # a tensor hook needs a tensor that requires grad when it is registered
        # (not on a tensor an in-place op changes later: which version it hooks is moot)
        hookable = [v for v in range(n_leaves) if leaves[v].kind == "param"] + [
            n_leaves + i for i, op in enumerate(op_list)
            if op.attach and not s.leafy[n_leaves + i] and not s.dead[n_leaves + i]]
        for v in hookable:
            if draw(st.integers(0, 2)) == 2:
                hook_specs.append((v, draw(st.sampled_from((2.0, -1.0, 0.5))), draw(st.booleans())))
        post_hooks = draw(st.integers(0, 2)) == 2
    split = draw(st.integers(0, 3)) == 3

    dtype = draw(st.sampled_from(("float32", "float64"))) if torch else "float32"
    return Program(tuple(leaves), tuple(op_list), output, tuple(chains),
                   seed=draw(st.integers(0, 2**16)), dtype=dtype, segment=segment,
                   closure=closure, hooks=tuple(hook_specs), post_hooks=post_hooks,
                   split_attach=split)


def segment_io(program: Program) -> Tuple[List[int], List[int]]:
    """For a checkpointed program: the values the segment reads from outside (in order), and
    the values it makes that are used after it (its outputs)."""
    start, stop = program.segment
    lo, hi = program.n_leaves + start, program.n_leaves + stop
    ins: List[int] = []
    for op in program.ops[start:stop]:
        for a in op.args:
            if a < lo and a not in ins:
                ins.append(a)
    used_later = {a for op in program.ops[stop:] for a in op.args} | set(program.output.terms)
    outs = [v for v in range(lo, hi) if v in used_later]
    return ins, outs


def live_after_inplace(program: Program) -> Dict[int, int]:
    """Maps every value number overwritten by an in-place op to the number of its new version
    (the same tensor object)."""
    alias: Dict[int, int] = {}
    for i, op in enumerate(program.ops):
        if op.name in INPLACE:
            alias[op.args[0]] = program.vid_of_op(i)
    return alias


# ------------------------------------------------------------------------------ two managers
TWO_MANAGER_MODES = ("nested", "group", "same_y_inner_first", "same_y_outer_first")
PENALTIES = ("square", "tanh", "sin", "scale")


@dataclass(frozen=True)
class TwoManagers:
    """Two managers over one program (only leaves attached; each manager its own chains).

    * ``nested``: ``m1`` records, ``m2`` records inside it and backwards the program's output;
      ``m1`` then backwards ``sum(penalty(x.grad))`` over ``m2``'s tensors (plus ``sum(v_extra)``):
      second derivatives through ``m2``'s backward (a gradient penalty).
    * ``group``: ``with m1 | m2``; ``m1`` backwards the output, ``m2`` backwards
      ``sum(v_extra) + sum(penalty(x.grad))`` over ``m1``'s tensors: members do not see each
      other's backward, so that last sum is a constant for ``m2``.
    * ``same_y_inner_first`` / ``same_y_outer_first``: ``m2`` records inside ``m1``; both
      backward the same output, in that order; each gets its own result.
    """

    program: Program
    mode: str
    first: Tuple[Tuple[int, Tuple[Callback, ...]], ...]  # m1's tensors and chains
    second: Tuple[Tuple[int, Tuple[Callback, ...]], ...]  # m2's
    penalty: str = "square"
    extra: Optional[int] = None

    def pretty(self) -> str:
        def side(items):
            return ", ".join(f"v{v}{_chain_text(c)}" for v, c in items) or "nothing"

        return (f"{self.program.pretty()}\nmode {self.mode}: m1 attaches {side(self.first)}; "
                f"m2 attaches {side(self.second)}; penalty {self.penalty}, extra "
                f"{'none' if self.extra is None else f'v{self.extra}'}")


@st.composite
def two_manager_cases(draw, framework: str = "torch", modes: Sequence[str] = TWO_MANAGER_MODES,
                      **program_kwargs) -> TwoManagers:
    mode = draw(st.sampled_from(tuple(modes)))
    kinds = ("loss", "loss", "loss_dy", "tensors", "tensor")
    program = draw(programs(framework, callbacks=False, attach_ops=False, hooks=False,
                            output_kinds=kinds, force_leaf0_term=True, **program_kwargs))
    candidates = program.attached_leaves()
    chains = callback_chains(framework, max_len=2)

    def subset(min_size):
        vids = draw(st.lists(st.sampled_from(candidates), min_size=min_size,
                             max_size=len(candidates), unique=True))
        return tuple((v, draw(chains)) for v in sorted(vids))

    # the manager whose gradients the test is mostly about always attaches v0 (reached)
    first, second = subset(1), subset(1)
    if mode != "nested" and 0 not in dict(first):
        first = ((0, draw(chains)),) + first
    if 0 not in dict(second):
        second = ((0, draw(chains)),) + second
    n_values = program.n_leaves + len(program.ops)
    dead = set(live_after_inplace(program))
    extra_options = [v for v in range(n_values) if v not in dead]
    extra = draw(st.sampled_from(extra_options)) if mode == "group" else draw(
        st.none() | st.sampled_from(extra_options))
    return TwoManagers(program, mode, first, second, draw(st.sampled_from(PENALTIES)), extra)


def inplace_on_attached(program: Program) -> bool:
    """Some in-place op modifies a value after it was attached."""
    attached = set(program.attached())
    return any(op.name in INPLACE and op.args[0] in attached for op in program.ops)
