"""PyTorch-specific behaviour beyond the shared contract (runs on torch 2.8 and 2.13).

Reference gradients come from plain ``torch.autograd.grad``; float32, rtol=1e-5, atol=1e-6.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest

torch = pytest.importorskip("torch")

from gradmgr import GradManager  # noqa: E402
from gradmgr.backends import torch as tb  # noqa: E402

TOL = {"rtol": 1e-5, "atol": 1e-6}


def mlp(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 3),
    )


def test_requires_grad_false_input_gets_grad_and_flag_is_restored():
    x = torch.randn(4, 8)
    model = mlp()
    gm = GradManager().attach(x)
    with gm:
        assert x.requires_grad
        gm.backward(model(x).sum())
    assert not x.requires_grad
    xr = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(model(xr).sum(), xr)
    torch.testing.assert_close(x.grad, expected, **TOL)
    assert all(p.grad is None for p in model.parameters())  # not attached: untouched


def test_flag_survives_other_managers_release():
    x = torch.ones(3)
    gm1, gm2 = GradManager().attach(x), GradManager().attach(x)
    gm1.record()
    gm2.record()
    gm2.release()
    assert x.requires_grad, "gm2's release must not undo what gm1 still needs"
    gm1.backward((x * 2).sum())
    assert not x.requires_grad
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_callbacks_fire_last_layer_first_while_engine_runs():
    model = mlp()
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    fired = []

    def tag(i):
        def cb(t, g):
            # earlier layers' gradients do not exist yet when a later layer's callback runs
            fired.append((i, [j for j, _ in fired]))
            return g
        return cb

    gm = GradManager()
    for i, layer in enumerate(layers):
        gm.attach(layer.weight, callbacks=tag(i))
    with gm:
        gm.backward(model(torch.randn(4, 8)).square().mean())
    assert [i for i, _ in fired] == [2, 1, 0]
    assert fired[0][1] == [] and fired[2][1] == [2, 1]


def test_mlp_with_callbacks_matches_autograd():
    model, x = mlp(), torch.randn(6, 8)
    params = list(model.parameters())
    expected = torch.autograd.grad(model(x).square().mean(), params)
    gm = GradManager().attach(params[:3]).attach(params[3:], callbacks=lambda t, g: g * 0.5)
    with gm:
        gm.backward(model(x).square().mean())
    for i, (p, e) in enumerate(zip(params, expected)):
        torch.testing.assert_close(p.grad, e if i < 3 else e * 0.5, **TOL)


def test_conv_batchnorm_net_matches_autograd():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, stride=2), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 7 * 7, 5),
    )
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    expected = torch.autograd.grad(
        torch.nn.functional.cross_entropy(net(x), y), list(net.parameters())
    )
    net.load_state_dict(state)  # same running stats for the second forward
    gm = GradManager().attach(net.parameters())
    with gm:
        gm.backward(torch.nn.functional.cross_entropy(net(x), y))
    for p, e in zip(net.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-5)


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_reuse_with_temporaries_leaks_nothing():
    model = mlp()
    gm = GradManager().attach(model.parameters())
    refs = []

    def step():
        x = torch.randn(2, 8)
        gm.attach(x, callbacks=lambda t, g: g)
        with gm:
            gm.backward(model(x).sum())
        refs.append(weakref.ref(x))

    for _ in range(10):
        step()
    baseline = _live_tensors()
    for _ in range(1000):
        step()
    gc.collect()
    assert all(r() is None for r in refs), "a temporary attached tensor is still alive"
    assert len(gm.attached_tensors()) == len(list(model.parameters()))
    assert _live_tensors() <= baseline, "live tensors grew over 1000 iterations"
    tape = gm._recording.tape
    assert len(tape.watched.entries) == len(list(model.parameters()))
    assert len(tape.watched.handles) == 0  # only the temporaries had callbacks, and they are gone


def test_hooks_ignore_plain_backward_and_die_with_manager():
    w = torch.ones(2, requires_grad=True)
    calls = []
    gm = GradManager().attach(w, callbacks=lambda t, g: (calls.append(1), g)[1])
    with gm:
        gm.backward((w * 2).sum())
    (w * 3).sum().backward()  # not the manager's backward: no callback
    assert calls == [1]
    torch.testing.assert_close(w.grad, torch.full((2,), 5.0))
    del gm
    gc.collect()
    w.grad = None
    (w * 3).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((2,), 3.0))


def test_a_dead_manager_leaves_no_python_hook_call_behind():
    """Removing a hook handle leaves an empty dict that PyTorch still calls into Python for in
    every backward (~3 us per tensor, for good); a user's own hooks stay and keep working."""
    net = torch.nn.Linear(3, 2)
    seen = []
    net.bias.register_hook(lambda g: seen.append(g.clone()))
    gm = GradManager().attach(net.parameters(), callbacks=lambda t, g: g)
    with gm:
        gm.backward(net(torch.ones(1, 3)).sum())
    assert net.weight._backward_hooks and len(net.bias._backward_hooks) == 2
    del gm
    gc.collect()
    assert net.weight._backward_hooks is None  # not an empty dict
    assert len(net.bias._backward_hooks) == 1  # the user's
    net(torch.ones(1, 3)).sum().backward()
    assert len(seen) == 2 and torch.equal(seen[1], torch.ones(2))


def test_attach_while_a_dead_managers_hooks_are_collected(monkeypatch):
    """A manager freed by the garbage collector drops its tensors' emptied hook dicts; an
    automatic collection inside another manager's register_hook on the same tensor (torch
    allocates between reading the dict and filling it) made attach() fail with "'NoneType'
    object does not support item assignment" (seen in the 2-rank suite after a merge). The
    collection is made to come at that very allocation."""
    w = torch.ones(2, requires_grad=True)
    dead = GradManager().attach(w, callbacks=lambda t, g: g)
    cycle = [dead]
    cycle.append(cycle)  # only the collector frees it now
    del dead, cycle
    handle_class, threshold = torch.utils.hooks.RemovableHandle, gc.get_threshold()

    class CollectingHandle(handle_class):
        def __init__(self, *args, **kwargs):
            if gc.isenabled():  # an automatic collection, where one may come
                gc.collect()
            super().__init__(*args, **kwargs)

    gc.set_threshold(10**6)  # no other automatic collection until then
    monkeypatch.setattr(torch.utils.hooks, "RemovableHandle", CollectingHandle)
    try:
        second = GradManager().attach(w, callbacks=lambda t, g: 2 * g)
    finally:
        monkeypatch.undo()
        gc.set_threshold(*threshold)
    with second:
        second.backward((w * 3).sum())
    torch.testing.assert_close(w.grad, torch.full((2,), 6.0))

@pytest.mark.megengine
def test_mixing_frameworks_is_a_type_error():
    mge = pytest.importorskip("megengine")
    kept = torch.ones(2)
    gm = GradManager().attach(kept)
    with pytest.raises(TypeError, match=r"torch.*megengine|megengine.*torch"):
        gm.attach(mge.tensor([1.0, 2.0]))
    assert gm.attached_tensors() == [kept]


def test_pre_record_check_modes():
    def run():
        w = torch.ones(2, requires_grad=True)
        gm = GradManager().attach(w)
        caught_all = []
        for _ in range(2):
            u = w * 2  # before record: a constant for MegEngine, a path for PyTorch
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with gm:
                    gm.backward((u * w).sum())
            caught_all.append([c for c in caught if c.category is tb.PreRecordGradientWarning])
        return caught_all

    try:
        tb.set_pre_record_check("always")
        assert [len(c) for c in run()] == [1, 0]  # warned once per manager
        tb.set_pre_record_check("off")
        assert [len(c) for c in run()] == [0, 0]
        tb.set_pre_record_check("first")
        assert [len(c) for c in run()] == [1, 0]
        with pytest.raises(ValueError, match="always"):
            tb.set_pre_record_check("sometimes")
    finally:
        tb.set_pre_record_check("first")


def test_no_warning_for_clean_training_loop():
    model = mlp()
    gm = GradManager().attach(model.parameters())
    tb.set_pre_record_check("always")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tb.PreRecordGradientWarning)
            for _ in range(3):
                with gm:
                    gm.backward(model(torch.randn(2, 8)).sum())
    finally:
        tb.set_pre_record_check("first")


def test_reachable_helper():
    a, b, c = (torch.ones(2, requires_grad=True) for _ in range(3))
    h = a * b
    y = h.sum()
    assert tb.reachable_leaves([y], [a, b, c, h]) == [a, b, h]
    assert {id(t) for t in tb.reachable_leaves([y])} == {id(a), id(b)}
    gm = GradManager().attach([c, b])
    assert gm.reachable(y) == [b]


def test_integer_dtype_error_names_dtype_and_shape():
    with pytest.raises(TypeError, match=r"torch.int64.*\(2, 3\)"):
        GradManager().attach(torch.zeros(2, 3, dtype=torch.long))


def test_dy_dtype_device_mismatch_surfaces_from_torch():
    x = torch.ones(2)
    gm = GradManager().attach(x)
    with gm, pytest.raises(ValueError, match="shape"):
        gm.backward(x * 2, torch.ones(3))
    assert not x.requires_grad


def test_watched_set_changes_between_steps_are_seen():
    """The tape reuses last step's list of inputs; freezing, unfreezing, attaching and dropping
    tensors between steps must each change what gets a gradient."""
    a, b = torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([3.0], requires_grad=True)
    gm = GradManager().attach([a, b])

    def step(*extra):
        for t in (a, b, *extra):
            t.grad = None
        with gm:
            gm.backward((a * a).sum() + (b * 5).sum() + sum((t * 7).sum() for t in extra))

    step()
    torch.testing.assert_close(a.grad, torch.tensor([2.0, 4.0]), **TOL)
    torch.testing.assert_close(b.grad, torch.tensor([5.0]), **TOL)
    b.requires_grad_(False)  # frozen: skipped, and the engine is not asked for it
    step()
    assert b.grad is None
    torch.testing.assert_close(a.grad, torch.tensor([2.0, 4.0]), **TOL)
    b.requires_grad_(True)
    c = torch.tensor([1.0], requires_grad=True)
    gm.attach(c)
    step(c)
    torch.testing.assert_close(b.grad, torch.tensor([5.0]), **TOL)
    torch.testing.assert_close(c.grad, torch.tensor([7.0]), **TOL)
    c_ref = weakref.ref(c)
    del c
    gc.collect()
    assert c_ref() is None
    step()
    torch.testing.assert_close(a.grad, torch.tensor([2.0, 4.0]), **TOL)
    torch.testing.assert_close(b.grad, torch.tensor([5.0]), **TOL)
    live = gm.attached_tensors()
    assert len(live) == 2 and live[0] is a and live[1] is b


# The plain step (no callbacks, one manager recording) is the engine call with the trainable
# watched tensors as inputs and gradmgr's own seed told apart by identity; these tests hold it
# to what every step must give when the user changes things between plain steps.
def _reference(model, x, trainable):
    grads = torch.autograd.grad(model(x).square().mean(), trainable)
    return dict(zip(map(id, trainable), grads))


def _plain_steps(gm, model, x, params, n=1):
    for _ in range(n):
        for p in params:
            p.grad = None
        with gm:
            gm.backward(model(x).square().mean())


def test_plain_step_after_a_freeze_gives_the_trainable_ones_only():
    """A weight in the middle frozen between plain steps gets no .grad and the others exactly
    theirs; unfrozen again, it gets its gradient in the next step."""
    model, x = mlp(), torch.randn(6, 8)
    params = list(model.parameters())
    gm = GradManager().attach(params)
    _plain_steps(gm, model, x, params, n=2)  # (the first backward checks the graph)
    frozen = model[2].weight
    frozen.requires_grad_(False)
    _plain_steps(gm, model, x, params)
    assert frozen.grad is None
    trainable = [p for p in params if p is not frozen]
    expected = _reference(model, x, trainable)
    for p in trainable:
        torch.testing.assert_close(p.grad, expected[id(p)], **TOL)
    frozen.requires_grad_(True)
    _plain_steps(gm, model, x, params, n=2)
    expected = _reference(model, x, params)
    for p in params:
        torch.testing.assert_close(p.grad, expected[id(p)], **TOL)


def test_plain_step_with_a_second_manager_recording():
    """Two managers record the same forward (the earlier one's backward keeps the graph for
    the later one's): each gets exactly its own tensors' gradients, also with a tensor frozen
    between steps, and a tensor in the graph attached to neither gets none."""
    model, x = mlp(), torch.randn(6, 8)
    params = list(model.parameters())
    first, second = params[:2], params[2:]
    gm1, gm2 = GradManager().attach(first), GradManager().attach(second)
    outsider = torch.nn.Parameter(torch.ones(3))

    def step():
        for p in params + [outsider]:
            p.grad = None
        gm1.record()
        gm2.record()
        y = (model(x) * outsider).square().mean()
        gm1.backward(y)
        gm2.backward(y)

    for _ in range(3):
        step()
    assert outsider.grad is None
    expected = _reference(lambda t: model(t) * outsider, x, params)
    for p in params:
        torch.testing.assert_close(p.grad, expected[id(p)], **TOL)
    second[0].requires_grad_(False)
    step()
    assert second[0].grad is None and outsider.grad is None
    trainable = [p for p in params if p is not second[0]]
    expected = _reference(lambda t: model(t) * outsider, x, trainable)
    for p in trainable:
        torch.testing.assert_close(p.grad, expected[id(p)], **TOL)


def test_a_callback_attached_after_plain_steps_runs():
    """Attaching a callback to a tensor that plain steps have been accumulating by the engine
    takes it off the plain path from the next step on."""
    model, x = mlp(), torch.randn(6, 8)
    params = list(model.parameters())
    gm = GradManager().attach(params)
    _plain_steps(gm, model, x, params, n=2)
    seen = []
    gm.attach(params[0], callbacks=lambda t, g: seen.append(t) or g * 2)
    _plain_steps(gm, model, x, params)
    assert len(seen) == 1 and seen[0] is params[0]
    expected = _reference(model, x, params)
    torch.testing.assert_close(params[0].grad, expected[id(params[0])] * 2, **TOL)
    for p in params[1:]:
        torch.testing.assert_close(p.grad, expected[id(p)], **TOL)


def test_a_users_dy_after_plain_steps_is_still_kept_apart_from_grad():
    """The seed gradmgr made for a plain step (whose storage the engine may leave in .grad) is
    told apart from a ``dy`` the user passes later: a gradient the engine would store on the
    user's ``dy`` storage still gets a copy."""
    w = torch.ones(6, requires_grad=True)
    gm = GradManager().attach(w)
    for _ in range(2):
        w.grad = None
        with gm:
            gm.backward(w.reshape(2, 3))  # w.grad: a view of gradmgr's seed, as torch leaves it
    w.grad = None
    dy = torch.arange(6.0).reshape(2, 3)
    with gm:
        gm.backward(w.reshape(2, 3), dy)
    torch.testing.assert_close(w.grad, torch.arange(6.0))
    assert w.grad.untyped_storage().data_ptr() != dy.untyped_storage().data_ptr()
    dy.zero_()
    torch.testing.assert_close(w.grad, torch.arange(6.0))


def test_no_seed_outlives_a_backward_that_did_not_reach_the_engine():
    """The seed gradmgr makes for ``backward(y)`` is forgotten when the backward ends without
    the engine taking it (y needs no gradient, an error first): nothing of y's size is kept."""
    w = torch.ones(3, requires_grad=True)
    gm = GradManager().attach(w)
    for _ in range(2):  # (the plain path from the second backward on)
        with gm:
            gm.backward(torch.zeros(1000, 1000))  # needs no gradient: nothing to compute
        assert tb.engine.OWN_SEED[0] is None
    with gm:
        y = (w * 2).sum()
        with pytest.raises(ValueError):
            gm.backward([y, y], [torch.ones(()), torch.ones(2)])  # a dy of the wrong shape
    with gm:
        gm.backward((w * 2).sum())
    assert tb.engine.OWN_SEED[0] is None
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("alias", [False, True], ids=["same", "slice"])
def test_one_output_twice_adds_the_seeds_as_torch_autograd_backward(alias):
    """``backward([y, y], [dy1, dy2])`` and ``[y, y[:]]``: ``torch.autograd.backward`` adds
    the two seeds, and so does gradmgr, bit for bit (docs/paddle.md sets this beside MegEngine,
    which keeps the last seed of ``[y, y]``, and Paddle, which refuses both)."""
    model = mlp()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    dy1, dy2 = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(2))
    y = model(x)
    torch.autograd.backward([y, y[:] if alias else y], [dy1, dy2])
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    gm = GradManager().attach(model.parameters())
    with gm:
        y = model(x)
        gm.backward([y, y[:] if alias else y], [dy1, dy2])
    for p, w in zip(model.parameters(), want):
        assert torch.equal(p.grad, w)
    y = model(x)
    once = torch.autograd.grad(y, list(model.parameters()), dy1 + dy2)
    for g, w in zip(once, want):
        torch.testing.assert_close(g, w, **TOL)


def test_complex_dy_for_real_y_is_rejected_before_the_engine_runs():
    x = torch.ones(2)
    gm = GradManager().attach(x)
    with gm, pytest.raises(ValueError, match="complex"):
        gm.backward(x * 2, torch.ones(2, dtype=torch.complex64))
    assert x.grad is None and not x.requires_grad


def test_float64_dy_is_cast_like_torch_autograd_backward():
    x = torch.tensor([1.0, 2.0])
    gm = GradManager().attach(x)
    with gm:
        gm.backward(x * x, torch.tensor([0.5, 3.0], dtype=torch.float64))
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 12.0]), **TOL)


@pytest.mark.parametrize("callbacks", [None, lambda t, g: g * 0.5], ids=["plain", "callback"])
def test_public_engine_fallback_gives_the_same_gradients(monkeypatch, callbacks):
    """Without torch.autograd.graph._engine_run_backward (a private function the backend calls
    to skip argument re-checking), the public torch.autograd functions give the same result."""
    model, x = mlp(), torch.randn(6, 8)
    params = list(model.parameters())
    scale = 1.0 if callbacks is None else 0.5
    expected = [e * scale for e in torch.autograd.grad(model(x).square().mean(), params)]
    fast = GradManager().attach(params, callbacks=callbacks)
    with fast:
        fast.backward(model(x).square().mean())
    fast_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    monkeypatch.setattr(tb.engine, "_engine_run_backward", None)
    slow = GradManager().attach(params, callbacks=callbacks)
    with slow:
        slow.backward([model(x).square().mean(), model(x).sum()],
                      [torch.tensor(1.0), torch.tensor(0.0)])
    for p, g, e in zip(params, fast_grads, expected):
        torch.testing.assert_close(g, e, **TOL)
        torch.testing.assert_close(p.grad, e, **TOL)


def test_backward_inside_a_functorch_transform_gives_torchs_own_error():
    w = torch.ones(2, requires_grad=True)
    gm = GradManager().attach(w)

    def f(t):
        with gm:
            gm.backward((w * t).sum())
        return t.sum()

    with pytest.raises(RuntimeError, match="functorch"):
        torch.func.grad(f)(torch.ones(2))
    assert w.grad is None
    from gradmgr import _state

    assert _state.state.recording == [] and _state.state.backwarding == []


cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: no GPU visible to torch on this machine"
)


@cuda
def test_cuda_gradients_stay_on_device_without_syncs():
    model = mlp().cuda()
    x = torch.randn(16, 8, device="cuda")
    expected = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    seen_devices = []
    gm = GradManager().attach(
        model.parameters(), callbacks=lambda t, g: (seen_devices.append(g.device), g)[1]
    )
    torch.cuda.synchronize()
    with gm:
        loss = model(x).square().mean()
        torch.cuda.set_sync_debug_mode("error")  # any host-device sync in backward raises
        try:
            gm.backward(loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for p, e in zip(model.parameters(), expected):
        assert p.grad.device == p.device
        torch.testing.assert_close(p.grad, e, **TOL)
    assert all(d.type == "cuda" for d in seen_devices)


@cuda
def test_cuda_second_order():
    x = torch.tensor([1.5, -0.5], device="cuda")
    outer, inner = GradManager().attach(x), GradManager().attach(x)
    with outer:
        with inner:
            inner.backward((x ** 3).sum())
        g = x.grad
        x.grad = None
        outer.backward(g)
    torch.testing.assert_close(x.grad, 6 * torch.tensor([1.5, -0.5], device="cuda"))


def test_grad_presence_tests_compare_by_identity_not_equality():
    # The .grad snapshots ask "is any None / any not None" of every attached tensor each step,
    # in one C-level pass: by identity, never by == (a tensor's == is elementwise).
    from gradmgr.backends.torch.grads import any_missing, any_present

    zero, one = torch.zeros(3), torch.ones(2)
    assert not any_present([]) and not any_missing([])
    assert not any_present([None, None]) and any_missing([None, None])
    assert any_present([None, zero]) and any_missing([None, zero])
    assert any_present([zero, one]) and not any_missing([zero, one])
