"""ShardedOptimizer's checkpoint numbering: the state dict is the unsharded optimizer's over the
same ``params``, every parameter numbered, frozen ones included (two gaps, once recorded here as
``xfail(strict=True)``, found writing docs/sharded.md).

Before, ``ShardedOptimizer.state_dict()`` numbered only the parameters the manager reduces (the
trainable ones), where torch's optimizers number every parameter they were given. So:

* after a freeze, ``new.load_state_dict(old.state_dict())`` (what the class docstring
  recommends) mapped by index into a shifted numbering: a parameter got another's state, of
  another shape, without an error; the next ``state_dict()`` then raised on the ranks holding
  such a segment while the others waited in its collective (a hang on 2 gloo ranks);
* with a frozen parameter in ``params``, the state dict was not the unsharded optimizer's over
  the same ``params``: ``torch.optim.AdamW(model.parameters())`` refused it.

In one process: a 1-rank transport whose collectives return their input. On 2 gloo ranks
(``dist_workers/zero_freeze.py``): a freeze and an unfreeze against DDP + AdamW, and dicts that
do not fit refused on every rank.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
from ranks import spawn  # noqa: E402

from gradmgr import GradManager  # noqa: E402
from gradmgr.distributed import ShardedOptimizer, make_reduce_scatter_cb  # noqa: E402
from gradmgr.distributed.contract import Done  # noqa: E402


class _OneRank:
    """Every collective of a world of one."""

    def world_size(self):
        return 1

    def rank(self):
        return 0

    def allreduce_async(self, flat):
        return Done(flat)

    def reduce_scatter_async(self, flat):
        return Done(flat)

    def all_gather_async(self, chunk):
        return Done(chunk)

    def broadcast(self, flat, src):
        return flat


def trained(params=None):
    """Three Linear layers, one AdamW step sharded over one rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 3))
    gm = GradManager().attach(model.parameters(),
                              callbacks=[make_reduce_scatter_cb(transport=_OneRank())])
    opt = ShardedOptimizer(gm, torch.optim.AdamW, params, lr=1e-2)
    with gm:
        gm.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    return model, gm, opt


def test_state_carried_over_a_freeze_stays_with_its_parameter():
    """Before the fix: the new numbering skipped the frozen layer, so its index 2 was the last
    layer's weight and got the (8, 8) moment saved for the frozen one; state_dict() raised."""
    model, gm, opt = trained()
    old = opt.state_dict()["state"]  # 0-5: the three layers' weights and biases
    model[1].requires_grad_(False)  # on every rank alike
    new = ShardedOptimizer(gm, torch.optim.AdamW, lr=1e-2)
    new.load_state_dict(opt.state_dict())
    state = new.state_dict()["state"]
    assert torch.equal(state[4]["exp_avg"], old[4]["exp_avg"])  # the last layer's weight
    assert sorted(state) == sorted(old) == list(range(6))  # the frozen layer's state is kept
    assert all(torch.equal(state[i][k], v) for i, s in old.items() for k, v in s.items())


def test_the_state_dict_is_the_unsharded_optimizers_with_a_frozen_parameter():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    model[0].bias.requires_grad_(False)
    gm = GradManager().attach(model.parameters(),
                              callbacks=[make_reduce_scatter_cb(transport=_OneRank())])
    opt = ShardedOptimizer(gm, torch.optim.AdamW, model.parameters(), lr=1e-2)
    with gm:
        gm.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain.load_state_dict(opt.state_dict())  # before the fix: ValueError, 3 against 4
    assert plain.state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]


def alike(ours, theirs):
    """Two optimizer state dicts, equal: groups, indices, every tensor bit for bit."""
    assert ours["param_groups"] == theirs["param_groups"]
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for i, state in theirs["state"].items():
        assert sorted(ours["state"][i]) == sorted(state), i
        assert all(torch.equal(ours["state"][i][k], v) for k, v in state.items()), i


def test_the_state_dict_is_adamws_over_the_same_params_frozen_ones_included():
    """Default params: every attached parameter, as AdamW(model.parameters()); the frozen
    bias is numbered (1) and has no state (never stepped), exactly as in AdamW's own dict."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    twin = copy.deepcopy(model)
    for net in (model, twin):
        net[0].bias.requires_grad_(False)
    gm = GradManager().attach(model.parameters(),
                              callbacks=[make_reduce_scatter_cb(transport=_OneRank())])
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        x = torch.randn(5, 4)
        with gm:
            gm.backward(model(x).square().mean())
        twin(x).square().mean().backward()
        opt.step()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
    alike(opt.state_dict(), plain.state_dict())
    assert sorted(opt.state_dict()["state"]) == [0, 2, 3]


def test_a_parameter_frozen_at_save_starts_afresh_once_trainable():
    """Frozen and never stepped when saved (no state in the dict), trainable when loaded: it
    starts without state, as in AdamW loading the same dict; training goes on as AdamW's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    model[0].bias.requires_grad_(False)
    gm = GradManager().attach(model.parameters(),
                              callbacks=[make_reduce_scatter_cb(transport=_OneRank())])
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=1e-2)
    with gm:
        gm.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    saved = opt.state_dict()
    twin = copy.deepcopy(model)  # the weights saved with the state
    for net in (model, twin):
        net[0].bias.requires_grad_(True)
    new = ShardedOptimizer(gm, torch.optim.AdamW, lr=1e-2)
    new.load_state_dict(saved)
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(saved))
    alike(new.state_dict(), plain.state_dict())
    assert 1 not in new.state_dict()["state"]
    x = torch.randn(5, 4)
    with gm:
        gm.backward(model(x).square().mean())
    twin(x).square().mean().backward()
    new.step()
    plain.step()
    alike(new.state_dict(), plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_loading_leaves_the_dict_as_it_was_and_takes_string_indices():
    """AdamW adds to its step count in place: the loaded dict's own must not move. A dict
    whose indices went through JSON (strings) loads too."""
    _, gm, opt = trained()
    saved = opt.state_dict()
    before = copy.deepcopy(saved)
    as_json = {"state": {str(i): s for i, s in saved["state"].items()},
               "param_groups": [{**g, "params": [str(i) for i in g["params"]]}
                                for g in saved["param_groups"]]}
    new = ShardedOptimizer(gm, torch.optim.AdamW, lr=1e-2)
    new.load_state_dict(as_json)
    alike(new.state_dict(), before)
    new.step()
    alike(saved, before)


@pytest.mark.parametrize("wrong", ["fewer", "swapped", "unlisted", "groups"])
def test_a_dict_that_does_not_fit_is_refused_and_changes_nothing(wrong):
    _, gm, opt = trained()
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    if wrong == "fewer":  # numbered over 5 of the 6 parameters
        bad["param_groups"][0]["params"] = [0, 1, 2, 3, 4]
        del bad["state"][5]
    elif wrong == "swapped":  # the middle layer's weight (8, 8) and the last's (3, 8)
        bad["state"][2], bad["state"][4] = bad["state"][4], bad["state"][2]
    elif wrong == "unlisted":
        bad["state"][9] = bad["state"][5]
    else:
        bad["param_groups"] = [{**bad["param_groups"][0], "params": p}
                               for p in ([0, 1, 2], [3, 4, 5])]
    with pytest.raises(ValueError, match="load_state_dict"):
        opt.load_state_dict(bad)
    alike(opt.state_dict(), good)


def test_a_parameter_twice_in_params_is_refused():
    model = torch.nn.Linear(4, 3)
    gm = GradManager().attach(model.parameters(),
                              callbacks=[make_reduce_scatter_cb(transport=_OneRank())])
    with pytest.raises(ValueError, match="more than once"):
        ShardedOptimizer(gm, torch.optim.AdamW, [{"params": [model.weight, model.bias]},
                                                 {"params": [model.bias]}])


# ---------------------------------------------------------------------- 2 gloo ranks
@pytest.fixture(scope="module")
def freeze_ranks(tmp_path_factory):
    """Bounded: a rank left waiting in a collective fails the test after 120 s."""
    return spawn("zero_freeze", tmp_path_factory.mktemp("zero_freeze"), 2, timeout=120)


def test_state_follows_its_parameter_across_a_freeze_and_an_unfreeze_as_with_ddp(freeze_ranks):
    """Each phase a new ShardedOptimizer loads the last phase's state_dict(): it reads back
    exactly what was saved (the frozen layer's state kept), equals DDP's AdamW given the same
    dict, and trains as it does, bit for bit (2 ranks; AdamW is elementwise)."""
    for rank, out in enumerate(freeze_ranks):
        for phase in ("start", "frozen", "unfrozen"):
            run = out[phase]
            assert run["state_vs_ddp"] == [], (rank, phase)
            assert all(torch.equal(a, b) for a, b in zip(run["ours"], run["ddp"])), (rank, phase)
        for phase in ("frozen", "unfrozen"):
            assert out[phase]["loaded_vs_saved"] == [], (rank, phase)
            assert out[phase]["loaded_vs_ddp"] == [], (rank, phase)
        assert out["start"]["indices"] == [0, 2, 3, 4, 5]  # 0.bias: frozen, never stepped
        assert out["frozen"]["indices"] == [0, 2, 3, 4, 5]  # the frozen layer's state kept
        assert out["unfrozen"]["indices"] == [0, 1, 2, 3, 4, 5]
    ours = [out["unfrozen"]["ours"] for out in freeze_ranks]
    assert all(torch.equal(a, b) for a, b in zip(*ours))


def test_a_dict_that_does_not_fit_raises_valueerror_on_every_rank(freeze_ranks):
    """Decided from the dict and the parameters, which every rank has: every rank raises, none
    waits for another, and the optimizer is unchanged (the ranks then train on together)."""
    for out in freeze_ranks:
        errors = out["refused"]["errors"]
        assert sorted(errors) == ["groups", "swapped", "trainable", "unlisted"]
        assert all(e is not None and "load_state_dict" in e for e in errors.values()), errors
        assert "has 4 parameter(s), this optimizer's 6" in errors["trainable"]
        assert "shape" in errors["swapped"]
        assert out["refused"]["unchanged"] == []
    stepped = [out["refused"]["stepped"] for out in freeze_ranks]
    assert all(torch.equal(a, b) for a, b in zip(*stepped))


def test_without_a_freeze_the_state_reloads_exactly():
    """What works today: the same parameter set, reloaded into a new optimizer."""
    _, gm, opt = trained()
    saved = opt.state_dict()
    new = ShardedOptimizer(gm, torch.optim.AdamW, lr=1e-2)
    new.load_state_dict(saved)
    again = new.state_dict()["state"]
    assert all(torch.equal(again[i][k], v) for i, s in saved["state"].items()
               for k, v in s.items())


def test_a_state_one_rank_cannot_consolidate_raises_on_every_rank(freeze_ranks):
    raised = [out["unconsolidable"]["raised"] for out in freeze_ranks]
    assert "another rank" in raised[0], raised
    assert "'odd'" in raised[1] and "elementwise" in raised[1], raised
    assert all(out["unconsolidable"]["then"] == list(range(6)) for out in freeze_ranks)
