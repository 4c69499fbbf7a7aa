"""The Paddle backend beyond the contract (test_contract.py runs S1-S13 on it): gradients
against Paddle's own engine on the same program, bit for bit (the same kernels run), the
``stop_gradient`` flags a recording lifts, the order of the callbacks, and the gaps' errors.
Runs only where PaddlePaddle is installed (conftest.py: FRAMEWORK_FILES)."""

from __future__ import annotations

import functools
import threading

import numpy as np
import paddle
import pytest

from gradmgr import GradManager, UnsupportedGraphError, backend_for, get_backwarding_grad_manager
from gradmgr.backends.paddle import flags


def _mlp(seed: int) -> paddle.nn.Layer:
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    x = paddle.to_tensor(rng.standard_normal((6, 8)).astype("float32"))
    labels = paddle.to_tensor(rng.integers(0, 4, 6).astype("int64"))
    return x, labels


def _copy(model: paddle.nn.Layer) -> paddle.nn.Layer:
    twin = _mlp(0)
    twin.set_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    return twin


def test_parameters_and_tensors_are_paddles():
    model = _mlp(0)
    assert backend_for(model[0].weight).name == "paddle"  # EagerParamBase
    assert backend_for(paddle.ones([2])).name == "paddle"
    assert tuple(model[0].weight.shape) == (8, 16)  # Linear's weight is [in, out] in Paddle


def test_an_array_attached_is_refused_naming_paddles_conversion():
    """A numpy array is no tensor: the error names each built-in framework's conversion,
    Paddle's too (on the old code only PyTorch's and MegEngine's)."""
    from gradmgr.errors import AttachError

    gm = GradManager().attach(paddle.ones([3]))
    with pytest.raises(AttachError, match="an array, which has no gradients") as refused:
        gm.attach(np.ones(3, dtype="float32"))
    assert "convert it to a tensor first (" in str(refused.value)
    assert "paddle.to_tensor(a)" in str(refused.value), str(refused.value)


def test_training_equals_native_backward_bit_for_bit():
    """Three SGD steps of an MLP: gradmgr's .grad and the parameters after each step equal
    those of loss.backward() and the same optimizer, exactly (both run the same kernels)."""
    ours, native = _mlp(0), None
    native = _copy(ours)
    opt_ours = paddle.optimizer.SGD(learning_rate=0.1, parameters=ours.parameters())
    opt_native = paddle.optimizer.SGD(learning_rate=0.1, parameters=native.parameters())
    gm = GradManager().attach(ours.parameters())
    for step in range(3):
        x, labels = _batch(step)
        with gm:
            gm.backward(paddle.nn.functional.cross_entropy(ours(x), labels))
        paddle.nn.functional.cross_entropy(native(x), labels).backward()
        for p, q in zip(ours.parameters(), native.parameters()):
            assert np.array_equal(p.grad.numpy(), q.grad.numpy()), (step, p.name)
        opt_ours.step(), opt_native.step()
        opt_ours.clear_grad(), opt_native.clear_grad()
    for p, q in zip(ours.parameters(), native.parameters()):
        assert np.array_equal(p.numpy(), q.numpy())


def test_gradients_equal_paddle_grad_on_the_same_program_with_dy():
    rng = np.random.default_rng(3)
    w = paddle.to_tensor(rng.standard_normal((4, 3)).astype("float32"), stop_gradient=False)
    x = paddle.to_tensor(rng.standard_normal((5, 4)).astype("float32"))
    dy = paddle.to_tensor(rng.standard_normal((5, 3)).astype("float32"))
    expected, = paddle.grad([paddle.tanh(x @ w)], [w], grad_outputs=[dy])
    gm = GradManager().attach(w)
    with gm:
        gm.backward(paddle.tanh(x @ w), dy)
    assert np.array_equal(w.grad.numpy(), expected.numpy())


def test_an_attached_input_gets_a_gradient_and_its_flag_back():
    """An input (stop_gradient=True) gets its gradient, as with requires_grad=False on
    PyTorch; its flag is back after the recording, also when the backward raised."""
    x = paddle.to_tensor([1.0, 2.0])
    w = paddle.to_tensor([3.0, 4.0], stop_gradient=False)
    gm = GradManager().attach([x, w])
    with gm:
        assert x.stop_gradient is False
        gm.backward((x * w).sum())
    assert x.stop_gradient is True and w.stop_gradient is False
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 4.0])

    def boom(t, g):
        raise KeyError("boom")

    gm.attach(w, callbacks=boom)
    with pytest.raises(KeyError), gm:
        gm.backward((x * w).sum())
    assert x.stop_gradient is True and flags.lifted_count() == 0


def _grad_of(w, backward) -> object:
    """``w``'s gradient after ``backward()`` as a list (None: it got none), then cleared."""
    backward()
    grad = None if w.grad is None else w.grad.numpy().tolist()
    w.clear_gradient(False)
    return grad


def _native(w, freeze_after_forward=False) -> object:
    """What Paddle's own ``loss.backward()`` gives ``w`` in ``3 * w`` (a trainable anchor
    keeps the loss differentiable when ``w`` is frozen)."""
    anchor = paddle.to_tensor([0.0], stop_gradient=False)
    loss = (w * 3.0).sum() + anchor.sum()
    if freeze_after_forward:
        w.stop_gradient = True
    return _grad_of(w, loss.backward)


def _step(gm, w, freeze_after_forward=False) -> object:
    def backward():
        with gm:
            y = (w * 3.0).sum()
            if freeze_after_forward:
                w.stop_gradient = True
            gm.backward(y)
    return _grad_of(w, backward)


def test_freeze_rule_paddle_as_native_backward():
    """The contract's point 15 (as tests/test_edges.py's test_freeze_rule_torch), each case
    against Paddle's own loss.backward() of 3 * w where one applies ([3, 3] or none): a plain
    tensor attached trainable, then frozen, gets none; attached again while frozen it is an
    input of that manager and gets [3, 3], its flag back after; another manager attaching it
    decides for itself alone, also recording with the first in a group; a parameter frozen
    gets none whatever its attach calls; frozen between the forward and the backward, what
    Paddle's engine gives (the gradient: the forward recorded it)."""
    w = paddle.to_tensor([1.0, 2.0], stop_gradient=False)
    gm1 = GradManager().attach(w)
    w.stop_gradient = True
    assert _step(gm1, w) is None and _native(w) is None
    gm2 = GradManager().attach(w)  # another manager: an input of gm2 only
    assert _step(gm2, w) == [3.0, 3.0] and _step(gm1, w) is None
    with gm1 | gm2:  # gm2 lifts w's flag; for gm1, w stays frozen
        y = (w * 3.0).sum()
        gm1.backward(y)
        assert w.grad is None
        gm2.backward(y)
    assert w.grad.numpy().tolist() == [3.0, 3.0] and w.stop_gradient is True
    w.clear_gradient(False)
    gm1.attach(w)  # attached again while frozen: now an input of gm1 too
    assert _step(gm1, w) == [3.0, 3.0] and w.stop_gradient is True
    assert flags.lifted_count() == 0
    p = paddle.create_parameter([2], "float32")
    p.set_value(np.array([1.0, 2.0], np.float32))
    gm3 = GradManager().attach(p)
    p.stop_gradient = True
    gm3.attach(p)
    assert _step(gm3, p) is None and _native(p) is None
    p.stop_gradient = False  # unfrozen: trainable again
    assert _step(gm3, p) == [3.0, 3.0] == _native(p)
    v = paddle.to_tensor([1.0, 2.0], stop_gradient=False)
    gm4 = GradManager().attach(v)
    assert _step(gm4, v, freeze_after_forward=True) == [3.0, 3.0]
    v.stop_gradient = False
    assert _native(v, freeze_after_forward=True) == [3.0, 3.0]


def test_a_flag_two_managers_lifted_comes_back_with_the_last():
    x = paddle.to_tensor([1.0, 2.0])
    gm1, gm2 = GradManager().attach(x), GradManager().attach(x)
    gm1.record()
    gm2.record()
    gm2.release()
    assert x.stop_gradient is False  # gm1 still records it
    gm1.backward((x * x).sum())
    assert x.stop_gradient is True and flags.lifted_count() == 0
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0])


def test_callbacks_run_in_the_order_the_engine_finishes_the_gradients():
    """Last layer first, as the engine computes them (paddle.grad runs no leaf hooks, so they
    run after the engine, in its order)."""
    model = _mlp(1)
    order = []
    gm = GradManager()
    for name, p in model.named_parameters():
        gm.attach(p, callbacks=lambda t, g, name=name: (order.append(name), g)[1])
    x, labels = _batch(0)
    with gm:
        gm.backward(paddle.nn.functional.cross_entropy(model(x), labels))
    assert order[:2] == ["2.weight", "2.bias"] or order[:2] == ["2.bias", "2.weight"]
    assert sorted(order[2:]) == ["0.bias", "0.weight"]


class _Branchy(paddle.nn.Layer):
    """Branches that join, a weight used twice, a chain: an order with more than one
    topological order to choose from."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (paddle.nn.Linear(8, 8) for _ in range(3))
        self.chain = paddle.nn.Sequential(*(paddle.nn.Linear(8, 8) for _ in range(4)))
        self.d = paddle.nn.Linear(8, 4)

    def forward(self, x):
        h = paddle.nn.functional.relu(self.a(x))
        return self.d(self.chain(self.b(h) * self.c(h) + self.a.weight.sum() + h))


def test_callbacks_run_in_the_order_paddles_backward_runs_leaf_hooks():
    """The whole order (order.py), not only its first two, against the engine's own: the
    order in which ``loss.backward()`` runs a hook on each parameter of the same model."""
    paddle.seed(0)
    model = _Branchy()
    x, _ = _batch(1)
    native: list = []
    handles = [p.register_hook(lambda g, i=i: native.append(i))
               for i, p in enumerate(model.parameters())]
    model(x).sum().backward()
    for handle in handles:
        handle.remove()
    ours: list = []
    gm = GradManager()
    for i, p in enumerate(model.parameters()):
        gm.attach(p, callbacks=lambda t, g, i=i: (ours.append(i), g)[1])
    with gm:
        gm.backward(model(x).sum())
    assert len(native) == len(list(model.parameters())) == 16
    assert ours == native


def _split_outputs(model: paddle.nn.Layer, x: paddle.Tensor) -> tuple:
    """Two outputs of one operation, which share its grad node, and a seed for each."""
    y1, y2 = paddle.split(model(x), 2, axis=1)
    return [y1, y2], [paddle.ones_like(y1), paddle.full_like(y2, 2.0)]


def test_callbacks_follow_the_engine_when_two_outputs_share_their_node():
    """``backward([y1, y2], [dy1, dy2])`` of two outputs of one ``paddle.split``: the callbacks
    run in the order ``paddle.autograd.backward`` of the same outputs runs leaf hooks, on the
    same gradients, bit for bit. (order.py counted the shared node's edges once per output,
    so no node below it became ready: every callback ran in the attach order.)"""
    paddle.seed(0)
    model = _Branchy()
    x, _ = _batch(1)
    params = list(model.parameters())
    native: list = []
    handles = [p.register_hook(lambda g, i=i: native.append(i)) for i, p in enumerate(params)]
    paddle.autograd.backward(*_split_outputs(model, x))
    for handle in handles:
        handle.remove()
    native_grads = [p.grad.numpy() for p in params]
    model.clear_gradients(set_to_zero=False)
    ours: list = []
    gm = GradManager()
    for i, p in enumerate(params):
        gm.attach(p, callbacks=lambda t, g, i=i: (ours.append(i), g)[1])
    with gm:
        gm.backward(*_split_outputs(model, x))
    assert len(native) == 16 and native != sorted(native)
    assert ours == native
    for p, want in zip(params, native_grads):
        np.testing.assert_array_equal(p.grad.numpy(), want)


def _seeds(y) -> list:
    rng = np.random.default_rng(7)
    return [paddle.to_tensor(rng.standard_normal(y.shape).astype("float32")) for _ in range(2)]


def _same(y):
    return [y, y]


def _alias(y):
    return [y, y[:]]  # a new tensor object over y's autograd record


@pytest.mark.parametrize("pick,which,native", [
    (_same, "the same tensor twice", (AssertionError, "duplicate paddle.Tensor")),
    (_alias, "two tensors over one autograd record", (SystemError, "already been initialized")),
])
def test_one_output_twice_is_refused_saying_what_to_pass(pick, which, native):
    """``backward([y, y], [dy1, dy2])``, and ``y`` with ``y[:]``: Paddle's engine refuses both
    (measured here, so a Paddle that starts to add them fails this test): ``paddle.grad`` with
    "duplicate tensor", ``paddle.autograd.backward`` as ``native`` says. gradmgr's backward,
    one ``paddle.grad``, raised Paddle's RuntimeError on the old code; now its own
    ``UnsupportedGraphError`` saying what to pass, before any callback or ``.grad``. What it
    says, ``gm.backward([y], [dy1 + dy2])``, gives bit for bit what Paddle's own backward gives
    where it adds two seeds of one value (``y`` and a view of it), and the manager's next
    backward is whole."""
    model = _mlp(0)
    x, _ = _batch(0)
    y = model(x)
    dy1, dy2 = _seeds(y)
    with pytest.raises(RuntimeError, match="duplicate tensor"):
        paddle.grad(pick(y), model.parameters(), [dy1, dy2], retain_graph=True)
    with pytest.raises(native[0], match=native[1]):
        paddle.autograd.backward(pick(y), [dy1, dy2])
    model.clear_gradients(set_to_zero=False)
    calls: list = []
    gm = GradManager().attach(model.parameters(), callbacks=lambda t, g: (calls.append(1), g)[1])
    with gm, pytest.raises(UnsupportedGraphError, match="got one output twice") as refused:
        gm.backward(pick(model(x)), [dy1, dy2])
    message = str(refused.value)
    assert f"({which}" in message and "gm.backward([y], [dy1 + dy2])" in message, message
    assert "PyTorch adds the two seeds and MegEngine keeps the last one" in message
    assert calls == [] and all(p.grad is None for p in model.parameters())
    twin = _copy(model)
    y = twin(x)
    paddle.autograd.backward([y, y.view(y.shape)], [dy1, dy2])
    with gm:
        gm.backward([model(x)], [dy1 + dy2])
    assert len(calls) == 4
    for p, q in zip(model.parameters(), twin.parameters()):
        np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())


def test_an_output_and_a_view_of_it_add_up_as_in_paddles_backward():
    """``y`` and ``y.view(...)`` are two autograd records: Paddle's engine adds their seeds,
    and so does gradmgr's backward, bit for bit."""
    model = _mlp(0)
    twin = _copy(model)
    x, _ = _batch(1)
    y = twin(x)
    dy1, dy2 = _seeds(y)
    paddle.autograd.backward([y, y.view([-1])], [dy1, dy2.reshape([-1])])
    gm = GradManager().attach(model.parameters())
    with gm:
        y = model(x)
        gm.backward([y, y.view([-1])], [dy1, dy2.reshape([-1])])
    for p, q in zip(model.parameters(), twin.parameters()):
        np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())


def _kept(forward):
    @functools.wraps(forward)
    def decorated(*args):  # no self here: the forward it calls (__wrapped__) has it
        return forward(*args)
    return decorated


def _bare(forward):
    def decorated(*args):  # no self, no functools.wraps: nothing leads to the wrapper
        return forward(*args)
    return decorated


class _OwnForward(paddle.DataParallel):
    def forward(self, x):
        return self._layers(x)


class _Kept(paddle.DataParallel):
    @_kept
    def forward(self, x):
        return self._layers(x)


class _Bare(paddle.DataParallel):
    @_bare
    def forward(self, x):
        return self._layers(x)


@pytest.mark.filterwarnings("ignore:The program will return to single-card")
def test_the_wrapper_checks_find_each_paddle_data_parallel():
    """What data_parallel's forward watch finds (wrappers.py), in one process, where
    ``paddle.DataParallel`` only calls the layer (tests/test_paddle_distributed.py has the
    refusals on 2 ranks): the wrapper around the model, a subclass with a forward of its own,
    one decorated with ``functools.wraps``, a wrapper around a layer holding the model, one
    inside the model at sublayer ``2``; not a subclass whose forward a decorator replaced by a
    function of ``*args`` without ``__wrapped__`` (docs/paddle.md says so)."""
    from gradmgr.backends.paddle import wrappers

    x, _ = _batch(0)
    found: list = []

    def run(forward, model) -> str:
        found.clear()
        forward(x)
        return found[0] or "none"

    model = _mlp(0)
    model.register_forward_post_hook(
        lambda layer, inputs, output: found.append(wrappers.forward_problem(layer)))
    around = wrappers.DATA_PARALLEL_AROUND
    assert run(model, model) == "none"
    for wrapper in (paddle.DataParallel, _OwnForward, _Kept):
        assert run(wrapper(model), model) == around, wrapper
    assert run(paddle.DataParallel(paddle.nn.Sequential(model)), model) == around
    assert run(_Bare(model), model) == "none"
    model[2] = paddle.DataParallel(model[2])
    assert run(model, model).startswith(
        "data_parallel(): this layer holds a paddle.DataParallel at sublayer '2'")
    holder = paddle.nn.Sequential(paddle.nn.Sequential(model))
    assert wrappers.given_problem(holder).startswith(
        "data_parallel() was given a layer that holds a paddle.DataParallel at sublayer "
        "'0.0.2'")
    assert wrappers.given_problem(_OwnForward(_mlp(1))) == wrappers.DATA_PARALLEL_WRAPPER
    assert wrappers.given_problem(_mlp(1)) is None


def test_leaf_hooks_without_callbacks_run_in_the_order_of_paddles_backward():
    """No callback, so the order is read from the graph only because the leaves have hooks
    of their own (tape.py: _deliver): they run in the engine's order, on the same gradients."""
    paddle.seed(0)
    model = _Branchy()
    x, _ = _batch(1)
    seen: list = []
    for i, p in enumerate(model.parameters()):
        p.register_hook(lambda g, i=i: (seen.append(i), g * 2)[1])
    model(x).sum().backward()
    native, native_grads = list(seen), [p.grad.numpy() for p in model.parameters()]
    model.clear_gradients()
    seen.clear()
    gm = GradManager().attach(model.parameters())
    with gm:
        gm.backward(model(x).sum())
    assert seen == native and native != sorted(native)
    for p, want in zip(model.parameters(), native_grads):
        np.testing.assert_array_equal(p.grad.numpy(), want)


def test_leaf_hooks_registered_between_backwards_run_in_the_order_of_paddles_backward():
    """No callback; a backward without hooks (the tape's probes see none), then a hook on each
    parameter: the next backward runs them in the engine's order (the tape's one probe of a
    leaf comes after the engine, and the graph is read then), on ``loss.backward()``'s
    gradients, bit for bit."""
    paddle.seed(0)
    model = _Branchy()
    x, _ = _batch(1)
    gm = GradManager().attach(model.parameters())
    with gm:
        gm.backward(model(x).sum())
    model.clear_gradients(set_to_zero=False)
    seen: list = []
    for i, p in enumerate(model.parameters()):
        p.register_hook(lambda g, i=i: (seen.append(i), g * 2)[1])
    model(x).sum().backward()
    native, native_grads = list(seen), [p.grad.numpy() for p in model.parameters()]
    model.clear_gradients(set_to_zero=False)
    seen.clear()
    with gm:
        gm.backward(model(x).sum())
    assert seen == native and native != sorted(native)
    for p, want in zip(model.parameters(), native_grads):
        np.testing.assert_array_equal(p.grad.numpy(), want)


def test_without_callbacks_nor_hooks_the_graph_is_not_read(monkeypatch):
    """Nothing can see the order then: the tape spares order.py's walk of the graph (about
    half of the time gradmgr adds in Python at 1,000 tensors, bench/RESULTS.md); .grad is Paddle's
    own, bit for bit; a callback attached later brings the walk back."""
    from gradmgr.backends.paddle import tape

    walks: list = []
    real = tape.ready_order
    monkeypatch.setattr(tape, "ready_order",
                        lambda ys, ts: (walks.append(len(ts)), real(ys, ts))[1])
    model, x, labels = _mlp(0), *_batch(0)
    twin = _copy(model)
    paddle.nn.functional.cross_entropy(twin(x), labels).backward()
    gm = GradManager().attach(model.parameters())
    with gm:
        gm.backward(paddle.nn.functional.cross_entropy(model(x), labels))
    assert walks == []
    for p, q in zip(model.parameters(), twin.parameters()):
        np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())
    gm.attach(model[0].bias, callbacks=lambda t, g: g)
    with gm:
        gm.backward(paddle.nn.functional.cross_entropy(model(x), labels))
    assert walks == [4]


@pytest.mark.parametrize("use_gm", [False, True])
def test_a_leaf_hook_registered_while_the_engine_runs_runs(use_gm):
    """No callback and no hook when the backward starts; a non-leaf's hook registers one on
    the leaf while the engine runs: the tape's probe after the engine sees it, and it runs,
    as under ``loss.backward()`` (x3 on ``[1, 2]``: exact in float32)."""
    w = paddle.create_parameter([2], "float32",
                                default_initializer=paddle.nn.initializer.Constant(1.0))
    y = paddle.to_tensor([1.0, 2.0]) * w
    y.register_hook(lambda g: (w.register_hook(lambda gw: gw * 3), g)[1])
    if use_gm:
        gm = GradManager().attach(w)
        with gm:
            gm.backward(y.sum())
    else:
        y.sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), [3.0, 6.0])


@pytest.mark.parametrize("use_gm", [False, True])
def test_a_leaf_hook_registered_by_an_earlier_leafs_hook_runs(use_gm):
    """No callback; the last layer's weight has a hook, which registers one (x3) on the first
    layer's weight, whose gradient the engine finishes later: it runs in this backward, as
    under ``loss.backward()`` (the tape probes a leaf again once a hook has run), and the
    first layer's bias, which got no hook, keeps its gradient."""
    model, x, labels = _mlp(0), *_batch(0)
    twin = _copy(model)
    paddle.nn.functional.cross_entropy(twin(x), labels).backward()
    first = model[0].weight
    model[2].weight.register_hook(lambda g: (first.register_hook(lambda gw: gw * 3), g)[1])
    loss = paddle.nn.functional.cross_entropy(model(x), labels)
    if use_gm:
        gm = GradManager().attach(model.parameters())
        with gm:
            gm.backward(loss)
    else:
        loss.backward()
    want = [q.grad.numpy() for q in twin.parameters()]
    want[0] = want[0] * 3  # x3 of a float32: the same rounding on both sides
    for p, w in zip(model.parameters(), want):
        np.testing.assert_array_equal(p.grad.numpy(), w)


def test_a_nonleaf_grad_owns_its_storage():
    x = paddle.to_tensor([1.0, 2.0], stop_gradient=False)
    kept = []
    gm = GradManager().attach(x)
    with gm:
        h = x * 2.0
        gm.attach(h, callbacks=lambda t, g: (kept.append(g), g)[1])
        gm.backward((h * h).sum())
    np.testing.assert_array_equal(h.grad.numpy(), [4.0, 8.0])
    kept[0][0] = 100.0  # the callback's tensor, changed afterwards
    np.testing.assert_array_equal(h.grad.numpy(), [4.0, 8.0])


def test_a_constant_output_gives_no_gradient():
    w = paddle.to_tensor([1.0], stop_gradient=False)
    gm = GradManager().attach(w)
    with gm:
        gm.backward(paddle.to_tensor([5.0]))
    assert w.grad is None


def test_higher_order_is_refused_clearly_and_leaves_no_state():
    x = paddle.to_tensor([1.5], stop_gradient=False)
    outer, inner = GradManager().attach(x), GradManager().attach(x)
    with outer, inner, pytest.raises(UnsupportedGraphError, match="paddle.grad"):
        inner.backward((x * x * x).sum())
    assert get_backwarding_grad_manager() is None and x.grad is None
    assert flags.lifted_count() == 0


def test_a_thread_is_refused_clearly():
    errors = []

    def work():
        try:
            GradManager().attach(paddle.to_tensor([1.0], stop_gradient=False))
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert len(errors) == 1 and "main thread" in errors[0]


def test_operations_on_an_input_before_record_are_ignored():
    """An attached input's flag is lifted only at record(), so what was computed from it
    before is a constant (MegEngine's S9), unlike a parameter's (docs/paddle.md)."""
    x = paddle.to_tensor([2.0])
    u = x * 3.0  # before record(): Paddle records nothing for an input
    gm = GradManager().attach(x)
    with gm:
        gm.backward((u * x).sum())
    np.testing.assert_array_equal(x.grad.numpy(), [6.0])  # u, not u + 3x


def test_the_porting_tool_takes_paddle_models():
    from gradmgr import get_backend

    # its own tests: tests/test_parity_paddle.py; data parallelism: tests/test_paddle_distributed.py
    assert get_backend("paddle").parity_adapter(_mlp(0)).framework == "paddle"


def test_the_conventions_docs_paddle_md_states():
    """Linear's weight [in, out], BatchNorm's momentum 0.9, and .grad a view that
    ``x.grad = None`` empties (so the contract suite keeps ``x.grad.clone()``)."""
    assert tuple(paddle.nn.Linear(3, 2).weight.shape) == (3, 2)
    assert paddle.nn.BatchNorm1D(2)._momentum == 0.9
    x = paddle.to_tensor([2.0], stop_gradient=False)
    (x * x).sum().backward()
    view, kept = x.grad, x.grad.clone()
    x.grad = None
    assert view.numpy().size == 0 and kept.numpy().tolist() == [4.0]


def test_an_attached_input_dropped_while_recording_leaves_no_lifted_flag():
    gm = GradManager()
    with gm:
        x = paddle.to_tensor([1.0])
        gm.attach(x)
        assert flags.lifted_count() == 1
        del x
        import gc

        gc.collect()
        assert flags.lifted_count() == 0
        gm.backward()


def test_split_backward_equals_one_backward_bit_for_bit():
    """A pipeline stage: the input's gradient first, the parameters' at finish(); each equals
    what one paddle.grad over all of them gives, bit for bit, and finish() writes only those."""
    model = _mlp(2)
    x, labels = _batch(5)
    x.stop_gradient = False
    loss = paddle.nn.functional.cross_entropy(model(x), labels)
    expected = paddle.grad([loss], [x, *model.parameters()])
    x.stop_gradient = True
    seen = []
    gm = GradManager().attach(model.parameters(), callbacks=lambda t, g: (seen.append(t), g)[1])
    with gm:
        gm.attach(x)
        rest = gm.backward_split(paddle.nn.functional.cross_entropy(model(x), labels), first=[x])
    assert np.array_equal(x.grad.numpy(), expected[0].numpy())
    assert all(p.grad is None for p in model.parameters()) and seen == []
    rest.finish()
    for p, e in zip(model.parameters(), expected[1:]):
        assert np.array_equal(p.grad.numpy(), e.numpy()), p.name
    assert len(seen) == 4 and x.stop_gradient is True


# The single-process column of two habit rows (their data-parallel columns:
# tests/test_paddle_distributed.py). Bit for bit against Paddle's own ``loss.backward()`` on
# the same program.
@pytest.mark.parametrize("removed", [False, True])
def test_a_parameters_register_hook_runs_as_under_paddles_backward(removed):
    """Two hooks on a weight (one printing-like, returning None), over two steps with .grad
    kept; ``removed``: the scaling hook removed after the first step, on both sides. The
    callbacks see the hooked gradient, outside the graph as paddle.grad gives it."""
    model, native = _mlp(0), _mlp(0)
    seen = []
    calls = {"ours": 0, "theirs": 0}
    handles = []
    for m, side in ((model, "ours"), (native, "theirs")):
        m[0].weight.register_hook(lambda grad, side=side: calls.__setitem__(side, calls[side] + 1))
        handles.append(m[0].weight.register_hook(lambda grad: grad * 3))
    gm = GradManager().attach(model.parameters(),
                              callbacks=lambda t, g: (seen.append((t, g)), g)[1])
    for step in range(2):
        if removed and step == 1:
            assert all(h.remove() for h in handles)
        x, labels = _batch(step)
        with gm:
            gm.backward(paddle.nn.functional.cross_entropy(model(x), labels))
        paddle.nn.functional.cross_entropy(native(x), labels).backward()
        for ours, theirs in zip(model.parameters(), native.parameters()):
            np.testing.assert_array_equal(ours.grad.numpy(), theirs.grad.numpy())
        if step == 0:  # .grad held nothing before: it is the hooked gradient
            hooked = [g for t, g in seen if t is model[0].weight]
            np.testing.assert_array_equal(hooked[0].numpy(), native[0].weight.grad.numpy())
    assert calls == {"ours": 2, "theirs": 2} and len(seen) == 8
    assert all(g.stop_gradient for _, g in seen)


def test_callbacks_see_the_gradients_of_a_recomputed_layer():
    """A callback doubling every gradient, with the second Linear under Paddle's
    ``fleet.utils.recompute(use_reentrant=False)``: twice ``loss.backward()``'s gradients
    (without recompute)."""
    from paddle.distributed.fleet.utils import recompute

    model, native = _mlp(0), _mlp(0)
    x, labels = _batch(0)
    gm = GradManager().attach(model.parameters(), callbacks=[lambda t, g: g * 2])
    with gm:
        h = model[1](model[0](x))
        out = recompute(model[2], h, use_reentrant=False)
        gm.backward(paddle.nn.functional.cross_entropy(out, labels))
    paddle.nn.functional.cross_entropy(native(x), labels).backward()
    for ours, theirs in zip(model.parameters(), native.parameters()):
        np.testing.assert_array_equal(ours.grad.numpy(), 2 * theirs.grad.numpy())


@pytest.mark.parametrize("split", [False, True])
def test_a_reentrant_recompute_is_refused_naming_the_parameter(split):
    """Paddle's default ``recompute`` (``use_reentrant=True``) writes the recomputed layer's
    ``.grad`` in its own backward and gives ``paddle.grad`` None: the callbacks would never
    see it, so gm.backward (and a split backward's rest) raises, naming the weight."""
    from paddle.distributed.fleet.utils import recompute

    model = _mlp(0)
    x, labels = _batch(0)
    gm = GradManager().attach(model.parameters(), callbacks=[lambda t, g: g * 2])
    match = f"wrote the .grad of '{model[2].weight.name}'.*use_reentrant=False"
    with gm:
        loss = paddle.nn.functional.cross_entropy(recompute(model[2], model[1](model[0](x))),
                                                  labels)
        if not split:
            with pytest.raises(UnsupportedGraphError, match=match):
                gm.backward(loss)
            return
        rest = gm.backward_split(loss, first=[])
    with pytest.raises(UnsupportedGraphError, match=match):
        rest.finish()


def _sparse_rows(grad) -> tuple:
    """A sparse gradient's rows and their values (``SelectedRows``: ``numpy()`` has none)."""
    assert grad.is_selected_rows()
    return grad.rows(), grad._get_tensor_from_selected_rows().numpy()


def test_a_sparse_gradient_runs_its_leafs_hooks_and_accumulates_as_in_paddles_backward():
    """``Embedding(sparse=True)`` with a ``register_hook`` (x2) on its weight and a callback
    (so the tape runs the hooks itself), two backwards accumulated into ``.grad``: the hook
    sees what it sees in ``loss.backward()`` (the rows, repeated rows kept), and ``.grad``
    is Paddle's own, sparse, its rows merged, bit for bit. On the old code the hooks' backward
    read the sparse gradient as dense (``OSError``, a dimension of garbage size), and two
    sparse gradients could not be added (``Tensor holds no memory``)."""
    ids = [paddle.to_tensor(np.array([[1, 3, 3]], dtype="int64")),
           paddle.to_tensor(np.array([[2, 3]], dtype="int64"))]
    models, seen = [], []
    for side in range(2):
        paddle.seed(0)
        models.append(paddle.nn.Sequential(paddle.nn.Embedding(10, 4, sparse=True),
                                           paddle.nn.Linear(4, 1)))
        seen.append([])
        models[side][0].weight.register_hook(
            lambda g, rows=seen[side]: (rows.append(g.rows()), g * 2)[1])
    ours, native = models
    gm = GradManager().attach(ours.parameters(), callbacks=lambda tensor, grad: grad)
    for batch in ids:
        with gm:
            gm.backward(ours(batch).sum())
        native(batch).sum().backward()
    assert seen[0] == seen[1] == [[1, 3, 3], [2, 3]]
    rows, values = _sparse_rows(ours[0].weight.grad)
    want_rows, want_values = _sparse_rows(native[0].weight.grad)
    assert rows == want_rows == [1, 2, 3]
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(ours[1].weight.grad.numpy(), native[1].weight.grad.numpy())


def test_every_way_of_assigning_a_sublayer_or_parameter_into_a_watched_layer_is_counted():
    """What ``data_parallel``'s watch sees a replaced layer by (registrations.py): each
    assignment Paddle makes into a watched layer or a sublayer of it moves the count, a
    sublayer added since is counted once watched again, and a deep or pickled copy of the
    model gets Paddle's plain dicts back."""
    import copy
    import pickle
    from collections import OrderedDict

    from gradmgr.backends.paddle import registrations

    model = _mlp(0)
    registrations.count_changes(model)
    first = model[0]
    changes = {
        "Sequential.__setitem__": lambda: model.__setitem__(2, paddle.nn.Linear(16, 4)),
        "setattr of a layer": lambda: setattr(first, "extra", paddle.nn.Linear(1, 1)),
        "delattr": lambda: delattr(first, "extra"),
        "add_parameter": lambda: first.add_parameter(
            "scale", first.create_parameter([1])),
        "setattr of a parameter": lambda: setattr(first, "weight", first.create_parameter(
            [8, 16])),
        "add_sublayer": lambda: model.add_sublayer("head", paddle.nn.Linear(4, 2)),
    }
    for what, change in changes.items():
        before = registrations.changes()
        change()
        assert registrations.changes() > before, what
    added = model.head
    assert type(added._parameters) is OrderedDict  # not watched yet
    registrations.count_changes(model)
    before = registrations.changes()
    added.weight = added.create_parameter([4, 2])
    assert registrations.changes() > before
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        for layer in copied.sublayers(include_self=True):
            assert type(layer._sub_layers) is OrderedDict
            assert type(layer._parameters) is OrderedDict
