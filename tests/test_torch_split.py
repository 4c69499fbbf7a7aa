"""Split backward on PyTorch (``GradManager.backward_split``): input gradients now, the rest
later. References are a single ``gm.backward`` and ``torch.autograd.grad`` on the same graph;
comparisons are bit-exact (``torch.equal``) except where a docstring states a tolerance.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest

torch = pytest.importorskip("torch")

from gradmgr import (  # noqa: E402
    Future,
    GradManager,
    GradMgrWarning,
    UnfinishedBackwardWarning,
    UnsupportedGraphError,
    get_backwarding_grad_manager,
)
from gradmgr.distributed import make_allreduce_cb  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                               torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 5))


def stage_step(model, x0, split, callbacks=None, dy_of=None):
    """One pipeline-stage backward: x (the stage input) attached while recording."""
    gm = GradManager().attach(model.parameters(), callbacks=callbacks)
    with gm:
        x = x0.clone()
        gm.attach(x, callbacks=callbacks)
        out = model(x)
        dy = torch.ones_like(out) if dy_of is None else dy_of(out)
        if split:
            rest = gm.backward_split(out, dy, first=[x])
        else:
            gm.backward(out, dy)
    if split:
        assert all(p.grad is None for p in model.parameters()), "weights were computed early"
        x_grad = x.grad.clone()
        rest.finish()
    else:
        x_grad = x.grad.clone()
    return x_grad, [p.grad for p in model.parameters()]


def split_and_engine(loss, x0, weights):
    """``loss(x)`` differentiated by one split backward (``x``, attached while recording, in
    ``first``) and by ``torch.autograd.grad``: ``([x.grad, *weights' .grad], engine's)``."""
    xr = x0.clone().requires_grad_()
    want = torch.autograd.grad(loss(xr), [xr, *weights])
    gm = GradManager().attach(weights)
    with gm:
        x = x0.clone()
        gm.attach(x)
        rest = gm.backward_split(loss(x), first=[x])
    rest.finish()
    return [x.grad, *(w.grad for w in weights)], list(want)


@pytest.mark.parametrize("build, shape", [(mlp, (5, 8)), (cnn, (2, 3, 8, 8))], ids=["mlp", "cnn"])
@pytest.mark.parametrize("callbacks", [None, lambda t, g: g * 0.5], ids=["plain", "callback"])
def test_split_equals_single_backward_bit_for_bit(build, shape, callbacks):
    x0 = torch.randn(*shape)
    dy_of = lambda out: torch.linspace(-1, 1, out.numel()).reshape(out.shape)  # noqa: E731
    single = stage_step(build(), x0, False, callbacks, dy_of)
    split = stage_step(build(), x0, True, callbacks, dy_of)
    assert torch.equal(single[0], split[0])
    for a, b in zip(single[1], split[1]):
        assert torch.equal(a, b)
    model = build()
    xr = x0.clone().requires_grad_()
    out = model(xr)
    engine = torch.autograd.grad(out, [xr, *model.parameters()], dy_of(out))
    scale = 1.0 if callbacks is None else 0.5
    assert torch.equal(split[0], engine[0] * scale)
    for got, want in zip(split[1], engine[1:]):
        assert torch.equal(got, want * scale)


def test_no_node_runs_twice_below_the_boundary():
    """A node on the activation path that also leads to weights runs once (in the first
    part); the weight part starts from the boundary nodes."""
    calls = []

    class Count(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h):
            return h.clone()

        @staticmethod
        def backward(ctx, g):
            calls.append(1)
            return g

    model = mlp()
    gm = GradManager().attach(model.parameters())
    with gm:
        x = torch.randn(3, 8)
        gm.attach(x)
        h = Count.apply(model[1](model[0](x)))
        rest = gm.backward_split(model[4](model[3](model[2](h))).sum(), first=[x])
    assert calls == [1]
    rest.finish()
    assert calls == [1]
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("retain", [False, True])
def test_a_custom_function_at_the_boundary_computes_each_side_once(retain):
    """Issue 38: a custom Function that honours ``ctx.needs_input_grad``, where the input and
    weight paths meet, computes its input side in the first part and its weight side in the
    rest, once each (on the old code: both sides in both parts, the flags being the
    forward's). Gradients bit for bit as one backward; with ``retain_graph`` a plain backward
    of the same graph afterwards sees the forward's flags again."""
    work = []

    class Lin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            gx = gw = None
            if ctx.needs_input_grad[0]:
                work.append("input")
                gx = g @ w.t()
            if ctx.needs_input_grad[1]:
                work.append("weight")
                gw = x.t() @ g
            return gx, gw

    torch.manual_seed(0)
    w, x0 = torch.randn(4, 4, requires_grad=True), torch.randn(3, 4)
    gm = GradManager().attach([w])
    with gm:
        x = x0.clone()
        gm.attach(x)
        y = torch.tanh(Lin.apply(x, w)).sum()
        rest = gm.backward_split(y, first=[x])
    assert work == ["input"]
    rest.finish(retain_graph=retain)
    assert work == ["input", "weight"]
    xr, wr = x0.clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.tanh(Lin.apply(xr, wr)).sum().backward()
    assert torch.equal(x.grad, xr.grad) and torch.equal(w.grad, wr.grad)
    if retain:
        del work[:]
        y.backward()
        assert work == ["input", "weight"]  # the flags the forward recorded
        assert torch.equal(w.grad, 2 * wr.grad)


def test_callbacks_after_backward_callbacks_and_futures_run_in_their_part():
    model, events = mlp(), []

    def cb(t, g):
        events.append(("cb", "x" if t.dim() == 2 and t.shape[1] == 8 and not
                       isinstance(t, torch.nn.Parameter) else "w"))
        return Future.resolved(g)

    gm = GradManager().attach(model.parameters(), callbacks=cb)
    gm.register_after_backward_callback(
        lambda: events.append(("after", get_backwarding_grad_manager() is gm)))
    with gm:
        x = torch.randn(3, 8)
        gm.attach(x, callbacks=cb)
        rest = gm.backward_split(model(x).sum(), first=[x])
    assert events == [("cb", "x")] and x.grad is not None
    rest.finish()
    assert events[1:-1] == [("cb", "w")] * 6 and events[-1] == ("after", True)
    assert rest.done


def test_several_outstanding_finished_in_any_order_while_recording_goes_on():
    model = mlp()
    xs = [torch.randn(2, 8) for _ in range(3)]
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for x in xs:
        for e, g in zip(expected, torch.autograd.grad(model(x).sum(), list(model.parameters()))):
            e.add_(g)
    gm = GradManager().attach(model.parameters())
    pending = []
    for x0 in xs:
        with gm:
            x = x0.clone()
            gm.attach(x)
            pending.append(gm.backward_split(model(x).sum(), first=[x]))
    with gm:  # the manager records again while three are outstanding
        gm.attach(torch.ones(1))
    for rest in reversed(pending):
        rest.finish()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-7)  # summed in another order


def test_errors_say_what_to_do():
    model = mlp()
    gm = GradManager().attach(model.parameters())
    with gm, pytest.raises(ValueError, match="not attached"):
        gm.backward_split(model(torch.randn(2, 8)).sum(), first=[torch.ones(2)])
    with gm:
        x = torch.randn(2, 8)
        gm.attach(x)
        rest = gm.backward_split(model(x).sum(), first=[x])
    rest.finish()
    with pytest.raises(RuntimeError, match="already finished"):
        rest.finish()
    outer = GradManager().attach(model.parameters())
    with outer, gm, pytest.raises(UnsupportedGraphError, match="outer|earlier"):
        x = torch.randn(2, 8)
        gm.attach(x)
        gm.backward_split(model(x).sum(), first=[x])


def test_an_unfinished_split_backward_warns_when_collected():
    model = mlp()
    gm = GradManager().attach(model.parameters())
    with gm:
        x = torch.randn(2, 8)
        gm.attach(x)
        rest = gm.backward_split(model(x).sum(), first=[x])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del rest
        gc.collect()
    assert any(issubclass(c.category, UnfinishedBackwardWarning) for c in caught)


def test_a_collected_split_runs_the_error_callbacks_at_its_step_at_the_next_record():
    """Once, at the next ``record()`` (not at collection, which may come inside another
    backward), with ``gm.step`` the dropped backward's: what the data-parallel callback
    completes that step's collectives from. The next step is plain autograd's."""
    model = mlp()
    seen = []
    gm = GradManager().attach(model.parameters())
    gm.register_backward_error_callback(lambda: seen.append(gm.step))
    with gm:
        x = torch.randn(2, 8)
        gm.attach(x)
        rest = gm.backward_split(model(x).sum(), first=[x])
    dropped_step = rest.step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnfinishedBackwardWarning)
        del rest
        gc.collect()
    assert seen == []  # not at collection
    x = torch.randn(2, 8)
    with gm:
        assert seen == [dropped_step] and gm.step != dropped_step
        gm.backward(model(x).sum())
    with gm:
        gm.backward(model(x).sum())
    assert seen == [dropped_step]  # once
    got = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    (model(x).sum() * 2).backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)


def test_graph_is_freed_after_finish():
    model = mlp()
    gm = GradManager().attach(model.parameters())
    with gm:
        x = torch.randn(2, 8)
        gm.attach(x)
        hidden = model[1](model[0](x))
        hidden_ref = weakref.ref(hidden)
        out = model[4](model[3](model[2](hidden)))
        rest = gm.backward_split(out.sum(), first=[x])
    del hidden, out
    gc.collect()
    assert hidden_ref() is not None, "the weight part still needs the saved activation"
    rest.finish()
    gc.collect()
    assert hidden_ref() is None, "the graph outlived the split backward"


def test_outputs_that_do_not_depend_on_the_first_tensors():
    """A term of the loss that only the weights reach (weight decay) reaches them in the rest."""
    model = mlp()
    x0 = torch.randn(3, 8)

    def loss(x):
        return model(x).sum() + sum((p ** 2).sum() for p in model.parameters())

    got, want = split_and_engine(loss, x0, list(model.parameters()))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_a_weight_used_twice_gets_the_whole_gradient():
    """Tied weights: two contributions, one from below another boundary node. Summed in
    another order than in a single backward: equal within float32 rounding (rtol 1e-6)."""
    torch.manual_seed(0)
    w = torch.randn(6, 6, requires_grad=True)
    x0 = torch.randn(4, 6)

    def forward(x):
        return torch.tanh(torch.tanh(x @ w) @ w).sum()

    (x_grad, w_grad), (x_want, w_want) = split_and_engine(forward, x0, [w])
    assert torch.equal(x_grad, x_want)
    torch.testing.assert_close(w_grad, w_want, rtol=1e-6, atol=1e-7)


def test_accumulation_over_micro_batches_equals_plain_backward():
    """Without callbacks the engine accumulates each part into ``.grad`` itself: two
    micro-batches into existing gradients give what two ``loss.backward()`` calls give."""
    x0s = [torch.randn(5, 8), torch.randn(5, 8)]
    plain, managed = mlp(), mlp()
    xs = []
    for x0 in x0s:
        xr = x0.clone().requires_grad_()
        plain(xr).square().sum().backward()
        xs.append(xr.grad)
    gm = GradManager().attach(managed.parameters())
    for x0, want in zip(x0s, xs):
        with gm:
            x = x0.clone()
            gm.attach(x)
            rest = gm.backward_split(managed(x).square().sum(), first=[x])
        assert torch.equal(x.grad, want)
        rest.finish()
    for p, q in zip(managed.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_an_after_backward_callback_that_raises_in_finish_leaves_weights_untouched():
    model = mlp()
    gm = GradManager().attach(model.parameters())
    before = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, b in zip(model.parameters(), before):
        p.grad = b.clone()

    def abort():
        raise KeyError("skip this step")

    gm.register_after_backward_callback(abort)
    with gm:
        x = torch.randn(3, 8)
        gm.attach(x)
        rest = gm.backward_split(model(x).sum(), first=[x])
    with pytest.raises(KeyError, match="skip this step"):
        rest.finish()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.grad, b)


def test_data_parallel_callback_with_split_backward():
    """The allreduce callback overlaps the weight part and sees the split's own step, also
    when the next recording has begun; with a fake peer that sends zeros, mean = grad / 2."""
    class Half:
        def world_size(self):
            return 2

        def allreduce_async(self, flat):
            class Done:
                def wait(self_inner):
                    return flat
            return Done()

    model = mlp()
    cb = make_allreduce_cb("mean", transport=Half(), verify=False, broadcast=False)
    gm = GradManager().attach(model.parameters(), callbacks=[cb])
    x0 = torch.randn(3, 8)
    expected = torch.autograd.grad(model(x0).sum(), list(model.parameters()))
    with gm:
        x = x0.clone()
        gm.attach(x)
        rest = gm.backward_split(model(x).sum(), first=[x])
    gm.record()  # the next micro-batch starts before the weights are done
    rest.finish()
    gm.release()
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p.grad, e * 0.5)


@pytest.mark.parametrize("callbacks", [None, lambda t, g: g * 0.5], ids=["plain", "callback"])
def test_hooks_on_a_boundary_output_count_once(callbacks):
    """A tensor hook and ``retain_grad`` on the output of a layer whose node feeds both the
    input path and its weights: the weights get the hooked gradient once (the rest used to
    apply the hook a second time: bias x4), and the retained ``.grad`` is what one backward
    leaves. The rest calls the hook again with zeros and ignores what it returns."""
    x0 = torch.randn(5, 8)
    seen = []

    def step(split, hook):
        model = mlp()
        gm = GradManager().attach(model.parameters(), callbacks=callbacks)
        with gm:
            x = x0.clone()
            gm.attach(x)
            hidden = model[0](x)
            hidden.register_hook(hook)
            hidden.retain_grad()
            out = model[4](model[3](model[2](model[1](hidden))))
            if split:
                gm.backward_split(out.sum(), first=[x]).finish()
            else:
                gm.backward(out.sum())
        return [x.grad, *(p.grad for p in model.parameters()), hidden.grad]

    def doubling(g):
        seen.append(g.abs().sum().item())
        return g * 2

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for got, want in zip(step(True, doubling), step(False, doubling)):
            assert torch.equal(got, want)
    assert seen[0] > 0 and seen[1:] == [0.0, seen[0]]  # split: real, then zeros; single

    # A hook that does not map zero to zero: every gradient is still exact, but a retained
    # .grad got the hook's value for the zero stand-in added, and the user is told.
    with pytest.warns(GradMgrWarning, match="retain_grad"):
        got = step(True, lambda g: g * 2 + 1)
    want = step(False, lambda g: g * 2 + 1)
    for a, b in zip(got[:-1], want[:-1]):
        assert torch.equal(a, b)
    assert torch.equal(got[-1], want[-1] + 1)


def test_a_dropped_split_leaves_the_retained_graph_to_a_plain_backward():
    """An unfinished split backward, once collected, leaves nothing behind on the graph its
    first part retained: a later ``torch.autograd.grad`` over it is the engine's own."""
    model = mlp()
    x0 = torch.randn(3, 8)
    xr = x0.clone().requires_grad_()
    want = torch.autograd.grad(model(xr).sum(), [xr, *model.parameters()])
    gm = GradManager().attach(model.parameters())
    with gm:
        x = x0.clone()
        gm.attach(x)
        out = model(x).sum()
        rest = gm.backward_split(out, first=[x])
    with pytest.warns(UnfinishedBackwardWarning):
        del rest
        gc.collect()
    got = torch.autograd.grad(out, list(model.parameters()))
    for g, w in zip(got, want[1:]):
        assert torch.equal(g, w)


def test_checkpointed_layers_recomputed_in_finish_see_the_recording_flags():
    """Non-reentrant checkpointing recomputes a region again when ``finish()`` runs its
    boundary nodes, after the recording ended and gave the stage input back its
    ``requires_grad=False``; the recompute then saved other tensors and PyTorch raised
    CheckpointError. The rest now holds the recording's flags while it runs."""
    from torch.utils.checkpoint import checkpoint

    model, x0 = mlp(), torch.randn(5, 8)

    def forward(x):
        h = checkpoint(lambda t: model[1](model[0](t)), x, use_reentrant=False)
        h = checkpoint(lambda t: model[3](model[2](t)), h, use_reentrant=False)
        return model[4](h).square().sum()

    xr = x0.clone().requires_grad_()
    want = torch.autograd.grad(forward(xr), [xr, *model.parameters()])
    gm = GradManager().attach(model.parameters())
    with gm:
        x = x0.clone()
        gm.attach(x)
        rest = gm.backward_split(forward(x), first=[x])
    assert not x.requires_grad
    rest.finish()
    assert not x.requires_grad
    for got, w in zip([x.grad, *(p.grad for p in model.parameters())], want):
        assert torch.equal(got, w)


def test_a_split_inside_a_compiled_region_is_refused_before_anything_runs():
    """A torch.compile'd stage is one backward node holding both the input and the weight
    gradients. With the default (inductor) backend PyTorch gives wrong weight gradients when
    that node runs a second time for other outputs (seen with donated buffers off; with them
    on, PyTorch raises its own error), so gradmgr refuses such a split up front, whatever the
    backend (aot_eager here, which compiles in a second), and leaves every ``.grad`` alone."""
    import torch._functorch.config as functorch_config

    model = mlp()
    compiled = torch.compile(model, backend="aot_eager")
    gm = GradManager().attach(model.parameters())
    with functorch_config.patch(donated_buffer=False), gm:
        x = torch.randn(3, 8)
        gm.attach(x)
        out = compiled(x).sum()
        with pytest.raises(UnsupportedGraphError, match="torch.compile"):
            gm.backward_split(out, first=[x])
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    with gm:  # the manager records and differentiates the next step as usual
        x = torch.randn(3, 8)
        gm.attach(x)
        gm.backward(compiled(x).sum())
    assert x.grad is not None and all(p.grad is not None for p in model.parameters())


def test_a_boundary_node_with_several_outputs_restarts_from_each():
    """A custom Function with two outputs, both used, takes the stage input and a weight: its
    node has two inputs, and the rest must start it from both (from one, the engine refused to
    take the other's recorded gradient)."""
    class TwoOut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w, (x * 2) @ w

        @staticmethod
        def backward(ctx, ga, gb):
            x, w = ctx.saved_tensors
            gx = ga @ w.t() + 2 * (gb @ w.t()) if ctx.needs_input_grad[0] else None
            gw = x.t() @ ga + (2 * x).t() @ gb if ctx.needs_input_grad[1] else None
            return gx, gw

    torch.manual_seed(0)
    w, x0 = torch.randn(3, 3, requires_grad=True), torch.randn(2, 3)

    def loss(x):
        a, b = TwoOut.apply(x, w)
        return torch.tanh(a).sum() + (b * b).sum()

    got, want = split_and_engine(loss, x0, [w])
    assert all(torch.equal(g, e) for g, e in zip(got, want))


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_autocast_a_frozen_layer_and_finish_in_another_thread(amp):
    """What a pipeline stage combines: bf16 autocast, a frozen weight, callbacks, and the
    weight part finished by a worker thread. Against ``torch.autograd.grad`` on the same
    graph shape, bit for bit (the callback halves: exact in binary); the frozen weight gets
    no gradient."""
    import threading

    model, x0 = mlp(), torch.randn(5, 8)
    model[2].weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]

    def loss(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            return model(x).float().square().sum()

    xr = x0.clone().requires_grad_()
    want = torch.autograd.grad(loss(xr), [xr, *trainable])
    gm = GradManager().attach(model.parameters(), callbacks=[lambda t, g: g * 0.5])
    with gm:
        x = x0.clone()
        gm.attach(x, callbacks=[lambda t, g: g * 0.5])
        rest = gm.backward_split(loss(x), first=[x])
    worker = threading.Thread(target=rest.finish)
    worker.start()
    worker.join()
    assert rest.done and model[2].weight.grad is None
    for got, w in zip([x.grad, *(p.grad for p in trainable)], want):
        assert torch.equal(got, w * 0.5)
