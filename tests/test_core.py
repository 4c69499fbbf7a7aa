"""The manager's life cycle and semantic contract on the pure-Python fake backend, so the core is
tested without any framework. Gradients are compared with hand-computed values; the fake
computes in float64, so the tolerance is ``rel=1e-12``."""

from __future__ import annotations

import gc
import math
import threading
import warnings
import weakref

import pytest
from fake_backend import EVENTS, FakeTensor, cos, live_state, register, sin, sum_

import gradmgr
from gradmgr import Future, GradManager, GradManagerGroup, get_backwarding_grad_manager
from gradmgr import _state as core_state

TOL = 1e-12


def approx(value):
    return pytest.approx(value, rel=TOL, abs=TOL)


def grad_of(t: FakeTensor):
    """``t.grad`` as a float (scalar) or a list of floats, or None."""
    g = t.grad
    if g is None:
        return None
    return list(g.data) if g.shape else g.data[0]


@pytest.fixture
def fk():
    EVENTS.clear()
    return register()


@pytest.fixture(autouse=True)
def no_leaked_state():
    """Every test must leave no recording, backwarding manager or started tape behind."""
    yield
    leaked = (get_backwarding_grad_manager(), core_state.recording_managers(), live_state())
    for gm in leaked[1]:  # clean up so that one failure does not cascade into the next tests
        gm.release()
    core_state.state.backwarding.clear()
    assert leaked == (None, [], (0, 0))


# ----------------------------------------------------------------------------- basic use
def test_with_block_gives_dy_weighted_gradient(fk):
    w = fk.tensor([0.5, -1.0, 2.0])
    x = fk.tensor([1.0, 2.0, 3.0])
    gm = GradManager().attach(w)
    with gm:
        gm.backward(sum_(w * x))
    assert grad_of(w) == approx([1.0, 2.0, 3.0])
    assert x.grad is None  # not attached


def test_record_backward_without_with(fk):
    x = fk.tensor(0.7)
    gm = GradManager().attach(x)
    gm.record()
    gm.backward(sin(x))
    assert grad_of(x) == approx(math.cos(0.7))
    assert core_state.state.recording == []


def test_default_dy_is_ones_and_explicit_dy_weights(fk):
    x = fk.tensor([1.0, 2.0, 3.0])
    gm = GradManager().attach(x)
    with gm:
        gm.backward(x * x)  # dy = ones
    assert grad_of(x) == approx([2.0, 4.0, 6.0])
    x.grad = None
    with gm:
        gm.backward(x * x, fk.tensor([1.0, 0.5, -2.0]))
    assert grad_of(x) == approx([2.0, 2.0, -12.0])


def test_several_outputs_sum_their_vjps(fk):
    x = fk.tensor(2.0)
    gm = GradManager().attach(x)
    with gm:
        gm.backward([x * x, sin(x)], [fk.tensor(3.0), fk.tensor(-1.0)])
    assert grad_of(x) == approx(3.0 * 4.0 - math.cos(2.0))


def test_backward_without_y_is_legal(fk):
    x = fk.tensor(1.0)
    calls = []
    gm = GradManager().attach(x).register_after_backward_callback(lambda: calls.append(1))
    with gm:
        gm.backward()
    assert calls == [1]
    assert x.grad is None


def test_manager_is_reusable_and_grads_accumulate(fk):
    x = fk.tensor(3.0)
    gm = GradManager().attach(x)
    for _ in range(3):
        with gm:
            gm.backward(x * x)
    assert grad_of(x) == approx(18.0)


def test_unreached_keeps_none_and_zero_gradient_gives_zeros(fk):
    a, b, c = fk.tensor([1.0, 2.0]), fk.tensor([3.0, 4.0]), fk.tensor(5.0)
    gm = GradManager().attach([a, b, c])
    with gm:
        gm.backward(sum_(a * 2.0 + b * 0.0))
    assert grad_of(a) == approx([2.0, 2.0])
    assert grad_of(b) == [0.0, 0.0]
    assert c.grad is None


def test_y_that_is_an_attached_tensor_gets_dy(fk):
    x = fk.tensor([1.0, 2.0])
    gm = GradManager().attach(x)
    with gm:
        gm.backward(x, fk.tensor([4.0, 5.0]))
    assert grad_of(x) == approx([4.0, 5.0])


# ----------------------------------------------------------------------------- S4 life cycle
def test_record_twice_raises_and_keeps_recording(fk):
    x = fk.tensor(1.0)
    gm = GradManager().attach(x)
    gm.record()
    with pytest.raises(RuntimeError, match="already recording"):
        gm.record()
    gm.backward(x * 4.0)  # the first recording is intact
    assert grad_of(x) == approx(4.0)


def test_step_identifies_each_recording(fk):
    x = fk.tensor(1.0)
    gm, other = GradManager().attach(x), GradManager().attach(x)
    assert gm.step == -1
    steps = []
    for _ in range(3):
        with gm:
            steps.append(gm.step)
            with other:
                assert other.step > gm.step  # global order: later recordings get larger ids
        assert gm.step == steps[-1]  # still names the latest recording after release
    assert steps == sorted(set(steps))


def test_backward_without_record_names_record(fk):
    x = fk.tensor(1.0)
    gm = GradManager().attach(x)
    with pytest.raises(RuntimeError, match=r"record\(\)"):
        gm.backward(x * x)
    with gm:
        gm.backward(x * x)
    with pytest.raises(RuntimeError, match=r"record\(\)"):
        gm.backward(x * x)  # the backward above released the recording
    assert grad_of(x) == approx(2.0)


def test_release_is_idempotent(fk):
    x = fk.tensor(1.0)
    gm = GradManager().attach(x)
    gm.release()
    gm.record()
    gm.release()
    gm.release()
    with pytest.raises(RuntimeError, match="record"):
        gm.backward(x)
    with gm:
        gm.release()  # releasing inside `with` is fine; __exit__ releases again
    assert x.grad is None


@pytest.mark.parametrize(
    "bad_call",
    [
        lambda gm, x, fk: gm.backward([x * 2.0, x * 3.0], [fk.tensor(1.0)]),
        lambda gm, x, fk: gm.backward(x * 2.0, fk.tensor([1.0, 1.0])),
        lambda gm, x, fk: gm.backward(None, fk.tensor(1.0)),
    ],
    ids=["dy-length", "dy-shape", "dy-without-y"],
)
def test_bad_dy_raises_value_error_and_releases(fk, bad_call):
    x = fk.tensor(1.0)
    gm = GradManager().attach(x)
    gm.record()
    with pytest.raises(ValueError, match="dy"):
        bad_call(gm, x, fk)
    assert core_state.state.recording == []
    with gm:  # can record again
        gm.backward(x * 2.0)
    assert grad_of(x) == approx(2.0)


def test_callback_exception_propagates_and_leaves_no_state(fk):
    x = fk.tensor(2.0)
    fail = [True]

    def cb(tensor, grad):
        if fail[0]:
            raise KeyError("boom")
        return grad

    gm = GradManager().attach(x, callbacks=cb)
    with pytest.raises(KeyError, match="boom"), gm:
        gm.backward(x * x)
    assert get_backwarding_grad_manager() is None
    assert core_state.state.recording == []
    assert x.grad is None  # nothing of the failed backward was accumulated
    fail[0] = False
    with gm:
        gm.backward(x * x)
    assert grad_of(x) == approx(4.0)


def test_after_backward_callback_exception_propagates_and_releases(fk):
    x = fk.tensor(2.0)

    def boom():
        raise ArithmeticError("after")

    gm = GradManager().attach(x).register_after_backward_callback(boom)
    gm.record()
    with pytest.raises(ArithmeticError, match="after"):
        gm.backward(x * x)
    assert x.grad is None
    gm.record()  # released: recording again works
    gm.release()


def test_backward_error_callbacks_run_when_a_backward_raises_and_keep_its_error(fk):
    x = fk.tensor(2.0)
    seen = []
    gm = GradManager().attach(x, callbacks=lambda t, g: g)
    gm.register_backward_error_callback(lambda: seen.append(gm.step))

    def failing_callback():
        raise OSError("transport down")

    gm.register_backward_error_callback(failing_callback)
    with gm:
        gm.backward(x * x)
    assert seen == [] and grad_of(x) == approx(4.0)
    gm.register_after_backward_callback(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError) as raised, gm:
        step = gm.step
        gm.backward(x * x)
    assert seen == [step] and grad_of(x) == approx(4.0) and not gm.is_recording
    assert isinstance(raised.value.__context__, OSError)  # the callback's error, chained
    with pytest.raises(TypeError, match="callable"):
        gm.register_backward_error_callback("not a function")


def test_a_backward_that_raised_leaves_nothing_to_the_next_one(fk):
    """What a backward delivered before it raised is accumulated neither then nor by the next
    backward (which may reuse the scope's bookkeeping, never its gradients)."""
    w, x = fk.tensor(3.0), fk.tensor(2.0)
    gm = GradManager().attach([w, x], callbacks=lambda t, g: g)
    fail = [True]

    def after_backward():
        if fail[0]:
            raise RuntimeError("bad step")

    gm.register_after_backward_callback(after_backward)
    with pytest.raises(RuntimeError, match="bad step"), gm:
        gm.backward(w * w)  # w's gradient delivered, then the step fails
    assert w.grad is None
    fail[0] = False
    with gm:
        gm.backward(x * x * x)
    assert w.grad is None and grad_of(x) == approx(12.0)
    with gm:
        gm.backward(w * x)
    assert grad_of(w) == approx(2.0) and grad_of(x) == approx(15.0)


def test_with_block_calls_a_subclass_record_and_release(fk):
    """``with gm:`` goes through ``record()`` as MegEngine's ``__enter__`` does, so a subclass
    that overrides it (a MegEngine port adding its own bookkeeping) is still called."""
    calls = []

    class Logged(GradManager):
        def record(self):
            calls.append("record")
            super().record()

        def release(self):
            calls.append("release")
            super().release()

    x = fk.tensor(2.0)
    gm = Logged().attach(x)
    with gm:
        gm.backward(x * x)
    assert calls[0] == "record" and "release" in calls and grad_of(x) == approx(4.0)


# ----------------------------------------------------------------------------- S1/S2 attach
def test_attach_keeps_first_order_without_duplicates(fk):
    a, b, c = fk.tensor(1.0), fk.tensor(2.0), fk.tensor(3.0)
    gm = GradManager()
    assert gm.attach([a, b]) is gm
    gm.attach(iter([c, a]))
    gm.attach(b)
    assert gm.attached_tensors() == [a, b, c]
    assert [id(t) for t in gm.attached_tensors()] == [id(a), id(b), id(c)]


def test_callbacks_append_per_tensor(fk):
    x, y = fk.tensor(1.0), fk.tensor(1.0)
    log = []

    def f(t, g):
        log.append(("f", "x" if t is x else "y"))
        return g * 10.0

    def g(t, grad):
        log.append(("g", "x" if t is x else "y"))
        return grad + 1.0

    gm = GradManager()
    gm.attach([x, y], callbacks=[f])
    gm.attach([y], callbacks=g)
    with gm:
        gm.backward([x * 3.0, y * 5.0])
    assert grad_of(x) == approx(30.0)
    assert grad_of(y) == approx(51.0)
    assert sorted(log) == [("f", "x"), ("f", "y"), ("g", "y")]
    assert log.index(("f", "y")) < log.index(("g", "y"))


def test_callbacks_receive_the_attached_tensor_itself(fk):
    x = fk.tensor([1.0, 2.0])
    seen = []
    gm = GradManager().attach(x, callbacks=lambda t, g: seen.append(t) or g)
    with gm:
        gm.backward(sum_(x))
    assert len(seen) == 1 and seen[0] is x


def test_attached_tensors_with_callback_filters(fk):
    a, b, c = fk.tensor(1.0), fk.tensor(2.0), fk.tensor(3.0)

    def cb1(t, g):
        return g

    def cb2(t, g):
        return g

    gm = GradManager().attach([a, b], callbacks=cb1).attach([c, a], callbacks=[cb2])
    assert gm.attached_tensors(with_callback=cb1) == [a, b]
    assert gm.attached_tensors(with_callback=cb2) == [a, c]
    assert gm.attached_tensors(with_callback=lambda t, g: g) == []


def test_attached_tensors_with_bound_method_callback(fk):
    class Reducer:
        def cb(self, t, g):
            return g

    r = Reducer()
    x = fk.tensor(1.0)
    gm = GradManager().attach(x, callbacks=r.cb)
    assert gm.attached_tensors(with_callback=r.cb) == [x]


def test_backend_detected_on_first_attach_or_forced(fk):
    gm = GradManager()
    assert gm.backend is None
    gm.attach(fk.tensor(1.0))
    assert gm.backend is fk.backend and gm.backend.name == "fake"
    forced = GradManager(backend="fake")
    assert forced.backend is fk.backend
    other = register("fake_other_forced")
    with pytest.raises(TypeError, match="fake_other_forced"):
        forced.attach(other.tensor(1.0))


# ----------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    ("obj", "type_name"),
    [(5, "int"), (1.5, "float"), ([1.0], "float"), ("ab", "str"), (None, "NoneType")],
)
def test_attach_non_tensor_names_the_type(fk, obj, type_name):
    gm = GradManager()
    with pytest.raises(TypeError, match=type_name):
        gm.attach(obj)
    assert gm.attached_tensors() == [] and gm.backend is None


def test_bad_attach_call_leaves_no_trace(fk):
    x = fk.tensor(1.0)
    gm = GradManager()
    with pytest.raises(TypeError, match="dict"):
        gm.attach([x, {}])
    assert gm.attached_tensors() == [] and gm.backend is None


def test_attach_integer_tensor_names_dtype_and_shape(fk):
    with pytest.raises(TypeError, match=r"int32.*\(2,\)"):
        GradManager().attach(fk.tensor([1, 2], dtype="int32"))


@pytest.mark.parametrize("callbacks", [5, [print, 5], "ab"])
def test_non_callable_callback_raises_type_error(fk, callbacks):
    x = fk.tensor(1.0)
    gm = GradManager()
    with pytest.raises(TypeError, match="callable"):
        gm.attach(x, callbacks=callbacks)
    assert gm.attached_tensors() == []


def test_non_callable_after_backward_callback(fk):
    with pytest.raises(TypeError, match="callable"):
        GradManager().register_after_backward_callback("not a function")


def test_mixing_two_backends_names_both(fk):
    other = register("fake_other")
    a, b = fk.tensor(1.0), other.tensor(1.0)
    with pytest.raises(TypeError, match=r"(?=.*\bfake\b)(?=.*fake_other)"):
        GradManager().attach([a, b])
    gm = GradManager().attach(a)
    with pytest.raises(TypeError, match=r"(?=.*\bfake\b)(?=.*fake_other)"):
        gm.attach(b)
    assert gm.attached_tensors() == [a]
    gm.record()
    with pytest.raises(TypeError, match=r"(?=.*\bfake\b)(?=.*fake_other)"):
        gm.backward(b * 2.0)
    assert core_state.state.recording == []
    with pytest.raises(TypeError, match=r"(?=.*\bfake\b)(?=.*fake_other)"):
        (GradManager().attach(a) | GradManager().attach(b)).record()


def test_group_of_two_backends_cannot_record(fk):
    other = register("fake_other")
    group = GradManager().attach(fk.tensor(1.0)) | GradManager().attach(other.tensor(1.0))
    with pytest.raises(TypeError, match=r"(?=.*\bfake\b)(?=.*fake_other)"):
        group.record()


def test_unbound_manager_keeps_its_place_when_two_frameworks_are_imported(fk):
    """Nothing attached and no backend= at record(), two frameworks imported: the outer manager
    learns its framework only when it attaches inside the inner recording, yet it must record
    the inner backward (forward mode through double reverse), as a bound manager would."""
    register("fake_other")
    x, u = fk.tensor([0.5, -1.0]), fk.tensor([0.0, 0.0])
    outer = GradManager()
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradmgr.GradMgrWarning)
        with outer:
            assert live_state()[0] >= 2  # a provisional tape for each fake framework
            with GradManager().attach(x) as inner:
                y = sin(x) * x
                outer.attach(u)
                assert live_state()[0] == 2  # outer's fake tape and inner's; fake_other stopped
                inner.backward(y, u)  # x.grad = J^T u, recorded by outer
            outer.backward(x.grad, fk.tensor([1.0, 2.0]))  # u.grad = J v
    assert live_state() == (0, 0)
    jvp = [(math.cos(a) * a + math.sin(a)) * v for a, v in ((0.5, 1.0), (-1.0, 2.0))]
    assert grad_of(u) == approx(jvp)


def test_unbound_manager_that_never_attaches_leaves_no_tapes(fk):
    register("fake_other")
    gm = GradManager()
    with gm:
        assert live_state()[0] >= 2  # a provisional tape for each fake framework
        gm.backward(None)
    assert live_state() == (0, 0) and gm.backend is None
    with gm:
        gm.attach([])  # an empty attach names no framework: the provisional tapes stay
        assert live_state()[0] >= 2
    assert live_state() == (0, 0)


def test_backward_y_not_a_tensor(fk):
    gm = GradManager().attach(fk.tensor(1.0))
    gm.record()
    with pytest.raises(TypeError, match="float"):
        gm.backward(1.0)


# ----------------------------------------------------------------------------- S3 weak refs
def test_dropped_tensor_disappears(fk):
    a, b = fk.tensor(1.0), fk.tensor(2.0)
    gm = GradManager().attach([a, b])
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None
    assert gm.attached_tensors() == [b]


def test_manager_does_not_keep_tensors_alive_across_uses(fk):
    gm = GradManager()
    x = fk.tensor([1.0, 2.0])
    gm.attach(x, callbacks=lambda t, g: g)
    with gm:
        gm.backward(sum_(x * x))
    with gm:  # attached during a recording, e.g. an input whose gradient is wanted
        y = fk.tensor(3.0)
        gm.attach(y)
        gm.backward(y * x)
    refs = [weakref.ref(x), weakref.ref(y)]
    assert grad_of(y) == approx(3.0)
    del x, y
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert gm.attached_tensors() == []


def test_new_tensor_after_dead_one_attaches_fresh(fk):
    gm = GradManager()
    gm.attach(fk.tensor(1.0), callbacks=lambda t, g: g * 100.0)  # dies at once
    gc.collect()
    x = fk.tensor(2.0)
    gm.attach(x)
    with gm:
        gm.backward(x * 3.0)
    assert grad_of(x) == approx(3.0)  # no stale callback from the dead tensor


# ----------------------------------------------------------------------------- S7 eager chain
def test_callbacks_run_as_each_gradient_is_ready(fk):
    a, b, c = fk.tensor(0.3), fk.tensor(0.5), fk.tensor(0.7)

    def cb(name):
        def record(t, g):
            EVENTS.append(f"cb:{name}")
            return g

        return record

    gm = GradManager()
    for name, t in zip("abc", (a, b, c)):
        gm.attach(t, callbacks=cb(name))
    with gm:
        h = sin(a)  # a is used first, so its gradient is ready last
        h = h * b
        h = h * c
        EVENTS.clear()
        gm.backward(h)
    assert EVENTS == ["vjp:mul", "cb:c", "vjp:mul", "cb:b", "vjp:sin", "cb:a"]
    assert grad_of(a) == approx(math.cos(0.3) * 0.5 * 0.7)
    assert grad_of(b) == approx(math.sin(0.3) * 0.7)
    assert grad_of(c) == approx(math.sin(0.3) * 0.5)


def test_callback_attached_while_recording_makes_tensor_eager(fk):
    a, b = fk.tensor(0.3), fk.tensor(0.5)
    gm = GradManager().attach([a, b])  # no callbacks: the backend may deliver late
    with gm:
        gm.attach(b, callbacks=lambda t, g: EVENTS.append("cb:b") or g)
        h = sin(a) * b
        EVENTS.clear()
        gm.backward(h)
    assert EVENTS == ["vjp:mul", "cb:b", "vjp:sin"]
    assert grad_of(b) == approx(math.sin(0.3))


# ----------------------------------------------------------------------------- S7/S11 futures
def test_future_resolves_after_after_backward_callbacks(fk):
    x, y = fk.tensor(2.0), fk.tensor(3.0)
    log = []
    pending = []

    def defer(t, g):  # like an allreduce in flight
        fut = Future()
        pending.append((fut, g))
        return fut

    class Handle:  # any object with .get() is a Future
        def __init__(self, g):
            self.g = g

        def get(self):
            log.append("get")
            return self.g * 2.0

    def flush():
        log.append("after")
        for fut, g in pending:
            fut.set(g * 10.0)

    gm = GradManager().attach(x, callbacks=defer).attach(y, callbacks=lambda t, g: Handle(g))
    gm.register_after_backward_callback(flush)
    with gm:
        gm.backward(x * y)
    assert log == ["after", "get"]
    assert grad_of(x) == approx(30.0)
    assert grad_of(y) == approx(4.0)


def test_future_value_semantics():
    f = Future(lambda: 7)
    assert not f.done()
    assert f.get() == 7 and f.done()
    assert Future.resolved(3).get() == 3
    assert gradmgr.is_future(f) and not gradmgr.is_future(3)
    with pytest.raises(TimeoutError):
        Future().get(timeout=0)


def test_future_across_threads():
    """A get() that waits is woken by set() from another thread; a lazy value is computed
    once however many threads ask at the same time; None is a value, not "unset"."""
    import threading

    waiting = Future()
    got = []
    reader = threading.Thread(target=lambda: got.append(waiting.get(timeout=10)))
    reader.start()
    waiting.set("value")
    reader.join(10)
    assert got == ["value"] and waiting.done()

    calls = []
    start = threading.Barrier(8)

    def compute():
        calls.append(1)
        return len(calls)

    lazy = Future(compute)
    results = []

    def ask():
        start.wait(10)
        results.append(lazy.get(timeout=10))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == [1] and results == [1] * 8
    none = Future()
    none.set(None)
    assert none.done() and none.get(timeout=0) is None


# ----------------------------------------------------------------------------- S11 backwarding
def test_get_backwarding_grad_manager_inside_and_after(fk):
    x = fk.tensor(1.0)
    seen = []
    gm = GradManager()
    gm.attach(x, callbacks=lambda t, g: seen.append(get_backwarding_grad_manager()) or g)
    gm.register_after_backward_callback(lambda: seen.append(get_backwarding_grad_manager()))
    assert get_backwarding_grad_manager() is None
    with gm:
        gm.backward(x * 2.0)
    assert seen == [gm, gm]
    assert get_backwarding_grad_manager() is None


def test_backwarding_manager_restored_after_nested_backward(fk):
    x = fk.tensor(1.0)
    inner = GradManager().attach(x)
    seen = []

    def run_inner(t, g):
        with inner:
            inner.backward(x * 5.0)
        seen.append(get_backwarding_grad_manager())
        return g

    w = fk.tensor(1.0)
    outer = GradManager().attach(w, callbacks=run_inner)
    with outer:
        outer.backward(w * 3.0)
    assert seen == [outer]
    assert grad_of(x) == approx(5.0)
    assert grad_of(w) == approx(3.0)


# ----------------------------------------------------------------------------- add_gradient
def test_add_gradient_from_after_backward_callback(fk):
    a, b = fk.tensor(2.0), fk.tensor(4.0)
    gm = GradManager().attach([a, b])

    def supply():
        gm.add_gradient(b, fk.tensor(7.0))  # not reached by y: delivered by hand
        gm.add_gradient(a, Future.resolved(fk.tensor(1.5)))  # replaces a's gradient

    gm.register_after_backward_callback(supply)
    b.grad = fk.tensor(1.0)
    with gm:
        gm.backward(a * 3.0)
    assert grad_of(a) == approx(1.5)
    assert grad_of(b) == approx(8.0)


def test_add_gradient_errors(fk):
    a = fk.tensor(1.0)
    gm = GradManager().attach(a)
    with pytest.raises(RuntimeError, match="backward"):
        gm.add_gradient(a, fk.tensor(1.0))
    stranger = fk.tensor(1.0)
    gm.register_after_backward_callback(lambda: gm.add_gradient(stranger, fk.tensor(1.0)))
    with pytest.raises(ValueError, match="not attached"), gm:
        gm.backward()


def test_add_gradient_between_record_and_backward_raises(fk):
    a = fk.tensor(1.0)
    gm = GradManager().attach(a)
    gm.record()
    try:
        with pytest.raises(RuntimeError):
            gm.add_gradient(a, fk.tensor(1.0))
    finally:
        gm.release()


# ----------------------------------------------------------------------------- S8/S9 snapshots
def test_ops_before_record_are_ignored(fk):
    x = fk.tensor(1.5)
    gm = GradManager().attach(x)
    early = x * x  # before record(): a constant for the manager
    with gm:
        gm.backward(early * x)
    assert grad_of(x) == approx(1.5**2)  # not 3 * 1.5**2


def test_attach_while_recording_snapshots(fk):
    x = fk.tensor(1.5)
    gm = GradManager()
    with gm:
        early = x * x
        gm.attach(x)
        gm.backward(early * x)
    assert grad_of(x) == approx(1.5**2)


def test_attach_non_leaf_intermediate_while_recording(fk):
    x = fk.tensor(0.4)
    gm = GradManager()
    with gm:
        h = sin(x)  # x is not attached: h is where differentiation starts
        gm.attach(h)
        gm.backward(h * h)
    assert grad_of(h) == approx(2 * math.sin(0.4))
    assert x.grad is None


# ----------------------------------------------------------------------------- S10 nesting/groups
def test_earlier_manager_records_later_backward(fk):
    x = fk.tensor(0.8)
    gm1 = GradManager().attach(x)
    gm2 = GradManager().attach(x)
    with gm1:
        with gm2:
            gm2.backward(cos(x))
            assert grad_of(x) == approx(-math.sin(0.8))
        gm1.backward(x.grad)
    assert grad_of(x) == approx(-math.sin(0.8) - math.cos(0.8))


def test_later_manager_never_sees_earlier_backward(fk):
    x = fk.tensor(0.8)
    gm1 = GradManager().attach(x)
    gm2 = GradManager().attach(x)
    with gm1, gm2:
        y = cos(x)
        gm1.backward(y)
        gm2.backward(x.grad)  # x.grad was not recorded by gm2
    assert grad_of(x) == approx(-math.sin(0.8))


def test_group_members_do_not_see_each_other(fk):
    x = fk.tensor(0.8)
    gm1 = GradManager().attach(x)
    gm2 = GradManager().attach(x)
    with gm1 | gm2:
        y = cos(x)
        gm2.backward(y)
        first = grad_of(x)
        gm1.backward(x.grad)  # not recorded by gm1: contributes nothing
    assert first == approx(-math.sin(0.8))
    assert grad_of(x) == approx(-math.sin(0.8))


def test_group_members_each_backward_the_shared_graph(fk):
    x, w = fk.tensor(0.8), fk.tensor(2.0)
    gm1 = GradManager().attach(x)
    gm2 = GradManager().attach(w)
    with gm1 | gm2:
        y = sin(x) * w
        gm1.backward(y)
        gm2.backward(y)
    assert grad_of(x) == approx(2.0 * math.cos(0.8))
    assert grad_of(w) == approx(math.sin(0.8))


def test_group_construction_and_rollback(fk):
    gm1, gm2, gm3 = GradManager(), GradManager(), GradManager()
    assert isinstance(gm1 | gm2, GradManagerGroup)
    assert (gm1 | gm2 | gm3)._gms == [gm1, gm2, gm3]
    assert (gm1 | (gm2 | gm3))._gms == [gm1, gm2, gm3]
    with pytest.raises(TypeError, match="int"):
        GradManagerGroup([gm1, 3])
    for gm in (gm1, gm2, gm3):
        gm.attach(fk.tensor(1.0))
    gm2.record()
    with pytest.raises(RuntimeError, match="already recording"):
        (gm1 | gm2 | gm3).record()
    assert core_state.recording_managers() == [gm2]  # gm1 rolled back; gm3 never started
    gm2.release()


# ----------------------------------------------------------------------------- S12 threads
def test_managers_in_threads_are_independent(fk):
    barrier = threading.Barrier(2)
    results = {}

    def work(k: float) -> None:
        try:
            x = fk.tensor(k)
            seen = []
            gm = GradManager().attach(
                x, callbacks=lambda t, g: seen.append(get_backwarding_grad_manager()) or g
            )
            with gm:
                y = x * x * k
                barrier.wait(timeout=30)  # both threads are recording now
                gm.backward(y)
                barrier.wait(timeout=30)
            results[k] = (grad_of(x), seen == [gm], core_state.recording_managers())
        except BaseException as exc:  # report in the main thread
            results[k] = exc

    threads = [threading.Thread(target=work, args=(k,)) for k in (2.0, 3.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results[2.0] == (approx(8.0), True, [])
    assert results[3.0] == (approx(18.0), True, [])


def test_repr_mentions_backend_and_state(fk):
    gm = GradManager()
    assert "no backend" in repr(gm)
    gm.attach(fk.tensor(1.0))
    gm.record()
    assert "fake" in repr(gm) and "recording" in repr(gm)
    gm.release()
    assert "idle" in repr(gm)


# ----------------------------------------------------------------------------- hooks for libraries
def test_record_callbacks_run_before_each_recording_and_can_abort_it(fk):
    w = fk.tensor([1.0])
    gm = GradManager().attach(w)
    events = []
    gm.register_record_callback(lambda: events.append("record"))
    with gm:
        events.append("body")
        gm.backward(sum_(w * 2.0))
    assert events == ["record", "body"]

    def refuse() -> None:
        raise RuntimeError("not now")

    gm.register_record_callback(refuse)
    with pytest.raises(RuntimeError, match="not now"):
        gm.record()
    assert core_state.state.recording == []  # the failed record() left nothing behind
    with pytest.raises(TypeError, match="callable"):
        gm.register_record_callback(3)


def test_attach_binds_callbacks_that_ask_for_it(fk):
    class Binding:
        def __init__(self) -> None:
            self.bound = []

        def __gradmgr_bind__(self, manager) -> None:
            self.bound.append(manager)

        def __call__(self, t, g):
            return g

    cb = Binding()
    gm = GradManager().attach(fk.tensor([1.0]), callbacks=[cb, lambda t, g: g])
    gm.attach(fk.tensor([2.0]), callbacks=cb)
    assert cb.bound == [gm, gm]  # once per attach call; the callback decides what to keep


def test_a_future_that_replaces_grad_sets_it_without_adding(fk):
    class Final(Future):
        replaces_grad = True

    w, unused = fk.tensor([1.0, 2.0]), fk.tensor([3.0])
    w.grad, unused.grad = fk.tensor([100.0, 100.0]), fk.tensor([7.0])
    final = fk.tensor([5.0, 6.0])
    nothing = Final.resolved(None)
    gm = GradManager().attach(w, callbacks=lambda t, g: Final.resolved(final))
    gm.attach(unused, callbacks=lambda t, g: nothing)
    with gm:
        gm.backward(sum_(w * 2.0) + sum_(unused * 1.0))
    assert w.grad is final and grad_of(w) == approx([5.0, 6.0])
    assert grad_of(unused) == approx([7.0])  # a replacing None delivers nothing


def test_attach_errors_are_type_and_assertion_errors(fk):
    for bad in ([1.0], ["x"], 3):
        with pytest.raises(gradmgr.AttachError) as info:
            GradManager().attach(bad)
        assert isinstance(info.value, TypeError) and isinstance(info.value, AssertionError)


def test_split_backward_without_the_capability_raises_and_releases(fk):
    w = fk.tensor([1.0])
    gm = GradManager().attach(w)
    with pytest.raises(gradmgr.UnsupportedGraphError, match="cannot split"), gm:
        gm.backward_split(sum_(w * 2.0), first=[w])
    assert w.grad is None
    with pytest.raises(ValueError, match="not attached"), gm:
        gm.backward_split(sum_(w * 2.0), first=[fk.tensor([3.0])])
