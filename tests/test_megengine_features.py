"""MegEngine training-loop features with gradmgr, each checked against the native manager.

Every program runs twice from the same numpy weights and data: with
``megengine.autodiff.GradManager`` and with ``gradmgr.GradManager``. Both drive MegEngine's own
engine, so gradients, parameters after optimizer steps and BatchNorm statistics must be
bit-identical (``np.testing.assert_array_equal``, dtypes compared too). MegEngine runs only in
the main thread, so there are no thread tests here.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

mge = pytest.importorskip("megengine")

import megengine.amp as amp  # noqa: E402
import megengine.functional as F  # noqa: E402
import megengine.module as M  # noqa: E402
import megengine.optimizer as optim  # noqa: E402
from megengine.autodiff import GradManager as NativeGradManager  # noqa: E402
from megengine.core.autodiff.grad import Grad  # noqa: E402
from megengine.utils.future import Future as NativeFuture  # noqa: E402

import gradmgr  # noqa: E402

IMPLS = {"native": NativeGradManager, "gradmgr": gradmgr.GradManager}


def arrays(values) -> list:
    return [None if v is None else np.array(v.numpy()) for v in values]


def grads(tensors) -> list:
    return arrays(t.grad for t in tensors)


def assert_identical(native: list, ours: list, what: str = "value") -> None:
    assert len(native) == len(ours), what
    for i, (a, b) in enumerate(zip(native, ours)):
        assert (a is None) == (b is None), f"{what}[{i}]"
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
            np.testing.assert_array_equal(b, a, err_msg=f"{what}[{i}]")


def both(program: Callable[[Any], list]) -> list:
    """Run ``program(GradManagerClass)`` with the native manager and with gradmgr's."""
    native = program(IMPLS["native"])
    ours = program(IMPLS["gradmgr"])
    assert_identical(native, ours)
    return ours


@pytest.fixture(autouse=True)
def clean_global_state():
    yield
    assert Grad.stack == [], "MegEngine's Grad stack was left non-empty"
    assert gradmgr.get_backwarding_grad_manager() is None


def identity(t, g):
    return g


def half(t, g):
    return g * 0.5


def half_future(t, g):
    future = NativeFuture(ack=False)  # the native manager resolves only its own Future class
    future.set(g * 0.5)
    return future


CALLBACKS = pytest.mark.parametrize("cb", [None, [identity], [half]],
                                    ids=["plain", "identity", "half"])

RNG = np.random.default_rng(7)
XS = [RNG.standard_normal((4, 8)).astype("float32") for _ in range(4)]
IMGS = [RNG.standard_normal((2, 3, 8, 8)).astype("float32") for _ in range(3)]
LABELS = [RNG.integers(0, 4, size=(2,)).astype("int32") for _ in range(3)]


def with_state(make: Callable[[], M.Module]) -> Callable[[], M.Module]:
    """A factory whose modules all start from the same weights."""
    state = {k: np.array(v) for k, v in make().state_dict().items()}

    def build():
        module = make()
        module.load_state_dict({k: v.copy() for k, v in state.items()})
        return module

    return build


MLP = with_state(lambda: M.Sequential(M.Linear(8, 16), M.ReLU(), M.Linear(16, 4)))


class ConvNet(M.Module):
    def __init__(self):
        super().__init__()
        self.conv = M.Conv2d(3, 8, 3, padding=1)
        self.bn = M.BatchNorm2d(8)
        self.drop = M.Dropout(0.2)
        self.fc = M.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(self.drop(F.flatten(F.avg_pool2d(h, 2), 1)))


CONVNET = with_state(ConvNet)


def mlp_loss(model, x):
    return (model(mge.tensor(x)) ** 2).mean()


# ------------------------------------------------------------------------- training loops
@CALLBACKS
def test_conv_batchnorm_dropout_training_with_clipping_and_momentum(cb):
    def program(GM):
        model = CONVNET()
        model.train()
        opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        gm = GM().attach(model.parameters(), callbacks=cb)
        mge.random.seed(11)  # dropout masks
        out = []
        for x, y in zip(IMGS, LABELS):
            with gm:
                gm.backward(F.nn.cross_entropy(model(mge.tensor(x)), mge.tensor(y)))
            out += grads(model.parameters())
            optim.clip_grad_norm(model.parameters(), 1.0)
            opt.step().clear_grad()
        return out + arrays(model.parameters()) + arrays(model.buffers())

    both(program)


@pytest.mark.parametrize("cb", [None, [half], [half_future]], ids=["plain", "half", "future"])
def test_gradient_accumulation_over_micro_batches(cb):
    def program(GM):
        model = MLP()
        opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        gm = GM().attach(model.parameters(), callbacks=cb)
        out = []
        for _ in range(2):
            for x in XS:
                with gm:
                    gm.backward(mlp_loss(model, x) / len(XS))
            out += grads(model.parameters())
            opt.step().clear_grad()
        return out + arrays(model.parameters())

    both(program)


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW", "Adagrad", "Adadelta"])
def test_optimizers_with_value_clipping(optimizer):
    def program(GM):
        model = MLP()
        opt = getattr(optim, optimizer)(model.parameters(), lr=1e-2)
        gm = GM().attach(model.parameters(), callbacks=identity)
        for x in XS:
            with gm:
                gm.backward(mlp_loss(model, x))
            optim.clip_grad_value(model.parameters(), -0.05, 0.05)
            opt.step().clear_grad()
        return arrays(model.parameters())

    both(program)


# ------------------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("cb", [None, [identity]], ids=["plain", "callback"])
def test_autocast_with_grad_scaler_backward(cb):
    """``GradScaler.backward(gm, loss)`` scales dy, runs gm.backward and unscales the grads of
    ``gm.attached_tensors()``: it works with gradmgr's manager as with the native one."""
    def program(GM):
        model = MLP()
        opt = optim.SGD(model.parameters(), lr=0.1)
        gm = GM().attach(model.parameters(), callbacks=cb)
        scaler = amp.GradScaler()
        out = []
        for x in XS[:2]:
            with gm:
                with amp.autocast():
                    loss = mlp_loss(model, x)
                scaler.backward(gm, loss)
            out += grads(model.parameters())
            opt.step().clear_grad()
        return out + arrays(model.parameters()) + [np.array(scaler.scale_factor)]

    both(program)


def test_grad_scaler_accumulating_before_unscaling():
    def program(GM):
        model = MLP()
        gm = GM().attach(model.parameters(), callbacks=identity)
        scaler = amp.GradScaler()
        for x in XS:
            with gm:
                scaler.backward(gm, mlp_loss(model, x), unscale_grad=False)
        scaler.unscale(gm.attached_tensors())
        scaler.update()
        return grads(model.parameters())

    both(program)


# ------------------------------------------------------------------------- what gets a gradient
def test_only_some_layers_attached():
    def program(GM):
        model = MLP()
        gm = GM().attach(model[2].parameters())
        with gm:
            gm.backward(mlp_loss(model, XS[0]))
        return grads(model.parameters())

    result = both(program)
    assert result[0] is None and result[2] is not None


@CALLBACKS
def test_detach_inside_the_recording(cb):
    def program(GM):
        model = MLP()
        gm = GM().attach(model.parameters(), callbacks=cb)
        with gm:
            h = model[1](model[0](mge.tensor(XS[0])))
            loss = (model[2](h.detach()) ** 2).mean() + 0.5 * (model[2](h) ** 2).mean()
            gm.backward(loss)
        return grads(model.parameters())

    both(program)


@CALLBACKS
def test_tied_embedding_and_output_weights(cb):
    emb_w = RNG.standard_normal((10, 8)).astype("float32")
    idx = np.array([[1, 2, 2], [3, 1, 9]], dtype="int32")
    target = np.array([1, 2, 3, 4, 5, 6], dtype="int32")

    def program(GM):
        emb = M.Embedding(10, 8)
        emb.weight._reset(mge.tensor(emb_w))
        lin = M.Linear(8, 8)
        lin.weight._reset(mge.tensor(np.eye(8, dtype="float32")))
        lin.bias._reset(mge.tensor(np.zeros(8, dtype="float32")))
        gm = GM().attach([emb.weight, *lin.parameters()], callbacks=cb)
        for _ in range(2):
            with gm:
                h = F.tanh(lin(emb(mge.tensor(idx))))
                logits = F.matmul(h, emb.weight, transpose_b=True)  # the output layer is emb
                gm.backward(F.nn.cross_entropy(logits.reshape(-1, 10), mge.tensor(target)))
        return grads([emb.weight, *lin.parameters()])

    both(program)


def test_a_tensor_listed_twice_runs_its_callbacks_twice():
    """Attaching a tensor again appends its callbacks (S2), in one call as in two."""
    def program(GM):
        model = MLP()
        params = list(model.parameters())
        gm = GM().attach(params + params[:1], callbacks=half)
        with gm:
            gm.backward(mlp_loss(model, XS[0]))
        return grads(params)

    both(program)


# ------------------------------------------------------------------------- higher order
class Critic(M.Module):
    """tanh, so that the second derivative is not piecewise zero."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = M.Linear(2, 16), M.Linear(16, 1)

    def forward(self, x):
        return self.fc2(F.tanh(self.fc1(x)))


def test_gradient_penalty_through_nested_managers():
    real, fake = RNG.standard_normal((16, 2)).astype("float32"), \
        RNG.standard_normal((16, 2)).astype("float32")
    eps = RNG.uniform(size=(16, 1)).astype("float32")
    critic = with_state(Critic)

    def program(GM):
        model = critic()
        outer = GM().attach(model.parameters())
        out = []
        for _ in range(2):
            x_hat = mge.tensor(eps * real + (1 - eps) * fake)
            inner = GM()
            with outer:
                with inner:
                    inner.attach(x_hat)
                    inner.backward(model(x_hat).sum())
                norm = F.sqrt((x_hat.grad ** 2).sum(axis=1))
                loss = (model(mge.tensor(fake)).mean() - model(mge.tensor(real)).mean()
                        + 10 * ((norm - 1) ** 2).mean())
                outer.backward(loss)
            out += grads(model.parameters())
        return out

    both(program)


# ------------------------------------------------------------------------- jit.trace
@pytest.mark.parametrize("symbolic", [False, True], ids=["imperative", "symbolic"])
def test_traced_training_step_without_callbacks(symbolic):
    from megengine.jit import trace

    def program(GM):
        model = MLP()
        opt = optim.SGD(model.parameters(), lr=0.1)
        gm = GM().attach(model.parameters())

        @trace(symbolic=symbolic)
        def train_step(x):
            with gm:
                loss = mlp_loss(model, x)
                gm.backward(loss)
            opt.step().clear_grad()
            return loss

        return [train_step(x) for x in XS] + list(model.parameters())

    result = both(lambda GM: arrays(program(GM)))
    assert len(result) == len(XS) + 4
