"""PyTorch features that training loops combine with gradmgr, each checked against the engine.

Every test runs the same program twice from the same weights and data: once with plain PyTorch
(``loss.backward()``, ``torch.autograd.grad``, the optimizer, the feature under test) and once
with ``gradmgr.GradManager`` in place of the backward. The same kernels run on both sides, so
``.grad`` (and parameters after optimizer steps) must be bit-identical: comparisons use
``torch.equal`` and also check dtype, shape, layout and ``None``-ness. A test that cannot be
bit-identical says so, and why, in its docstring.

Most tests run twice: ``plain`` (no callbacks: the engine accumulates into ``.grad`` itself) and
``callback`` (an identity callback: gradients go through gradmgr's hooks and its own
accumulation), because the two take different paths through the torch backend. A callback that
changes the gradient is compared with ``torch.autograd.grad`` plus the same change by hand.
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint, checkpoint_sequential  # noqa: E402

from gradmgr import GradManager, UnsupportedGraphError  # noqa: E402
from gradmgr.backends.torch import PreRecordGradientWarning  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::gradmgr.errors.GradMgrWarning")


def identity(t, g):
    return g


def half(t, g):
    return g * 0.5


class Resolved:
    """A Future (anything with ``.get()``) that already holds its value."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


def half_future(t, g):
    return Resolved(g * 0.5)


CALLBACKS = pytest.mark.parametrize("cb", [None, [identity]], ids=["plain", "callback"])


def mlp(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 4))


def data(n: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def grads(tensors):
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def assert_same(expected, actual, what="grad"):
    """Bit-identical lists of tensors (or Nones): dtype, shape, layout and values."""
    expected, actual = list(expected), list(actual)
    assert len(expected) == len(actual), what
    for i, (e, a) in enumerate(zip(expected, actual)):
        assert (e is None) == (a is None), f"{what}[{i}]: {e is None=} {a is None=}"
        if e is None:
            continue
        assert e.dtype == a.dtype and e.shape == a.shape and e.layout == a.layout, (
            f"{what}[{i}]: {e.dtype} {tuple(e.shape)} {e.layout} vs "
            f"{a.dtype} {tuple(a.shape)} {a.layout}")
        if e.is_sparse:
            e, a = e.coalesce(), a.coalesce()
            assert torch.equal(e.indices(), a.indices()), f"{what}[{i}] indices"
            e, a = e.values(), a.values()
        assert torch.equal(e, a), f"{what}[{i}] differs by {(e - a).abs().max().item()}"


def assert_same_grads(ref: nn.Module, ours: nn.Module):
    assert_same(grads(ref.parameters()), grads(ours.parameters()))


def backward_with(loss, params, scale=None):
    """The engine's reference for a callback ``g * scale``: ``autograd.grad``, changed by hand,
    accumulated as AccumulateGrad does."""
    params = list(params)
    if scale is None:
        loss.backward()
        return
    for p, g in zip(params, torch.autograd.grad(loss, params)):
        g = g * scale
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.add_(g)


def step(gm, loss_fn):
    with gm:
        gm.backward(loss_fn())


# ================================================================= 1. autocast and GradScaler
@CALLBACKS
def test_autocast_bfloat16_forward(cb):
    x, y = data()
    ref, ours = mlp(), mlp()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(ref(x).float(), y)
        loss.backward()
        with gm:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(ours(x).float(), y)
            gm.backward(loss)
    assert_same_grads(ref, ours)


def test_autocast_with_a_scaling_callback():
    x, y = data()
    ref, ours = mlp(), mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        backward_with(F.mse_loss(ref(x).float(), y), ref.parameters(), 0.5)
    gm = GradManager().attach(ours.parameters(), callbacks=half)
    with gm:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(ours(x).float(), y)
        gm.backward(loss)
    assert_same_grads(ref, ours)


@CALLBACKS
def test_recording_and_backward_inside_autocast(cb):
    x, y = data()
    ref, ours = mlp(), mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.mse_loss(ref(x), y.bfloat16()).backward()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    with torch.autocast("cpu", dtype=torch.bfloat16), gm:
        gm.backward(F.mse_loss(ours(x), y.bfloat16()))
    assert_same_grads(ref, ours)


@CALLBACKS
def test_grad_scaler_unscale_clip_step(cb):
    """scaler.scale(loss) goes to gm.backward; unscale_, clip, step, update as usual."""
    x, y = data()
    ref, ours = mlp(), mlp()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    s_ref, s = torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler(
        "cpu", init_scale=1024.0)
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(ref(x).float(), y)
        s_ref.scale(loss).backward()
        s_ref.unscale_(opt_ref)
        unscaled = grads(ref.parameters())
        nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        s_ref.step(opt_ref)
        s_ref.update()
        opt_ref.zero_grad()

        with gm:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(ours(x).float(), y)
            gm.backward(s.scale(loss))
        s.unscale_(opt)
        assert_same(unscaled, grads(ours.parameters()))
        nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
        s.step(opt)
        s.update()
        opt.zero_grad()
    assert_same(ref.parameters(), ours.parameters(), "param")
    assert s.get_scale() == s_ref.get_scale()


@CALLBACKS
def test_grad_scaler_skips_the_step_on_inf_like_the_plain_loop(cb):
    x, _ = data()
    x[0, 0] = float("inf")  # the first layer's gradient becomes non-finite
    ref, ours = mlp(), mlp()
    opt_ref, opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours))
    s_ref, s = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    s_ref.scale(ref(x).sum()).backward()
    s_ref.step(opt_ref)
    s_ref.update()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    with gm:
        gm.backward(s.scale(ours(x).sum()))
    s.step(opt)
    s.update()
    assert s.get_scale() == s_ref.get_scale() < 65536.0
    assert_same(ref.parameters(), ours.parameters(), "param")


# ================================================================= 2. torch.compile
# Compiling is slow on a 2-core CPU, so these use a tiny model. Inductor was checked by hand
# (bit-identical with and without callbacks) but takes 10-20 s to compile here.
def tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 4))


@pytest.mark.slow
@pytest.mark.parametrize("backend, cb, scale", [("eager", None, None),
                                                ("eager", [identity], None),
                                                ("eager", [half], 0.5)],
                         ids=["eager-plain", "eager-callback", "eager-half"])
def test_compiled_module_forward(backend, cb, scale):
    x, y = data()
    ref, ours = tiny(), tiny()
    c_ref, c_ours = torch.compile(ref, backend=backend), torch.compile(ours, backend=backend)
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(2):
        backward_with(F.mse_loss(c_ref(x), y), ref.parameters(), scale)
        step(gm, lambda: F.mse_loss(c_ours(x), y))
    assert_same_grads(ref, ours)


@pytest.mark.slow
def test_compiled_autograd_with_callbacks():
    """The backward itself compiled (compiled autograd), gradmgr's hooks included."""
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    x, y = data()
    ref, ours = tiny(), tiny()
    gm = GradManager().attach(ours.parameters(), callbacks=identity)
    F.mse_loss(ref(x), y).backward()
    counters["compiled_autograd"].clear()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        step(gm, lambda: F.mse_loss(ours(x), y))
    assert counters["compiled_autograd"]["captures"] == 1
    assert_same_grads(ref, ours)


# ================================================================= 3. gradient accumulation
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
@pytest.mark.parametrize("cb, scale", [(None, None), ([identity], None), ([half], 0.5),
                                       ([half_future], 0.5)],
                         ids=["plain", "identity", "half", "future"])
def test_gradient_accumulation_over_micro_batches(cb, scale, set_to_none):
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(3)]
    ref, ours = mlp(), mlp()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(2):
        for x, y in batches:
            backward_with(F.mse_loss(ref(x), y) / len(batches), ref.parameters(), scale)
            step(gm, lambda x=x, y=y: F.mse_loss(ours(x), y) / len(batches))
        assert_same_grads(ref, ours)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
    assert_same(ref.parameters(), ours.parameters(), "param")


@pytest.mark.parametrize("cb, scale", [(None, None), ([identity], None), ([half], 0.5)],
                         ids=["plain", "identity", "half"])
def test_non_contiguous_preset_grad_is_accumulated_in_place(cb, scale):
    w_ref = torch.randn(6, 5, requires_grad=True)
    w = w_ref.detach().clone().requires_grad_()
    base = torch.randn(5, 6)
    w_ref.grad, w.grad = base.clone().t(), base.clone().t()
    kept = w.grad
    x = torch.randn(3, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the engine: "gradient layout contract"
        backward_with((x @ w_ref).sin().sum(), [w_ref], scale)
        gm = GradManager().attach(w, callbacks=cb)
        step(gm, lambda: (x @ w).sin().sum())
    assert w.grad is kept and w.grad.stride() == w_ref.grad.stride() == (1, 6)
    assert torch.equal(w.grad, w_ref.grad)


# ================================================================= 4. frozen layers, no_grad
@CALLBACKS
def test_layer_frozen_after_attach_gets_no_grad_and_can_be_unfrozen(cb):
    x, _ = data()
    ref, ours = mlp(), mlp()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)

    def both():
        ref(x).pow(2).mean().backward()
        step(gm, lambda: ours(x).pow(2).mean())

    both()
    for m in (ref, ours):
        m.zero_grad()
        m[2].requires_grad_(False)
    both()
    assert ours[2].weight.grad is None and not ours[2].weight.requires_grad
    assert_same_grads(ref, ours)
    for m in (ref, ours):
        m[2].requires_grad_(True)
    both()
    assert_same_grads(ref, ours)


@CALLBACKS
def test_layer_frozen_before_attach_gets_no_grad(cb):
    """Fine-tuning: the backbone is frozen, then the whole model is attached. A frozen
    Parameter stays frozen (only plain tensors attached as inputs get the flag)."""
    x, _ = data()
    ref, ours = mlp(), mlp()
    for m in (ref, ours):
        m[0].requires_grad_(False)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, weight_decay=0.1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, weight_decay=0.1)
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(2):
        ref(x).pow(2).mean().backward()
        step(gm, lambda: ours(x).pow(2).mean())
        assert_same_grads(ref, ours)
        opt_ref.step()
        opt.step()
    assert ours[0].weight.grad is None and not ours[0].weight.requires_grad
    assert_same(ref.parameters(), ours.parameters(), "param")


@CALLBACKS
def test_unfreezing_inside_the_recording(cb):
    """Progressive unfreezing done inside the training step is kept after the step."""
    x, _ = data()
    ref, ours = mlp(), mlp()
    for m in (ref, ours):
        m[0].requires_grad_(False)
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for i in range(2):
        if i == 1:
            ref[0].requires_grad_(True)
        ref(x).pow(2).mean().backward()
        with gm:
            if i == 1:
                ours[0].requires_grad_(True)
            gm.backward(ours(x).pow(2).mean())
    assert ours[0].weight.requires_grad
    assert_same_grads(ref, ours)


@CALLBACKS
def test_layer_frozen_between_forward_and_backward(cb):
    x, _ = data()
    ref, ours = mlp(), mlp()
    loss = ref(x).pow(2).mean()
    ref[4].requires_grad_(False)
    loss.backward()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    with gm:
        loss = ours(x).pow(2).mean()
        ours[4].requires_grad_(False)
        gm.backward(loss)
    assert ours[4].weight.grad is None
    assert_same_grads(ref, ours)


@CALLBACKS
def test_only_some_layers_attached(cb):
    """Fine-tuning the MegEngine way: attach what should train. The reference is the engine
    asked for those inputs only (``backward(inputs=...)``)."""
    x, _ = data()
    ref, ours = mlp(), mlp()
    torch.autograd.backward(ref(x).pow(2).mean(), inputs=list(ref[2].parameters()))
    gm = GradManager().attach(ours[2].parameters(), callbacks=cb)
    step(gm, lambda: ours(x).pow(2).mean())
    assert_same_grads(ref, ours)


@CALLBACKS
def test_no_grad_segment_and_detach_inside_the_recording(cb):
    x, _ = data()

    def loss_of(m):
        h = m[1](m[0](x))
        with torch.no_grad():
            h_const = m[2](h)
        out = m[4](m[3](h_const)) + 0.5 * m[4](m[3](m[2](h))).detach() + m[4](m[3](m[2](h)))
        return out.pow(2).mean()

    ref, ours = mlp(), mlp()
    loss_of(ref).backward()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    step(gm, lambda: loss_of(ours))
    assert_same_grads(ref, ours)


# ================================================================= 5. shared / tied parameters
class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.emb.weight  # tied input and output embeddings
        self.register_buffer("scale", torch.tensor(0.7))

    def forward(self, idx):
        h = torch.tanh(self.lin(self.emb(idx))) * self.scale
        h = h + self.lin(h)  # one layer in two places
        return self.out(h)


def tied_lm():
    torch.manual_seed(0)
    return TiedLM()


_IDX = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(0))
_TGT = torch.randint(0, 20, (15,), generator=torch.Generator().manual_seed(1))


def tied_loss(m):
    return F.cross_entropy(m(_IDX).reshape(-1, 20), _TGT)


@pytest.mark.parametrize("cb, scale", [(None, None), ([identity], None), ([half], 0.5)],
                         ids=["plain", "identity", "half"])
def test_tied_embedding_and_a_layer_used_twice(cb, scale):
    ref, ours = tied_lm(), tied_lm()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(2):
        backward_with(tied_loss(ref), ref.parameters(), scale)
        step(gm, lambda: tied_loss(ours))
    assert len(list(ours.parameters())) == 3
    assert_same_grads(ref, ours)


def test_float_buffer_attached_as_an_input():
    ref, ours = tied_lm(), tied_lm()
    ref.scale.requires_grad_()
    (g,) = torch.autograd.grad(tied_loss(ref), [ref.scale])
    gm = GradManager().attach(ours.scale)
    step(gm, lambda: tied_loss(ours))
    assert torch.equal(ours.scale.grad, g) and not ours.scale.requires_grad
    assert all(p.grad is None for p in ours.parameters())


# ================================================================= 6. user hooks
@pytest.mark.parametrize("cb, scale", [(None, None), ([identity], None), ([half], 0.5)],
                         ids=["plain", "identity", "half"])
def test_parameter_hooks_registered_before_attach_change_the_gradient(cb, scale):
    x, _ = data()
    ref, ours = mlp(), mlp()
    for m in (ref, ours):
        m[0].weight.register_hook(lambda g: g * 3)
        m[4].bias.register_hook(lambda g: g.clamp(-0.01, 0.01))
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(2):
        backward_with(ref(x).pow(2).mean(), ref.parameters(), scale)
        step(gm, lambda: ours(x).pow(2).mean())
    assert_same_grads(ref, ours)


@pytest.mark.parametrize("cb, scale", [(None, None), ([identity], None), ([half], 0.5)],
                         ids=["plain", "identity", "half"])
def test_parameter_hooks_registered_after_attach_change_the_gradient(cb, scale):
    """The callbacks see (and .grad gets) the gradient after every user hook, also hooks that
    were registered after the manager's own."""
    x, _ = data()
    ref, ours = mlp(), mlp()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    backward_with(ref(x).pow(2).mean(), ref.parameters(), scale)
    step(gm, lambda: ours(x).pow(2).mean())  # the manager's hooks exist now
    for m in (ref, ours):
        m[0].weight.register_hook(lambda g: g * 3)
        m[4].bias.register_hook(lambda g: g.clamp(-0.01, 0.01))
    backward_with(ref(x).pow(2).mean(), ref.parameters(), scale)
    step(gm, lambda: ours(x).pow(2).mean())
    assert_same_grads(ref, ours)


@CALLBACKS
def test_optimizer_in_backward_with_post_accumulate_grad_hooks(cb):
    x, _ = data()
    ref, ours = mlp(), mlp()

    def install(model):
        opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
        seen = []

        def hook(p):
            seen.append(p.grad.clone())
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        return seen

    seen_ref, seen = install(ref), install(ours)
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(2):
        ref(x).pow(2).mean().backward()
        step(gm, lambda: ours(x).pow(2).mean())
    assert_same(seen_ref, seen, "grad seen by the hook")
    assert_same(ref.parameters(), ours.parameters(), "param")
    assert_same_grads(ref, ours)


@CALLBACKS
def test_module_full_backward_hooks_and_pre_hooks(cb):
    x, _ = data()
    ref, ours = mlp(), mlp()
    seen = {}

    def install(model, key):
        seen[key] = []

        def hook(module, grad_in, grad_out):
            seen[key] += [g.clone() for g in (*grad_in, *grad_out) if g is not None]
            return (grad_in[0] * 2,)

        model[2].register_full_backward_hook(hook)
        model[0].register_full_backward_pre_hook(lambda module, grad_out: (grad_out[0] * 0.5,))

    install(ref, "ref")
    install(ours, "ours")
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: hook fires for module outputs
        for _ in range(2):
            ref(x).pow(2).mean().backward()
            step(gm, lambda: ours(x).pow(2).mean())
    assert_same(seen["ref"], seen["ours"], "hook saw")
    assert_same_grads(ref, ours)


# ================================================================= 7. activation checkpointing
def dropout_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16),
                         nn.Tanh(), nn.Linear(16, 4))


def checkpointed(m, x, reentrant):
    h = checkpoint(lambda t: m[1](m[0](t)), x, use_reentrant=reentrant)
    h = checkpoint(m[2], h, use_reentrant=reentrant)  # dropout: the RNG state is replayed
    return m[5](m[4](m[3](h))).pow(2).mean()


def sequential(m, x, reentrant):
    return checkpoint_sequential(m, 3, x, use_reentrant=reentrant).pow(2).mean()


@pytest.mark.parametrize("forward", [checkpointed, sequential],
                         ids=["checkpoint", "checkpoint_sequential"])
@CALLBACKS
def test_non_reentrant_checkpointing_with_dropout(forward, cb):
    x, _ = data()
    ref, ours = dropout_mlp(), dropout_mlp()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for i in range(2):
        torch.manual_seed(10 + i)
        forward(ref, x, False).backward()
        torch.manual_seed(10 + i)
        step(gm, lambda: forward(ours, x, False))
    assert_same_grads(ref, ours)


@pytest.mark.parametrize("forward", [checkpointed, sequential],
                         ids=["checkpoint", "checkpoint_sequential"])
@CALLBACKS
def test_reentrant_checkpointing_is_refused(forward, cb):
    x, _ = data()
    x = x.requires_grad_()  # else the reentrant checkpoint is not in the graph at all
    ours = dropout_mlp()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(2):
        with pytest.raises(UnsupportedGraphError, match="use_reentrant=False"):
            step(gm, lambda: forward(ours, x, True))


@CALLBACKS
def test_reentrant_checkpoint_first_met_after_a_clean_step_is_refused(cb):
    x, _ = data()
    ours = mlp()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    step(gm, lambda: ours(x).sum())
    with pytest.raises(UnsupportedGraphError):
        step(gm, lambda: ours[4](checkpoint(lambda t: ours[3](ours[2](t)), ours[1](ours[0](x)),
                                            use_reentrant=True)).sum())


# ================================================================= 8. higher order
def critic():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 1))


_GEN = torch.Generator().manual_seed(5)
_REAL, _FAKE, _EPS = torch.randn(16, 2, generator=_GEN), torch.randn(16, 2, generator=_GEN), \
    torch.rand(16, 1, generator=_GEN)


@pytest.mark.parametrize("inner_cb", [None, [identity]], ids=["inner-plain", "inner-callback"])
@CALLBACKS
def test_wgan_gp_through_nested_managers(cb, inner_cb):
    ref, ours = critic(), critic()
    outer = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(2):
        x_hat = (_EPS * _REAL + (1 - _EPS) * _FAKE).requires_grad_()
        (g,) = torch.autograd.grad(ref(x_hat).sum(), x_hat, create_graph=True)
        penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
        (ref(_FAKE).mean() - ref(_REAL).mean() + 10 * penalty).backward()

        x_hat = _EPS * _REAL + (1 - _EPS) * _FAKE
        inner = GradManager()
        with outer:
            with inner:
                inner.attach(x_hat, callbacks=inner_cb)
                inner.backward(ours(x_hat).sum())
            penalty = ((x_hat.grad.norm(2, dim=1) - 1) ** 2).mean()
            outer.backward(ours(_FAKE).mean() - ours(_REAL).mean() + 10 * penalty)
    assert_same_grads(ref, ours)


@CALLBACKS
def test_gradient_norm_penalty_on_parameter_gradients(cb):
    x = _REAL
    ref, ours = critic(), critic()
    gs = torch.autograd.grad(ref(x).pow(2).mean(), list(ref.parameters()), create_graph=True)
    sum(g.pow(2).sum() for g in gs).backward()
    outer = GradManager().attach(ours.parameters(), callbacks=cb)
    inner = GradManager().attach(ours.parameters())
    with outer:
        with inner:
            inner.backward(ours(x).pow(2).mean())
        penalty = sum(p.grad.pow(2).sum() for p in ours.parameters())
        for p in ours.parameters():
            p.grad = None
        outer.backward(penalty)
    assert_same_grads(ref, ours)


@CALLBACKS
def test_autograd_grad_penalty_computed_inside_the_recording(cb):
    """Users may call torch.autograd.grad themselves while a manager records: the manager's
    hooks must not take those gradients."""
    x, _ = data()
    ref, ours = mlp(), mlp()
    loss = ref(x).pow(2).mean()
    gs = torch.autograd.grad(loss, list(ref.parameters()), create_graph=True)
    (loss + sum(g.pow(2).sum() for g in gs)).backward()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    with gm:
        loss = ours(x).pow(2).mean()
        gs = torch.autograd.grad(loss, list(ours.parameters()), create_graph=True)
        gm.backward(loss + sum(g.pow(2).sum() for g in gs))
    assert_same_grads(ref, ours)


@CALLBACKS
def test_functional_call_with_attached_parameter_dict(cb):
    from torch.func import functional_call

    x = _REAL
    model = critic()
    ref = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    ours = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    functional_call(model, ref, (x,)).pow(2).sum().backward()
    gm = GradManager().attach(list(ours.values()), callbacks=cb)
    step(gm, lambda: functional_call(model, ours, (x,)).pow(2).sum())
    assert_same(grads(ref.values()), grads(ours.values()))
    assert all(p.grad is None for p in model.parameters())
    (want,) = [torch.func.grad(lambda ps: functional_call(model, ps, (x,)).pow(2).sum())(
        {k: v.detach() for k, v in model.named_parameters()})]
    assert_same(want.values(), grads(ours.values()))


# ================================================================= 9. dtypes and edge cases
def _pair(shape, dtype):
    g = torch.Generator().manual_seed(0)
    if dtype.is_complex:
        return [torch.randn(shape, dtype=dtype, generator=g).requires_grad_() for _ in range(2)]
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(2)]


_X44 = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))

DTYPE_CASES = {
    "complex64": ((4, 4), torch.complex64, lambda a, b: (a @ b).abs().pow(2).sum()),
    "complex128": ((4, 4), torch.complex128,
                   lambda a, b: torch.view_as_real(a * b.conj()).sum()),
    "float64": ((4, 4), torch.float64, lambda a, b: (a @ b).tanh().sum()),
    "float16": ((4, 4), torch.float16, lambda a, b: (a * b).sum()),
    "bfloat16": ((4, 4), torch.bfloat16, lambda a, b: (a @ b).sum()),
    "0-d": ((), torch.float32, lambda a, b: (a * _X44 + b).pow(2).sum()),
    "empty": ((0, 3), torch.float32, lambda a, b: (a + b).sum()),
}


@pytest.mark.parametrize("case", list(DTYPE_CASES))
@CALLBACKS
def test_dtypes_and_shapes(case, cb):
    shape, dtype, loss_fn = DTYPE_CASES[case]
    ref, ours = _pair(shape, dtype), _pair(shape, dtype)
    gm = GradManager().attach(ours, callbacks=cb)
    for _ in range(2):
        loss_fn(*ref).backward()
        step(gm, lambda: loss_fn(*ours))
    assert_same(grads(ref), grads(ours))


@CALLBACKS
def test_complex_output_with_complex_dy(cb):
    dy = torch.tensor([1 + 1j, 2 - 1j, 0.5j], dtype=torch.complex64)
    ref, ours = _pair((3,), torch.complex64), _pair((3,), torch.complex64)
    (ref[0] * ref[1]).backward(dy)
    gm = GradManager().attach(ours, callbacks=cb)
    with gm:
        gm.backward(ours[0] * ours[1], dy)
    assert_same(grads(ref), grads(ours))


@CALLBACKS
def test_parameters_on_the_meta_device(cb):
    ref = torch.empty(3, 4, device="meta", requires_grad=True)
    ours = torch.empty(3, 4, device="meta", requires_grad=True)
    (ref * 2).sum().backward()
    gm = GradManager().attach(ours, callbacks=cb)
    step(gm, lambda: (ours * 2).sum())
    assert ours.grad.device == ref.grad.device and ours.grad.shape == ref.grad.shape


@CALLBACKS
def test_a_thousand_small_parameters(cb):
    def params():
        g = torch.Generator().manual_seed(0)
        return [torch.randn(3, generator=g).requires_grad_() for _ in range(1000)]

    ref, ours = params(), params()
    torch.stack(ref).pow(2).sum().backward()
    gm = GradManager().attach(ours, callbacks=cb)
    step(gm, lambda: torch.stack(ours).pow(2).sum())
    assert_same(grads(ref), grads(ours))


def sparse_model():
    torch.manual_seed(0)
    return nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True), "lin": nn.Linear(4, 1)})


_SPARSE_IDX = [torch.tensor([[1, 2, 2], [3, 1, 9]]), torch.tensor([[0, 2, 5]])]


@CALLBACKS
def test_sparse_embedding_with_sgd_and_sparse_adam(cb):
    def loss(m, i):
        return m["lin"](m["emb"](i)).pow(2).sum()

    ref, ours = sparse_model(), sparse_model()
    opts_ref = [torch.optim.SGD(ref["lin"].parameters(), lr=0.1),
                torch.optim.SparseAdam(list(ref["emb"].parameters()))]
    opts = [torch.optim.SGD(ours["lin"].parameters(), lr=0.1),
            torch.optim.SparseAdam(list(ours["emb"].parameters()))]
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for _ in range(2):
        for i in _SPARSE_IDX:
            loss(ref, i).backward()
            step(gm, lambda i=i: loss(ours, i))
        assert ours["emb"].weight.grad.is_sparse
        assert_same_grads(ref, ours)
        for o in opts_ref + opts:
            o.step()
            o.zero_grad()
    assert_same(ref.parameters(), ours.parameters(), "param")


@CALLBACKS
def test_sparse_and_dense_gradient_of_one_weight_in_one_backward(cb):
    x = torch.randn(3, 4)
    idx = torch.tensor([1, 2, 2])

    def loss(e):
        return e(idx).sum() + (x @ e.weight.t()).pow(2).sum()

    ref, ours = sparse_model()["emb"], sparse_model()["emb"]
    gm = GradManager().attach(ours.weight, callbacks=cb)
    for _ in range(2):
        loss(ref).backward()
        step(gm, lambda: loss(ours))
    assert_same([ref.weight.grad], [ours.weight.grad])


@CALLBACKS
def test_sparse_gradient_into_an_existing_dense_grad(cb):
    ref, ours = sparse_model()["emb"], sparse_model()["emb"]
    for e in (ref, ours):
        e.weight.grad = torch.zeros(10, 4)
    idx = torch.tensor([1, 2, 2])
    ref(idx).sum().backward()
    gm = GradManager().attach(ours.weight, callbacks=cb)
    step(gm, lambda: ours(idx).sum())
    assert_same([ref.weight.grad], [ours.weight.grad])


# ================================================================= 10. data-parallel callbacks
def test_hand_written_allreduce_callbacks_on_one_rank(gloo_one_rank):
    """One rank, so the averaged gradient is the local one, bit for bit: this checks the
    plumbing (clone, collective, Futures from ``async_op``), not the arithmetic of a reduction."""
    dist = gloo_one_rank

    def clone_and_reduce(t, g):
        g = g.clone()
        dist.all_reduce(g)
        return g / dist.get_world_size()

    def reduce_async(t, g):
        g = g.clone()
        work = dist.all_reduce(g, async_op=True)

        class Pending:
            def get(self):
                work.wait()
                return g / dist.get_world_size()

        return Pending()

    def reduce_torch_future(t, g):
        future = dist.all_reduce(g.clone(), async_op=True).get_future()

        class Pending:
            def get(self):
                return future.wait()[0]

        return Pending()

    x, _ = data()
    for cb in (clone_and_reduce, reduce_async, reduce_torch_future):
        ref, ours = mlp(), mlp()
        gm = GradManager().attach(ours.parameters(), callbacks=cb)
        for _ in range(2):
            ref(x).pow(2).mean().backward()
            step(gm, lambda ours=ours: ours(x).pow(2).mean())
        assert_same_grads(ref, ours)


# ================================================================= 11. threads
@CALLBACKS
def test_forward_in_a_worker_thread_inside_the_recording(cb):
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(4, 8, generator=g) for _ in range(3)]
    ref, ours = mlp(), mlp()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for x in xs:
        ref(x).pow(2).mean().backward()
        with gm:
            out = []
            worker = threading.Thread(
                target=lambda x=x, out=out: out.append(ours(x).pow(2).mean()))
            worker.start()
            worker.join()
            gm.backward(out[0])
    assert_same_grads(ref, ours)


@CALLBACKS
def test_forward_split_between_a_worker_and_the_main_thread(cb):
    x, _ = data()
    ref, ours = mlp(), mlp()
    ref(x).pow(2).mean().backward()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    # Autograd numbers operations per thread: the worker's look older than the recording.
    # A thread ran inside it, so the pre-record check is skipped (issue 42: it warned).
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreRecordGradientWarning)
        with gm:
            box = []
            worker = threading.Thread(target=lambda: box.append(ours[1](ours[0](x))))
            worker.start()
            worker.join()
            gm.backward(ours[4](ours[3](ours[2](box[0]))).pow(2).mean())
    assert_same_grads(ref, ours)


def test_no_false_pre_record_warning_after_a_worker_threads_forward():
    """Issue 42's case: the forward of an inner manager in a worker thread, inside both
    recordings, then more of the outer manager's forward on the main thread."""
    leaf = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    gm_a = GradManager().attach([leaf])
    gm_b = GradManager()  # attaches nothing: only gm_a's gradient lands on leaf
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreRecordGradientWarning)
        with gm_a:
            with gm_b:
                box = []
                worker = threading.Thread(target=lambda: box.append(leaf + leaf))
                worker.start()
                worker.join()
                r1 = box[0]
                gm_b.backward(r1)
            r2 = r1 + r1
            gm_a.backward(r2)
    assert torch.equal(leaf.grad, torch.full((3,), 4.0))  # d(4 * leaf)/d leaf, as MegEngine


def test_the_pre_record_check_still_warns_where_no_thread_started_during_the_recording():
    """Threads started before record() (one still alive, idle) leave the check on; a value
    computed from the parameter before record() still warns."""
    w = torch.ones(3, requires_grad=True)
    done = threading.Thread(target=lambda: (w * 2).sum())
    done.start()
    done.join()
    release = threading.Event()
    idle = threading.Thread(target=release.wait)
    idle.start()
    try:
        gm = GradManager().attach([w])
        older = w * 3  # before record(): PyTorch differentiates it, MegEngine does not
        with pytest.warns(PreRecordGradientWarning, match="#0"), gm:
            gm.backward((older * w).sum())
    finally:
        release.set()
        idle.join()


@CALLBACKS
def test_one_manager_used_from_a_thread_pool(cb):
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(4, 8, generator=g) for _ in range(4)]
    ref, ours = mlp(), mlp()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for x in xs:
        ref(x).pow(2).mean().backward()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for x in xs:  # one step at a time, each on whichever pool thread is free
            pool.submit(step, gm, lambda x=x: ours(x).pow(2).mean()).result()
    assert_same_grads(ref, ours)


@CALLBACKS
def test_concurrent_managers_each_with_its_own_model(cb):
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(4, 8, generator=g) for _ in range(3)]
    models, refs = [mlp() for _ in range(3)], [mlp() for _ in range(3)]

    def train(model):
        gm = GradManager().attach(model.parameters(), callbacks=cb)
        for x in xs:
            step(gm, lambda x=x: model(x).pow(2).mean())

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(train, models))
    for ref, model in zip(refs, models):
        for x in xs:
            ref(x).pow(2).mean().backward()
        assert_same_grads(ref, model)


@pytest.mark.parametrize("cb", [None, [identity], [half]], ids=["plain", "identity", "half"])
def test_two_threads_two_managers_sharing_parameters(cb):
    """Both threads accumulate into the same ``.grad`` in an order that varies from run to run,
    so the data are small integers: every gradient and every partial sum is exact in float32,
    and the result is the same in any order."""
    w = torch.zeros(4, 3, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    xs = [torch.arange(8.0).reshape(2, 4), torch.arange(8.0).reshape(2, 4).flip(0) - 3]
    steps = 25
    errors = []

    def train(x):
        try:
            gm = GradManager().attach([w, b], callbacks=cb)
            for _ in range(steps):
                step(gm, lambda: (x @ w + b).sum() * 2)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    scale = 0.5 if cb and cb[0] is half else 1.0
    w_ref, b_ref = torch.zeros(4, 3, requires_grad=True), torch.zeros(3, requires_grad=True)
    for x in xs:
        gw, gb = torch.autograd.grad((x @ w_ref + b_ref).sum() * 2, [w_ref, b_ref])
        w_ref.grad = gw * scale * steps + (0 if w_ref.grad is None else w_ref.grad)
        b_ref.grad = gb * scale * steps + (0 if b_ref.grad is None else b_ref.grad)
    assert torch.equal(w.grad, w_ref.grad) and torch.equal(b.grad, b_ref.grad)


class _TakesNothing:
    """A backward delegate (``gradmgr.hooks.set_backward_delegate``) that takes no tensor: the
    engine accumulates the parameters, the tape delivers the rest from node pre-hooks (the
    data-parallel reducer path's way, without the process group)."""

    taken = frozenset()

    def finish(self):
        pass

    def abort(self):
        pass


def _while_held(out, other):
    """Run ``other()`` in a second thread while the main thread's backward waits at ``out``'s
    gradient: before the nodes below ``out`` have run in the main backward."""
    errors = []

    def hold(grad):
        if threading.current_thread() is threading.main_thread():
            worker = threading.Thread(target=lambda: _collect(errors, other))
            worker.start()
            worker.join(timeout=30)
            assert not worker.is_alive(), "the second thread hung"

    out.register_hook(hold)
    return errors


def _collect(errors, fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_a_delegated_backward_delivers_only_its_own_gradients_while_another_thread_runs():
    """A delegated backward (torch's reducer path) delivers an attached activation and an
    attached input with callbacks from pre-hooks on their nodes. A second thread's backward
    through those nodes meanwhile (``torch.autograd.grad`` of another output of the same
    graph, ``retain_graph=True``; ``.backward()`` of its own graph through the same input)
    ran them too. Old code: each callback ran twice, once with the other thread's gradient,
    and the input's accumulator dropped that thread's gradient (``x.grad`` lacked it). Now
    (S12) each callback runs once with this backward's gradient, and ``.grad`` is the engine's:
    the activation's ``torch.autograd.grad(loss, h)``, the input's the sum of both threads'
    backwards, as torch alone gives (exact: small integers)."""
    from gradmgr.hooks import set_backward_delegate

    w = torch.tensor([[1.0, -2.0], [3.0, 1.0]], requires_grad=True)
    x = torch.tensor([[2.0, 1.0]])
    seen = {"x": [], "h": []}
    gm = set_backward_delegate(GradManager().attach(w), _TakesNothing)
    with gm:
        gm.attach(x, callbacks=lambda t, g: seen["x"].append(g.clone()) or g)
        h = x @ w
        gm.attach(h, callbacks=lambda t, g: seen["h"].append(g.clone()) or g)
        out = h * h
        loss = out.sum()

        def other():
            torch.autograd.grad(out.sum() * 5, w, retain_graph=True)
            (x * 7).sum().backward()

        errors = _while_held(out, other)
        gm.backward(loss)
    assert not errors, errors
    # references: torch alone, on fresh tensors with the same values
    w_r, x_r = w.detach().requires_grad_(), x.detach().requires_grad_()
    h_r = x_r @ w_r
    g_h, g_x, g_w = torch.autograd.grad((h_r * h_r).sum(), [h_r, x_r, w_r])
    assert [len(seen["x"]), len(seen["h"])] == [1, 1], seen
    assert torch.equal(seen["h"][0], g_h) and torch.equal(h.grad, g_h)
    assert torch.equal(seen["x"][0], g_x)
    assert torch.equal(x.grad, g_x + 7)  # the other thread's .backward() adds 7 everywhere
    assert torch.equal(w.grad, g_w)


# ================================================================= 12. the rest of a loop
def clip_norm(m):
    nn.utils.clip_grad_norm_(m.parameters(), 0.5)


def clip_value(m):
    nn.utils.clip_grad_value_(m.parameters(), 0.05)


def norm_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def train_both(make, loss_fn, cb, *, optimizer=None, after_backward=None, steps=2, seed=100):
    """Train two copies, the engine's and gradmgr's; compare grads every step and params at
    the end. ``loss_fn`` may use randomness (dropout): both sides get the same seed."""
    ref, ours = make(), make()
    opt_ref = optimizer(ref.parameters()) if optimizer else None
    opt = optimizer(ours.parameters()) if optimizer else None
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    for i in range(steps):
        torch.manual_seed(seed + i)
        loss_fn(ref).backward()
        torch.manual_seed(seed + i)
        step(gm, lambda: loss_fn(ours))
        if after_backward:
            after_backward(ref)
            after_backward(ours)
        assert_same_grads(ref, ours)
        if optimizer:
            opt_ref.step()
            opt.step()
            opt_ref.zero_grad()
            opt.zero_grad()
    assert_same(ref.parameters(), ours.parameters(), "param")
    return ref, ours


_X8 = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))


def mlp_loss(m):
    return m(_X8).pow(2).sum()


@pytest.mark.parametrize("clip", [clip_norm, clip_value])
@CALLBACKS
def test_gradient_clipping_after_backward(clip, cb):
    train_both(norm_mlp, mlp_loss, cb, after_backward=clip,
               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


@pytest.mark.parametrize("kind", ["foreach", "for-loop", "fused", "fused-amsgrad-adamw"])
@CALLBACKS
def test_adam_implementations(kind, cb):
    options = {"foreach": (torch.optim.Adam, {"foreach": True}),
               "for-loop": (torch.optim.Adam, {"foreach": False}),
               "fused": (torch.optim.Adam, {"fused": True}),
               "fused-amsgrad-adamw": (torch.optim.AdamW, {"fused": True, "amsgrad": True})}
    cls, kwargs = options[kind]
    train_both(norm_mlp, mlp_loss, cb, optimizer=lambda ps: cls(ps, lr=1e-2, **kwargs))


def channels_last_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 2)).to(memory_format=torch.channels_last)


_IMG = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(3)).to(
    memory_format=torch.channels_last)


@CALLBACKS
def test_channels_last_cnn_with_batchnorm_and_momentum(cb):
    ref, ours = train_both(channels_last_cnn, lambda m: m(_IMG).pow(2).sum(), cb,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert_same(ref.buffers(), ours.buffers(), "batchnorm buffer")
    step(GradManager().attach(ours.parameters(), callbacks=cb), lambda: ours(_IMG).sum())
    ref(_IMG).sum().backward()
    assert [p.grad.stride() for p in ours.parameters()] == \
        [p.grad.stride() for p in ref.parameters()]


@CALLBACKS
def test_detect_anomaly(cb):
    with torch.autograd.set_detect_anomaly(True):
        train_both(norm_mlp, mlp_loss, cb)


@CALLBACKS
def test_detect_anomaly_reports_nan_like_the_engine(cb):
    def bad_loss(m):
        h = m(_X8)
        return torch.sqrt(h - h).sum()  # d sqrt(0) = inf, times 0 -> nan

    ref, ours = norm_mlp(), norm_mlp()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    with torch.autograd.set_detect_anomaly(True), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # anomaly mode's traceback warning
        with pytest.raises(RuntimeError, match="returned nan values") as engine_error:
            bad_loss(ref).backward()
        with pytest.raises(RuntimeError, match="returned nan values") as our_error:
            step(gm, lambda: bad_loss(ours))
    assert str(our_error.value) == str(engine_error.value)


@pytest.mark.parametrize("hooks", ["save_on_cpu", "saved_tensors_hooks", "inside-forward"])
@CALLBACKS
def test_saved_tensors_hooks(hooks, cb):
    def pack(t):
        return t.clone()

    def unpack(t):
        return t

    if hooks == "inside-forward":
        def loss_fn(m):
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return mlp_loss(m)
        train_both(norm_mlp, loss_fn, cb)
        return
    context = (torch.autograd.graph.save_on_cpu() if hooks == "save_on_cpu"
               else torch.autograd.graph.saved_tensors_hooks(pack, unpack))
    with context:
        train_both(norm_mlp, mlp_loss, cb)


@CALLBACKS
def test_cpu_data_parallel_wrapper(cb):
    train_both(lambda: nn.DataParallel(norm_mlp()), mlp_loss, cb)


def parametrized_mlp():
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    parametrizations.weight_norm(m[0])
    parametrizations.orthogonal(m[2])
    parametrizations.spectral_norm(m[4])  # power iteration updates buffers in every forward
    return m


@CALLBACKS
def test_parametrizations(cb):
    train_both(parametrized_mlp, mlp_loss, cb,
               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))


_SEQ = torch.randn(3, 6, 5, generator=torch.Generator().manual_seed(6))
_LENS = torch.tensor([6, 4, 2])


def lstm():
    torch.manual_seed(0)
    return nn.LSTM(5, 7, num_layers=2, batch_first=True)


def lstm_loss(m):
    packed = nn.utils.rnn.pack_padded_sequence(_SEQ, _LENS, batch_first=True)
    out, _ = m(packed)
    return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0].pow(2).sum()


@CALLBACKS
def test_lstm_on_packed_sequences(cb):
    train_both(lstm, lstm_loss, cb)


_SRC = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(7))


def transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)


@CALLBACKS
def test_transformer_encoder_with_dropout_and_adamw(cb):
    train_both(transformer, lambda m: m(_SRC).pow(2).sum(), cb,
               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))


@CALLBACKS
def test_custom_function_once_differentiable(cb):
    class MatmulArgmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            ctx.save_for_backward(a, w)
            idx = a.argmax(1)
            ctx.mark_non_differentiable(idx)
            return a @ w, idx

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g, _):
            a, w = ctx.saved_tensors
            return (g @ w.t() if ctx.needs_input_grad[0] else None,
                    a.t() @ g if ctx.needs_input_grad[1] else None)

    w_ref = torch.randn(8, 3, requires_grad=True)
    w = w_ref.detach().clone().requires_grad_()
    MatmulArgmax.apply(_X8, w_ref)[0].sin().sum().backward()
    gm = GradManager().attach(w, callbacks=cb)
    step(gm, lambda: MatmulArgmax.apply(_X8, w)[0].sin().sum())
    assert torch.equal(w.grad, w_ref.grad)


@CALLBACKS
def test_several_outputs_with_dy_and_one_output_without_grad(cb):
    ref, ours = mlp(), mlp()
    d1, d2 = torch.randn(4, 4), torch.tensor(2.0)
    torch.autograd.backward([ref(_X8), ref[0](_X8).sum()], [d1, d2])
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    with gm:
        gm.backward([ours(_X8), ours[0](_X8).sum(), torch.ones(2)], [d1, d2, torch.ones(2)])
    assert_same_grads(ref, ours)


@CALLBACKS
def test_intermediate_attached_while_recording_matches_retain_grad(cb):
    ref, ours = mlp(), mlp()
    h_ref = ref[0](_X8)
    h_ref.retain_grad()
    ref[4](ref[3](ref[2](ref[1](h_ref)))).sum().backward()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    with gm:
        h = ours[0](_X8)
        gm.attach(h, callbacks=cb)
        gm.backward(ours[4](ours[3](ours[2](ours[1](h)))).sum())
    assert_same(grads([*ref.parameters(), h_ref]), grads([*ours.parameters(), h]))


@CALLBACKS
def test_flat_parameter_used_through_views(cb):
    def flat():
        torch.manual_seed(0)
        return nn.Parameter(torch.randn(8 * 4 + 4))

    def loss(p):
        return (_X8 @ p[:32].view(8, 4) + p[32:]).tanh().sum()

    ref, ours = flat(), flat()
    gm = GradManager().attach(ours, callbacks=cb)
    for _ in range(2):
        loss(ref).backward()
        step(gm, lambda: loss(ours))
    assert torch.equal(ours.grad, ref.grad)


@CALLBACKS
def test_plain_backward_of_an_auxiliary_loss_inside_the_recording(cb):
    ref, ours = mlp(), mlp()
    h = ref[0](_X8)
    h.pow(2).mean().backward(retain_graph=True)
    ref[4](ref[3](ref[2](ref[1](h)))).sum().backward()
    gm = GradManager().attach(ours.parameters(), callbacks=cb)
    with gm:
        h = ours[0](_X8)
        h.pow(2).mean().backward(retain_graph=True)
        gm.backward(ours[4](ours[3](ours[2](ours[1](h)))).sum())
    assert_same_grads(ref, ours)


def test_model_converted_to_float64_after_attach():
    for cb in (None, [identity]):
        ref, ours = mlp(), mlp()
        gm = GradManager().attach(ours.parameters(), callbacks=cb)
        step(gm, lambda ours=ours: ours(_X8).sum())
        for m in (ref, ours):
            m.zero_grad()
            m.double()
        ref(_X8.double()).sum().backward()
        step(gm, lambda ours=ours: ours(_X8.double()).sum())
        assert_same_grads(ref, ours)


@pytest.mark.slow
def test_compiled_callback_with_autocast_grad_scaler_and_fused_adamw():
    """Everything at once: compiled model and callback, bf16 autocast, GradScaler, clipping."""
    x, _ = data()

    def clip_and_halve(t, g):
        return g.clamp(-0.01, 0.01) * 0.5

    compiled_cb = torch.compile(clip_and_halve, backend="aot_eager")
    ref, ours = tiny(), tiny()
    c_ref = torch.compile(ref, backend="aot_eager")
    c_ours = torch.compile(ours, backend="aot_eager")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=True)
    s_ref, s = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    gm = GradManager().attach(ours.parameters(), callbacks=compiled_cb)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = c_ref(x).float().pow(2).mean()
        params = list(ref.parameters())
        for p, g in zip(params, torch.autograd.grad(s_ref.scale(loss), params)):
            p.grad = clip_and_halve(p, g).clone()
        s_ref.unscale_(opt_ref)
        nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        s_ref.step(opt_ref)
        s_ref.update()
        opt_ref.zero_grad()

        with gm:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = c_ours(x).float().pow(2).mean()
            gm.backward(s.scale(loss))
        s.unscale_(opt)
        nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
        s.step(opt)
        s.update()
        opt.zero_grad()
    assert_same(ref.parameters(), ours.parameters(), "param")



def test_a_reducer_that_failed_to_rebuild_raises_the_transport_error_again(gloo_one_rank,
                                                                           monkeypatch):
    """After a backward raised midway, the next recording rebuilds torch's reducer; when that
    raised (a process group broken by a rank that failed), every later step raised
    AttributeError ('NoneType' object has no attribute 'tensors') instead."""
    from gradmgr.backends.torch import reducer as reducer_module
    from gradmgr.distributed import make_allreduce_cb

    x, _ = data()
    ref, ours = mlp(), mlp()
    cb = make_allreduce_cb("mean")
    gm = GradManager().attach(ours.parameters(), callbacks=[cb])
    step(gm, lambda: ours(x).pow(2).mean())
    assert cb.path(gm) == "reducer"
    weight = next(ours.parameters())
    handle = weight.register_hook(lambda g: (_ for _ in ()).throw(ValueError("user hook")))
    with pytest.raises(ValueError, match="user hook"):
        step(gm, lambda: ours(x).pow(2).mean())
    handle.remove()

    class BrokenGroup(reducer_module.TorchReducer):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(reducer_module, "TorchReducer", BrokenGroup)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            step(gm, lambda: ours(x).pow(2).mean())
    monkeypatch.undo()
    for p in ours.parameters():
        p.grad = None
    step(gm, lambda: ours(x).pow(2).mean())
    ref(x).pow(2).mean().backward()
    assert_same_grads(ref, ours)
