"""Distributed checkpoints (torch.distributed.checkpoint) of ZeRO-2: ``get_state_dict`` and
``set_state_dict`` of ``gradmgr.distributed`` on spawned gloo ranks (dist_workers/zero_dcp.py).

Training of 3 AdamW steps on 2 ranks, saved with DCP, loaded on 3 ranks, one step, saved,
loaded on 2 ranks, one step: at every load the optimizer state and the parameters are bit for
bit those of the same training saved and loaded with the gathered ``state_dict()``, and after
every step the parameters are bit for bit the gathered path's (the same ranks, the same sums:
exact). A DCP checkpoint of DDP with torch's AdamW loads into ZeRO-2, and ZeRO-2's into DDP,
every tensor bit for bit. A checkpoint without a key the loader asks for (another model,
another optimizer class) fails on every rank naming the key, the optimizer as it was.
``dcp.async_save`` (a gloo group of its own, a ``FileSystemWriter``), a step taken as soon as
it returns: the checkpoint holds the state it was given. ``opt.load_state_dict`` of
``get_state_dict``'s dict raises ValueError naming ``set_state_dict``, nothing changed.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
from ranks import spawn  # noqa: E402

from gradmgr.backends.torch.dcp import boxes  # noqa: E402

SPAWN_S = 400  # per world size: the ranks share 2 cores with other test runs
# the module's fixture spawns three times within its first test
pytestmark = pytest.mark.timeout(3 * SPAWN_S + 120)


@pytest.fixture(scope="module")
def dcp_ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("dcp")
    first = spawn("zero_dcp", outdir, 2, timeout=SPAWN_S, GRADMGR_DCP_PART="first")
    second = spawn("zero_dcp", outdir, 3, timeout=SPAWN_S, GRADMGR_DCP_PART="second")
    third = spawn("zero_dcp", outdir, 2, timeout=SPAWN_S, GRADMGR_DCP_PART="third")
    return first, second, third


@pytest.mark.parametrize("leg", [1, 2], ids=["2 to 3 ranks", "3 to 2 ranks"])
def test_dcp_checkpoint_loads_at_another_world_size_bit_for_bit(dcp_ranks, leg):
    outs = dcp_ranks[leg]
    assert [out["world"] for out in outs] == [3, 2][leg - 1:leg] * len(outs)
    for out in outs:
        assert out["loaded_state_equal"], "optimizer state differs from the gathered save's"
        assert out["loaded_params_equal"], "parameters differ from the gathered save's"
        assert out["stepped_state_equal"], "state after a step differs from the gathered path"
        ours, theirs = out["stepped_params"]
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert torch.equal(a, b), f"parameter {i} differs by {(a - b).abs().max()}"
    for out in outs[1:]:  # and every rank holds the same parameters
        for a, b in zip(out["stepped_params"][0], outs[0]["stepped_params"][0]):
            assert torch.equal(a, b)


def test_ddp_checkpoint_loads_into_zero2_and_back_bit_for_bit(dcp_ranks):
    for out in dcp_ranks[2]:
        assert out["from_ddp_state_equal"] and out["from_ddp_params_equal"]
        assert out["to_ddp_state_equal"] and out["to_ddp_params_equal"]


@pytest.mark.parametrize("name", ["zero", "full"])
def test_a_save_inside_no_sync_changes_nothing_and_loads_anywhere(dcp_ranks, name):
    """Saved mid-accumulation: the run goes on bit for bit as the same run unsaved, and the
    checkpoint loads before any step (ZeRO-2: into a manager of another bucket size) as the
    saving run held it."""
    for out in dcp_ranks[2]:
        assert out[f"{name}_mid_window_goes_on"] and out[f"{name}_mid_window_loads"], name


@pytest.mark.parametrize("name", ["zero", "full"])
def test_async_save_in_a_group_of_its_own_holds_the_state_it_was_given(dcp_ranks, name):
    """dcp.async_save(..., process_group=<a gloo group of its own>,
    storage_writer=dcp.FileSystemWriter(path)), then a step at once (the optimizer's state
    changes in place while the checkpoint is written): the checkpoint loads as the state was
    at the save, bit for bit (ZeRO-2: into a manager of another bucket size)."""
    for out in dcp_ranks[2]:
        assert out[f"{name}_async_saved"], name


@pytest.mark.parametrize("case, key", [("missing_key", "model.5.weight"),
                                       ("wrong_class", "optim.state.0.weight.momentum_buffer")])
def test_a_checkpoint_without_a_key_fails_on_every_rank_and_changes_nothing(dcp_ranks, case,
                                                                            key):
    for out in dcp_ranks[2]:
        assert out[case] is not None, "loaded without an error"
        kind, text, unchanged = out[case]
        assert kind == "CheckpointException"
        assert f"Missing key in checkpoint state_dict: {key}" in text
        assert unchanged, "the optimizer's state changed"


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (5, 1, 3)])
def test_a_flat_range_is_cut_into_boxes_that_cover_it_in_order(shape):
    n = int(torch.tensor(shape).prod())
    whole = torch.arange(n).view(shape)
    for start in range(n):
        for stop in range(start + 1, n + 1):
            cut = boxes(shape, start, stop)
            assert len(cut) <= 2 * len(shape) - 1
            flat = [whole[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
                    for off, size in cut]
            assert torch.equal(torch.cat(flat), torch.arange(start, stop))


def test_a_plain_optimizer_is_sent_to_torchs_own_functions():
    from gradmgr.distributed import get_state_dict

    net = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="torch.distributed.checkpoint.state_dict"):
        get_state_dict(net, torch.optim.AdamW(net.parameters()))


def _trained(gm, net):
    from gradmgr.distributed import ShardedOptimizer

    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=0.1)
    with gm:
        gm.backward(net(torch.ones(2, 3)).square().sum())
    opt.step()
    return opt


def test_another_model_or_groups_of_other_parameters_raise_and_change_nothing(gloo_one_rank):
    from gradmgr.distributed import data_parallel, get_state_dict, set_state_dict

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    gm = data_parallel(net, shard=True)
    opt = _trained(gm, net)
    with pytest.raises(ValueError, match="not one of the model's"):
        get_state_dict(torch.nn.Linear(3, 4), opt)
    model_state, optim_state = get_state_dict(net, opt)
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    lr = opt.param_groups[0]["lr"]
    optim_state["param_groups"] = [{"lr": 5.0, "params": ["other.weight"]}]
    with pytest.raises(ValueError, match="no parameter group of the loaded dict holds "
                                         "parameter '0.weight'"):
        set_state_dict(net, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    assert opt.param_groups[0]["lr"] == lr
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(after[k], v) for k, v in before.items())
    del opt, gm


def test_the_load_template_leaves_a_fresh_optimizer_as_it_was(gloo_one_rank):
    """get_state_dict of an optimizer that has not stepped: zeros of AdamW's making for every
    parameter (step 1, as torch's get_state_dict makes of a fresh optimizer), and the
    optimizer and the parameters untouched."""
    from gradmgr.distributed import ShardedOptimizer, data_parallel, get_state_dict

    net = torch.nn.Linear(3, 2)
    gm = data_parallel(net, shard=True)
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=0.1, weight_decay=0.5)
    weights = [p.detach().clone() for p in net.parameters()]
    _, optim_state = get_state_dict(net, opt)
    assert sorted(optim_state["state"]) == ["bias", "weight"]
    weight = optim_state["state"]["weight"]
    assert float(weight["step"]) == 1.0
    for key in ("exp_avg", "exp_avg_sq"):
        assert tuple(weight[key].size()) == (2, 3)
        assert all(torch.equal(s.tensor, torch.zeros_like(s.tensor))
                   for s in weight[key].local_shards())
    assert opt.optimizer.state == {}, "the optimizer itself was stepped"
    assert all(torch.equal(p, w) for p, w in zip(net.parameters(), weights))
    del opt, gm


FULL = {0: ["full_loaded_equal", "full_resumed_equal", "full_trains_as_plain"],
        1: ["full_from_plain_equal", "plain_from_full_equal", "full_stepped_as_plain",
            "zero_from_full_equal", "full_from_zero_equal"],
        2: ["full_reloaded_as_plain", "full_restepped_as_plain"]}


@pytest.mark.parametrize("leg", [0, 1, 2], ids=["2 ranks", "2 to 3 ranks", "3 to 2 ranks"])
def test_full_sharding_checkpoints_as_plain_fsdp2_bit_for_bit(dcp_ranks, leg):
    """data_parallel(shard="full") with a plain AdamW, saved and loaded with gradmgr's
    get_state_dict/set_state_dict (dist_workers/full_dcp.py): on 2 ranks a resumed run equals
    the uninterrupted one; across 2 -> 3 -> 2 ranks it equals plain FSDP2 saved and loaded
    with torch's own functions, reads FSDP2's checkpoints and FSDP2 reads its own, and ZeRO-2
    and full sharding read each other's; every tensor whole, bit for bit."""
    failed = [(r, key) for r, out in enumerate(dcp_ranks[leg]) for key in FULL[leg]
              if out[key] is not True]
    assert not failed, f"(rank, check) not bit for bit: {failed}"


def test_opt_load_state_dict_of_get_state_dicts_dict_raises_and_changes_nothing(gloo_one_rank):
    """The DDP habit ``optimizer.load_state_dict(optim_state)`` after ``dcp.load`` (torch's
    AdamW loads torch's get_state_dict layout by position): ShardedOptimizer.load_state_dict
    takes whole tensors, and a ShardedTensor of gradmgr's get_state_dict raises ValueError
    naming set_state_dict, before the groups' options or any state change. (Before: torch's
    "torch function 'reshape' ... not supported for ShardedTensor!" half-way through.)"""
    from gradmgr.distributed import data_parallel, get_state_dict

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    gm = data_parallel(net, shard=True)
    opt = _trained(gm, net)
    before = opt.state_dict()  # gathered: copies
    _, optim_state = get_state_dict(net, opt)
    optim_state["param_groups"][0]["lr"] = 5.0
    with pytest.raises(ValueError, match=r"a loaded state is a ShardedTensor.*"
                                         r"gradmgr\.distributed\.set_state_dict\(model, opt"):
        opt.load_state_dict(optim_state)
    assert opt.param_groups[0]["lr"] == 0.1
    after = opt.state_dict()
    for index, state in before["state"].items():
        assert all(torch.equal(after["state"][index][k], v) for k, v in state.items())
    del opt, gm
