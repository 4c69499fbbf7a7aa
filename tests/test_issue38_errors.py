"""Issue 38, "Errors that point the wrong way": each case's error says what was wrong and what
to do (one gloo rank in this process: every case here fails, or trains, the same on any
number of ranks). Where a case trains, its gradients are compared with DDP's on the same
rank: bit for bit (the same kernels on the same inputs).
"""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _step(gm, model, x):
    with gm:
        gm.backward(model(x).sum())


# ------------------------------------------------------------------ a second manager
@pytest.mark.parametrize("shard", [False, True])
def test_a_second_manager_on_one_model_says_so(gloo_one_rank, shard):
    """On the old code the second manager's first step raised the forgotten-recording error
    ("forward ran outside `with gm:`") although it ran inside the new manager's recording."""
    from gradmgr.distributed import data_parallel

    model, x = _model(), torch.randn(5, 3)
    gm = data_parallel(model, shard=shard)
    _step(gm, model, x)
    with pytest.raises(RuntimeError, match="already has a data-parallel manager") as caught:
        data_parallel(model, shard=shard)
    assert "del gm" in str(caught.value)
    del caught
    _step(gm, model, x)  # the first manager still works
    del gm  # the way the error names: then the model takes a new manager
    gm = data_parallel(model, shard=shard)
    model.zero_grad()
    _step(gm, model, x)
    if not shard:  # (sharded: .grad is not the gradient)
        plain = _model()
        plain.load_state_dict(model.state_dict())
        plain(x).sum().backward()
        for p, q in zip(model.parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_a_dropped_manager_in_a_cycle_is_not_in_the_way(gloo_one_rank):
    from gradmgr.distributed import data_parallel

    model = _model()
    gm = data_parallel(model)
    gm.cycle = [gm]  # only the garbage collector frees it
    del gm
    gm = data_parallel(model)
    _step(gm, model, torch.randn(5, 3))
    gc.collect()


# ------------------------------------------------------------------ Join
def test_two_managers_in_one_join_are_refused_at_once(gloo_one_rank):
    """On the old code the second manager's first recording raised "must be the first
    joinable", which it could not be; the first manager was left inside the context."""
    from torch.distributed.algorithms.join import Join

    from gradmgr.distributed import data_parallel

    model_a, model_b, x = _model(), _model(), torch.randn(5, 3)
    gm_a, gm_b = data_parallel(model_a), data_parallel(model_b)
    with pytest.raises(ValueError, match="two managers in one Join context"):
        Join([gm_a, gm_b])
    for gm in (gm_a, gm_b):  # neither is left inside a context that never started
        assert not gm._join_config.enable
    model_a.zero_grad()
    _step(gm_a, model_a, x)
    plain = _model()
    plain(x).sum().backward()
    for p, q in zip(model_a.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_manager_built_by_hand_in_join_says_what_to_do(gloo_one_rank):
    """On the old code: torch's AttributeError, 'GradManager' object has no attribute
    'join_hook'."""
    from torch.distributed.algorithms.join import Join

    from gradmgr import GradManager
    from gradmgr.distributed import make_allreduce_cb

    model = _model()
    gm = GradManager().attach(model.parameters(), callbacks=[make_allreduce_cb("mean")])
    with pytest.raises(TypeError, match=r"not a joinable.*gm = data_parallel\(model\)"):
        Join([gm])
    with pytest.raises(AttributeError, match="no attribute 'joinhook'"):
        gm.joinhook  # noqa: B018 (any other missing name is as before)


# ------------------------------------------------------------------ comm hooks
def _short_hook(state, bucket):
    """A future of the wrong shape: the bucket less its last element."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer()[:-1].clone())
    return future


def _after_short_hook(state, bucket):
    """The same, from a ``.then()`` callback (the form torch's own hooks take)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0][:-1])


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("hook", [_short_hook, _after_short_hook])
def test_a_hook_future_of_the_wrong_shape_raises_value_error(gloo_one_rank, native, hook):
    """On the old code the reducer path (native) raised RuntimeError("Got the following error
    when running the callback: ValueError: ...") where the docs and the python path say
    ValueError."""
    from gradmgr.distributed import data_parallel

    model, x = _model(), torch.randn(5, 3)
    gm = data_parallel(model, comm_hook=hook, native=native)
    with pytest.raises(ValueError, match="comm_hook's future gave a tensor of shape"):
        _step(gm, model, x)
    del gm
    gm = data_parallel(model, native=native)  # the group and the model go on
    model.zero_grad()
    _step(gm, model, x)
    plain = _model()
    plain(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


# ------------------------------------------------------------------ autograd.grad outside
def _grad_habits(net, step):
    """What users compute with torch.autograd.grad outside the training step, after a
    forward through ``net`` outside it: a saliency map, this rank's parameter gradients (their
    norms), a gradient penalty built outside and trained inside the next step."""
    torch.manual_seed(1)
    x = torch.randn(5, 3, requires_grad=True)
    params = list(net.parameters())
    saliency = torch.autograd.grad(net(x).square().sum(), x)[0]
    local = torch.autograd.grad(net(x).square().sum(), params)
    grads_written = [p.grad for p in params]
    penalty = torch.autograd.grad(net(x).sum(), x, create_graph=True)[0].square().sum()
    step(penalty)
    return [saliency, *local, *(p.grad for p in params)], grads_written


def test_autograd_grad_outside_the_step_is_allowed_as_under_ddp(gloo_one_rank):
    """On the old code the forward watch refused ``torch.autograd.grad(out, params)`` after a
    forward outside ``with gm:`` (it writes no .grad: it gives this rank's gradient, as under
    DDP). Bit for bit against DDP on the same rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradmgr.distributed import data_parallel

    ones = torch.ones(2, 3)
    ddp = DDP(_model())

    def ddp_step(extra):
        (ddp(ones).sum() + extra).backward()

    expected, ddp_written = _grad_habits(ddp, ddp_step)
    model = _model()
    gm = data_parallel(model)

    def step(extra):
        with gm:
            gm.backward(model(ones).sum() + extra)

    got, written = _grad_habits(model, step)
    assert written == ddp_written == [None] * 4  # no .grad written outside the step
    assert len(got) == len(expected) == 9
    for ours, theirs in zip(got, expected):
        assert torch.equal(ours, theirs)
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="outside `with gm:`") as refused:
        model(ones).sum().backward()  # loss.backward() by habit is still refused
    assert all(p.grad is None for p in model.parameters())  # before anything was written
    for idiom in ("after dropping DDP?", "under torch.no_grad(),", "so is torch.autograd.grad,",
                  "as under DDP.)"):  # PyTorch's words (TensorOps.idioms)
        assert idiom in str(refused.value), (idiom, str(refused.value))
