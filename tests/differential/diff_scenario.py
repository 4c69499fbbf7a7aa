"""Scenarios: several managers over one set of leaves, as a script of events.

Where :mod:`diff_program` makes one program recorded by one manager (or two in a fixed
pattern), a :class:`Scenario` is a flat script that several managers (2 or 3) act on in any
order: attaching the same tensors at different times (before a recording, inside their own or
another manager's recording, again with or without callbacks), recording alone, as a group
``m0 | m1`` or nested inside another recording, running part of the forward before any
``record()``, backwarding (also an attached tensor itself as ``y``), releasing or dropping a
recording manager without releasing it (``def h(): gm.record()``), and, between recordings,
freezing and unfreezing leaves (torch: ``requires_grad_``) and dropping ``.grad``.
Ops include custom autograd Functions (``fn_*``).

Values are numbered as in :mod:`diff_program`: leaves first, then one value per ``op`` event.
Leaf kinds: ``param`` (a ``torch.nn.Parameter`` / ``megengine.Parameter``), ``tensor`` (a plain
tensor that requires grad; on MegEngine a ``Tensor``), ``input`` (a plain tensor that does not
require grad: an input whose gradient is wanted), ``free`` (requires grad, never attached) and
``const`` (never attached, no gradient).

The script keeps what the engines need: no value is used after a backward that may have freed
its graph (a backward with no other manager recording, where gradmgr on torch does not retain
it); freezing happens only while nothing records. :mod:`diff_scenario_run` runs a scenario
through managers and holds the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

import numpy as np
from diff_program import (
    BINARY,
    INDEXING,
    REDUCE,
    UNARY,
    VIEWS,
    Callback,
    Op,
    Output,
    _draw_op,
    _State,
    callback_chains,
    op_shape,
)
from hypothesis import strategies as st

Shape = Tuple[int, ...]

SCENARIO_LEAF_KINDS = ("param", "tensor", "input", "free", "const")
ATTACHABLE = ("param", "tensor", "input")
BUILTIN_OPS = UNARY + BINARY + ("matmul",) + REDUCE + VIEWS + INDEXING
# Custom autograd Functions (torch.autograd.Function / megengine.autodiff.Function):
#   fn_scale  x * c, backward g * c          fn_ste   round(x), backward g (straight through)
#   fn_once   x * x, once_differentiable     fn_first / fn_second  output 0 / 1 of a Function
#   fn_mul    a * b, saves both inputs          with two outputs (exp(x), 3x), one unused
#   fn_nograd a + b, no gradient for b
CUSTOM_UNARY = ("fn_scale", "fn_ste", "fn_once", "fn_first", "fn_second")
CUSTOM_BINARY = ("fn_mul", "fn_nograd")
CUSTOM_OPS = CUSTOM_UNARY + CUSTOM_BINARY
CONSTANTS = (2.0, 0.5, -1.0, 3.0)


@dataclass(frozen=True)
class SLeaf:
    shape: Shape
    kind: str


@dataclass(frozen=True)
class Event:
    """``attach`` (manager, value, chain), ``freeze`` / ``unfreeze`` (value: a leaf),
    ``zero_grad`` (every leaf's ``.grad = None``), ``record`` (managers: one, or a group),
    ``op`` (op: its result is the next value), ``backward`` (manager, output), ``release``
    (manager), ``drop`` (manager: the recording manager is dropped, never released, and the
    garbage collector runs; the script never uses it again)."""

    kind: str
    manager: int = -1
    managers: Tuple[int, ...] = ()
    value: int = -1
    chain: Tuple[Callback, ...] = ()
    op: Optional[Op] = None
    output: Optional[Output] = None


@dataclass(frozen=True)
class Scenario:
    leaves: Tuple[SLeaf, ...]
    events: Tuple[Event, ...]
    n_managers: int
    seed: int = 0
    dtype: str = "float32"

    @property
    def n_leaves(self) -> int:
        return len(self.leaves)

    def shapes(self) -> List[Shape]:
        shapes = [leaf.shape for leaf in self.leaves]
        for ev in self.events:
            if ev.kind == "op":
                shapes.append(scenario_op_shape(ev.op, [shapes[a] for a in ev.op.args]))
        return shapes

    def leaf_data(self) -> List[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        return [(rng.standard_normal(leaf.shape) * 0.8).astype(self.dtype)
                for leaf in self.leaves]

    def dy_data(self, index: int, shapes: List[Shape]) -> List[np.ndarray]:
        """The seeds of the backward at event ``index`` (``loss_dy``: one 0-d seed)."""
        out = self.events[index].output
        rng = np.random.default_rng(self.seed * 1000 + index)
        if out.kind == "loss_dy":
            return [np.full((), rng.choice([0.5, -2.0, 3.0]), dtype=self.dtype)]
        return [rng.standard_normal(shapes[t]).astype(self.dtype) for t in out.terms]

    def backward_events(self) -> List[int]:
        return [i for i, ev in enumerate(self.events) if ev.kind == "backward"]

    def pretty(self) -> str:
        """A readable listing (hypothesis notes it when a test fails)."""
        shapes = self.shapes()
        lines = [f"# {self.dtype}, data seed {self.seed}, managers m0..m{self.n_managers - 1}"]
        lines += [f"v{v} = leaf{leaf.shape} {leaf.kind}" for v, leaf in enumerate(self.leaves)]
        vid = self.n_leaves
        for i, ev in enumerate(self.events):
            if ev.kind == "op":
                lines.append(f"{i:3}: {_op_text(ev.op, vid)} -> {shapes[vid]}")
                vid += 1
            else:
                lines.append(f"{i:3}: {_event_text(ev)}")
        return "\n".join(lines)


def _op_text(op: Op, vid: int) -> str:
    args = ", ".join(f"v{a}" for a in op.args)
    params = f" {op.params}" if op.params else ""
    return f"v{vid} = {op.name}({args}){params}"


def _event_text(ev: Event) -> str:
    m = f"m{ev.manager}"
    if ev.kind == "attach":
        chain = " -> ".join(cb.kind if cb.kind in ("identity", "clone") else f"{cb.kind}({cb.c})"
                            for cb in ev.chain)
        return f"{m}.attach(v{ev.value}{', callbacks: ' + chain if chain else ''})"
    if ev.kind in ("freeze", "unfreeze"):
        return f"v{ev.value}.requires_grad_({ev.kind == 'unfreeze'})"
    if ev.kind == "zero_grad":
        return "every leaf: .grad = None"
    if ev.kind == "record":
        return "record " + " | ".join(f"m{i}" for i in ev.managers)
    if ev.kind == "release":
        return f"{m}.release()"
    if ev.kind == "drop":
        return f"del {m} (still recording); gc.collect()"
    out = ev.output
    if out.kind.startswith("loss"):
        body = " + ".join(f"{r}(v{t})" for t, r in zip(out.terms, out.reductions))
        return f"{m}.backward({body}{', dy' if out.kind == 'loss_dy' else ''})"
    ys = ", ".join(f"v{t}" for t in out.terms)
    return f"{m}.backward({'[' + ys + ']' if out.kind == 'tensors' else ys}, random dy)"


def scenario_op_shape(op: Op, shapes: List[Shape]) -> Shape:
    if op.name in CUSTOM_OPS:
        return shapes[0]
    return op_shape(op, shapes)


# ------------------------------------------------------------------------------ strategy
@dataclass
class _Gen:
    """What the generator knows while it writes a script."""

    framework: str
    n_managers: int
    leaves: List[SLeaf]
    values: _State = field(default_factory=_State)
    ancestors: List[Set[int]] = field(default_factory=list)
    attached: List[Set[int]] = field(default_factory=list)  # per manager
    recording: List[int] = field(default_factory=list)  # in start order
    events: List[Event] = field(default_factory=list)
    dropped: Set[int] = field(default_factory=set)  # managers dropped while recording

    def usable(self) -> List[int]:
        return [m for m in range(self.n_managers) if m not in self.dropped]

    @property
    def torch(self) -> bool:
        return self.framework == "torch"

    def idle(self) -> List[int]:
        return [m for m in self.usable() if m not in self.recording]

    def live(self) -> List[int]:
        return self.values.live()

    def attachable(self) -> List[int]:
        """Leaves a manager may attach, and (inside a recording) live op results."""
        leaves = [v for v, leaf in enumerate(self.leaves) if leaf.kind in ATTACHABLE]
        if not self.recording:
            return leaves
        return leaves + [v for v in self.live() if v >= len(self.leaves)]


def _add_value(g: _Gen, shape: Shape, ancestors: Set[int]) -> None:
    g.values.add(shape, inplace_ok=False, attached=False, reach=False, graph=False)
    g.ancestors.append(ancestors | {len(g.ancestors)})


def _draw_custom(draw, g: _Gen, name: str) -> Optional[Op]:
    live = g.live()
    shapes = g.values.shapes
    a = draw(st.sampled_from(live))
    if name in CUSTOM_UNARY:
        params = (draw(st.sampled_from(CONSTANTS)),) if name == "fn_scale" else ()
        return Op(name, (a,), params)
    partners = [b for b in live if shapes[b] == shapes[a]]
    return Op(name, (a, draw(st.sampled_from(partners))))


def _draw_any_op(draw, g: _Gen) -> Optional[Op]:
    name = draw(st.sampled_from(BUILTIN_OPS + CUSTOM_OPS))
    if name in CUSTOM_OPS:
        return _draw_custom(draw, g, name)
    drawn = _draw_op(draw, name, g.values, g.framework, False, 0)
    return None if drawn is None else Op(name, *drawn)


def _op_event(draw, g: _Gen) -> None:
    for _ in range(4):
        op = _draw_any_op(draw, g)
        if op is None:
            continue
        shape = scenario_op_shape(op, [g.values.shapes[a] for a in op.args])
        if 0 in shape:
            continue
        _add_value(g, shape, set().union(*(g.ancestors[a] for a in op.args)))
        g.events.append(Event("op", op=op))
        return


def _attach_event(draw, g: _Gen, m: Optional[int] = None) -> None:
    # mostly a recording manager (the flags and snapshots live there), sometimes any
    managers = g.recording if g.recording and draw(st.integers(0, 3)) else g.usable()
    m = draw(st.sampled_from(list(managers))) if m is None else m
    # often a tensor another manager holds already (shared flags, hooks, snapshots)
    candidates = g.attachable()
    shared = [v for v in candidates if any(v in g.attached[o] for o in range(g.n_managers)
                                           if o != m)]
    v = draw(st.sampled_from(shared if shared and draw(st.booleans()) else candidates))
    chain = draw(callback_chains(g.framework, max_len=2)) if draw(st.integers(0, 2)) == 0 else ()
    g.attached[m].add(v)
    g.events.append(Event("attach", manager=m, value=v, chain=chain))


def _record_event(draw, g: _Gen) -> None:
    idle = g.idle()
    size = draw(st.integers(1, min(len(idle), 3)))
    ms = tuple(draw(st.permutations(idle))[:size])
    g.recording.extend(ms)
    g.events.append(Event("record", managers=ms))


def _draw_output(draw, g: _Gen, m: int) -> Output:
    live = g.live()
    useful = [v for v in live if g.ancestors[v] & g.attached[m]]
    # mostly the newest values; sometimes an attached tensor itself is an output
    pool = useful if useful and draw(st.integers(0, 5)) else live
    newest = sorted(pool, reverse=True)[:4]
    terms = draw(st.lists(st.sampled_from(newest), min_size=1, max_size=2, unique=True))
    kind = draw(st.sampled_from(("loss", "loss", "loss_dy", "tensors", "tensor")))
    if kind == "tensor":
        terms = terms[:1]
    reductions = tuple(draw(st.sampled_from(("sum", "mean"))) for _ in terms) \
        if kind.startswith("loss") else ()
    return Output(kind, tuple(terms), reductions)


def _backward_event(draw, g: _Gen, m: int) -> None:
    g.events.append(Event("backward", manager=m, output=_draw_output(draw, g, m)))
    alone = g.recording == [m]
    g.recording.remove(m)
    if alone:  # gradmgr on torch did not retain the graph: no value may be used again
        for v in range(len(g.leaves), len(g.values.shapes)):
            g.values.dead[v] = True


def _idle_action(draw, g: _Gen) -> None:
    actions = ["attach"] * 3 + ["record"] * 3 + ["op", "zero_grad"]
    if g.torch:
        actions += ["freeze", "unfreeze"]
    action = draw(st.sampled_from(actions))
    if action == "attach":
        _attach_event(draw, g)
    elif action == "record":
        _record_event(draw, g)
    elif action == "op":  # part of the forward before record()
        _op_event(draw, g)
    elif action == "zero_grad":
        g.events.append(Event("zero_grad"))
    else:
        leaves = [v for v, leaf in enumerate(g.leaves) if leaf.kind in ATTACHABLE]
        g.events.append(Event(action, value=draw(st.sampled_from(leaves))))


def _recording_action(draw, g: _Gen) -> None:
    actions = ["op"] * 5 + ["attach"] * 3 + ["backward"] * 2 + ["release"]
    if g.idle():
        actions.append("record")
    if any(m != 0 for m in g.recording):  # (manager 0 stays: _close may need it)
        actions.append("drop")
    action = draw(st.sampled_from(actions))
    if action == "op":
        _op_event(draw, g)
    elif action == "attach":
        _attach_event(draw, g)
    elif action == "record":  # nested (a manager or a group inside the recording)
        _record_event(draw, g)
    elif action == "backward":
        _backward_event(draw, g, draw(st.sampled_from(_holders(g) or g.recording)))
    elif action == "drop":
        m = draw(st.sampled_from([m for m in g.recording if m != 0]))
        g.recording.remove(m)
        g.dropped.add(m)
        g.events.append(Event("drop", manager=m))
    else:
        m = draw(st.sampled_from(g.recording))
        g.recording.remove(m)
        g.events.append(Event("release", manager=m))


def _holders(g: _Gen) -> List[int]:
    """The recording managers with something attached (a backward of the others is moot)."""
    return [m for m in g.recording if g.attached[m]]


def _close(draw, g: _Gen) -> None:
    """End every recording (mostly with a backward); a script without any backward gets one
    recording of a manager with an attached tensor."""
    while g.recording:
        m = draw(st.sampled_from(g.recording))
        if g.attached[m] and draw(st.integers(0, 4)):
            _backward_event(draw, g, m)
        else:
            g.recording.remove(m)
            g.events.append(Event("release", manager=m))
    if any(ev.kind == "backward" for ev in g.events):
        return
    v = next(v for v, leaf in enumerate(g.leaves) if leaf.kind in ATTACHABLE)
    g.attached[0].add(v)
    g.events += [Event("attach", manager=0, value=v), Event("record", managers=(0,))]
    g.recording.append(0)
    _op_event(draw, g)
    _backward_event(draw, g, 0)


@st.composite
def scenarios(draw, framework: str = "torch", max_events: int = 22,
              max_leaves: int = 4) -> Scenario:
    """A random scenario (see the module docstring). ``framework`` leaves out what the other
    framework lacks (freezing, float64 and torch-only callbacks are torch only)."""
    a, b, c = (draw(st.integers(1, 3)) for _ in range(3))
    pool = [(a,), (b,), (a, b), (b, c), (1, b), (), (a, b, c)]
    n_leaves = draw(st.integers(1, max_leaves))
    # inputs are where flags are shared: twice as likely as the other kinds
    kinds = [draw(st.sampled_from(ATTACHABLE + ("input",) if i == 0
                                  else SCENARIO_LEAF_KINDS + ("input",)))
             for i in range(n_leaves)]
    g = _Gen(framework, draw(st.integers(2, 3)),
             [SLeaf(draw(st.sampled_from(pool)), k) for k in kinds])
    g.attached = [set() for _ in range(g.n_managers)]
    for leaf in g.leaves:
        _add_value(g, leaf.shape, set())
    for m in range(g.n_managers):  # most managers hold a tensor from the start
        if draw(st.integers(0, 2)):
            _attach_event(draw, g, m)
    n_events = draw(st.integers(4, max_events))
    while len(g.events) < n_events:
        (_recording_action if g.recording else _idle_action)(draw, g)
    _close(draw, g)
    dtype = draw(st.sampled_from(("float32", "float64"))) if g.torch else "float32"
    return Scenario(tuple(g.leaves), tuple(g.events), g.n_managers,
                    seed=draw(st.integers(0, 2**16)), dtype=dtype)
