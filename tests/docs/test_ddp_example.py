"""The side-by-side example of docs/switching-from-ddp.md: examples/ddp/ddp_train.py (PyTorch's
DistributedDataParallel) and examples/ddp/gradmgr_train.py (gradmgr) run on 2 gloo ranks under
``torchrun --nproc_per_node 2``, and the gradmgr one also through ``spawn_local`` (plain
``python``). Every rank's parameters, buffers and losses must be equal bit for bit (``==`` and
``torch.equal``, no tolerance) to DDP's: a sum of two numbers does not depend on the order of its
terms, so 2 ranks leave no room for rounding. Buffers are compared as DDP's next forward would
use them: rank 0's, which DDP broadcasts at the start of that forward and gradmgr when the
synced step ends (between the two, DDP's other ranks still hold their own)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
from docs_helpers import ROOT, run, torchrun

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
EXAMPLE = os.path.join(ROOT, "examples", "ddp")
TIMEOUT_S = 240
# The fixture's three runs may each take up to TIMEOUT_S: pytest's 300 s (pyproject) cut it
# short at 319 s on 2 cores at load 20, with no run past its own limit
pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(3 * TIMEOUT_S + 60)]


def load_ranks(out) -> list:
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in range(2)]


def initial_model(seed: int):
    """The model as ddp_train.py builds it on the rank seeded ``seed``, before any broadcast."""
    spec = importlib.util.spec_from_file_location("ddp_train", os.path.join(EXAMPLE,
                                                                           "ddp_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(seed)
    return module.make_model()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Each run's ranks' saved results: ``{run: [rank 0's, rank 1's]}``."""
    out = tmp_path_factory.mktemp("ddp_example")
    script = {"DDP": os.path.join(EXAMPLE, "ddp_train.py"),
              "gradmgr": os.path.join(EXAMPLE, "gradmgr_train.py")}
    runs = {
        "DDP under torchrun": torchrun(script["DDP"], "--out", str(out / "0")),
        "gradmgr under torchrun": torchrun(script["gradmgr"], "--out", str(out / "1")),
        "gradmgr through spawn_local": [sys.executable, script["gradmgr"], "--out", str(out / "2")],
    }
    found = {}
    for i, (name, cmd) in enumerate(runs.items()):
        run(cmd, TIMEOUT_S)
        found[name] = load_ranks(out / str(i))
    return found


def test_gradmgr_script_equals_ddp_bit_for_bit(results) -> None:
    ddp = results["DDP under torchrun"]
    ddp_buffers = {name for name, _ in initial_model(0).named_buffers()}
    for name in ("gradmgr under torchrun", "gradmgr through spawn_local"):
        for rank, (want, got) in enumerate(zip(ddp, results[name])):
            assert got["losses"] == want["losses"], f"{name}, rank {rank}: losses differ"
            assert list(got["state"]) == list(want["state"]), f"{name}: other state_dict keys"
            for key, value in want["state"].items():
                if key in ddp_buffers:
                    value = ddp[0]["state"][key]
                assert torch.equal(got["state"][key], value), f"{name}, rank {rank}: {key}"


def test_the_comparison_can_fail(results) -> None:
    """What makes the bit-for-bit test meaningful: the ranks start from different weights and
    read different data, so only the broadcasts and the reduction make them agree; training
    moves the trainable weights and leaves the frozen layer at rank 0's initial values."""
    ranks = results["gradmgr under torchrun"]
    assert ranks[0]["losses"] != ranks[1]["losses"]
    rank0, rank1 = initial_model(0).state_dict(), initial_model(1).state_dict()
    assert not torch.equal(rank0["3.weight"], rank1["3.weight"])
    for state in (r["state"] for r in ranks):
        assert torch.equal(state["3.weight"], rank0["3.weight"])  # frozen, broadcast from 0
        assert not torch.equal(state["0.weight"], rank0["0.weight"])  # trained
        assert state["1.num_batches_tracked"].item() == 8  # 4 steps of 2 micro-batches
    for key in ("0.weight", "1.weight", "5.bias"):
        assert torch.equal(ranks[0]["state"][key], ranks[1]["state"][key]), key


def test_the_readmes_quick_diff_equals_ddp_bit_for_bit() -> None:
    """README.md's first example, the diff of examples/ddp/quick_ddp.py against
    quick_gradmgr.py: both under torchrun print each rank's last loss and weights (``repr``,
    every bit), which must be the same lines, with the ranks' weights equal (they start
    from different seeds: the broadcast and the averaged gradients made them so)."""
    printed = {}
    for name in ("quick_ddp.py", "quick_gradmgr.py"):
        done = run(torchrun(os.path.join(EXAMPLE, name)), TIMEOUT_S)
        # found anywhere in the output: the ranks share torchrun's stdout, and their two
        # lines were once written into one (seen on torch 2.13)
        printed[name] = sorted(re.findall(r"rank \d: loss \S+ weight \[\[[^\]]*\]\]",
                                          done.stdout))
    assert len(printed["quick_ddp.py"]) == 2, printed
    assert printed["quick_gradmgr.py"] == printed["quick_ddp.py"]
    weights = {line.split(" weight ")[1] for line in printed["quick_ddp.py"]}
    assert len(weights) == 1, "the ranks' weights differ"
