"""Full sharding, ``data_parallel(model, shard="full")`` on FSDP2, next to plain FSDP2
(``fully_shard`` per block and the root, ``loss.backward()``) on 2 gloo ranks
(dist_workers/full_shard_suite.py; FSDP2 summing, then dividing, as gradmgr has it do over gloo:
its own average there is the sum on torch 2.8): after 10 AdamW steps on the same data every
parameter shard and every step's loss is FSDP2's bit for bit (both run the same kernels and the
same reduce-scatters in the same order; nothing is left to round differently), with
reshard-after-forward on and off, with a bf16 ``MixedPrecisionPolicy`` (also with the forward
under ``torch.autocast("cpu", dtype=torch.bfloat16)``), with activation checkpointing
(``use_reentrant=True``) or a custom ``autograd.Function`` inside each block, and with gradmgr's
``no_sync`` against FSDP2's ``set_requires_gradient_sync(False)``. A callback that scales the
gradient equals FSDP2 with the same scaling applied to ``.grad`` (SGD, bit for bit). Bad input
raises a clear error, before any collective where it can be told at once. One backward's
gradients equal DDP's bit for bit (2 ranks: a sum halved is the halves summed)."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
from ranks import spawn  # noqa: E402

from gradmgr.distributed import data_parallel  # noqa: E402

SCENARIOS = ["reshard_on", "reshard_off", "no_sync", "scaled", "mixed_precision",
             "autocast_mixed_precision", "checkpoint_inside", "custom_function"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("full_shard")
    return spawn("full_shard_suite", outdir, 2, timeout=600)


@pytest.mark.parametrize("name", SCENARIOS)
def test_full_shard_equals_fsdp2_bit_for_bit(two_ranks, name):
    for rank, out in enumerate(two_ranks):
        result = out[name]
        assert result["types"] == ["DTensor"], (rank, result["types"])  # FSDP2's shards
        assert result["moved"], "the parameters never changed: the comparison would be empty"
        assert all(result["shards"]), (rank, result["shards"])
        assert all(result["losses"]) and len(result["losses"]) == (
            20 if name == "no_sync" else 10), (rank, result["losses"])


def test_gradients_are_ddps_mean_bit_for_bit(two_ranks):
    """Not FSDP2's own average over gloo, which on torch 2.8 is the sum (every gradient twice
    DDP's on 2 ranks, no error): a sum divided by the number of ranks."""
    for rank, out in enumerate(two_ranks):
        result = out["against_ddp"]
        assert all(result["equal"]), (rank, result["ratio"])


def test_callbacks_receive_the_reduced_shards(two_ranks):
    """The callback's ``(tensor, grad)``: the sharded parameter and its gradient shard, both
    DTensors of the same local shape."""
    for out in two_ranks:
        assert out["scaled"]["seen"] == [("DTensor", "DTensor", True)]


def test_bad_input_on_the_ranks(two_ranks):
    for out in two_ranks:
        refused = out["refusals"]
        assert "blocks=['Conv2d'] names no submodule" in refused["nothing"]
        assert "Block, Linear" in refused["nothing"]
        assert "already wrapped with FSDP2's fully_shard" in refused["wrapped"]
        assert "shard=True on rank 1; shard='full' on rank 0" in refused["mixed"]


def test_join_says_full_sharding_has_none(two_ranks):
    """``gm.join()`` and ``Join([gm])`` name full sharding and what to do (old code: "this
    framework has no such context", on PyTorch, which has one). FSDP2 has no Join either."""
    from torch.distributed.algorithms.join import Joinable
    from torch.distributed.fsdp import FSDPModule

    assert not issubclass(FSDPModule, Joinable)
    for out in two_ranks:
        for how in ("join", "Join"):
            said = out["refusals"][how]
            assert "under full sharding (shard='full')" in said, said
            assert "none for FSDP2" in said and "drop_last=True" in said, said
            assert "no such context" not in said, said


def test_split_backward_is_refused(two_ranks):
    """Old code: no error, and every parameter's .grad None after finish() (FSDP2's hooks
    reduce only in a plain backward)."""
    for out in two_ranks:
        said = out["refusals"].get("split", "no error")
        assert said.startswith("gm.backward_split() under full sharding (shard='full')"), said
        assert "Use gm.backward(loss), or shard=True" in said, said


def test_a_gradient_penalty_is_refused_and_the_next_step_is_ddps(two_ranks):
    """Old code: an inner manager's backward (WGAN-GP) left a Linear's weight without a
    gradient, silently, and ``torch.autograd.grad(create_graph=True)`` failed inside torch
    (``setStorage``). Now each is refused before FSDP2 gathers anything, and the next plain
    step's gradients are DDP's, bit for bit."""
    for rank, out in enumerate(two_ranks):
        found = out["gradient_penalty"]
        said = found.get("manager", "no error")
        assert said.startswith("UnsupportedGraphError: a backward that "
                               "data_parallel(shard='full')'s manager would differentiate"), said
        assert "Use data_parallel(model) or shard=True" in said, said
        said = found.get("autograd", "no error")
        assert said.startswith("RuntimeError: data_parallel(shard='full'): a backward that "
                               "keeps its graph (create_graph=True"), said
        assert all(found["equal"]), (rank, found)


def test_attached_activations_get_their_gradients(two_ranks):
    """An input and activations attached inside ``with gm:`` get ``.grad`` as on every other
    path, equal to plain FSDP2's with ``retain_grad()`` bit for bit (a callback's doubling
    included). Old code: the activations' ``.grad`` stayed None, silently (the differential
    test_torch_dp_differential.py::test_full_sharding_equals_fsdp2 found it)."""
    for rank, out in enumerate(two_ranks):
        assert all(out["attached_activations"]["equal"]), (rank, out["attached_activations"])


def test_a_refusal_leaves_the_parameters_sharded(two_ranks):
    """With ``reshard_after_forward=False``, after each refused recording (a split backward,
    an inner manager's, ``autograd.grad(create_graph=True)``) the modules hold their sharded
    parameters, and the next step, a hook on a weight registered before it, is plain FSDP2's
    bit for bit. Old code: the gathered parameters stayed on the modules, the hook landed on
    one and scaled the step's gradient, silently (the differential
    test_torch_dp_differential.py::test_full_sharding_equals_fsdp2 found it, 60 steps, seed
    13)."""
    for rank, out in enumerate(two_ranks):
        found = out["after_a_refusal"]
        assert found["types"] == [["DTensor"]] * 3, (rank, found)
        assert all(found["equal"]), (rank, found)


def test_four_ranks_bit_for_bit(tmp_path):
    outs = spawn("full_shard_suite", tmp_path, 4, timeout=600,
                 FULL_SHARD_SCENARIOS="reshard_on")
    for rank, out in enumerate(outs):
        result = out["reshard_on"]
        assert result["moved"] and all(result["shards"]) and all(result["losses"]), rank


def model():
    return torch.nn.Sequential(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("shard", ["bogus", "FULL", 1, "True"])
def test_a_shard_that_is_not_a_sharding(shard):
    """Before any collective (no process group here); old code took any truthy value for
    ZeRO-2."""
    with pytest.raises(ValueError, match=r"is not a sharding: pass shard=False .* shard='full'"):
        data_parallel(model(), shard=shard)


@pytest.mark.parametrize("option, value", [("reduce", "sum"), ("bucket_bytes", 1 << 20),
                                           ("compression", "fp16"), ("native", True),
                                           ("group", object()), ("comm_hook", print)])
def test_options_full_sharding_cannot_take(option, value):
    with pytest.raises(ValueError, match=rf"{option}= is not supported under full sharding"):
        data_parallel(model(), shard="full", **{option: value})


@pytest.mark.parametrize("shard", [False, True])
def test_fsdp2_options_need_full_sharding(shard):
    with pytest.raises(ValueError, match=r"blocks=, mp_policy= apply only for shard='full'"):
        data_parallel(model(), shard=shard, blocks=[torch.nn.Linear], mp_policy=object())



@pytest.mark.parametrize("verify", ["always", None, 1.0])
def test_a_verify_that_is_not_one(verify):
    """Before any collective (no process group here); old code took any value under full
    sharding and checked nothing."""
    with pytest.raises(ValueError, match=r"verify must be True, 'step', 'plan' or False"):
        data_parallel(model(), shard="full", verify=verify)


class _TwoAlikeRanks:
    """A check transport of 2 ranks that always agree (each sum is twice this rank's
    vector), counting the checks."""

    def __init__(self):
        self.checks = 0

    def world_size(self):
        return 2

    def allreduce_async(self, flat):
        self.checks += 1
        return type("Done", (), {"wait": lambda _: flat * 2})()


@pytest.mark.parametrize("verify, expected", [
    (True, 5), ("step", 5),  # every recording, inside no_sync too
    ("plan", 2),  # the first, and the one after the freeze
    (False, 0),
])
def test_which_recordings_are_checked(verify, expected):
    from gradmgr.backends.torch.ops import TorchOps
    from gradmgr.distributed.sharded.full_check import FullShardCheck

    net = torch.nn.Linear(2, 2)
    checks = _TwoAlikeRanks()
    check = FullShardCheck(TorchOps(), checks, net, list(net.parameters()), verify)
    for synced in (False, True, True):
        check.record(synced)
    net.bias.requires_grad_(False)
    check.record(True)
    check.record(True)
    assert checks.checks == expected


class _RankOneSynced:
    """Rank 0's side of a check transport of 2 ranks where rank 1 always starts a synced
    recording after none inside no_sync: each sum is this rank's row (the first half) and
    that row again with its last 3 numbers, the stage, as rank 1's (1: synced, 0 before)."""

    def world_size(self):
        return 2

    def rank(self):
        return 0

    def allreduce_async(self, flat):
        width = len(flat) // 2
        other = flat[:width].clone()
        other[-3:] = torch.tensor([1.0, 0.0, 0.0])
        summed = torch.cat([flat[:width], other, flat[2 * width:]])
        return type("Done", (), {"wait": lambda _: summed})()


def test_a_no_sync_mismatch_says_what_full_sharding_offers():
    """Rank 0 records inside no_sync where rank 1 syncs: the error speaks of recordings (the
    check runs at every one) and of no_sync(gm), not of a callback's cb.no_sync(), which full
    sharding has none of; nor of empty recordings, which meet no gather of FSDP2's. (The same
    message on 2 gloo ranks: tests/test_out_of_step.py.)"""
    from gradmgr.backends.torch.ops import TorchOps
    from gradmgr.distributed import RankMismatchError
    from gradmgr.distributed.sharded.full_check import FullShardCheck

    net = torch.nn.Linear(2, 2)
    check = FullShardCheck(TorchOps(), _RankOneSynced(), net, list(net.parameters()), True)
    with pytest.raises(RankMismatchError) as raised:
        check.record(synced=False)
    message = str(raised.value)
    assert ("at this recording rank 0 records inside no_sync; rank 1 starts a synced "
            "recording after 0 recording(s) inside no_sync") in message, message
    assert "Enter no_sync(gm) for the same recordings" in message, message
    assert "cb.no_sync" not in message and "record empty ones" not in message, message
    assert message.endswith("Nothing was gathered or reduced at this recording"), message


def test_a_check_group_nobody_comes_to_make_is_told_in_full_sharding_terms(gloo_one_rank,
                                                                             monkeypatch):
    """data_parallel(model, shard="full") makes the plan checks' group (its first recording
    must not be the first collective a rank with no batch misses); where the other rank never
    comes to make it, the error speaks of recordings and of what full sharding offers, not of
    a synced step and Join, which it has none of: at once and at every later check. In one
    process: the user's transport is a 2-rank one whose other rank sends the same (the
    module check agrees), and the check group's maker times out as gloo's does."""
    from gradmgr import get_backend
    from gradmgr.backends.torch import control
    from gradmgr.distributed import RanksOutOfStepError

    class TwoRankChecks(control.CheckTransport):
        def world_size(self):
            return 2

    class Mirrored:
        def world_size(self):
            return 2

        def allreduce_async(self, flat):
            summed = flat * 2
            return type("Done", (), {"wait": lambda _: summed})()

        def control(self, terms):
            return TwoRankChecks(None, terms)

    def never_made(*args, **kwargs):
        raise RuntimeError("Wait timeout")

    monkeypatch.setattr(type(get_backend("torch")), "transport", lambda *a, **k: Mirrored())
    monkeypatch.setattr(control.dist, "new_group", never_made)
    with pytest.raises(RanksOutOfStepError) as first:
        data_parallel(torch.nn.Linear(2, 2), shard="full")
    with pytest.raises(RanksOutOfStepError) as later:
        TwoRankChecks().start_sum(torch.zeros(1))
    for message in (str(first.value), str(later.value)):
        assert "synced step" not in message, message
        assert "take every step on every rank" not in message, message  # (STEPS' remedy)
        assert "full sharding has no Join" in message, message
    assert "not every rank started this recording" in str(first.value)
    assert "gave up on an earlier recording's plan check" in str(later.value)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(x)


def _blocks(share) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), _Block(), _Block(), torch.nn.Linear(4, 2))
    share(net)
    return net


def _tie(net):
    net[2].fc.weight = net[1].fc.weight


def _same_module(net):
    net[2].fc = net[1].fc


def _with_root(net):
    net[0].weight = net[1].fc.weight


@pytest.mark.parametrize("share, names, units", [
    (_tie, "1.fc.weight = 2.fc.weight", "'1' and '2'"),
    (_same_module, "1.fc.weight = 2.fc.weight", "'1' and '2'"),
    (_with_root, "0.weight = 1.fc.weight", "'1' and the root"),
])
def test_a_parameter_two_wrapped_units_hold_is_refused(gloo_one_rank, share, names, units):
    """A parameter held by two of the modules fully_shard wraps (two blocks, or a block and
    the root), refused at data_parallel. Old code on torch 2.8: FSDP2 (as alone) gave each its
    own shard, the model went from 11 to 12 parameters and the copies trained apart, silently
    (2 gloo ranks, 3 AdamW steps: equal to FSDP2 alone bit for bit, the two copies' values no
    longer equal); a shared module failed on FSDP2's "FSDP requires named DeviceMesh dims"
    assertion. On torch 2.13 FSDP2 alone refuses a tied parameter at its first forward."""
    net = _blocks(share)
    with pytest.raises(ValueError) as raised:
        data_parallel(net, shard="full", blocks=[_Block])
    message = str(raised.value)
    assert f"the parameter {names} is held by {units}" in message, message
    assert "Choose blocks= so that every module holding it is wrapped in the same unit" \
        in message, message
    assert not any(type(p).__name__ == "DTensor" for p in net.parameters())  # nothing wrapped


def test_a_parameter_shared_inside_one_unit_trains_tied(gloo_one_rank):
    """The remedy the refusal gives: the root holds the shared parameter (blocks=() here):
    one parameter, one shard, whose gradient sums both uses, as the unwrapped model's."""
    net, plain = _blocks(_tie), _blocks(_tie)
    gm = data_parallel(net, shard="full", blocks=())
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with gm:
        gm.backward(net(x).square().mean())
    plain(x).square().mean().backward()
    assert len(list(net.parameters())) == len(list(plain.parameters())) == 7
    assert net[1].fc.weight is net[2].fc.weight
    for ours, theirs in zip(net.parameters(), plain.parameters()):  # 1 rank: the whole grad
        torch.testing.assert_close(ours.grad.full_tensor(), theirs.grad, rtol=1e-6, atol=1e-7)


def test_callbacks_on_parameters_taken_before_wrapping_are_refused(gloo_one_rank):
    """``kept = list(model.parameters())`` before data_parallel(shard="full"), then
    ``gm.attach(kept, callbacks=...)``: FSDP2 put new parameters on the model, so no forward
    uses the kept ones. Old code: the callbacks never ran and training went on without them
    (2 gloo ranks, 3 SGD steps with a callback halving block 1's gradients: every parameter
    differed from FSDP2 alone with those gradients halved). Refused at the next recording,
    before any collective; the model's own parameters are taken."""
    net = _blocks(lambda net: None)
    kept = list(net[1].parameters())
    gm = data_parallel(net, shard="full", blocks=[_Block])
    gm.attach(kept, callbacks=[lambda t, g: g * 0.5])
    with pytest.raises(TypeError) as raised, gm:
        pass
    message = str(raised.value)
    assert "was given 2 parameter(s) the model no longer has (1.fc.weight, 1.fc.bias)" \
        in message, message
    assert "gm.attach(list(model.parameters()), callbacks=...)" in message, message
    del kept, raised  # the remedy: the old parameters go, the model's are attached
    gc.collect()
    seen = []
    gm.attach(list(net[1].parameters()), callbacks=[lambda t, g: seen.append(t) or g * 0.5])
    plain = _blocks(lambda net: None)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with gm:
        gm.backward(net(x).square().mean())
    plain(x).square().mean().backward()
    assert [id(t) for t in seen] == [id(p) for p in net[1].parameters()]
    for ours, theirs in zip(net[1].parameters(), plain[1].parameters()):
        torch.testing.assert_close(ours.grad.full_tensor(), theirs.grad * 0.5, rtol=1e-6,
                                   atol=1e-7)


def test_an_optimizer_made_before_wrapping_is_refused_at_its_step(gloo_one_rank):
    """An optimizer made before data_parallel(shard="full") holds the parameters FSDP2
    replaced, which get no gradient. Old code: its step changed nothing, silently (as under
    FSDP2 alone). Refused at its first step, naming the parameters and the remedy; one made
    after the wrapping, and optimizers of other models, step as before."""
    net = _blocks(lambda net: None)
    before = torch.optim.SGD(net.parameters(), lr=0.1)
    other = torch.nn.Linear(2, 2)
    bystander = torch.optim.SGD(other.parameters(), lr=0.1)
    gm = data_parallel(net, shard="full", blocks=[_Block])
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    with gm:
        gm.backward(net(x).square().mean())
    with pytest.raises(TypeError) as raised:
        before.step()
    message = str(raised.value)
    assert "this optimizer (SGD) holds 8 parameter(s) that data_parallel(model, " \
        "shard='full') replaced (0.weight, 0.bias, 1.fc.weight, 1.fc.bias, ...)" \
        in message, message
    assert "optimizer = SGD(model.parameters(), ...)" in message, message
    other(torch.ones(1, 2)).sum().backward()
    old = other.weight.detach().clone()
    bystander.step()
    assert not torch.equal(other.weight, old)
    after = torch.optim.SGD(net.parameters(), lr=0.1)
    shards = [p.detach().full_tensor().clone() for p in net.parameters()]
    after.step()
    assert all(not torch.equal(p.detach().full_tensor(), s)
               for p, s in zip(net.parameters(), shards))
    after.add_param_group({"params": [before.param_groups[0]["params"][0]]})
    with pytest.raises(TypeError, match="holds 1 parameter"):
        after.step()  # (a group added since: checked again)


def test_loss_backward_inside_the_recording_with_callbacks_is_refused(gloo_one_rank):
    """``loss.backward()`` typed inside ``with gm:`` where callbacks are attached: FSDP2
    reduces the gradients, but the callbacks never ran. Old code: silently (2 gloo ranks, 3
    SGD steps with a callback halving every gradient: 0 calls, every parameter different from
    FSDP2 alone with its gradients halved); the other paths raise at the recording's end, as
    this now does. .grad holds the reduced gradient without the callbacks' change, as said;
    without callbacks the same step is FSDP2's own (tests/test_habit_harness.py)."""
    net, plain = _blocks(lambda net: None), _blocks(lambda net: None)
    gm = data_parallel(net, shard="full", blocks=[_Block])
    gm.attach(list(net.parameters()), callbacks=[lambda t, g: g * 0.5])
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError) as raised, gm:
        net(x).square().mean().backward()
    message = str(raised.value)
    assert "the gradient callbacks attached to 8 of them never ran" in message, message
    assert "Call gm.backward(loss) inside `with gm:` instead" in message, message
    plain(x).square().mean().backward()
    for ours, theirs in zip(net.parameters(), plain.parameters()):  # 1 rank: the whole grad
        torch.testing.assert_close(ours.grad.full_tensor(), theirs.grad, rtol=1e-6, atol=1e-7)
    for p in net.parameters():
        p.grad = None
    with gm:  # the next recording, as documented, runs the callbacks
        gm.backward(net(x).square().mean())
    for ours, theirs in zip(net.parameters(), plain.parameters()):
        torch.testing.assert_close(ours.grad.full_tensor(), theirs.grad * 0.5, rtol=1e-6,
                                   atol=1e-7)


def test_a_second_data_parallel_says_the_wrapping_stays(gloo_one_rank):
    """A second data_parallel on a model full sharding wrapped, on any path, the first
    manager kept or dropped: the error says to keep that manager (old code: "Pass the plain
    model: data_parallel(model, shard='full', ...) wraps it with fully_shard itself", which
    the user had done; 2 gloo ranks: both ranks raised it, the group in step). A model the
    user wrapped keeps its own message (test_bad_input_on_the_ranks)."""
    net = _blocks(lambda net: None)
    gm = data_parallel(net, shard="full", blocks=[_Block])
    for dropped in (False, True):
        if dropped:
            del gm
            gc.collect()
        for options in ({"shard": "full", "blocks": [_Block]}, {}, {"shard": True}):
            with pytest.raises(TypeError) as raised:
                data_parallel(net, **options)
            message = str(raised.value)
            assert "an earlier data_parallel(model, shard='full') wrapped" in message, message
            assert "Keep using the manager that call returned" in message, message
            assert "Pass the plain model" not in message, message
