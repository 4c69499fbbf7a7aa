"""The references: what the engine alone computes for a program.

PyTorch: :func:`reference_program` and :func:`reference_two_managers` differentiate with plain
``torch.autograd.grad(ys, attached, dys, allow_unused=True)`` on fresh copies of the leaves,
apply each tensor's callback chain by hand (the same callback code, logging its arguments), and
accumulate into tensors of their own (``g.clone()`` first, ``acc + g`` later), so they share
nothing with the run under test. An attached intermediate is differentiated through
``torch.autograd.graph.get_gradient_edge`` taken when it is attached: MegEngine's snapshot
semantics (S8), which differ from the tensor's current version only after an in-place op on it.
An attached intermediate with a user tensor hook gets the gradient *after* its hooks, taken by a
hook of the reference's own registered last: what ``retain_grad()`` and AccumulateGrad see, and
what gradmgr documents. (``torch.autograd.grad`` itself returns a non-leaf input's gradient
after its hooks when the engine stops there, but before them when it goes on to other inputs
through that node.)

MegEngine: the reference is MegEngine's own ``megengine.autodiff.GradManager`` driven by the
same runner as gradmgr (:func:`diff_harness.run_managed`, :func:`diff_harness.run_two_managers`)
with the same callbacks; :func:`native_megengine` makes one.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from diff_harness import (
    CallLog,
    StepResult,
    Trace,
    apply_action,
    expected_flags,
    finish_calls,
    frozen_after,
    make_chain,
    resolve,
    second_loss,
)
from diff_interp import TorchEngine, add_leaf_hooks, build, make_leaves
from diff_program import Program


def engine_grads(ys: Sequence[Any], dys: Sequence[Any], inputs: Sequence[Any], *,
                 create_graph: bool = False, retain_graph: Optional[bool] = None) -> List[Any]:
    """``torch.autograd.grad`` over the outputs that require grad (gradmgr skips the others);
    all None when none does."""
    import torch

    pairs = [(y, d) for y, d in zip(ys, dys) if y.requires_grad]
    if not pairs or not inputs:
        return [None] * len(inputs)
    return list(torch.autograd.grad([y for y, _ in pairs], list(inputs),
                                    [d for _, d in pairs], allow_unused=True,
                                    create_graph=create_graph, retain_graph=retain_graph))


def run_chain(specs, vid: int, tensor: Any, grad: Any, log: CallLog, eng, label: str) -> Any:
    """Apply a callback chain by hand and resolve a Future at the end."""
    for cb in make_chain(specs, vid, log, eng, label):
        grad = cb(tensor, grad)
    return resolve(grad)


def reference_program(program: Program, schedule: Sequence[Any], *,
                      leaves: Optional[List[Any]] = None, label: str = "ref") -> Trace:
    """The torch reference of :func:`diff_harness.run_managed` (no checkpointing: a
    checkpointed program's reference is the same program run inline)."""
    import torch

    eng = TorchEngine()
    leaves = leaves if leaves is not None else make_leaves(program, eng, reference=True)
    add_leaf_hooks(program, leaves)
    n = program.n_leaves
    log = CallLog()
    acc: Dict[int, Any] = {v: None for v in program.attached_leaves()}
    trace = Trace()
    for step, action in enumerate(schedule):
        apply_action(action, leaves, eng, program, grads=acc)
        log.step = step
        inputs = [(v, leaves[v], leaves[v]) for v in program.attached_leaves()
                  if not program.leaves[v].late and leaves[v].requires_grad]

        def on_attach(vid, t, inputs=inputs):
            if vid < n:
                if t.requires_grad:
                    inputs.append((vid, t, t))
                return
            if not t.requires_grad:  # made from constants only: attaching makes it a leaf
                t.requires_grad_(True)
            inputs.append((vid, t, torch.autograd.graph.get_gradient_edge(t)))

        captured: Dict[int, Any] = {}

        def on_made(vid, t, captured=captured):
            if program.hook_of(vid) is not None and vid in program.attached_ops():
                t.register_hook(lambda grad, vid=vid: captured.__setitem__(vid, grad))

        built = build(program, eng, leaves, on_attach, on_made=on_made)
        grads = engine_grads(built.ys, built.dys, [x for _, _, x in inputs])
        # an intermediate with a user hook: the gradient after the hooks (see the docstring)
        grads = [captured.get(vid, g) for (vid, _, _), g in zip(inputs, grads)]
        made: Dict[int, Any] = {v: None for v in program.attached_ops()}
        reached = set()
        for (vid, tensor, _), g in zip(inputs, grads):
            if g is None:
                continue
            reached.add(vid)
            g = run_chain(program.chain(vid), vid, tensor, g, log, eng, label)
            if vid < n:
                acc[vid] = g.clone() if acc[vid] is None else acc[vid] + g
            else:
                made[vid] = g.clone()
        result = {v: _np(eng, g) for v, g in {**acc, **made}.items()}
        attached = set(program.attached_leaves())
        trace.steps.append(StepResult(
            result, {v: None for v in range(n) if v not in attached},
            expected_flags(program, frozen_after(schedule, step)), reached))
    finish_calls(trace, log, eng)
    return trace


def reference_two_managers(case: Any) -> Trace:
    """The torch reference of :func:`diff_harness.run_two_managers`: ``create_graph`` exactly
    where MegEngine's semantics record a backward (S10: a later manager's backward while an
    earlier one, not of its group, records), ``retain_graph`` where the graph is used again."""
    import torch

    program = case.program
    eng = TorchEngine()
    leaves = make_leaves(program, eng, reference=True)
    log = CallLog()
    built = build(program, eng, leaves)
    acc: Dict[int, Any] = {}

    def deliver(label, items, ys, dys, **kw):
        grads = engine_grads(ys, dys, [leaves[v] for v, _ in items], **kw)
        for (vid, specs), g in zip(items, grads):
            if g is not None:
                g = run_chain(specs, vid, leaves[vid], g, log, eng, label)
                acc[vid] = g if acc.get(vid) is None else acc[vid] + g
        log.settle(eng)

    def ones(y):
        return [torch.ones_like(y)]

    mode, ys, dys = case.mode, built.ys, built.dys
    if mode == "nested":
        deliver("m2", case.second, ys, dys, create_graph=True)
        loss = second_loss(case, eng, built.values, [acc.get(v) for v, _ in case.second])
        if loss is not None:
            deliver("m1", case.first, [loss], ones(loss))
    elif mode == "group":
        deliver("m1", case.first, ys, dys, retain_graph=True)
        y2 = second_loss(case, eng, built.values, [acc.get(v) for v, _ in case.first])
        deliver("m2", case.second, [y2], ones(y2))
    elif mode == "same_y_inner_first":
        deliver("m2", case.second, ys, dys, create_graph=True)
        deliver("m1", case.first, ys, dys)
    else:
        deliver("m1", case.first, ys, dys, retain_graph=True)
        deliver("m2", case.second, ys, dys)
    attached = sorted({v for v, _ in case.first} | {v for v, _ in case.second})
    trace = Trace()
    trace.steps.append(StepResult({v: _np(eng, acc.get(v)) for v in attached},
                                  {v: None for v in range(program.n_leaves)
                                   if v not in attached}))
    finish_calls(trace, log, eng)
    return trace


def native_megengine():
    """MegEngine's own GradManager: the reference on MegEngine tensors."""
    from megengine.autodiff import GradManager

    return GradManager()


def _np(eng, g):
    return None if g is None else eng.numpy(g)
