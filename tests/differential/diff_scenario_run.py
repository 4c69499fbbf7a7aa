"""Running a :class:`diff_scenario.Scenario`: through managers, and the torch reference.

:func:`run_scenario` drives any manager with MegEngine's API (gradmgr on torch or MegEngine
tensors, MegEngine's native ``GradManager``) through a scenario's events. After every backward
it records the ``.grad`` of every leaf and of every op result attached so far (a
:class:`diff_harness.StepResult` per backward), and, on torch, the leaves' ``requires_grad``
whenever nothing records, storage sharing and layout problems of the ``.grad`` tensors.

:func:`reference_scenario` is the torch reference: the same events interpreted by a small model
of the semantics on plain autograd (``torch.autograd.grad`` per backward, callback chains
applied by hand, ``.grad`` accumulated in tensors of its own). The rules it encodes:

* A backward gives a gradient to each tensor attached to its manager that the outputs reach,
  snapshotted at attach for an op result (its gradient edge then), and (PyTorch notes)
  through every operation autograd recorded, also ones before ``record()``.
* A ``Parameter`` whose ``requires_grad`` is off is frozen: no gradient, whatever its attach
  calls and callbacks; its flag is never turned on.
* A plain leaf (a tensor, not a ``Parameter``; also an op result made of constants only) that
  some ``attach()`` call found with the user's ``requires_grad`` off is an *input* of that
  manager from then on: it gets its gradient, and ``requires_grad`` is on while any manager
  that has it as an input records. "The user's flag" is the one the user set, not one a
  recording manager turned on (a second manager attaching an input another one holds the flag
  of still takes it as an input), nor the base's flag a view made before it shows. A plain
  leaf frozen after its last attach is frozen.
* ``create_graph`` where an earlier-started manager outside the backward's group records,
  ``retain_graph`` where any other manager records (what MegEngine's semantics need; the
  values are the same bits either way).
"""

from __future__ import annotations

import functools
import gc
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from diff_harness import (
    CallLog,
    StepResult,
    Trace,
    expect_tensor,
    finish_calls,
    layout_problems,
    make_chain,
    storage_problems,
)
from diff_interp import Engine, TorchEngine
from diff_program import Op
from diff_reference import engine_grads, run_chain
from diff_scenario import CUSTOM_OPS, Event, Scenario

from gradmgr import GradManager


# --------------------------------------------------------------------------- custom Functions
@functools.cache
def _torch_functions() -> Dict[str, Any]:
    import torch
    from torch.autograd.function import once_differentiable

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, c):
            ctx.c = c
            return x * c

        @staticmethod
        def backward(ctx, g):
            return g * ctx.c, None

    class Ste(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.round(x)

        @staticmethod
        def backward(ctx, g):
            return g

    class Once(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x * 2.0

    class Two(torch.autograd.Function):  # two outputs; the program uses one of them
        @staticmethod
        def forward(ctx, x):
            e = torch.exp(x)
            ctx.save_for_backward(e)
            return e, x * 3.0

        @staticmethod
        def backward(ctx, g1, g2):  # (the unused output's gradient comes as zeros)
            (e,) = ctx.saved_tensors
            return g1 * e + g2 * 3.0

    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g * b, g * a

    class NoGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a + b

        @staticmethod
        def backward(ctx, g):
            return g, None

    return {
        "fn_scale": lambda args, p: Scale.apply(args[0], p[0]),
        "fn_ste": lambda args, p: Ste.apply(args[0]),
        "fn_once": lambda args, p: Once.apply(args[0]),
        "fn_first": lambda args, p: Two.apply(args[0])[0],
        "fn_second": lambda args, p: Two.apply(args[0])[1],
        "fn_mul": lambda args, p: Mul.apply(*args),
        "fn_nograd": lambda args, p: NoGrad.apply(*args),
    }


@functools.cache
def _mge_functions() -> Dict[str, Any]:
    import megengine.functional as F
    from megengine.autodiff import Function

    # MegEngine may call a backward with None for an output no gradient reached (also an
    # output of an earlier recording): each returns None for its inputs then.
    class Scale(Function):
        def __init__(self, c):
            super().__init__()
            self.c = c

        def forward(self, x):
            return x * self.c

        def backward(self, g):
            return None if g is None else g * self.c

    class Ste(Function):
        def forward(self, x):
            return F.round(x)

        def backward(self, g):
            return g

    class Once(Function):  # (MegEngine has no once_differentiable: the same Function)
        def forward(self, x):
            self.x = x
            return x * x

        def backward(self, g):
            return None if g is None else g * self.x * 2.0

    class Two(Function):
        def forward(self, x):
            self.e = F.exp(x)
            return self.e, x * 3.0

        def backward(self, g1, g2):
            parts = [g * c for g, c in ((g1, self.e), (g2, 3.0)) if g is not None]
            return functools.reduce(operator.add, parts) if parts else None

    class Mul(Function):
        def forward(self, a, b):
            self.a, self.b = a, b
            return a * b

        def backward(self, g):
            return (None, None) if g is None else (g * self.b, g * self.a)

    class NoGrad(Function):
        def forward(self, a, b):
            return a + b

        def backward(self, g):
            return g, None

    return {
        "fn_scale": lambda args, p: Scale(p[0])(args[0]),
        "fn_ste": lambda args, p: Ste()(args[0]),
        "fn_once": lambda args, p: Once()(args[0]),
        "fn_first": lambda args, p: Two()(args[0])[0],
        "fn_second": lambda args, p: Two()(args[0])[1],
        "fn_mul": lambda args, p: Mul()(*args),
        "fn_nograd": lambda args, p: NoGrad()(*args),
    }


def apply_op(eng: Engine, op: Op, args: List[Any]) -> Any:
    if op.name in CUSTOM_OPS:
        table = _torch_functions() if eng.name == "torch" else _mge_functions()
        return table[op.name](args, op.params)
    return eng.apply(op, args)


# --------------------------------------------------------------------------- shared pieces
def make_scenario_leaves(sc: Scenario, eng: Engine) -> List[Any]:
    """The leaves as the user makes them (the reference changes flags later, by its rules)."""
    leaves = []
    for data, leaf in zip(sc.leaf_data(), sc.leaves):
        if eng.name == "torch":
            import torch

            t = torch.tensor(data)
            if leaf.kind == "param":
                t = torch.nn.Parameter(t)
            elif leaf.kind in ("tensor", "free"):
                t.requires_grad_(True)
        else:
            cls = eng.mge.Parameter if leaf.kind in ("param", "free") else eng.mge.Tensor
            t = cls(np.array(data, copy=True))
        leaves.append(t)
    return leaves


def make_outputs(sc: Scenario, index: int, eng: Engine, values: List[Any],
                 shapes: List[Tuple[int, ...]]) -> Tuple[Any, Any, List[Any], List[Any]]:
    """``(y, dy)`` as passed to ``backward()`` and as lists, for the backward at ``index``."""
    out = sc.events[index].output
    data = sc.dy_data(index, shapes)
    if out.kind.startswith("loss"):
        loss = None
        for t, r in zip(out.terms, out.reductions):
            term = eng.reduce(r, values[t])
            loss = term if loss is None else loss + term
        if out.kind == "loss":
            return loss, None, [loss], [eng.ones_like(loss)]
        dy = eng.tensor(data[0])
        return loss, dy, [loss], [dy]
    ys = [values[t] for t in out.terms]
    dys = [eng.tensor(d) for d in data]
    if out.kind == "tensor":
        return ys[0], dys[0], ys, dys
    return ys, dys, ys, dys


def _np(eng: Engine, g: Any) -> Optional[np.ndarray]:
    return None if g is None else eng.numpy(g)


# --------------------------------------------------------------------------- managers
@dataclass
class _Run:
    """One scenario running through managers made by one factory."""

    sc: Scenario
    eng: Engine
    values: List[Any]
    managers: List[Any]
    eager: bool
    check_backwarding: bool
    log: CallLog = field(default_factory=CallLog)
    trace: Trace = field(default_factory=Trace)
    recording: List[int] = field(default_factory=list)
    chain_len: Dict[Tuple[int, int], int] = field(default_factory=dict)
    observed: List[int] = field(default_factory=list)
    user: List[Tuple[str, Any]] = field(default_factory=list)
    leaked: List[Any] = field(default_factory=list)  # native managers dropped but alive

    def event(self, index: int, ev: Event) -> None:
        getattr(self, "do_" + ev.kind)(index, ev)

    def do_attach(self, index: int, ev: Event) -> None:
        gm, t, key = self.managers[ev.manager], self.values[ev.value], (ev.manager, ev.value)
        chain = make_chain(ev.chain, ev.value, self.log, self.eng, f"m{ev.manager}",
                           owner=gm if self.check_backwarding else None, eager=self.eager,
                           first_pos=self.chain_len.get(key, 0))
        expect_tensor(chain, t)
        self.chain_len[key] = self.chain_len.get(key, 0) + len(chain)
        gm.attach(t, callbacks=chain or None)
        if ev.value not in self.observed:
            self.observed.append(ev.value)

    def do_freeze(self, index: int, ev: Event) -> None:
        self.values[ev.value].requires_grad_(False)

    def do_unfreeze(self, index: int, ev: Event) -> None:
        self.values[ev.value].requires_grad_(True)

    def do_zero_grad(self, index: int, ev: Event) -> None:
        for t in self.values[: self.sc.n_leaves]:
            t.grad = None

    def do_record(self, index: int, ev: Event) -> None:
        gms = [self.managers[m] for m in ev.managers]
        if len(gms) == 1:
            gms[0].record()
        else:  # (MegEngine's native group has no record(): enter it as `with` does)
            functools.reduce(operator.or_, gms).__enter__()
        self.recording.extend(ev.managers)

    def do_op(self, index: int, ev: Event) -> None:
        self.values.append(apply_op(self.eng, ev.op, [self.values[a] for a in ev.op.args]))

    def do_release(self, index: int, ev: Event) -> None:
        self.recording.remove(ev.manager)
        self.managers[ev.manager].release()

    def do_drop(self, index: int, ev: Event) -> None:
        """The manager is dropped while it records: its recording must end once collected
        (MegEngine's own frees a manager with nothing attached; one with attached tensors it
        keeps alive, recording, through its callbacks: the same gradients either way)."""
        self.recording.remove(ev.manager)
        dropped = weakref.ref(self.managers[ev.manager])
        self.managers[ev.manager] = None
        gc.collect()
        gm = dropped()
        if isinstance(gm, GradManager):
            raise AssertionError(f"m{ev.manager} was dropped while recording and is still alive")
        if gm is not None:  # (native; released at the end, so that no recording is left)
            self.leaked.append(gm)

    def do_backward(self, index: int, ev: Event) -> None:
        y, dy, ys, dys = make_outputs(self.sc, index, self.eng, self.values, self.sc.shapes())
        self.user += [(f"dy of event {index}", d) for d in dys]
        self.recording.remove(ev.manager)
        self.managers[ev.manager].backward(y, dy)
        self.log.settle(self.eng)
        self.log.step += 1
        self.observe()

    def observe(self) -> None:
        eng = self.eng
        vids = list(range(self.sc.n_leaves)) + [v for v in self.observed
                                                if v >= self.sc.n_leaves]
        grads = {v: eng.grad(self.values[v]) for v in vids}
        flags = {}
        if eng.name == "torch" and not self.recording:
            flags = {v: bool(t.requires_grad)
                     for v, t in enumerate(self.values[: self.sc.n_leaves])}
        self.trace.steps.append(StepResult({v: _np(eng, g) for v, g in grads.items()}, {},
                                           flags))
        if eng.name == "torch":
            step = len(self.trace.steps) - 1
            user = self.user + [(f"value v{i}", v) for i, v in enumerate(self.values)]
            self.trace.storage += [f"backward #{step}: {p}"
                                   for p in storage_problems(grads, self.log.calls, user)]
            self.trace.layout += [f"backward #{step}: {p}" for p in layout_problems(
                {v: self.values[v] for v in vids}, eng)]

    def release_all(self) -> None:
        for m in reversed(self.recording):
            self.managers[m].release()
        self.recording.clear()
        for gm in self.leaked:
            gm.release()


def run_scenario(sc: Scenario, eng: Engine, factory: Any, *, eager: bool = False,
                 check_backwarding: bool = True) -> Trace:
    """Run ``sc`` through ``sc.n_managers`` managers made by ``factory`` (labels ``m0``...).
    An exception ends the run and is kept in ``trace.error``; every recording is released."""
    run = _Run(sc, eng, make_scenario_leaves(sc, eng),
               [factory() for _ in range(sc.n_managers)], eager, check_backwarding)
    index = 0
    try:
        for index, ev in enumerate(sc.events):
            run.event(index, ev)
    except Exception as exc:  # noqa: BLE001 - compared with the reference's outcome
        run.trace.error, run.trace.failed_at = exc, index
    finally:
        run.release_all()
    finish_calls(run.trace, run.log, eng)
    return run.trace


# --------------------------------------------------------------------------- torch reference
@dataclass
class _Item:
    specs: list  # the whole callback chain
    edge: Any  # an op result's gradient edge at attach (None: a leaf)
    input: bool = False  # a plain leaf attached with the user's flag off (see the docstring)


@dataclass
class _RefManager:
    items: Dict[int, _Item] = field(default_factory=dict)  # in first-attach order
    recording: bool = False
    start: int = -1
    group: Optional[int] = None


class _Model:
    """The torch reference's state: its own tensors, the user's flags, each manager's view."""

    def __init__(self, sc: Scenario) -> None:
        import torch

        self.torch = torch
        self.sc = sc
        self.eng = TorchEngine()
        self.values: List[Any] = make_scenario_leaves(sc, self.eng)
        self.user_flag = {v: t.requires_grad for v, t in enumerate(self.values)}
        self.raised: set = set()  # the flags the model turned on
        self.managers = [_RefManager() for _ in range(sc.n_managers)]
        self.acc: Dict[int, Any] = {}
        self.log = CallLog()
        self.trace = Trace()
        self.observed: List[int] = []
        self.counter = 0

    def is_param(self, v: int) -> bool:
        return isinstance(self.values[v], self.torch.nn.Parameter)

    def sync_flags(self) -> None:
        """Turn ``requires_grad`` on for every input that a recording manager holds (see the
        docstring), and off again once none does, where the model turned it on. (A view made
        before its base required grad may show the base's flag, but gets a gradient of its
        own only once its own flag is set, which this does too.)"""
        for v in self.user_flag:
            t = self.values[v]
            held = not self.is_param(v) and any(
                m.recording and v in m.items and m.items[v].input for m in self.managers)
            if held and v not in self.raised and not self.user_flag[v]:
                t.requires_grad_(True)
                self.raised.add(v)
            elif not held and v in self.raised:
                t.requires_grad_(False)
                self.raised.discard(v)

    def do_attach(self, index: int, ev: Event) -> None:
        t, m = self.values[ev.value], self.managers[ev.manager]
        item = m.items.get(ev.value)
        new = item is None
        if new:
            edge = None
            if t.grad_fn is not None:
                edge = self.torch.autograd.graph.get_gradient_edge(t)
            else:
                self.user_flag.setdefault(ev.value, False)  # an op result: no user flag
            item = m.items[ev.value] = _Item([], edge)
        item.specs.extend(ev.chain)
        if item.edge is None and not self.is_param(ev.value) and not self.user_flag[ev.value]:
            item.input = True
        if ev.value not in self.observed:
            self.observed.append(ev.value)
        self.sync_flags()

    def do_freeze(self, index: int, ev: Event) -> None:
        self.user_flag[ev.value] = False
        self.values[ev.value].requires_grad_(False)

    def do_unfreeze(self, index: int, ev: Event) -> None:
        self.user_flag[ev.value] = True
        self.values[ev.value].requires_grad_(True)

    def do_zero_grad(self, index: int, ev: Event) -> None:
        for v in range(self.sc.n_leaves):
            self.acc.pop(v, None)

    def do_record(self, index: int, ev: Event) -> None:
        for i in ev.managers:
            m = self.managers[i]
            m.recording, m.start = True, self.counter
            m.group = index if len(ev.managers) > 1 else None
            self.counter += 1
        self.sync_flags()

    def do_op(self, index: int, ev: Event) -> None:
        self.values.append(apply_op(self.eng, ev.op, [self.values[a] for a in ev.op.args]))

    def do_release(self, index: int, ev: Event) -> None:
        self.managers[ev.manager].recording = False
        self.sync_flags()

    do_drop = do_release  # the recording ends when the manager is collected

    def gets_gradient(self, v: int, item: _Item) -> bool:
        if item.edge is not None:
            return True
        return self.user_flag[v] or (item.input and not self.is_param(v))

    def do_backward(self, index: int, ev: Event) -> None:
        m = self.managers[ev.manager]
        others = [o for o in self.managers if o.recording and o is not m]
        create_graph = any(o.start < m.start and (m.group is None or o.group != m.group)
                           for o in others)
        _, _, ys, dys = make_outputs(self.sc, index, self.eng, self.values, self.sc.shapes())
        items = [(v, item) for v, item in m.items.items() if self.gets_gradient(v, item)]
        inputs = [self.values[v] if item.edge is None else item.edge for v, item in items]
        grads = engine_grads(ys, dys, inputs, create_graph=create_graph,
                             retain_graph=bool(others) or create_graph)
        for (v, item), g in zip(items, grads):
            if g is not None:
                g = run_chain(item.specs, v, self.values[v], g, self.log, self.eng,
                              f"m{ev.manager}")
                self.acc[v] = g.clone() if self.acc.get(v) is None else self.acc[v] + g
        self.log.settle(self.eng)
        self.log.step += 1
        m.recording = False
        self.sync_flags()
        self.observe()

    def observe(self) -> None:
        vids = list(range(self.sc.n_leaves)) + [v for v in self.observed
                                                if v >= self.sc.n_leaves]
        flags = {}
        if not any(m.recording for m in self.managers):
            flags = {v: self.user_flag[v] for v in range(self.sc.n_leaves)}
        self.trace.steps.append(StepResult(
            {v: _np(self.eng, self.acc.get(v)) for v in vids}, {}, flags))


def reference_scenario(sc: Scenario) -> Trace:
    """The torch reference of :func:`run_scenario` (see the module docstring)."""
    model = _Model(sc)
    index = 0
    try:
        for index, ev in enumerate(sc.events):
            getattr(model, "do_" + ev.kind)(index, ev)
    except Exception as exc:  # noqa: BLE001 - compared with gradmgr's outcome
        model.trace.error, model.trace.failed_at = exc, index
    finish_calls(model.trace, model.log, model.eng)
    return model.trace


# --------------------------------------------------------------------------- checks
def check_scenario(got: Trace, ref: Trace, sc: Scenario, *, torch_checks: bool = True) -> None:
    """Every comparison of one scenario run with its reference (each from its own line)."""
    from diff_harness import (
        check_callbacks,
        check_flags,
        check_grads,
        check_layout,
        check_outcome,
        check_storage,
    )

    from gradmgr import _state

    check_outcome(got, ref)
    check_grads(got, ref)
    for m in range(sc.n_managers):
        check_callbacks(got, ref, f"m{m}", f"m{m}")
    if torch_checks:
        check_storage(got)
        check_layout(got)
        check_flags(got, ref)
    assert not _state.state.recording and not _state.state.backwarding, "state left behind"
