"""Uneven inputs (issue 26 item 2): ``data_parallel``'s manager inside torch's ``Join`` against
DDP inside it, each rank with its own number of batches (dist_workers/join_suite.py), on
torch's reducer path ("native"), gradmgr's buckets ("buckets", ``native=False``) and the
sharded path ("sharded", ``Join([gm, opt])`` with a ShardedOptimizer, against DDP + Join with
the unsharded optimizer: the model DDP's ranks train).

Tolerances: bit for bit on 2 ranks (both sum the same two numbers; a joined rank adds zeros);
on 3 ranks gloo sums three numbers in an order that depends on their place in the buffer,
which differs between DDP's buckets and gradmgr's (these carry the used flags), so
``rtol=1e-5, atol=1e-6`` there, as tests/test_sharded.py (the same 1-ulp differences show
without Join). Errors (``throw_on_early_termination=True``) must be DDP's, on every rank.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from ranks import spawn_scenarios  # noqa: E402

PATHS = ["native", "buckets", "sharded"]
CASES = [f"{s}:{p}" for s in ("plain", "accumulate", "throw", "empty", "failed")
         for p in PATHS] + [
    "join_method:native", "join_method:buckets", "clip:native", "clip:sharded"]
CASES3 = [f"{s}:{p}" for s in ("plain", "accumulate") for p in PATHS]


def _spawn(tmp_path_factory, name, cases, world):
    return spawn_scenarios("join_suite", tmp_path_factory.mktemp(name), [], world=world,
                           timeout=300, JOIN_CASES=",".join(cases))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _spawn(tmp_path_factory, "join2", CASES, 2)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return _spawn(tmp_path_factory, "join3", CASES3, 3)


def sides(ranks, case: str) -> list:
    """Per rank: (DDP's results, gradmgr's), by name."""
    outs = ranks.scenario(case)
    kind = case.split(":")[1]
    found = []
    for out in outs:
        ddp = {k.split("/", 2)[2]: v for k, v in out.items() if k.startswith(f"{case}/ddp/")}
        ours = {k.split("/", 2)[2]: v for k, v in out.items()
                if k.startswith(f"{case}/{kind}/")}
        found.append((ddp, ours))
    return found


def assert_like_ddp(ranks, case: str, exact: bool = True) -> None:
    for rank, (ddp, ours) in enumerate(sides(ranks, case)):
        assert sorted(ours) == sorted(ddp), (rank, sorted(ours), sorted(ddp))
        assert "error" not in ours, (rank, str(ours["error"]))
        for name, expected in ddp.items():
            if exact:
                np.testing.assert_array_equal(ours[name], expected, err_msg=f"{rank} {name}")
            else:
                np.testing.assert_allclose(ours[name], expected, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{rank} {name}")


@pytest.mark.parametrize("path", PATHS)
def test_uneven_batches_give_ddp_join_parameters(two, path):
    assert_like_ddp(two, f"plain:{path}")


@pytest.mark.parametrize("path", PATHS)
def test_no_sync_accumulation_inside_join(two, path):
    assert_like_ddp(two, f"accumulate:{path}")


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_without_any_batch(two, path):
    """It joins before the first step: before torch's reducer was ever built, before any
    plan check (the others' first step asks it to build one, and it does)."""
    assert_like_ddp(two, f"empty:{path}")


@pytest.mark.parametrize("path", PATHS)
def test_a_failed_step_after_a_rank_joined_is_skipped(two, path):
    """A batch whose forward raises (caught, the batch skipped: the failed-step habit) once
    the other rank joined: the joined rank shadows the failed step and goes on, instead of
    raising RankFailedError out of Join while the other trains on (a hang). The result: DDP
    + Join without that batch (DDP itself cannot skip a batch whose forward raised under
    Join: its joined rank shadows a backward that never comes)."""
    assert_like_ddp(two, f"failed:{path}")


@pytest.mark.parametrize("path", ["native", "buckets"])
def test_join_method_is_ddps_spelling(two, path):
    assert_like_ddp(two, f"join_method:{path}")


@pytest.mark.parametrize("path", PATHS)
def test_throw_on_early_termination_raises_as_ddp(two, path):
    """DDP's error on every rank (rank 1 exhausted its inputs first: "Rank 1 exhausted all
    inputs."; rank 0: "Detected at least one rank that exhausted inputs"), and the
    parameters where it stopped."""
    for rank, (ddp, ours) in enumerate(sides(two, f"throw:{path}")):
        assert "error" in ddp and str(ours.get("error")) == str(ddp["error"]), rank
        for name, expected in ddp.items():
            if name != "error":
                np.testing.assert_array_equal(ours[name], expected, err_msg=name)


def test_torch_clipping_inside_join_as_ddp(two):
    assert_like_ddp(two, "clip:native")


def test_sharded_clipping_after_a_rank_joined_stops_every_rank(two):
    """The joined rank cannot take part in the norm's collective: every rank raises the same
    clear error (DDP + Join clips locally and trains on)."""
    for rank, (_, ours) in enumerate(sides(two, "clip:sharded")):
        message = str(ours.get("error"))
        assert "RuntimeError" in message and "clip_grad_norm_" in message, (rank, message)
        assert "Join" in message, message


@pytest.mark.parametrize("path", PATHS)
def test_three_ranks_uneven(three, path):
    assert_like_ddp(three, f"plain:{path}", exact=False)
    assert_like_ddp(three, f"accumulate:{path}", exact=False)


# ------------------------------------------------------------------ one process
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                               torch.nn.Linear(4, 2))


def test_join_on_one_rank_trains_as_without(gloo_one_rank):
    """No rank joins early: the steps inside Join are the plain ones, bit for bit."""
    from torch.distributed.algorithms.join import Join

    from gradmgr.distributed import data_parallel

    x, y = torch.randn(5, 3), torch.randn(5, 2)
    results = []
    for joined in (False, True):
        model = _model()
        gm = data_parallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Join([gm]) if joined else contextlib.nullcontext():
            for _ in range(3):
                with gm:
                    gm.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
        results.append([t.detach().clone() for t in (*model.parameters(), *model.buffers())])
    for plain, joined in zip(*results):
        assert torch.equal(plain, joined)


def test_join_refusals(gloo_one_rank):
    from torch.distributed.algorithms.join import Join

    from gradmgr.distributed import ShardedOptimizer, data_parallel

    model = _model()
    with pytest.raises(NotImplementedError, match="divide_by_initial_world_size=False"):
        data_parallel(model).join(divide_by_initial_world_size=False)
    with pytest.raises(ValueError, match="verify=True"):
        Join([data_parallel(model, verify=False)])
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with pytest.raises(NotImplementedError, match="comm_hook= is not supported"):
        Join([data_parallel(model, comm_hook=default_hooks.allreduce_hook)])
    gm = data_parallel(model, shard=True)
    opt = ShardedOptimizer(gm, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="first joinable"), Join([opt, gm]), gm:
        gm.backward(model(torch.randn(5, 3)).sum())


@pytest.mark.megengine
def test_join_on_megengine_says_what_to_do(gloo_one_rank):
    mge = pytest.importorskip("megengine")
    import megengine.module as M

    from gradmgr.distributed import data_parallel

    gm = data_parallel(M.Linear(3, 2))
    for use in (gm.join, lambda: gm.join_hook(), lambda: gm.join_device):
        with pytest.raises(NotImplementedError, match="same number of batches"):
            use()
    del mge
