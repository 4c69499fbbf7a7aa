"""Differential tests of ``GradManager.backward_split`` on PyTorch.

Every generated case runs twice through gradmgr with the same callbacks, hooks and data: once
with ``gm.backward(y, dy)`` per micro-batch, once with ``gm.backward_split(y, dy, first=...)``
and a later ``finish()``, and also through ``torch.autograd.grad`` (:mod:`diff_reference`,
one reference run per micro-batch, accumulated here in step order). Compared:

* every attached tensor's ``.grad`` (shared parameters at the end, per-micro-batch tensors,
  inputs and attached intermediates, of each step), and the ``.grad`` of leaves that are not
  attached (stays None);
* what the split does in each part: right after ``backward_split`` the ``first`` tensors (and
  the attached tensors on a path to them) have exactly the single backward's ``.grad`` of that
  step and nothing else changed; ``finish()`` changes only the other tensors of its own step;
* every callback's argument and how often it ran, and in which part (the ``first`` side's in
  ``backward_split``, the rest in ``finish()``); that callbacks see their manager as the
  backwarding one;
* the after-backward callback: once per micro-batch, in ``finish()``, with ``gm.step`` that
  backward's recording, after every callback of that part, before anything of it is
  accumulated and before any Future of it is resolved;
* user tensor hooks on intermediates (scaling, so they map zero to zero; see
  ``tests/test_torch_split.py`` for the documented second call with zeros on a boundary
  node's output): the gradients they see, except that extra all-zero calls are allowed in the
  split; ``retain_grad()`` on intermediates; post-accumulate-grad hooks (same leaves per step,
  each sees the ``.grad`` accumulated by then);
* no ``.grad`` sharing storage with another or with a tensor user code was handed, and
  AccumulateGrad's layout.

Cases: generated programs (:func:`diff_program.programs`: several outputs with dy, reused
values, callback chains with Futures, hooks, late attaches, attached inputs and intermediates,
float64), pipeline stages (:func:`stage_programs`: linear layers, tied weights, a second stage
input, attached activations, a weight-decay output), several micro-batches with the splits
outstanding together, finished in any order, some ``finish()`` calls inside the next
micro-batch's recording, in-place ops on attached intermediates, non-reentrant checkpointing,
and the errors.

Tolerance: bit-identical, except where a tensor's gradient is a sum over several paths (the
split may compute the paths in different engine runs and add them in another order) and, for
a ``.grad`` accumulated over three micro-batches, where the finish order changes the order of
the additions: then ``rtol=1e-6, atol=1e-7`` (float32; 1e-12 / 1e-14 for float64), relative to
the largest magnitude involved (:func:`_close`). A ``retain_grad()`` ``.grad`` may also differ
from ``backward()``'s in the sign of a zero (``finish()`` adds the documented zero stand-in to
a boundary node's output). Storage: a leaf without callbacks is accumulated by the engine
itself, whose ``.grad`` may alias ``dy`` or another gradient as with ``loss.backward()`` (not
checked).

Bugs this file found (B-J, each fixed): the cases at the end of the file pin each one down
with a minimal program, and fail on the code before its fix.

Running: ``.venv/bin/python -m pytest tests/differential/test_torch_split_differential.py -q
-p no:cacheprovider`` (about 20 s on 2 cores; ``GRADMGR_DIFF_EXAMPLES`` / ``GRADMGR_DIFF_SEED``
as for the rest of the suite, ``--hypothesis-show-statistics`` lists what the examples covered).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from diff_harness import (  # noqa: E402
    CallLog,
    attach_chain,
    attach_leaves,
    describe,
    expect_tensor,
    layout_problems,
    make_chain,
    resolve,
    same_bits,
    storage_problems,
)
from diff_interp import TorchEngine, add_leaf_hooks, build  # noqa: E402
from diff_program import (  # noqa: E402
    INPLACE,
    Callback,
    Leaf,
    Op,
    Output,
    Program,
    callback_chains,
    inplace_on_attached,
    live_after_inplace,
    programs,
)
from diff_reference import reference_program  # noqa: E402
from diff_settings import differential_settings  # noqa: E402
from hypothesis import event, example, given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gradmgr  # noqa: E402
from gradmgr import _state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::gradmgr.GradMgrWarning")

ENG = TorchEngine()
SHARED = -1  # the "step" of a shared parameter's .grad (accumulated over every micro-batch)


# =========================================================================== the case model
@dataclass(frozen=True)
class SplitCase:
    """A program, the value numbers passed as ``first``, and the order of events over the
    micro-batches: ``("record", k)`` starts recording micro-batch ``k`` and runs its forward,
    ``("split", k)`` is its ``backward_split`` (or ``backward``, which ends the recording),
    ``("finish", k)`` its ``finish()`` (nothing in the single-backward run). A finish between
    ``record`` and ``split`` of another micro-batch runs inside that recording.

    Micro-batch ``k > 0`` has fresh inputs, free and constant leaves (its own data and ``dy``,
    inputs attached inside its recording) and shares the parameters. ``retain``: op results
    with ``retain_grad()``; ``watch``: op results whose tensor hooks are logged (a logging hook
    registered after the program's own). ``bare``: a single ``first`` tensor passed as itself.
    """

    program: Program
    first: Tuple[int, ...]
    events: Tuple[Tuple[str, int], ...] = (("record", 0), ("split", 0), ("finish", 0))
    retain: Tuple[int, ...] = ()
    watch: Tuple[int, ...] = ()
    after_backward: bool = True
    bare: bool = False
    checkpoint: Optional[str] = None

    @property
    def n_steps(self) -> int:
        return 1 + max(k for _, k in self.events)

    def pretty(self) -> str:
        lines = [self.program.pretty(), f"first = {[f'v{v}' for v in self.first]}"
                 + (" (passed bare)" if self.bare else "")]
        if self.n_steps > 1 or self.events != SplitCase.events:
            lines.append("events: " + ", ".join(f"{e}{k}" for e, k in self.events))
        if self.retain:
            lines.append(f"retain_grad() on {[f'v{v}' for v in self.retain]}")
        if self.watch:
            lines.append(f"logging hooks on {[f'v{v}' for v in self.watch]}")
        if not self.after_backward:
            lines.append("no after-backward callback")
        if self.checkpoint:
            lines.append(f"checkpoint: {self.checkpoint}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- graph facts
def requires_grad_values(program: Program) -> Set[int]:
    """Values that require grad while recording (inputs are attached, so they do)."""
    rg = {v for v, leaf in enumerate(program.leaves) if leaf.kind != "const"}
    for i, op in enumerate(program.ops):
        if op.attach or any(a in rg for a in op.args):
            rg.add(program.vid_of_op(i))
    return rg


def leafy_values(program: Program) -> Set[int]:
    """Attached op results made of constants only (attaching makes them leaves)."""
    rg = {v for v, leaf in enumerate(program.leaves) if leaf.kind != "const"}
    leafy = set()
    for i, op in enumerate(program.ops):
        v = program.vid_of_op(i)
        if any(a in rg for a in op.args):
            rg.add(v)
        elif op.attach or (op.name in INPLACE and op.args[0] in leafy):
            rg.add(v)
            leafy.add(v)
    return leafy


def path_counts(program: Program) -> Dict[int, int]:
    """How many gradient paths lead from the outputs to each value (an op that uses a value
    twice is one edge: its backward adds both parts in one place, the same in every run)."""
    rg = requires_grad_values(program)
    paths: Dict[int, int] = defaultdict(int)
    for t in program.output.terms:
        paths[t] += 1
    for i in reversed(range(len(program.ops))):
        v = program.vid_of_op(i)
        if paths[v] and v in rg:
            for a in set(program.ops[i].args):
                if a in rg:
                    paths[a] += paths[v]
    return paths


def ancestors(program: Program) -> Dict[int, Set[int]]:
    """Each value's gradient-carrying ancestors."""
    rg = requires_grad_values(program)
    anc: Dict[int, Set[int]] = {v: set() for v in range(program.n_leaves)}
    for i, op in enumerate(program.ops):
        v = program.vid_of_op(i)
        anc[v] = set()
        for a in op.args:
            if a in rg:
                anc[v] |= {a} | anc[a]
    return anc


def now_set(program: Program, first: Sequence[int]) -> Set[int]:
    """The attached values whose gradients the first part computes: ``first``, the attached
    intermediates on a path to one of them, and the attached values below a ``first``
    intermediate on a gradient path that has no other of them below it, with those on a path
    to one of these (documented)."""
    anc = ancestors(program)
    moved = {v for v in program.attached_ops() if anc[v] & set(first)}
    now = set(first) | moved
    leafy, paths = leafy_values(program), path_counts(program)
    below = set()
    for f in first:
        if (f >= program.n_leaves and f not in leafy and paths.get(f, 0)
                and not anc[f] & now):
            below |= {v for v in program.attached() if v in anc[f]}
    if below:  # and, again, the attached intermediates on a path to one of those
        now |= below | {v for v in program.attached_ops() if anc[v] & below}
    return now


def shared_vids(program: Program) -> List[int]:
    """Attached leaves shared by every micro-batch: the parameters."""
    return [v for v in program.attached_leaves() if program.leaves[v].kind == "param"]


def step_program(program: Program, k: int) -> Program:
    """Micro-batch ``k``'s program: its own data and dy; inputs attached while recording."""
    if k == 0:
        return program
    leaves = tuple(dataclasses.replace(leaf, late=True) if leaf.kind == "input" else leaf
                   for leaf in program.leaves)
    return dataclasses.replace(program, seed=program.seed + 1009 * k, leaves=leaves)


def step_leaves(program: Program, k: int, shared: Optional[List[Any]], *,
                reference: bool) -> List[Any]:
    """Micro-batch ``k``'s leaves: the parameters of micro-batch 0 (the objects themselves, or
    fresh ones with their data for the reference), fresh leaves with ``k``'s data otherwise."""
    data0 = program.leaf_data()
    data = step_program(program, k).leaf_data()
    wants = ("param", "free", "input") if reference else ("param", "free")
    out = []
    for v, leaf in enumerate(program.leaves):
        if leaf.kind == "param" and shared is not None:
            out.append(shared[v])
            continue
        arr = data0[v] if leaf.kind == "param" else data[v]
        out.append(ENG.leaf(arr, leaf, leaf.kind in wants))
    return out


# =========================================================================== the runner
@dataclass
class AfterSeen:
    event: int
    step: int
    gm_step: int
    touched: List[str]
    calls_seen: int
    lazies_done: int


@dataclass
class Run:
    grads: Dict[Tuple[int, int], Optional[np.ndarray]] = field(default_factory=dict)
    others: Dict[Tuple[int, int], Optional[np.ndarray]] = field(default_factory=dict)
    retained: Dict[Tuple[int, int], Optional[np.ndarray]] = field(default_factory=dict)
    calls: Dict[Tuple[int, int, int], List[np.ndarray]] = field(default_factory=dict)
    call_events: List[Tuple[int, int, int]] = field(default_factory=list)  # event, step, vid
    call_facts: List[Any] = field(default_factory=list)
    hooks: Dict[Tuple[int, int], List[np.ndarray]] = field(default_factory=dict)
    after: List[AfterSeen] = field(default_factory=list)
    post: List[Tuple[int, int, int, Optional[np.ndarray]]] = field(default_factory=list)
    # .grad of every tracked tensor at the end of each event: (step, vid) -> array
    at_end: List[Dict[Tuple[int, int], Optional[np.ndarray]]] = field(default_factory=list)
    changed: List[List[Tuple[int, int]]] = field(default_factory=list)  # per event
    event_calls: List[Tuple[int, int]] = field(default_factory=list)  # log slice per event
    step_ids: Dict[int, int] = field(default_factory=dict)  # micro-batch -> gm.step
    deferred_steps: Dict[int, int] = field(default_factory=dict)  # DeferredBackward.step
    step_checks: List[Tuple[int, int]] = field(default_factory=list)  # (event, gm.step)
    event_calls_start: int = 0
    lazy_start: int = 0
    problems: List[str] = field(default_factory=list)
    storage: List[str] = field(default_factory=list)
    layout: List[str] = field(default_factory=list)
    error: Optional[BaseException] = None
    error_event: Optional[int] = None


def run_case(case: SplitCase, split: bool) -> Run:
    """Run ``case`` through one ``GradManager``, with ``backward_split`` + ``finish`` or with
    ``backward``, recording everything :func:`check_split` compares."""
    program = case.program
    n = program.n_leaves
    log = CallLog()
    gm = gradmgr.GradManager()
    r = Run()
    cur = {"event": -1, "step": 0}
    shared = shared_vids(program)
    leaves0 = step_leaves(program, 0, None, reference=False)
    leaves_of: Dict[int, List[Any]] = {0: leaves0}
    objs: Dict[Tuple[int, int], Any] = {(SHARED, v): leaves0[v] for v in shared}
    retained: Dict[Tuple[int, int], Any] = {}
    builts: Dict[int, Any] = {}
    pending: Dict[int, Any] = {}
    step_checks = r.step_checks  # (event, gm.step) seen by callbacks

    def wrap(chain):
        if not chain:
            return chain

        def check_step(tensor, grad):  # not logged; passes the gradient on untouched
            step_checks.append((cur["event"], gm.step))
            return grad

        return [check_step] + chain

    def attach(vid, tensor):
        chain = make_chain(program.chain(vid), vid, log, ENG, "gm", owner=gm)
        expect_tensor(chain, tensor)
        attach_chain(gm, tensor, wrap(chain), program.split_attach)

    attach_leaves(program, leaves0, attach)
    if program.post_hooks:
        for vid in shared:
            leaves0[vid].register_post_accumulate_grad_hook(
                lambda t, vid=vid: r.post.append(
                    (cur["event"], cur["step"], vid, _np(t.grad))))

    pre: Dict[Tuple[int, int], Tuple[Any, Optional[np.ndarray]]] = {}

    def snapshot() -> Dict[Tuple[int, int], Tuple[Any, Optional[np.ndarray]]]:
        return {key: (ENG.grad(t), _np(ENG.grad(t))) for key, t in objs.items()}

    def observe():
        start = r.event_calls_start
        lazies = [f for _, f in log.lazy[r.lazy_start:]]
        touched = [f"{_key(k)}" for k, t in objs.items() if not _untouched(t, pre.get(k))]
        r.after.append(AfterSeen(cur["event"], cur["step"], gm.step, touched,
                                 len(log.calls) - start, sum(f.done() for f in lazies)))

    if case.after_backward:
        gm.register_after_backward_callback(observe)

    for e, (what, k) in enumerate(case.events):
        cur["event"], cur["step"] = e, k
        log.step = k
        r.event_calls_start = len(log.calls)
        r.lazy_start = len(log.lazy)
        pre = snapshot()
        try:
            if what == "record":
                if k not in leaves_of:
                    leaves_of[k] = step_leaves(program, k, leaves0, reference=False)
                leaves = leaves_of[k]
                for vid in program.attached_leaves():
                    if program.leaves[vid].kind != "param":
                        objs[(k, vid)] = leaves[vid]
                gm.record()
                r.step_ids[k] = gm.step

                def on_attach(vid, tensor, k=k):
                    if vid >= n or program.leaves[vid].kind != "param":
                        objs[(k, vid)] = tensor
                    if vid >= n or k == 0 or program.leaves[vid].kind != "param":
                        attach(vid, tensor)

                def on_made(vid, tensor, k=k):
                    if vid in case.watch and tensor.requires_grad:
                        tensor.register_hook(
                            lambda g, vid=vid, k=k: r.hooks.setdefault((k, vid), []).append(
                                ENG.numpy(g)))
                    if vid in case.retain and tensor.requires_grad and not tensor.is_leaf:
                        tensor.retain_grad()
                        retained[(k, vid)] = tensor

                builts[k] = build(step_program(program, k), ENG, leaves, on_attach,
                                  case.checkpoint, on_made=on_made)
            elif what == "split":
                built = builts[k]
                if split:
                    firsts = [objs[(SHARED, v)] if (SHARED, v) in objs else objs[(k, v)]
                              for v in case.first]
                    rest = gm.backward_split(built.y, built.dy,
                                             first=firsts[0] if case.bare else firsts)
                    pending[k] = rest
                    r.deferred_steps[k] = rest.step
                else:
                    gm.backward(built.y, built.dy)
            elif what == "finish" and split:
                pending[k].finish()
                if not pending[k].done:
                    r.problems.append(f"finish{k}: DeferredBackward.done is still False")
            log.settle(ENG)
        except Exception as exc:  # noqa: BLE001 - compared with the other run's outcome
            r.error, r.error_event = exc, e
            if gm in _state.recording_managers():
                gm.release()
            break
        finally:
            r.event_calls.append((r.event_calls_start, len(log.calls)))
            end = snapshot()
            r.at_end.append({key: a for key, (_, a) in end.items()})
            r.changed.append([key for key in end if not _untouched(objs[key], pre.get(key))])
    for i, (start, stop) in enumerate(r.event_calls):
        for call in log.calls[start:stop]:
            r.call_events.append((i, call.step, call.vid))

    for key, t in objs.items():
        r.grads[key] = _np(ENG.grad(t))
    for key, t in retained.items():
        r.retained[key] = _np(ENG.grad(t))
    attached = set(program.attached_leaves())
    for k, leaves in leaves_of.items():
        for v, t in enumerate(leaves):
            if v not in attached:
                r.others[(k, v)] = _np(t.grad)
    for call in log.calls:
        value = call.value if isinstance(call.value, np.ndarray) else None
        if value is None:
            try:
                value = ENG.numpy(resolve(call.value))
            except Exception:  # noqa: BLE001 - a Future of a failed run
                value = None
        r.calls.setdefault((call.step, call.vid, call.pos), []).append(value)
    r.call_facts = list(log.calls)
    if r.error is None:
        user = [(f"dy[{i}] of step {k}", d) for k, b in builts.items()
                for i, d in enumerate(b.dys)]
        user += [(f"value v{i} of step {k}", v) for k, b in builts.items()
                 for i, v in enumerate(b.values) if v is not None]
        # A leaf without callbacks is accumulated by the engine itself, as loss.backward()
        # does, and AccumulateGrad may then keep as .grad a view of dy, of a forward value, or
        # of a gradient the engine also hands on (a.sum() + b.sum() over 0-d leaves: a.grad
        # shares storage with b.grad or with b's hook argument): plain PyTorch and backward() do
        # the same, and a split takes that path more often (a part whose tensors have no
        # callbacks). Such leaves are left out of the storage checks.
        own = {_key(key): ENG.grad(t) for key, t in objs.items()
               if not (t.is_leaf and not program.chain(key[1]))}
        r.storage = storage_problems(own, log.calls, user)
        r.layout = layout_problems({_key(key): t for key, t in objs.items()}, ENG)
    # keep the run's tensors alive until here (storage checks compare pointers)
    del pending, builts
    return r


def _key(key: Tuple[int, int]) -> str:
    step, vid = key
    return f"{vid} (shared)" if step == SHARED else f"{vid} of step {step}"


def _np(g: Any) -> Optional[np.ndarray]:
    return None if g is None else ENG.numpy(g)


def _untouched(t: Any, pre: Optional[Tuple[Any, Optional[np.ndarray]]]) -> bool:
    g = ENG.grad(t)
    if pre is None or pre[0] is None:
        return g is None
    return g is pre[0] and same_bits(_np(g), pre[1])


# =========================================================================== the reference
@dataclass
class Ref:
    grads: Dict[Tuple[int, int], Optional[np.ndarray]]
    calls: Dict[Tuple[int, int, int], List[np.ndarray]]


def reference_case(case: SplitCase) -> Ref:
    """``torch.autograd.grad`` per micro-batch (:func:`diff_reference.reference_program` on
    that micro-batch's leaves), the shared parameters' gradients summed in step order."""
    program = case.program
    shared = set(shared_vids(program))
    grads: Dict[Tuple[int, int], Optional[np.ndarray]] = {}
    calls: Dict[Tuple[int, int, int], List[np.ndarray]] = {}
    for k in range(case.n_steps):
        pk = step_program(program, k)
        leaves = step_leaves(program, k, None, reference=True)
        trace = reference_program(pk, ["start"], leaves=leaves)
        for vid, g in trace.steps[0].grads.items():
            if vid in shared:
                acc = grads.get((SHARED, vid))
                grads[(SHARED, vid)] = g if acc is None else (acc if g is None else acc + g)
            else:
                grads[(k, vid)] = g
        for (_, _, vid, pos), values in trace.calls.items():
            calls[(k, vid, pos)] = values
    return Ref(grads, calls)


# =========================================================================== comparing
_TOL = {np.dtype("float32"): (1e-6, 1e-7), np.dtype("float64"): (1e-12, 1e-14)}


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal within the float rounding of summing in another order: ``rtol`` of each element,
    plus ``atol`` times the largest magnitude of either array (a sum whose terms cancel keeps
    the rounding error of its largest term)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    rtol, atol = _TOL[a.dtype]
    scale = max(1.0, float(np.max(np.abs(a), initial=0.0)), float(np.max(np.abs(b), initial=0.0)))
    return bool(np.allclose(a, b, rtol=rtol, atol=atol * scale, equal_nan=True))


_ROUNDED: List[int] = [0]  # comparisons that passed within the tolerance only


def _same(a: Optional[np.ndarray], b: Optional[np.ndarray], loose: bool) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if same_bits(a, b):
        return True
    if loose and _close(a, b):
        _ROUNDED[0] += 1
        return True
    return False


class Facts:
    """What the comparison needs to know about a case."""

    def __init__(self, case: SplitCase) -> None:
        program = case.program
        self.case = case
        self.paths = path_counts(program)
        self.now = now_set(program, case.first)
        self.shared = set(shared_vids(program))
        finishes = [k for e, k in case.events if e == "finish"]
        # a shared .grad summed over micro-batches in another order than 0, 1, 2, ...: for two
        # micro-batches a + b == b + a; beyond, each prefix must be the same set
        self.reordered = any(set(finishes[:i]) != set(range(i))
                             for i in range(2, len(finishes) + 1))

    def loose(self, key: Tuple[int, int], accumulated: bool = True) -> bool:
        step, vid = key
        if self.paths.get(vid, 0) > 1:
            return True
        return (accumulated and step == SHARED and vid not in self.now and self.reordered)


def compare_grads(got: Dict, want: Dict, facts: Facts, what: str) -> Tuple[List[str], List[str]]:
    nones, values = [], []
    for key in sorted(set(got) | set(want)):
        a, b = got.get(key), want.get(key)
        if (a is None) != (b is None):
            nones.append(f"v{_key(key)}: split {_kind(a)}, {what} {_kind(b)}")
        elif not _same(a, b, facts.loose(key)):
            values.append(f"v{_key(key)}: {describe(a, b)}")
    return nones, values


def _kind(a: Optional[np.ndarray]) -> str:
    return "None" if a is None else f"a {a.dtype}{a.shape} gradient"


def check_split(case: SplitCase, got: Run, single: Run, ref: Optional[Ref]) -> None:
    """Every comparison of a split run with the single-backward run and the reference, each
    kind of difference from its own ``assert`` line."""
    facts = Facts(case)
    if single.error is not None:  # a program backward() refuses: the split refuses it too
        assert type(got.error) is type(single.error), (
            f"backward() raised {single.error!r}, the split {got.error!r}")
        return
    if got.error is not None:
        what, k = case.events[got.error_event]
        raise AssertionError(
            f"the split run raised in {what}{k} where backward() did not: "
            f"{type(got.error).__name__}: {got.error}") from got.error
    assert any(g is not None for g in single.grads.values()), \
        "no attached tensor got a gradient (generator bug)"

    # .grad: against the single backward and the engine
    nones, values = compare_grads(got.grads, single.grads, facts, "backward()")
    assert not nones, "None where backward() has a gradient or vice versa:\n" + "\n".join(nones)
    assert not values, "gradients differ from backward():\n" + "\n".join(values)
    if ref is not None:
        nones, values = compare_grads(got.grads, ref.grads, facts, "autograd")
        assert not nones, "None where autograd has a gradient or vice versa:\n" + \
            "\n".join(nones)
        assert not values, "gradients differ from torch.autograd.grad:\n" + "\n".join(values)
    bad = [f"v{_key(k)}.grad = {_kind(a)}" for k, a in got.others.items() if a is not None]
    assert not bad, "a leaf that is not attached got a .grad:\n" + "\n".join(bad)

    assert not got.problems, "\n".join(got.problems)

    # what each part changes
    check_parts(case, got, single, facts)

    # callbacks
    counts = [f"step {s} v{v} callback #{p}: split {len(got.calls.get(key, []))}x, backward() "
              f"{len(single.calls.get(key, []))}x"
              for key in sorted(set(got.calls) | set(single.calls)) for s, v, p in [key]
              if len(got.calls.get(key, [])) != len(single.calls.get(key, []))]
    assert not counts, "callbacks ran a different number of times:\n" + "\n".join(counts)
    args = [f"step {s} v{v} callback #{p}: {describe(a, b)}"
            for (s, v, p), vals in sorted(got.calls.items())
            for a, b in zip(vals, single.calls[(s, v, p)])
            if not _same(a, b, facts.loose((s, v), accumulated=False))]
    assert not args, "callbacks got other gradients than in backward():\n" + "\n".join(args)
    if ref is not None:
        args = [f"step {s} v{v} callback #{p}: {describe(a, b)}"
                for (s, v, p), vals in sorted(got.calls.items())
                for a, b in zip(vals, ref.calls.get((s, v, p), []))
                if not _same(a, b, facts.loose((s, v), accumulated=False))]
        assert not args, "callbacks got other gradients than autograd's:\n" + "\n".join(args)
    wrong = [(c.step, c.vid, c.pos) for c in got.call_facts if not c.tensor_ok]
    assert not wrong, f"callbacks did not get the attached tensor: {wrong[:5]}"
    wrong = [(c.step, c.vid, c.pos) for c in got.call_facts if c.backwarding_ok is False]
    assert not wrong, f"get_backwarding_grad_manager() in a callback was not gm: {wrong[:5]}"
    expected_step = {e: got.step_ids[k] for e, (_, k) in enumerate(case.events)}
    wrong = [(e, s) for e, s in got.step_checks if s != expected_step[e]]
    assert not wrong, ("gm.step inside a callback was not its backward's recording "
                       f"(event, gm.step): {wrong[:5]}; recordings {got.step_ids}")

    # hooks and retained gradients
    check_hooks(got, single, facts)
    nones, values = [], []
    for key in sorted(set(got.retained) | set(single.retained)):
        a, b = got.retained.get(key), single.retained.get(key)
        if (a is None) != (b is None):
            nones.append(f"v{_key(key)}: split {_kind(a)}, backward() {_kind(b)}")
        elif not (_same(a, b, facts.loose(key)) or (a.dtype == b.dtype
                                                     and np.array_equal(a, b))):
            # (equal values: finish() adds the zero stand-in to a boundary node's output's
            # retained .grad, as documented, which turns -0.0 into 0.0)
            values.append(f"v{_key(key)}: {describe(a, b)}")
    assert not nones, "retain_grad(): None where backward() has a .grad or vice versa:\n" + \
        "\n".join(nones)
    assert not values, "retain_grad(): .grad differs from backward():\n" + "\n".join(values)
    check_post_hooks(got, single)

    # (PyTorch itself lets a leaf's .grad alias dy in some graphs, in backward() too: only
    # what the split adds counts)
    storage = [p for p in got.storage if p not in single.storage]
    assert not storage, ".grad shares storage (not in backward()):\n" + "\n".join(storage)
    layout = [p for p in got.layout if p not in single.layout]
    assert not layout, ".grad layout (not as in backward()):\n" + "\n".join(layout)
    assert not _state.state.recording and not _state.state.backwarding, "state left behind"


def check_parts(case: SplitCase, got: Run, single: Run, facts: Facts) -> None:
    """``backward_split`` changes only the now tensors of its micro-batch (and gives them the
    single backward's ``.grad`` of that step); ``finish()`` only its micro-batch's others;
    each callback runs in the part of its tensor; the after-backward callback runs once per
    micro-batch, in ``finish()``."""
    single_end = {k: single.at_end[e] for e, (what, k) in enumerate(case.events)
                  if what == "split"}
    wrong_change, wrong_value, wrong_calls = [], [], []
    for e, (what, k) in enumerate(case.events):
        if what == "record":
            allowed: Set[Tuple[int, int]] = set()
        elif what == "split":
            allowed = {(SHARED, v) for v in facts.shared & facts.now} | {
                (k, v) for v in facts.now}
        else:
            allowed = {(SHARED, v) for v in facts.shared - facts.now} | {
                (k, v) for v in set(case.program.attached()) - facts.now}
        bad = [_key(key) for key in got.changed[e] if key not in allowed]
        if bad:
            wrong_change.append(f"{what}{k} changed the .grad of v{', v'.join(bad)}")
        if what == "split":
            for key in sorted(allowed):
                if key in got.at_end[e] and not _same(got.at_end[e][key],
                                                      single_end[k].get(key),
                                                      facts.loose(key)):
                    wrong_value.append(f"after split{k}: v{_key(key)}: "
                                       f"{describe(got.at_end[e][key], single_end[k].get(key))}")
        for ev, step, vid in got.call_events:
            if ev != e:
                continue
            ok = (what == "split" and vid in facts.now) or (what == "finish" and vid not in
                                                             facts.now)
            if not ok or step != k:
                wrong_calls.append(f"v{vid}'s callback (step {step}) ran in {what}{k}")
    assert not wrong_change, "a part changed a .grad it should not have:\n" + \
        "\n".join(wrong_change)
    assert not wrong_value, ("the first part's .grad differs from backward()'s .grad after "
                             "that micro-batch:\n" + "\n".join(wrong_value))
    assert not wrong_calls, "callbacks ran in the wrong part:\n" + "\n".join(sorted(
        set(wrong_calls)))

    if case.after_backward:
        finish_of = {k: e for e, (what, k) in enumerate(case.events) if what == "finish"}
        seen = [(a.event, a.step) for a in got.after]
        want = sorted((finish_of[k], k) for k in finish_of)
        assert sorted(seen) == want, (
            f"after-backward callbacks ran at (event, micro-batch) {seen}, expected once in "
            f"each finish(): {want}")
        wrong_step = [(a.step, a.gm_step) for a in got.after
                      if a.gm_step != got.step_ids[a.step] or
                      a.gm_step != got.deferred_steps.get(a.step)]
        assert not wrong_step, (f"gm.step in the after-backward callback (micro-batch, step): "
                                f"{wrong_step}; recordings {got.step_ids}")
        touched = [(a.step, a.touched) for a in got.after if a.touched]
        assert not touched, (f"an after-backward callback saw .grad already written in "
                             f"finish(): {touched}")
        early = [(a.step, a.calls_seen, got.event_calls[a.event][1] - got.event_calls[a.event][0])
                 for a in got.after
                 if a.calls_seen != got.event_calls[a.event][1] - got.event_calls[a.event][0]]
        assert not early, ("the after-backward callback ran before all callbacks of finish() "
                           f"(micro-batch, seen, total): {early}")
        lazies = [(a.step, a.lazies_done) for a in got.after if a.lazies_done]
        assert not lazies, f"Futures of finish() resolved before the after-backward: {lazies}"


def check_hooks(got: Run, single: Run, facts: Facts) -> None:
    """A logged tensor hook sees the same gradients as in backward(); the split may add calls
    with zeros (a boundary node's output, called again when the rest runs the node; with a
    tied weight, also a first-part node between its uses, once per rest run through it)."""
    bad = []
    for key in sorted(set(got.hooks) | set(single.hooks)):
        mine, theirs = got.hooks.get(key, []), single.hooks.get(key, [])
        extra = len(mine) - len(theirs)
        if extra < 0:
            bad.append(f"v{_key(key)}: hook ran {len(mine)}x, in backward() {len(theirs)}x")
            continue
        if extra:
            zeros = [i for i, g in enumerate(mine) if not np.any(g)]
            if len(zeros) < extra:
                bad.append(f"v{_key(key)}: {extra} extra hook calls, "
                           f"{extra - len(zeros)} with a non-zero gradient")
                continue
            drop = set(zeros[-extra:])
            mine = [g for i, g in enumerate(mine) if i not in drop]
        for a, b in zip(mine, theirs):
            if not _same(a, b, facts.loose(key)) and not (not np.any(a) and not np.any(b)):
                bad.append(f"v{_key(key)}: hook got {describe(a, b)}")
    assert not bad, "tensor hooks saw other gradients than in backward():\n" + "\n".join(bad)


def check_post_hooks(got: Run, single: Run) -> None:
    """Post-accumulate-grad hooks: once per micro-batch for each parameter that got a gradient,
    each seeing the ``.grad`` accumulated by then (that of the end of its event)."""
    mine = sorted((s, v) for _, s, v, _ in got.post)
    theirs = sorted((s, v) for _, s, v, _ in single.post)
    assert mine == theirs, f"post-accumulate-grad hooks ran for {mine}, in backward() {theirs}"
    stale = [(s, v) for e, s, v, a in got.post
             if not same_bits(a, got.at_end[e].get((SHARED, v)))]
    assert not stale, f"post-accumulate-grad hooks saw a .grad other than the final one: {stale}"


# =========================================================================== strategies
@st.composite
def schedules(draw, n_steps: int) -> Tuple[Tuple[str, int], ...]:
    """Micro-batches recorded and split in order; each split outstanding until a finish drawn
    at some later point: inside the next recording (between its forward and its split), after
    a split, or at the end, in any order."""
    events: List[Tuple[str, int]] = []
    pending: List[int] = []

    def finish_some():
        for _ in range(draw(st.integers(0, len(pending)))):
            events.append(("finish", pending.pop(draw(st.integers(0, len(pending) - 1)))))

    for k in range(n_steps):
        events.append(("record", k))
        finish_some()
        events.append(("split", k))
        pending.append(k)
        if k < n_steps - 1:
            finish_some()
    while pending:
        events.append(("finish", pending.pop(draw(st.integers(0, len(pending) - 1)))))
    return tuple(events)


def aliases_of_attached(program: Program) -> Set[int]:
    """Values that are an attached intermediate changed in place (the same tensor object)."""
    attached = set(program.attached())
    alias: Set[int] = set()
    for i, op in enumerate(program.ops):
        if op.name in INPLACE and (op.args[0] in attached or op.args[0] in alias):
            alias.add(program.vid_of_op(i))
    return alias


def _hookable(program: Program) -> List[int]:
    """Op results a user may hook or retain here: they require grad, are not leaves, are not
    changed in place later, are not an attached tensor changed in place (``retain_grad()``
    there doubles its ``.grad`` in any backward, split or not: left as it is) and are not
    made inside a checkpoint."""
    rg = requires_grad_values(program)
    skip = set(live_after_inplace(program)) | leafy_values(program) | \
        aliases_of_attached(program)
    if program.segment is not None:
        skip |= {program.vid_of_op(i) for i in range(*program.segment)}
    return [program.vid_of_op(i) for i in range(len(program.ops))
            if program.vid_of_op(i) in rg and program.vid_of_op(i) not in skip]


@st.composite
def split_cases(draw, program_strategy, max_steps: int = 1, checkpoint: Optional[str] = None,
                pipeline_first: bool = False) -> SplitCase:
    program = draw(program_strategy)
    hookable = _hookable(program)
    attached_ops = set(program.attached_ops())
    # more hooks (scaling: zero stays zero) on intermediates that are not attached
    extra = [v for v in hookable if v not in attached_ops and program.hook_of(v) is None
             and draw(st.integers(0, 3)) == 3]
    if extra:
        program = dataclasses.replace(program, hooks=program.hooks + tuple(
            (v, draw(st.sampled_from((2.0, -1.0, 0.5))), True) for v in extra))
    # retain_grad() on an attached tensor is refused (both gradmgr and the engine would write
    # its .grad; test_torch_correctness checks the error): only on tensors that are not attached
    retain = tuple(v for v in hookable if v not in attached_ops and draw(st.integers(0, 3)) == 3)
    watch = tuple(sorted({v for v, _, _ in program.hooks if v in hookable} | set(retain)))
    attached = program.attached()
    activations = [v for v in attached if v >= program.n_leaves
                   or program.leaves[v].kind == "input"]
    use_activations = activations and (pipeline_first or draw(st.booleans()))
    pool = activations if use_activations else attached
    first = tuple(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=len(pool),
                                unique=True)))
    if draw(st.integers(0, 7)) == 7:
        first += first[:1]  # a tensor named twice is the same as once
    n_steps = draw(st.integers(1, max_steps))
    events = draw(schedules(n_steps))
    return SplitCase(program, first, events, retain, watch, draw(st.booleans()),
                     len(first) == 1 and draw(st.booleans()), checkpoint)


def rest_runs(case: SplitCase) -> List[Tuple[Set[int], Set[int]]]:
    """The split's plan, computed on the program's values the way the split plans on nodes
    (first-part nodes, climbs from each tensor of the rest to its boundary, groups of climbs
    that meet): per engine run of the rest, ``(boundary values, first-part values it runs
    with their gradients dropped)``. ``-1`` is the loss node when ``y`` is a loss."""
    program = case.program
    anc, now, paths = dict(ancestors(program)), now_set(program, case.first), \
        path_counts(program)
    rg, first, attached = requires_grad_values(program), set(case.first), set(program.attached())
    loss = program.output.kind.startswith("loss")
    if loss:
        anc[-1] = set(program.output.terms).union(*(anc[t] for t in program.output.terms))
    parents: Dict[int, List[int]] = defaultdict(list)
    for i, op in enumerate(program.ops):
        for a in set(op.args):
            if a in rg:
                parents[a].append(program.vid_of_op(i))
    if loss:
        for t in program.output.terms:
            parents[t].append(-1)
    live = {v for v in anc if v == -1 or paths.get(v, 0)}
    on_first = {v for v in live if ({v} | anc[v]) & first}
    merged: List[Tuple[Set[int], Set[int]]] = []  # (boundary, rest-only values and tensors)
    for t in program.attached():
        if t in now or t not in live:
            continue
        boundary, seen, stack = set(), set(), [t]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            for p in parents[v]:
                if p in live:
                    (boundary.add if p in on_first else stack.append)(p)
        for other in [m for m in merged if m[0] & boundary or m[1] & seen]:
            merged.remove(other)
            boundary, seen = boundary | other[0], seen | other[1]
        merged.append((boundary, seen))
    runs = []
    for boundary, nodes in merged:
        tensors = nodes & attached
        ran = {v for b in boundary for v in anc[b]
               if v in on_first and ({v} | anc[v]) & tensors} - boundary
        runs.append((boundary, ran))
    return runs




ACTIVATIONS = ("tanh", "sigmoid", "relu", "sin", "square", "scale", "neg", "exp")


@st.composite
def stage_programs(draw) -> Program:
    """A pipeline stage: ``h = act(h @ W_i + b_i)`` for 1-3 layers from the stage input
    ``x`` (attached while recording), some weights tied to an earlier layer's, an optional
    second input added to a layer's output, some layer outputs attached (activations),
    callbacks on some tensors, hooks on some layer outputs (the outputs of nodes that feed
    both the input path and a weight), several outputs with dy or a loss, and optionally a
    weight-decay term that does not depend on the inputs."""
    d_in, d, b = (draw(st.integers(1, 4)) for _ in range(3))
    n_layers = draw(st.integers(1, 3))
    layouts = ("contiguous", "contiguous", "strided", "transposed")
    leaves = [Leaf((b, d_in), "input", draw(st.sampled_from(layouts)) if d_in > 1 and b > 1
                   else "contiguous", late=True)]
    x2 = None
    if draw(st.integers(0, 2)) == 2:
        leaves.append(Leaf((b, d), "input", late=draw(st.booleans())))
        x2 = len(leaves) - 1
    weights: List[int] = []
    for i in range(n_layers):
        shape = (d_in if i == 0 else d, d)
        tie = [w for w in weights if leaves[w].shape == shape]
        if tie and draw(st.booleans()):
            weights.append(draw(st.sampled_from(tie)))
        else:
            leaves.append(Leaf(shape, "param", draw(st.sampled_from(layouts))))
            weights.append(len(leaves) - 1)
    biases: List[Optional[int]] = []
    for _ in range(n_layers):
        if draw(st.booleans()):
            leaves.append(Leaf((d,), "param"))
            biases.append(len(leaves) - 1)
        else:
            biases.append(None)
    n = len(leaves)
    ops: List[Op] = []
    outs: List[int] = []
    residual_at = draw(st.integers(0, n_layers - 1))
    h = 0
    for i in range(n_layers):
        ops.append(Op("matmul", (h, weights[i]), (), attach=draw(st.integers(0, 4)) == 4))
        h = n + len(ops) - 1
        if biases[i] is not None:
            ops.append(Op("add", (h, biases[i])))
            h = n + len(ops) - 1
        if x2 is not None and i == residual_at:
            ops.append(Op("add", (h, x2)))
            h = n + len(ops) - 1
        act = draw(st.sampled_from(ACTIVATIONS))
        ops.append(Op(act, (h,), (draw(st.sampled_from((2.0, 0.5, -1.0))),)
                      if act == "scale" else (), attach=draw(st.integers(0, 5)) == 5))
        h = n + len(ops) - 1
        outs.append(h)
    terms = [h]
    if len(outs) > 1 and draw(st.integers(0, 2)) == 2:
        terms.append(draw(st.sampled_from(outs[:-1])))  # a side output (several ys with dy)
    if draw(st.integers(0, 3)) == 3:
        ops.append(Op("square", (weights[0],)))  # weight decay: no path to the inputs
        terms.append(n + len(ops) - 1)
    kind = draw(st.sampled_from(("tensors", "tensors", "loss_dy", "tensor")))
    if kind == "tensor":
        terms = terms[:1]
    reductions = tuple(draw(st.sampled_from(("sum", "mean"))) for _ in terms) \
        if kind.startswith("loss") else ()
    output = Output(kind, tuple(terms), reductions)
    attached = [v for v, leaf in enumerate(leaves) if leaf.kind in ("param", "input")] + [
        n + i for i, op in enumerate(ops) if op.attach]
    chains = tuple((v, draw(callback_chains("torch", max_len=2))) for v in attached
                   if draw(st.integers(0, 2)) == 2)
    chains = tuple((v, c) for v, c in chains if c)
    layer_outputs = [n + i for i, op in enumerate(ops) if op.name == "matmul"]
    hooks = tuple((v, draw(st.sampled_from((2.0, -1.0, 0.5))), draw(st.booleans()))
                  for v in layer_outputs if draw(st.integers(0, 2)) == 2)
    return Program(tuple(leaves), tuple(ops), output, chains,
                   seed=draw(st.integers(0, 2**16)),
                   dtype=draw(st.sampled_from(("float32", "float32", "float64"))),
                   hooks=hooks, post_hooks=draw(st.integers(0, 2)) == 2,
                   split_attach=draw(st.integers(0, 3)) == 3)


def _run_all(case: SplitCase, with_reference: bool = True):
    note(case.pretty())
    describe_case(case)
    ref = reference_case(case) if with_reference else None
    single = run_case(case, split=False)
    got = run_case(case, split=True)
    rounded = _ROUNDED[0]
    check_split(case, got, single, ref)
    if _ROUNDED[0] != rounded:
        event("summed in another order: equal within the tolerance, not bit for bit")


def describe_case(case: SplitCase) -> None:
    """Hypothesis events (``--hypothesis-show-statistics``): what the examples covered."""
    program = case.program
    finishes = [k for e, k in case.events if e == "finish"]
    inside = any(e == "finish" and any(e2 == "record" and i2 < i and not any(
        e3 == "split" and k3 == k2 and i2 < i3 < i for i3, (e3, k3) in enumerate(case.events))
        for i2, (e2, k2) in enumerate(case.events)) for i, (e, _) in enumerate(case.events))
    kinds = {"input" if v < program.n_leaves else "intermediate" for v in case.first
             if v >= program.n_leaves or program.leaves[v].kind == "input"}
    event(f"micro-batches: {case.n_steps}")
    if finishes != sorted(finishes):
        event("finished out of order")
    if inside:
        event("finish() inside another recording")
    event(f"first has: {sorted(kinds) or ['params only']}")
    if any(count > 1 for count in path_counts(program).values()):
        event("a value reached by several paths")
    if program.callbacks:
        event("callbacks")
    if program.hooks or case.retain:
        event("hooks or retain_grad")
    hooked = {v for v, _, _ in program.hooks} | set(case.retain)
    if any(b & hooked for b, _ in rest_runs(case)):
        event("hook/retain on a boundary output")
    if program.output.kind in ("tensor", "tensors") and len(program.output.terms) > 1:
        event("several outputs with dy")


# =========================================================================== explicit cases
# A two-layer stage: x (attached while recording) -> x @ W1 (hooked, retained: a boundary
# node's output) -> tanh -> @ W2 (tied to nothing) -> two outputs with dy; callbacks on W1.
_LINEAR = SplitCase(
    Program(
        leaves=(Leaf((3, 4), "input", late=True), Leaf((4, 4), "param"), Leaf((4,), "param"),
                Leaf((4, 4), "param")),
        ops=(Op("matmul", (0, 1)), Op("add", (4, 2)), Op("tanh", (5,)), Op("matmul", (6, 3)),
             Op("sigmoid", (7,))),
        output=Output("tensors", (8, 6)),
        callbacks=((1, (Callback("scale", 0.5), Callback("future_lazy", 2.0))),
                   (2, (Callback("identity"),))),
        hooks=((4, 2.0, True),), post_hooks=True),
    first=(0,), retain=(4, 6), watch=(4, 6))
# Tied weights: W used by both layers; the second layer's input path and W meet at the
# boundary; over three micro-batches finished in reverse, one inside the next recording.
_TIED = SplitCase(
    Program(
        leaves=(Leaf((2, 3), "input", late=True), Leaf((3, 3), "param")),
        ops=(Op("matmul", (0, 1)), Op("tanh", (2,)), Op("matmul", (3, 1)), Op("sin", (4,))),
        output=Output("tensors", (5,)),
        callbacks=((1, (Callback("scale", 3.0),)),)),
    first=(0,),
    events=(("record", 0), ("split", 0), ("record", 1), ("split", 1), ("record", 2),
            ("finish", 1), ("split", 2), ("finish", 2), ("finish", 0)),
    retain=(2,), watch=(2,))
# An attached activation between x and the weights, with callbacks, in first together with x.
_ACTIVATION = SplitCase(
    Program(
        leaves=(Leaf((2, 3), "input", late=True), Leaf((3, 3), "param"), Leaf((3, 2), "param")),
        ops=(Op("matmul", (0, 1), attach=True), Op("relu", (3,)), Op("matmul", (4, 2))),
        output=Output("loss_dy", (5,), ("sum",)),
        callbacks=((3, (Callback("scale", 2.0),)), (2, (Callback("future_resolved", 0.5),)))),
    first=(0, 3),
    events=(("record", 0), ("split", 0), ("record", 1), ("split", 1), ("finish", 1),
            ("finish", 0)))


# =========================================================================== the tests
@differential_settings(250)
@example(case=_LINEAR)
@example(case=_ACTIVATION)
@given(case=split_cases(programs("torch")))
def test_split_matches_single_backward(case):
    """One micro-batch of a generated program: ``first`` any nonempty subset of the attached
    tensors (often inputs and attached intermediates), callbacks, hooks, retained gradients,
    several outputs with dy."""
    _run_all(case)


@differential_settings(200)
@example(case=_TIED)
@given(case=split_cases(stage_programs(), max_steps=3, pipeline_first=True))
def test_pipeline_stage_micro_batches(case):
    """Pipeline stages over 1-3 micro-batches, the splits outstanding together and finished in
    any order, some ``finish()`` inside the next micro-batch's recording."""
    _run_all(case)


@differential_settings(120)
@given(case=split_cases(
    programs("torch", output_kinds=("loss_dy", "tensors", "tensor")), max_steps=3))
def test_generated_programs_over_micro_batches(case):
    """Generated programs over 1-3 micro-batches (each with its own data and dy; parameters
    shared and accumulated), splits finished in any order."""
    _run_all(case)


@differential_settings(50)
@given(case=split_cases(
    programs("torch", inplace_attached=True).filter(inplace_on_attached)))
def test_inplace_on_an_attached_intermediate(case):
    """S8: an attached intermediate changed in place afterwards gets its snapshot's gradient;
    the split must agree, whichever part the snapshot falls in."""
    _run_all(case)


CHECKPOINTED = programs("torch", checkpoint=True, output_kinds=("loss", "loss_dy", "tensors")
                        ).filter(lambda p: p.segment is not None)


@differential_settings(60)
@given(case=split_cases(CHECKPOINTED, checkpoint="non_reentrant"))
def test_non_reentrant_checkpoint(case):
    """``torch.utils.checkpoint(..., use_reentrant=False)`` inside the split graph: the boundary
    nodes run twice (once per part), so the segment is recomputed in each part."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*None of the inputs.*")
        _run_all(case)


@st.composite
def misnamed_first(draw):
    """A program, a list of attached tensors for ``first``, and something not attached to
    insert into it: a free or constant leaf, an op result that is not attached, a tensor
    attached to another manager, a fresh tensor."""
    program = draw(programs("torch"))
    attached = program.attached()
    firsts = draw(st.lists(st.sampled_from(attached), max_size=3, unique=True))
    attached_set = set(attached)
    others = [("leaf", v) for v, leaf in enumerate(program.leaves) if v not in attached_set]
    others += [("op", program.vid_of_op(i)) for i, op in enumerate(program.ops)
               if not op.attach and program.vid_of_op(i) not in live_after_inplace(program)]
    others += [("other manager", 0), ("fresh", 0)]
    bad = draw(st.sampled_from(others))
    return program, tuple(firsts), bad, draw(st.integers(0, len(firsts)))


@differential_settings(40)
@given(spec=misnamed_first())
def test_first_not_attached_raises_value_error(spec):
    """``first`` naming a tensor that is not attached raises ``ValueError`` naming the item,
    before anything runs: no callback, no ``.grad`` written, no after-backward callback, the
    recording ended; the manager then works as before (a plain backward in a new recording
    gives autograd's gradients)."""
    program, firsts, (kind, vid), position = spec
    note(program.pretty())
    note(f"first = {[f'v{v}' for v in firsts]} with {kind} v{vid} at position {position}")
    log = CallLog()
    gm = gradmgr.GradManager()
    after = []
    gm.register_after_backward_callback(lambda: after.append(1))
    leaves = step_leaves(program, 0, None, reference=False)
    add_leaf_hooks(program, leaves)
    objs = {}

    def attach(v, t):
        objs[v] = t
        gm.attach(t, callbacks=make_chain(program.chain(v), v, log, ENG, "gm"))

    for v in program.attached_leaves():
        if not program.leaves[v].late:
            attach(v, leaves[v])
    other = gradmgr.GradManager()
    with gm:
        built = build(program, ENG, leaves, attach)
        if kind == "leaf":
            bad = leaves[vid]
        elif kind == "op":
            bad = built.values[vid]
        elif kind == "other manager":
            bad = torch.ones(2)
            other.attach(bad)
        else:
            bad = torch.ones(2, requires_grad=True)
        items = [objs[v] for v in firsts]
        items.insert(position, bad)
        with pytest.raises(ValueError, match=rf"item {position} .*not attached"):
            gm.backward_split(built.y, built.dy, first=items)
    assert not log.calls, "callbacks ran before the error"
    assert not after, "the after-backward callback ran"
    assert all(t.grad is None for t in leaves), "a .grad was written before the error"
    assert not _state.state.recording and not _state.state.backwarding, "state left behind"
    # the manager still works: a new recording and a plain backward give autograd's gradients
    if any(program.leaves[v].late for v in program.attached_leaves()):
        return  # late leaves would be attached twice; the plain path is tested elsewhere
    log2 = CallLog()
    gm2 = gradmgr.GradManager()
    ref = reference_program(program, ["start"])
    with gm:
        built = build(program, ENG, leaves, lambda v, t: objs.__setitem__(v, t) or gm.attach(
            t, callbacks=make_chain(program.chain(v), v, log2, ENG, "gm")))
        gm.backward(built.y, built.dy)
    del gm2
    for v in program.attached_leaves():
        want = ref.steps[0].grads.get(v)
        assert same_bits(_np(leaves[v].grad), want), (
            f"after the error, v{v}.grad differs from autograd: "
            f"{describe(_np(leaves[v].grad), want)}")


def test_finish_errors_are_clear():
    """``finish()`` twice, ``backward_split`` outside a recording, a ``dy`` of the wrong shape,
    a ``first`` that is not a tensor or a list of them."""
    w = torch.randn(3, 3, requires_grad=True)
    gm = gradmgr.GradManager().attach(w)
    with pytest.raises(RuntimeError, match="record"):
        gm.backward_split((w * 2).sum(), first=[w])
    with gm:
        x = torch.randn(2, 3)
        gm.attach(x)
        rest = gm.backward_split((x @ w).sum(), first=[x])
    rest.finish()
    assert rest.done
    with pytest.raises(RuntimeError, match="already finished"):
        rest.finish()
    with gm, pytest.raises(ValueError, match="shape"):
        x = torch.randn(2, 3)
        gm.attach(x)
        gm.backward_split(x @ w, torch.ones(3, 3), first=[x])
    with gm, pytest.raises(ValueError, match="not attached"):
        x = torch.randn(2, 3)
        gm.attach(x)
        gm.backward_split((x @ w).sum(), first=[x, np.ones(2)])
    assert not _state.state.recording and not _state.state.backwarding


def test_finish_inside_a_callback_of_the_same_manager_raises():
    """``finish()`` from a callback of a backward of the same manager is refused with a
    ``RuntimeError`` saying so; the deferred backward can be finished afterwards (once) and
    then gives the plain backward's gradients. (Bug E: the refusal used to spend it.)"""
    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    x0 = torch.randn(2, 3)
    want = torch.autograd.grad((x0 @ w).sum(), [w])[0]
    caught = []
    pending = []

    def cb(t, g):
        if pending:
            try:
                pending[0].finish()
            except RuntimeError as e:
                caught.append(str(e))
        return g

    gm = gradmgr.GradManager().attach(w)
    with gm:
        x = x0.clone()
        gm.attach(x)
        pending.append(gm.backward_split((x @ w).sum(), first=[x]))
    v = torch.ones(2, requires_grad=True)
    gm.attach(v, callbacks=cb)
    with gm:
        gm.backward((v * 2).sum())
    assert caught and "same manager" in caught[0], caught
    if not pending[0].done:
        pending[0].finish()
    assert torch.equal(w.grad, want)
    assert pending[0].done


# =========================================================================== fixed bugs
# Minimal cases of the bugs this file found, each failing on the code before its fix.
def _bug(case: SplitCase, what: str):
    """A case of the bug ``what`` ("B: ..."), named by its letter."""
    return pytest.param(case, id=what.split(":", 1)[0])


_X = Leaf((3, 2), "input", late=True)
BUG_CASES = [
    _bug(SplitCase(Program(  # y = -w alone, first = [x] that y does not depend on
        leaves=(Leaf((3,), "param"), Leaf((3,), "input", late=True)),
        ops=(Op("neg", (0,)),), output=Output("tensor", (2,))),
        first=(1,), retain=(2,), watch=(2,)),
        "B: hooks and "
        "retain_grad() on a y that no first tensor is reached from run twice with dy"),
    _bug(SplitCase(Program(  # first = [h], h = tanh(x @ W1) attached; y = h @ W2
        leaves=(_X, Leaf((2, 2), "param"), Leaf((2, 2), "param")),
        ops=(Op("matmul", (0, 1)), Op("tanh", (3,), attach=True), Op("matmul", (4, 2))),
        output=Output("tensors", (5,))),
        first=(4,)),
        "C: the tensors below an "
        "attached intermediate in first get no gradient"),
    _bug(SplitCase(Program(  # h = -w attached, h *= 2, h += w; first = [h]; callback on w
        leaves=(Leaf((1,), "param"),),
        ops=(Op("neg", (0,), attach=True), Op("mul_const_", (1,), (2.0,)), Op("add_", (2, 0))),
        output=Output("loss", (3,), ("sum",)), callbacks=((0, (Callback("identity"),)),)),
        first=(1,)),
        "D: an attached "
        "intermediate changed in place, in first, gets its gradient twice"),
    _bug(SplitCase(Program(  # h = -x attached with a hook is an output; first = [z]
        leaves=(Leaf((1,), "input"), Leaf((1,), "input")),
        ops=(Op("neg", (1,)), Op("neg", (0,), attach=True)),
        output=Output("tensors", (2, 3)), hooks=((3, 2.0, False),)),
        first=(1,)),
        "G: an "
        "attached output with a hook, left for finish(), gets its gradient before the hook"),
    _bug(SplitCase(Program(  # tanh(tanh(tanh(x @ W1) @ W2) @ W1), first = [x]
        leaves=(_X, Leaf((2, 2), "param"), Leaf((2, 2), "param")),
        ops=(Op("matmul", (0, 1)), Op("tanh", (3,)), Op("matmul", (4, 2)), Op("tanh", (5,)),
             Op("matmul", (6, 1)), Op("tanh", (7,))),
        output=Output("tensors", (8,))),
        first=(0,)),
        "H: a tied weight "
        "with another weight between its uses: finish() raises RuntimeError"),
    _bug(SplitCase(Program(  # tanh(tanh(x @ w) @ w) with a hook on the inner tanh
        leaves=(_X, Leaf((2, 2), "param")),
        ops=(Op("matmul", (0, 1)), Op("tanh", (2,)), Op("matmul", (3, 1)), Op("tanh", (4,))),
        output=Output("tensors", (5,)), hooks=((3, 2.0, True),)),
        first=(0,), watch=(3,)),
        "I: a hook between "
        "two uses of a tied weight is called with None in finish()"),
    _bug(SplitCase(Program(  # h = x @ W attached with a callback; tanh(h) + weight decay
        leaves=(_X, Leaf((2, 2), "param")),
        ops=(Op("matmul", (0, 1), attach=True), Op("tanh", (2,)), Op("square", (1,))),
        output=Output("loss", (3, 4), ("sum", "sum")),
        callbacks=((2, (Callback("scale", 0.5),)), (1, (Callback("identity"),)))),
        first=(0,)),
        "J: an attached "
        "intermediate whose node is a boundary runs its callbacks again in finish()"),
]


@pytest.mark.parametrize("case", BUG_CASES)
def test_fixed_split_bugs(case):
    _check_case(case)


def _check_case(case: SplitCase) -> None:
    ref = reference_case(case)
    single = run_case(case, split=False)
    got = run_case(case, split=True)
    check_split(case, got, single, ref)


def test_hooks_after_inplace_on_an_attached_intermediate():
    """Bug F (plain ``backward()`` too): an attached intermediate changed in place, then two
    tensor hooks on it; the tape's hook-ordering step raised KeyError."""
    case = SplitCase(Program(
        leaves=(Leaf((1,), "input"),),
        ops=(Op("neg", (0,), attach=True), Op("mul_const_", (1,), (2.0,))),
        output=Output("loss", (2,), ("sum",)), hooks=((2, 2.0, True),)),
        first=(0,), watch=(2,))
    for split in (False, True):
        run = run_case(case, split=split)
        assert run.error is None, run.error
    _check_case(case)


def test_no_warning_when_the_forward_overflows_between_tied_uses():
    """Bug L: a tied weight with a layer between its uses whose forward overflows to inf: the
    split gives backward()'s gradients (nan there too) and warns no more than backward() does
    (the zeros ``finish()`` passes between the uses became nan there, 0 * inf, and the
    boundary node took them for a hook's result)."""
    w = torch.full((2, 2), 0.5, requires_grad=True)
    v = torch.full((2, 2), 60.0, requires_grad=True)  # exp((x @ w) @ v) overflows

    def run(split):
        w.grad = v.grad = None
        gm = gradmgr.GradManager().attach([w, v])
        with gm:
            x = torch.ones(1, 2)
            gm.attach(x)
            y = torch.tanh(torch.exp((x @ w) @ v) @ w)
            if split:
                gm.backward_split(y, torch.ones_like(y), first=[x]).finish()
            else:
                gm.backward(y, torch.ones_like(y))
        return [x.grad, w.grad, v.grad]

    single, split = run(False), run(True)
    for a, b in zip(single, split):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
