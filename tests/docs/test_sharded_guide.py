"""docs/sharded.md's training loop, which shows only what a user writes, against DDP: the block
runs on 2 gloo ranks under torchrun and saves its model and optimizer state; REFERENCE trains the
same model on the same data with DistributedDataParallel, AdamW and the same scheduler, and
saves the same. The two must be equal bit for bit (``torch.equal``, no tolerance: with 2 ranks a
sum does not depend on the order of its terms, and the loop clips at a norm its gradients stay
below, so nothing is scaled). The reference must train as the block does: change both."""

from __future__ import annotations

import os

import pytest
from doc_blocks import blocks
from docs_helpers import run, torchrun

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
pytestmark = [pytest.mark.torch, pytest.mark.slow]
TIMEOUT_S = 240

REFERENCE = '''\
import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
ddp = DDP(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

torch.manual_seed(1 + rank)
for step in range(3):
    for micro in range(2):
        x = torch.randn(4, 8)
        with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
            (ddp(x).square().mean() / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 10.0)
    assert norm < 10.0, "the reference clipped: the runs may then differ in their last bits"
    opt.step()
    opt.zero_grad()
    scheduler.step()

if rank == 0:
    torch.save(opt.state_dict(), "optimizer.pt")
    torch.save(model.state_dict(), "model.pt")
dist.barrier()
del ddp
dist.destroy_process_group()
'''


def training_loop() -> str:
    """The block under "## A training loop" of docs/sharded.md."""
    found = blocks(os.path.join("docs", "sharded.md"))
    loop = next(b for b in found if "StepLR(opt" in b.text and b.marker == "2 ranks")
    return loop.text


def saved(folder) -> tuple:
    return (torch.load(folder / "model.pt", weights_only=True),
            torch.load(folder / "optimizer.pt", weights_only=True))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    found = {}
    for name, text in (("guide", training_loop()), ("DDP", REFERENCE)):
        folder = tmp_path_factory.mktemp(name)
        (folder / "train.py").write_text(text, encoding="utf-8")
        run(torchrun(str(folder / "train.py")), TIMEOUT_S, cwd=str(folder))
        found[name] = saved(folder)
    return found


def test_the_guides_loop_equals_ddp_bit_for_bit(runs) -> None:
    (model, optimizer), (ddp_model, ddp_optimizer) = runs["guide"], runs["DDP"]
    assert list(model) == list(ddp_model)
    for key, value in ddp_model.items():
        assert torch.equal(model[key], value), key
    assert optimizer["param_groups"] == ddp_optimizer["param_groups"]  # the scheduler's lr too
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    assert sorted(optimizer["state"]) == sorted(ddp_optimizer["state"]) == [0, 1, 2, 3]
    for index, state in ddp_optimizer["state"].items():
        for key, value in state.items():
            assert torch.equal(optimizer["state"][index][key], value), (index, key)


def test_the_comparison_can_fail(runs) -> None:
    """The model trained (so equal parameters mean something): not its initial weights."""
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                  torch.nn.Linear(32, 2)).state_dict()
    model, _ = runs["guide"]
    assert not torch.equal(model["0.weight"], initial["0.weight"])
