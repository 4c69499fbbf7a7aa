"""Running programs through a GradManager, and the checks that compare two runs.

:func:`run_managed` runs a program for a few steps through any manager with MegEngine's API
(gradmgr's ``GradManager`` on torch or megengine tensors, or MegEngine's native one) and returns
a :class:`Trace`: every attached tensor's ``.grad`` after every step, the ``.grad`` of the leaves
that are not attached, each callback's argument, what the after-backward callbacks saw, and (on
torch) every storage-sharing or layout problem of the ``.grad`` tensors. The reference runners
(:mod:`diff_reference`) return the same structure; the ``check_*`` functions compare two traces,
each kind of difference from its own ``assert`` line so that hypothesis reports (and shrinks)
different bugs separately.

All value comparisons are bit-for-bit (:func:`same_bits`): both sides run the same kernels on the
same data in the same order, so any difference is a semantic one.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from diff_interp import Engine, add_leaf_hooks, build, make_leaves
from diff_program import Callback, Program

from gradmgr import Future, get_backwarding_grad_manager, is_future

# --------------------------------------------------------------------------- comparing
_UINT = {4: np.uint32, 8: np.uint64, 2: np.uint16}


def same_bits(a: Optional[np.ndarray], b: Optional[np.ndarray]) -> bool:
    """Equal shapes, dtypes and bits (NaN payloads and signed zeros included)."""
    if a is None or b is None:
        return a is None and b is None
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a.view(_UINT[a.itemsize]), b.view(_UINT[b.itemsize])))


def describe(a: Optional[np.ndarray], b: Optional[np.ndarray]) -> str:
    if a is None or b is None:
        return f"{'None' if a is None else 'array'} vs {'None' if b is None else 'array'}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    with np.errstate(all="ignore"):
        diff = np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0)
    return f"max |diff| {diff:.3g}\n      got {a.tolist()}\n      ref {b.tolist()}"


def resolve(x: Any) -> Any:
    return x.get() if x is not None and not hasattr(x, "shape") and is_future(x) else x


# --------------------------------------------------------------------------- callbacks
@dataclass
class Call:
    manager: str
    step: int
    vid: int
    pos: int
    value: Any  # a numpy copy of the gradient received, or the Future received
    got: Any  # the object received, kept alive (None: the callback kept nothing)
    returned: Any  # the result (or a view of it), kept alive (None: not kept)
    tensor_ok: bool  # it received the attached tensor object itself (S3)
    backwarding_ok: Optional[bool]  # get_backwarding_grad_manager() was its manager (S11)
    thread: int


class CallLog:
    """Every callback call of a run; ``step`` is set by the runner before each backward."""

    def __init__(self) -> None:
        self.calls: List[Call] = []
        self.lazy: List[Tuple[int, Future]] = []  # (step, Future(lambda: ...)) made by callbacks
        self.step = 0
        self.lock = threading.Lock()

    def settle(self, eng: Engine) -> None:
        """Replace each Future a callback received by a copy of its value, right after a
        backward: later accumulation may change a tensor in place (MegEngine's ``+=``), also
        the one a Future holds."""
        for call in self.calls:
            if not isinstance(call.value, np.ndarray):
                call.value = eng.numpy(resolve(call.value))

    def count(self, step: int, manager: Optional[str] = None) -> int:
        return sum(1 for c in self.calls if c.step == step and manager in (None, c.manager))


def make_chain(
    specs: Sequence[Callback], vid: int, log: CallLog, eng: Engine, label: str, *,
    owner: Any = None, eager: bool = False, first_pos: int = 0,
) -> List[Callable[[Any, Any], Any]]:
    """User callbacks for one tensor, logging each call. ``owner``: the manager that should be
    the backwarding one inside the call (None: do not check). ``eager``: Future-returning links
    return the value itself (for MegEngine's native manager, which only resolves its own
    Future type; the value is the same). ``first_pos``: the position of the first one in the
    tensor's whole chain (a later ``attach()`` appends to it)."""
    return [_callback(spec, vid, pos, log, eng, label, owner, eager)
            for pos, spec in enumerate(specs, first_pos)]


def _callback(spec, vid, pos, log, eng, label, owner, eager):
    kind, c = spec.kind, spec.c

    def later(fn, grad):
        future = Future(lambda: fn(resolve(grad)))
        with log.lock:
            log.lazy.append((log.step, future))
        return future

    def callback(tensor, grad):
        received_future = is_future(grad) and not hasattr(grad, "shape")
        if received_future:  # the link before made a Future
            if kind == "identity":
                out = grad
            elif kind == "clone":
                out = later(eng.clone, grad)
            else:  # scale and both Future kinds: a lazy g * c
                out = later(lambda g: eng.scale(g, c), grad)
        elif kind == "identity":
            out = grad
        elif kind == "scale":
            out = eng.scale(grad, c)
        elif kind == "scale_t":  # g * c laid out transposed (a dense, non-contiguous result)
            out = (grad.t() * c).t() if grad.dim() == 2 else eng.scale(grad, c)
        elif kind == "clone":
            out = eng.clone(grad)
        elif kind == "future_resolved":
            out = eng.scale(grad, c) if eager else Future.resolved(eng.scale(grad, c))
        elif kind == "future_lazy":
            out = eng.scale(grad, c) if eager else later(lambda g: eng.scale(g, c), grad)
        else:
            raise ValueError(kind)
        # What the user's code keeps: the objects, nothing (so gradmgr may take the result
        # over as .grad, as AccumulateGrad would), or a view of the result (so it may not).
        got = returned = None
        if spec.keep == "object":
            got, returned = grad, out
        elif spec.keep == "view" and hasattr(out, "shape"):
            returned = out[...]  # a new tensor object sharing its storage
        expected_tensor = getattr(callback, "tensor", None)
        call = Call(label, log.step, vid, pos, grad if received_future else eng.numpy(grad),
                    got, returned,
                    expected_tensor is None or tensor is expected_tensor(),
                    None if owner is None else get_backwarding_grad_manager() is owner,
                    threading.get_ident())
        with log.lock:
            log.calls.append(call)
        return out

    return callback


def expect_tensor(chain: List[Callable], tensor: Any) -> None:
    """Make the chain's callbacks check that they receive ``tensor`` itself."""
    import weakref

    ref = weakref.ref(tensor)
    for cb in chain:
        cb.tensor = ref


# --------------------------------------------------------------------------- traces
@dataclass
class StepResult:
    grads: Dict[int, Optional[np.ndarray]]  # attached value number -> .grad
    others: Dict[int, Optional[np.ndarray]]  # leaves not attached -> .grad
    flags: Dict[int, bool] = field(default_factory=dict)  # torch: requires_grad after release
    reached: Optional[set] = None  # reference: the attached values that got a gradient


@dataclass
class AfterObs:
    step: int
    touched: List[int]  # attached tensors whose .grad had already changed
    calls_seen: int  # callback calls of this step done by then
    lazies_done: int  # callbacks' lazy Futures already resolved by then


@dataclass
class Trace:
    steps: List[StepResult] = field(default_factory=list)
    calls: Dict[Tuple[str, int, int, int], List[np.ndarray]] = field(default_factory=dict)
    call_facts: List[Call] = field(default_factory=list)
    after: List[AfterObs] = field(default_factory=list)
    storage: List[str] = field(default_factory=list)
    layout: List[str] = field(default_factory=list)
    post: List[Tuple[int, int, Optional[np.ndarray]]] = field(default_factory=list)
    error: Optional[BaseException] = None
    failed_at: Optional[int] = None  # scenarios: the index of the event that raised

    def grad(self, vid: int, step: int = -1) -> Optional[np.ndarray]:
        return self.steps[step].grads.get(vid)


def finish_calls(trace: Trace, log: CallLog, eng: Engine) -> None:
    for call in log.calls:
        key = (call.manager, call.step, call.vid, call.pos)
        try:
            value = call.value if isinstance(call.value, np.ndarray) else \
                eng.numpy(resolve(call.value))
        except Exception:  # noqa: BLE001 - a failed run: its outcome is what gets compared
            if trace.error is None:
                raise
            value = None
        trace.calls.setdefault(key, []).append(value)
    trace.call_facts = list(log.calls)


# --------------------------------------------------------------------------- schedules
def apply_action(action: Any, leaves: List[Any], eng: Engine, program: Program,
                 grads: Optional[Dict[int, Any]] = None) -> None:
    """Between steps: ``keep`` (accumulate), ``none`` (zero_grad(set_to_none=True)), ``zero``
    (in-place zeroing on torch; a fresh zeros tensor on MegEngine), ``("freeze", v)`` /
    ``("unfreeze", v)`` (torch: ``requires_grad_``). With ``grads`` (the reference's own
    accumulators) those are changed instead of ``.grad``."""
    if action in ("start", "keep"):
        return
    if isinstance(action, tuple):
        verb, vid = action
        leaves[vid].requires_grad_(verb == "unfreeze")
        return
    for vid in program.attached_leaves():
        current = grads[vid] if grads is not None else eng.grad(leaves[vid])
        if current is None:
            continue
        if action == "none":
            new = None
        elif grads is not None or eng.name != "torch":
            new = eng.zeros_like(current)
        else:
            current.zero_()
            continue
        if grads is not None:
            grads[vid] = new
        else:
            leaves[vid].grad = new


def expected_flags(program: Program, frozen: set) -> Dict[int, bool]:
    return {v: (leaf.kind == "free") or (leaf.kind == "param" and v not in frozen)
            for v, leaf in enumerate(program.leaves)}


def frozen_after(schedule: Sequence[Any], upto: int) -> set:
    frozen: set = set()
    for action in schedule[: upto + 1]:
        if isinstance(action, tuple):
            (frozen.add if action[0] == "freeze" else frozen.discard)(action[1])
    return frozen


# --------------------------------------------------------------------------- the runner
def attach_chain(gm: Any, tensor: Any, chain: List[Any], split_attach: bool) -> None:
    """Attach ``tensor`` with its callback ``chain``: in one ``attach()``, or with
    ``split_attach`` in two (the second appends to the first, S2)."""
    if split_attach:
        gm.attach(tensor, callbacks=chain[: len(chain) // 2])
        chain = chain[len(chain) // 2:]
    gm.attach(tensor, callbacks=chain)


def attach_leaves(program: Any, leaves: List[Any], attach: Callable[[int, Any], None]) -> None:
    """The user's leaf hooks registered before ``attach()``, the attached leaves not attached
    late (``attach(vid, leaf)``), then the leaf hooks registered after."""
    add_leaf_hooks(program, leaves, before=True)
    for vid in program.attached_leaves():
        if not program.leaves[vid].late:
            attach(vid, leaves[vid])
    add_leaf_hooks(program, leaves, before=False)


def run_managed(
    program: Program,
    eng: Engine,
    schedule: Sequence[Any],
    factory: Callable[[], Any],
    *,
    label: str = "gm",
    eager: bool = False,
    checkpoint: Optional[str] = None,
    leaves: Optional[List[Any]] = None,
    check_backwarding: bool = True,
    wrap_chain: Optional[Callable[[int, List[Callable]], List[Callable]]] = None,
    prepare: Optional[Callable[[List[Any]], None]] = None,
    after_backward: bool = True,
    bystander: Optional[str] = None,
) -> Trace:
    """Run ``program`` for ``len(schedule)`` steps through the manager ``factory()`` makes.

    Early leaves are attached once, before the first recording; late leaves and attached op
    results inside it, right after they are created. One after-backward callback records what
    it sees. An exception ends the run and is kept in ``trace.error``. ``wrap_chain(vid,
    chain)`` may add callbacks of a test's own (not logged); ``prepare(leaves)`` runs first.
    ``bystander``: a second manager attaches the same leaves with logging callbacks and never
    backwards: ``"idle"`` (never records), ``"outer"`` (records around every step, so it records
    this manager's backward: higher order), ``"inner"`` (records inside every step). Its
    callbacks must never run.
    """
    leaves = leaves if leaves is not None else make_leaves(program, eng, reference=False)
    if prepare is not None:
        prepare(leaves)
    n = program.n_leaves
    log = CallLog()
    gm = factory()
    trace = Trace()
    state: Dict[str, Any] = {"objs": {}, "pre": {}, "step": 0}

    def attach(vid, tensor):
        chain = make_chain(program.chain(vid), vid, log, eng, label,
                           owner=gm if check_backwarding else None, eager=eager)
        expect_tensor(chain, tensor)
        if wrap_chain is not None:
            chain = wrap_chain(vid, chain)
        attach_chain(gm, tensor, chain, program.split_attach)

    attach_leaves(program, leaves, attach)
    if program.post_hooks:
        for vid, leaf in enumerate(program.leaves):
            if leaf.kind in ("param", "free"):
                leaves[vid].register_post_accumulate_grad_hook(
                    lambda t, vid=vid: trace.post.append(
                        (state["step"], vid, _np(eng, eng.grad(t)))))
    other = None
    if bystander is not None:
        other = factory()
        for vid in program.attached_leaves():
            other.attach(leaves[vid], callbacks=make_chain(
                (Callback("identity"),), vid, log, eng, "bystander"))

    def observe():
        step = state["step"]
        touched = [vid for vid, t in state["objs"].items()
                   if not _untouched(eng, t, state["pre"].get(vid))]
        done = sum(1 for s, f in log.lazy if s == step and f.done())
        trace.after.append(AfterObs(step, touched, log.count(step), done))

    if after_backward:  # on torch, without one (and no callbacks) the engine accumulates
        register = getattr(gm, "register_after_backward_callback", None) or \
            gm._register_after_backward_callback
        register(observe)

    for step, action in enumerate(schedule):
        apply_action(action, leaves, eng, program)
        log.step = state["step"] = step
        objs = {vid: leaves[vid] for vid in program.attached_leaves()}
        state["objs"] = objs
        state["pre"] = {vid: _snapshot(eng, t) for vid, t in objs.items()}

        def on_attach(vid, tensor, step=step, objs=objs):
            objs[vid] = tensor
            state["pre"][vid] = _snapshot(eng, tensor)
            if vid >= n or step == 0:
                attach(vid, tensor)

        try:
            with contextlib.ExitStack() as stack:
                if bystander == "outer":
                    stack.enter_context(other)
                with gm:
                    if bystander == "inner":
                        stack.enter_context(other)
                    built = build(program, eng, leaves, on_attach, checkpoint)
                    gm.backward(built.y, built.dy)
            log.settle(eng)
            trace.steps.append(step_result(program, eng, leaves, objs))
        except Exception as exc:  # noqa: BLE001 - compared with the reference's outcome
            trace.error = exc
            break
        if eng.name == "torch":
            user = [(f"dy[{i}]", d) for i, d in enumerate(built.dys)]
            user += [(f"value v{i}", v) for i, v in enumerate(built.values) if v is not None]
            trace.storage += [f"step {step}: {p}" for p in storage_problems(
                {vid: eng.grad(t) for vid, t in objs.items()}, log.calls, user)]
            trace.layout += [f"step {step}: {p}" for p in layout_problems(objs, eng)]
    finish_calls(trace, log, eng)
    return trace


def _snapshot(eng: Engine, t: Any) -> Tuple[Any, Optional[np.ndarray]]:
    g = eng.grad(t)
    return g, None if g is None else eng.numpy(g)


def _untouched(eng: Engine, t: Any, pre: Optional[Tuple[Any, Any]]) -> bool:
    g = eng.grad(t)
    if pre is None or pre[0] is None:
        return g is None
    return g is pre[0] and same_bits(eng.numpy(g), pre[1])


def step_result(program: Program, eng: Engine, leaves: List[Any],
                 objs: Dict[int, Any]) -> StepResult:
    grads = {vid: _np(eng, eng.grad(t)) for vid, t in objs.items()}
    attached = set(program.attached_leaves())
    others = {v: _np(eng, eng.grad(t)) for v, t in enumerate(leaves) if v not in attached}
    flags = ({v: bool(t.requires_grad) for v, t in enumerate(leaves)}
             if eng.name == "torch" else {})
    return StepResult(grads, others, flags)


def _np(eng: Engine, g: Any) -> Optional[np.ndarray]:
    return None if g is None else eng.numpy(g)


# --------------------------------------------------------------------------- torch: memory
def storage_problems(grads: Dict[int, Any], calls: Sequence[Call],
                     user: Sequence[Tuple[str, Any]] = ()) -> List[str]:
    """S6: no two ``.grad`` share storage, and no ``.grad`` shares storage with a tensor that
    user code was handed or made: a callback's argument or result, a ``dy``, a forward value.
    The calls keep those tensors alive, so their memory cannot have been reused."""
    problems = []
    seen: Dict[int, int] = {}
    for vid, g in grads.items():
        if g is None:
            continue
        ptr = g.untyped_storage().data_ptr()
        if ptr in seen:
            same = " (the same tensor object)" if g is grads[seen[ptr]] else ""
            problems.append(f"v{vid}.grad shares storage with v{seen[ptr]}.grad{same}")
        else:
            seen[ptr] = vid
    handed: Dict[int, str] = {}
    for desc, t in user:
        handed.setdefault(t.untyped_storage().data_ptr(), desc)
    for call in calls:
        for what, x in (("argument", call.got), ("result", call.returned)):
            if x is None:
                continue
            x = resolve(x)
            if x is not None and hasattr(x, "untyped_storage"):
                handed.setdefault(x.untyped_storage().data_ptr(),
                                  f"the {what} of callback #{call.pos} of v{call.vid} "
                                  f"(step {call.step})")
    for vid, g in grads.items():
        if g is not None and g.untyped_storage().data_ptr() in handed:
            problems.append(f"v{vid}.grad shares storage with "
                            f"{handed[g.untyped_storage().data_ptr()]}")
    return problems


def layout_problems(objs: Dict[int, Any], eng: Engine) -> List[str]:
    """S6: ``.grad`` has its tensor's shape, dtype and device; on a leaf it is laid out as
    PyTorch's AccumulateGrad lays it out (the strides of ``torch.empty_like(leaf)``); on any
    tensor it owns one memory location per element (no stride-0 or overlapping ``.grad``)."""
    import torch

    problems = []
    for vid, t in objs.items():
        g = eng.grad(t)
        if g is None:
            continue
        if g.shape != t.shape or g.dtype != t.dtype or g.device != t.device:
            problems.append(f"v{vid}.grad is {g.dtype}{tuple(g.shape)} on {g.device}, the "
                            f"tensor {t.dtype}{tuple(t.shape)} on {t.device}")
            continue
        if not dense_non_overlapping(g):
            problems.append(f"v{vid}.grad overlaps itself: strides {g.stride()} for shape "
                            f"{tuple(g.shape)}")
        elif t.is_leaf:
            want = torch.empty_like(t).stride()
            if any(a != b for a, b, size in zip(g.stride(), want, t.shape) if size > 1):
                problems.append(f"leaf v{vid}.grad has strides {g.stride()}, AccumulateGrad "
                                f"gives {want} (leaf strides {t.stride()})")
    return problems


def dense_non_overlapping(t: Any) -> bool:
    dims = sorted((st, size) for st, size in zip(t.stride(), t.shape) if size != 1)
    expected = 1
    for st, size in dims:
        if st != expected:
            return False
        expected *= size
    return True


# --------------------------------------------------------------------------- checks
def check_outcome(got: Trace, ref: Trace) -> None:
    """Both ran to the end, or both raised the same exception type."""
    if ref.error is not None:
        assert type(got.error) is type(ref.error), (
            f"the reference raised {ref.error!r}, gradmgr {got.error!r}")
        return
    if got.error is not None:
        raise got.error


def check_grads(got: Trace, ref: Trace, what: str = "") -> None:
    """Every attached tensor's ``.grad`` after every step: the same Nones, the same bits."""
    nones, values = [], []
    for step, (g, r) in enumerate(zip(got.steps, ref.steps)):
        for vid in sorted(set(g.grads) | set(r.grads)):
            a, b = g.grads.get(vid), r.grads.get(vid)
            if (a is None) != (b is None):
                nones.append(f"step {step} v{vid}.grad: gradmgr {_kind(a)}, reference "
                             f"{_kind(b)}")
            elif not same_bits(a, b):
                values.append(f"step {step} v{vid}.grad differs: {describe(a, b)}")
    assert len(got.steps) == len(ref.steps), f"{what}steps: {len(got.steps)} vs {len(ref.steps)}"
    assert not nones, f"{what}None where the reference has a gradient or vice versa:\n" + \
        "\n".join(nones)
    assert not values, f"{what}gradients differ from the reference:\n" + "\n".join(values)


def check_unattached(got: Trace, ref: Trace) -> None:
    """Leaves that are not attached keep the reference's ``.grad`` (None)."""
    bad = [f"step {s} v{v}.grad = {_kind(a)}" for s, (g, r) in enumerate(zip(got.steps, ref.steps))
           for v, a in g.others.items() if not same_bits(a, r.others.get(v))]
    assert not bad, "a leaf that is not attached got a .grad:\n" + "\n".join(bad)


def check_flags(got: Trace, ref: Trace) -> None:
    bad = [f"step {s} v{v}.requires_grad = {f}"
           for s, (g, r) in enumerate(zip(got.steps, ref.steps))
           for v, f in g.flags.items() if r.flags and f != r.flags.get(v)]
    assert not bad, "requires_grad not restored after the recording:\n" + "\n".join(bad)


def check_callbacks(got: Trace, ref: Trace, manager: str = "gm",
                    ref_manager: str = "ref") -> None:
    """Each callback ran as often as in the reference (once per step for a reached tensor)
    and got the same gradient bits, the attached tensor itself, and (S11) its own manager as
    the backwarding one."""
    def keyed(trace, label):
        return {(s, v, p): vals for (m, s, v, p), vals in trace.calls.items() if m == label}

    mine, theirs = keyed(got, manager), keyed(ref, ref_manager)
    counts = [f"step {s} v{v} callback #{p}: ran {len(mine.get(k, []))}x, reference "
              f"{len(theirs.get(k, []))}x" for k in sorted(set(mine) | set(theirs))
              for s, v, p in [k] if len(mine.get(k, [])) != len(theirs.get(k, []))]
    assert not counts, "callbacks ran a different number of times:\n" + "\n".join(counts)
    args = [f"step {s} v{v} callback #{p}: {describe(a, b)}"
            for (s, v, p), vals in sorted(mine.items())
            for a, b in zip(vals, theirs[(s, v, p)]) if not same_bits(a, b)]
    assert not args, "callbacks got different gradients:\n" + "\n".join(args)
    wrong = [c for c in got.call_facts if c.manager == manager and not c.tensor_ok]
    assert not wrong, f"callbacks did not get the attached tensor: {wrong[:3]}"
    wrong = [c for c in got.call_facts if c.manager == manager and c.backwarding_ok is False]
    assert not wrong, (
        f"get_backwarding_grad_manager() inside a callback was not the callback's manager: "
        f"{[(c.step, c.vid, c.pos) for c in wrong[:5]]}")


def check_after_backward(got: Trace, n_steps: int) -> None:
    """S11 (MegEngine's order): after-backward callbacks run once per backward, after every
    callback of that backward and before anything is accumulated into ``.grad`` or any
    callback's Future is resolved. (Call only for runs with an after-backward callback.)"""
    assert [o.step for o in got.after] == list(range(n_steps)), (
        f"after-backward callbacks ran at steps {[o.step for o in got.after]}")
    touched = [(o.step, o.touched) for o in got.after if o.touched]
    assert not touched, (
        f"an after-backward callback saw .grad already written (step, value numbers): "
        f"{touched}")
    for o in got.after:
        total = sum(len(v) for (m, s, _, _), v in got.calls.items() if s == o.step)
        assert o.calls_seen == total, (
            f"step {o.step}: the after-backward callback ran when {o.calls_seen} of "
            f"{total} callback calls had happened")
    early = [(o.step, o.lazies_done) for o in got.after if o.lazies_done]
    assert not early, f"Futures resolved before the after-backward callbacks: {early}"


def check_storage(got: Trace) -> None:
    assert not got.storage, "S6: .grad shares storage:\n" + "\n".join(got.storage)


def check_layout(got: Trace) -> None:
    assert not got.layout, "S6: .grad layout:\n" + "\n".join(got.layout)


def check_run(got: Trace, ref: Trace, n_steps: int, after_backward: bool = True,
              program: Optional[Program] = None) -> None:
    """Every check of one :func:`run_managed` run against its reference (each fails from its
    own line), and no recording or backward left behind in this thread."""
    from gradmgr import _state

    check_outcome(got, ref)
    check_some_gradient(ref)
    check_grads(got, ref)
    check_unattached(got, ref)
    check_callbacks(got, ref)
    if after_backward:
        check_after_backward(got, n_steps)
    check_storage(got)
    check_layout(got)
    check_flags(got, ref)
    check_bystander(got)
    if program is not None:
        check_post_hooks(got, ref, program)
    assert not _state.state.recording and not _state.state.backwarding, "state left behind"


def check_bystander(got: Trace) -> None:
    """A manager that never backwards never runs a callback."""
    ran = [(c.step, c.vid) for c in got.call_facts if c.manager == "bystander"]
    assert not ran, f"a manager that never called backward() ran callbacks: {ran}"


def check_post_hooks(got: Trace, ref: Trace, program: Program) -> None:
    """Post-accumulate-grad hooks (torch) run once per backward for each leaf that got a
    gradient, after it was accumulated (they see the final ``.grad``), and never for a leaf
    that got none or is not attached."""
    if not program.post_hooks or ref.error is not None:
        return
    hooked = {v for v, leaf in enumerate(program.leaves) if leaf.kind in ("param", "free")}
    for step, (g, r) in enumerate(zip(got.steps, ref.steps)):
        calls = sorted((v, a) for s, v, a in got.post if s == step)
        want = sorted(hooked & r.reached)
        assert [v for v, _ in calls] == want, (
            f"step {step}: post-accumulate-grad hooks ran for {[f'v{v}' for v, _ in calls]}, "
            f"expected once for each of {[f'v{v}' for v in want]}")
        stale = [v for v, a in calls if not same_bits(a, g.grads.get(v))]
        assert not stale, (
            f"step {step}: post-accumulate-grad hooks of {stale} saw a .grad other than the "
            f"final one")


def check_some_gradient(ref: Trace) -> None:
    """Guards against vacuous passes: the generator makes every output reach an attached
    tensor, so the reference must have produced at least one gradient."""
    assert ref.error is not None or any(
        g is not None for s in ref.steps for g in s.grads.values()), \
        "no attached tensor got a gradient in the reference (generator bug)"


def _kind(a: Optional[np.ndarray]) -> str:
    return "None" if a is None else f"a {a.dtype}{a.shape} gradient"


# --------------------------------------------------------------------------- two managers
def second_loss(case: Any, eng: Engine, values: List[Any], grads: Sequence[Any]) -> Any:
    """``sum(penalty(g))`` over the given gradients plus ``sum(v_extra)``; None if empty."""
    from diff_program import Op

    params = (2.0,) if case.penalty == "scale" else ()
    terms = [eng.reduce("sum", eng.apply(Op(case.penalty, (0,), params), [g]))
             for g in grads if g is not None]
    if case.extra is not None:
        terms.append(eng.reduce("sum", values[case.extra]))
    total = None
    for term in terms:
        total = term if total is None else total + term
    return total


def run_two_managers(case: Any, eng: Engine, factory: Callable[[], Any], *,
                     eager: bool = False, check_backwarding: bool = True) -> Trace:
    """One :class:`diff_program.TwoManagers` case through two managers made by ``factory``."""
    program = case.program
    leaves = make_leaves(program, eng, reference=False)
    log = CallLog()
    m1, m2 = factory(), factory()
    for label, gm, items in (("m1", m1, case.first), ("m2", m2, case.second)):
        for vid, specs in items:
            chain = make_chain(specs, vid, log, eng, label,
                               owner=gm if check_backwarding else None, eager=eager)
            expect_tensor(chain, leaves[vid])
            gm.attach(leaves[vid], callbacks=chain)
    trace = Trace()
    built = None
    mode = case.mode
    try:
        if mode == "group":
            with m1 | m2:
                built = build(program, eng, leaves)
                m1.backward(built.y, built.dy)
                log.settle(eng)
                m2.backward(second_loss(case, eng, built.values,
                                        [eng.grad(leaves[v]) for v, _ in case.first]))
        else:
            with m1:
                with m2:
                    built = build(program, eng, leaves)
                    if mode == "same_y_outer_first":
                        m1.backward(built.y, built.dy)
                        log.settle(eng)
                    m2.backward(built.y, built.dy)
                    log.settle(eng)
                    if mode == "same_y_inner_first":
                        m1.backward(built.y, built.dy)
                if mode == "nested":
                    loss = second_loss(case, eng, built.values,
                                       [eng.grad(leaves[v]) for v, _ in case.second])
                    if loss is not None:
                        m1.backward(loss)
        attached = sorted({v for v, _ in case.first} | {v for v, _ in case.second})
        grads = {v: eng.grad(leaves[v]) for v in attached}
        trace.steps.append(StepResult(
            {v: _np(eng, g) for v, g in grads.items()},
            {v: _np(eng, eng.grad(t)) for v, t in enumerate(leaves) if v not in attached}))
    except Exception as exc:  # noqa: BLE001 - compared with the reference's outcome
        trace.error = exc
        finish_calls(trace, log, eng)
        return trace
    if eng.name == "torch" and built is not None:
        user = [(f"dy[{i}]", d) for i, d in enumerate(built.dys)]
        user += [(f"value v{i}", v) for i, v in enumerate(built.values) if v is not None]
        trace.storage += storage_problems(grads, log.calls, user)
        trace.layout += layout_problems({v: leaves[v] for v in attached}, eng)
    finish_calls(trace, log, eng)
    return trace
