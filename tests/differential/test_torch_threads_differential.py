"""Managers in threads (S12) on PyTorch, against plain autograd.

Two threads each run their own manager over their own copy of a generated program (their own
data), sharing one attached parameter ``W`` (leaf ``v0``). A barrier in each manager's first
callback on ``W`` holds both backwards until both have reached it, so they overlap. Each
manager's callbacks must run exactly once per tensor in its own backward, with that thread's
reference gradient bit for bit, and each thread's other tensors get exactly their reference.

Tolerance, for ``W.grad`` only: it is ``g0 + a + b`` (``g0`` the ``.grad`` that existed before,
``a`` and ``b`` what each thread's chain delivers) summed in whichever order the threads finish.
Float addition is not associative, so the test accepts either order, ``(g0 + a) + b`` or
``(g0 + b) + a``, each compared bit for bit; with no ``g0`` both orders give the same bits.

A second test records in the main thread and runs the forward in a worker thread: gradmgr must
give ``loss.backward()``'s gradients there and must not warn (README, PyTorch notes).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from diff_harness import (  # noqa: E402
    CallLog,
    Trace,
    check_callbacks,
    check_grads,
    check_layout,
    check_outcome,
    check_storage,
    check_unattached,
    describe,
    finish_calls,
    make_chain,
    run_managed,
    same_bits,
    step_result,
    storage_problems,
)
from diff_interp import TorchEngine, build, make_leaves  # noqa: E402
from diff_program import programs  # noqa: E402
from diff_reference import reference_program  # noqa: E402
from diff_settings import differential_settings  # noqa: E402
from hypothesis import given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gradmgr  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::gradmgr.GradMgrWarning")

ENG = TorchEngine()
BARRIER_TIMEOUT = 5.0


def _shared_param(program):
    """Leaf v0 is the shared parameter: a ``param`` attached before the recording."""
    leaves = list(program.leaves)
    leaves[0] = dataclasses.replace(leaves[0], kind="param", late=False)
    return dataclasses.replace(program, leaves=tuple(leaves))


SHARED = programs("torch", force_leaf0_term=True, hooks=False).map(_shared_param)


@differential_settings(20)
@given(program=SHARED, existing=st.booleans(), rendezvous=st.booleans(),
       after_backward=st.booleans())
def test_two_threads_share_an_attached_parameter(program, existing, rendezvous,
                                                 after_backward):
    note(program.pretty())
    per_thread = [dataclasses.replace(program, seed=program.seed + 1 + k) for k in (0, 1)]
    w_data = program.leaf_data()[0]
    g0 = np.random.default_rng(program.seed).standard_normal(w_data.shape).astype(w_data.dtype)

    # references, one per thread, each on fresh leaves (W's data shared)
    refs = []
    for k, prog in enumerate(per_thread):
        leaves = make_leaves(prog, ENG, reference=True)
        leaves[0] = ENG.leaf(w_data, prog.leaves[0], True)
        refs.append(reference_program(prog, ["start"], leaves=leaves, label=f"t{k}"))

    w = ENG.leaf(w_data, program.leaves[0], True)
    if existing:  # laid out like W, as AccumulateGrad would have made it
        w.grad = torch.empty_like(w).copy_(torch.tensor(g0))
    meet = threading.Barrier(2, timeout=BARRIER_TIMEOUT)
    start = threading.Barrier(2, timeout=BARRIER_TIMEOUT)
    met = [False, False]
    traces = [None, None]
    failures = []

    def first_call_waits(k):
        calls = []

        def callback(tensor, grad):
            calls.append(1)
            if len(calls) == 1:
                try:
                    meet.wait()
                    met[k] = True
                except threading.BrokenBarrierError:
                    pass
            return grad

        return callback

    def worker(k):
        try:
            leaves = make_leaves(per_thread[k], ENG, reference=False)
            leaves[0] = w
            waits = first_call_waits(k)

            def wrap(vid, chain):
                return [waits] + chain if vid == 0 and rendezvous else chain

            start.wait()
            traces[k] = run_managed(per_thread[k], ENG, ["start"], gradmgr.GradManager,
                                    label=f"t{k}", leaves=leaves, wrap_chain=wrap,
                                    after_backward=after_backward)
        except BaseException as exc:  # noqa: BLE001 - reported from the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if failures:
        raise failures[0]

    delivered = [ref.grad(0) for ref in refs]  # what each thread's chain delivers for W
    for k in (0, 1):
        got, ref = traces[k], refs[k]
        check_outcome(got, ref)
        check_callbacks(got, ref, f"t{k}", f"t{k}")
        # W's .grad is shared: compared below, after both threads finished
        for trace in (got, ref):
            trace.steps[0].grads.pop(0, None)
        check_grads(got, ref, f"thread {k}: ")
        check_unattached(got, ref)
        check_storage(got)
        check_layout(got)

    options = _sums(g0 if existing else None, *delivered)
    got_w = None if w.grad is None else ENG.numpy(w.grad)
    assert any(same_bits(got_w, want) for want in options), (
        f"W.grad is not the sum of both threads' gradients: {describe(got_w, options[0])}")
    calls = [c for trace in traces for c in trace.call_facts]
    problems = storage_problems({0: w.grad}, calls)
    assert not problems, "\n".join(problems)
    if rendezvous:
        assert all(met), f"the two backwards did not overlap (barrier reached: {met})"


def _sums(g0, a, b):
    def add(x, y):
        if x is None:
            return y
        if y is None:
            return x
        return (torch.tensor(x) + torch.tensor(y)).numpy()

    return [add(add(g0, a), b), add(add(g0, b), a)]


@differential_settings(25)
@given(program=programs("torch", attach_ops=False, late_leaves=False, hooks=False))
def test_forward_in_a_worker_thread(program):
    """Recording in the main thread, forward in a worker, backward in the main thread."""
    note(program.pretty())
    ref = reference_program(program, ["start"])
    leaves = make_leaves(program, ENG, reference=False)
    gm = gradmgr.GradManager()
    log = CallLog()
    for vid in program.attached_leaves():
        gm.attach(leaves[vid], callbacks=make_chain(program.chain(vid), vid, log, ENG, "gm"))
    trace = Trace()
    with gm, ThreadPoolExecutor(1) as pool:
        built = pool.submit(build, program, ENG, leaves).result()
        try:
            gm.backward(built.y, built.dy)
        except Exception as exc:  # noqa: BLE001
            trace.error = exc
    if trace.error is None:
        trace.steps.append(step_result(program, ENG, leaves,
                                        {v: leaves[v] for v in program.attached_leaves()}))
    finish_calls(trace, log, ENG)
    check_outcome(trace, ref)
    check_grads(trace, ref)
    check_unattached(trace, ref)
    check_callbacks(trace, ref)


def test_threads_whose_output_is_the_shared_tensor_itself():
    """Both threads backward ``y = W`` itself, seeded with ``dy = 1`` and ``dy = 2``: the
    engine's root is then the same node (W's AccumulateGrad) in both graphs. Each manager's
    callback must get its own seed and ``W.grad`` must be ``0.5 * (1 + 2)``. A wrong delivery
    depends on how the threads interleave, so the scenario runs 300 times."""
    wrong = []
    for trial in range(300):
        w = torch.tensor(1.0, requires_grad=True)
        seen = {0: [], 1: []}
        start = threading.Barrier(2, timeout=BARRIER_TIMEOUT)
        failures = []

        def worker(k, w=w, seen=seen, start=start, failures=failures):
            try:
                def callback(tensor, grad, k=k):
                    seen[k].append(grad.item())
                    return grad * 0.5

                gm = gradmgr.GradManager().attach(w, callbacks=callback)
                dy = torch.tensor(float(k + 1))
                start.wait()
                with gm:
                    gm.backward(w, dy)
            except BaseException as exc:  # noqa: BLE001 - reported from the main thread
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        if failures:
            raise failures[0]
        if seen != {0: [1.0], 1: [2.0]} or w.grad is None or w.grad.item() != 1.5:
            wrong.append((trial, seen, None if w.grad is None else w.grad.item()))
    assert not wrong, (
        f"{len(wrong)} of 300 runs delivered gradients to the wrong manager (trial, callback "
        f"arguments per manager, W.grad): {wrong[:5]}")
