"""One rank of the Lightning Fabric tests: ``python -m dist_workers.fabric_suite RANK OUTDIR
SCENARIO...``, started by tests/test_lightning.py with Fabric's environment variables
(LOCAL_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT), so that Fabric launches nothing itself.

Each scenario trains the same script, seeds and data with Fabric's own ``DDPStrategy`` and with
``GradmgrStrategy`` on each of its paths, and saves every side's losses, gradient norms and
final parameters (``rank{RANK}.pkl``: {scenario: {side: result}}), or the error a side raised.
"""

from __future__ import annotations

import copy
import datetime
import io
import os
import pickle
import sys
import traceback
import warnings

import torch

TIMEOUT = datetime.timedelta(seconds=60)
STEPS = 4


def sides(scenario: str) -> dict:
    from lightning_fabric.strategies import DDPStrategy

    from gradmgr.integrations.lightning import GradmgrStrategy

    # DDP needs find_unused_parameters for a layer no forward uses; gradmgr finds them always.
    unused = scenario == "frozen_unused"
    out = {
        "ddp": lambda: DDPStrategy(timeout=TIMEOUT, find_unused_parameters=unused),
        "native": lambda: GradmgrStrategy(timeout=TIMEOUT),
        "buckets": lambda: GradmgrStrategy(timeout=TIMEOUT, native=False),
    }
    if scenario in ("sgd", "adam", "accumulate", "clip_norm", "frozen_unused", "scheduler"):
        out["sharded"] = lambda: GradmgrStrategy(timeout=TIMEOUT, shard=True)
    return out


class Net(torch.nn.Module):
    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.norm = torch.nn.BatchNorm1d(16) if batchnorm else torch.nn.Identity()
        self.fc2 = torch.nn.Linear(16, 16)
        self.fc3 = torch.nn.Linear(16, 1)
        self.unused = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.norm(self.fc1(x))))))


def _batches(rank: int, count: int) -> list:
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(count)]


def _model(scenario: str, rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)  # different weights on each rank, until the strategy broadcasts
    model = Net(batchnorm=scenario.startswith("skipped"))
    if scenario != "frozen_unused":
        del model.unused  # DDPStrategy's default would refuse it
    else:
        model.fc1.requires_grad_(False)
    return model


def _optimizer(scenario: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters()]
    if scenario in ("sgd", "scheduler") or scenario.startswith("skipped"):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def train(scenario: str, strategy, rank: int) -> dict:
    from lightning_fabric import Fabric

    if scenario == "gan":
        return train_gan(strategy, rank)
    precision = "bf16-mixed" if scenario == "bf16_mixed" else "32-true"
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)
    fabric.launch()
    model = _model(scenario, rank)
    opt = _optimizer(scenario, model)
    # issue 38: a scheduler made before fabric.setup, as many scripts do
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5) if scenario == "scheduler" else None
    model, opt = fabric.setup(model, opt)
    losses, norms, evals = [], [], []
    skips = scenario in ("skipped", "skipped_accumulate")
    micro = 2 if scenario in ("accumulate", "skipped_accumulate") else 1
    data = iter(_batches(rank, STEPS * micro * 2))
    x_eval = _batches(7 + rank, 1)[0][0]

    def evaluate():  # in eval mode: BatchNorm's running statistics show in the output
        model.eval()
        with torch.no_grad():
            evals.append(model(x_eval).numpy())
        model.train()

    for _ in range(STEPS):
        if skips:
            x, y = next(data)
            model(x)  # a forward whose backward never comes (a skipped batch)
            evaluate()  # DDP broadcasts rank 0's buffers here, after a synced forward
            with torch.no_grad():
                model(x)  # in training mode: updates this rank's statistics
        for m in range(micro):
            x, y = next(data)
            with fabric.no_backward_sync(model, enabled=m < micro - 1):
                loss = torch.nn.functional.mse_loss(model(x), y) / micro
                fabric.backward(loss)
            losses.append(loss.item())
            if skips and m < micro - 1:
                evaluate()  # DDP broadcasts nothing here: each rank's own statistics
        if scenario == "clip_norm":
            norms.append(float(fabric.clip_gradients(model, opt, max_norm=0.05)))
        if scenario == "clip_val":
            fabric.clip_gradients(model, opt, clip_val=0.01)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    evaluate()
    inner = model.module  # Fabric's: the user's module, not DDP's or gradmgr's wrapper
    params = {n: p.detach().clone().numpy() for n, p in inner.named_parameters()}
    params.update({f"buffer:{n}": b.clone().numpy() for n, b in inner.named_buffers()})
    params.update(_copies(inner))
    path = os.path.join(os.environ["FABRIC_CKPT_DIR"], f"{scenario}-{type(strategy).__name__}")
    fabric.save(path, {"model": model, "opt": opt})
    state = {"model": model}
    fabric.load(path, state)  # the model's own keys, loaded into it
    keys = sorted(torch.load(path, weights_only=True)["model"])
    return {"losses": losses, "norms": norms, "params": params, "evals": evals, "keys": keys}


def _copies(inner: torch.nn.Module) -> dict:
    """Issue 38: an EMA copy (``copy.deepcopy``) and a snapshot (``torch.save``) of the
    user's module, DDP's ``module``: their parameters, and how many forward hooks they carry
    (none under DDP: a plain model)."""
    buf = io.BytesIO()
    torch.save(inner, buf)
    buf.seek(0)
    out = {}
    for label, twin in (("deepcopy", copy.deepcopy(inner)),
                        ("saved", torch.load(buf, weights_only=False))):
        out[f"{label} hooks"] = torch.tensor(len(twin._forward_hooks)).numpy()
        out.update({f"{label}:{n}": p.detach().numpy() for n, p in twin.named_parameters()})
    return out


def train_gan(strategy, rank: int) -> dict:
    """A generator trained through a discriminator: two modules set up, the generator's
    forward waiting while the discriminator steps, fabric.backward(loss, model=...)."""
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(rank)
    gen = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    disc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    gen, opt_g = fabric.setup(gen, torch.optim.Adam(gen.parameters(), lr=1e-2))
    disc, opt_d = fabric.setup(disc, torch.optim.Adam(disc.parameters(), lr=1e-2))
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    g = torch.Generator().manual_seed(2000 + rank)
    losses = []
    for _ in range(STEPS):
        z, real = torch.randn(8, 3, generator=g), torch.randn(8, 4, generator=g)
        fake = gen(z)
        opt_d.zero_grad()  # the generator's last backward computed these with DDP
        d_loss = bce(disc(real), torch.ones(8, 1)) + bce(disc(fake.detach()), torch.zeros(8, 1))
        fabric.backward(d_loss, model=disc)
        opt_d.step()
        g_loss = bce(disc(fake), torch.ones(8, 1))
        fabric.backward(g_loss, model=gen)
        opt_g.step()
        opt_g.zero_grad()
        losses += [d_loss.item(), g_loss.item()]
    params = {f"{name}.{n}": p.detach().clone().numpy()
              for name, net in (("gen", gen), ("disc", disc))
              for n, p in net.module.named_parameters()}
    return {"losses": losses, "norms": [], "params": params, "evals": [], "keys": []}


def _raised(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test checks its type and message
        traceback.print_exc()  # in the rank's log
        return f"{type(error).__name__}: {error}"
    return "nothing raised"


def misuses(rank: int) -> dict:
    """What each misuse raises, on every rank, with nothing communicated."""
    from lightning_fabric import Fabric

    from gradmgr.integrations.lightning import GradmgrStrategy

    def setup(**options):
        fabric = Fabric(accelerator="cpu", devices=2,
                        strategy=GradmgrStrategy(timeout=TIMEOUT, **options))
        fabric.launch()
        model = _model("adam", rank)
        model, opt = fabric.setup(model, _optimizer("adam", model))
        return fabric, model, opt

    x, y = _batches(rank, 1)[0]
    fabric, model, opt = setup()

    def backward_after_no_grad_forward():
        with torch.no_grad():
            model(x)
        fabric.backward(model.module(x).sum())  # the user's module, not Fabric's

    def backward_with_retain_graph():
        fabric.backward(model(x).sum(), retain_graph=True)

    out = {"unknown option": _raised(lambda: GradmgrStrategy(find_unused_parameters=True)),
           "backward without a recording": _raised(backward_after_no_grad_forward),
           "retain_graph": _raised(backward_with_retain_graph)}
    fabric, model, opt = setup()

    def backward_of_two_waiting_modules():
        other = fabric.setup(_model("adam", rank))
        fabric.backward((model(x) + other(x)).sum())  # whose step is this?

    out["two modules waiting"] = _raised(backward_of_two_waiting_modules)

    def backward_outside_the_forwards_no_backward_sync():
        fabric.backward(torch.nn.functional.mse_loss(model(x), y), model=model)  # clean up
        loss = model(x).sum()
        with fabric.no_backward_sync(model):
            fabric.backward(loss, model=model)

    out["forward outside no_backward_sync"] = _raised(
        backward_outside_the_forwards_no_backward_sync)
    fabric, model, opt = setup(shard=True)
    fabric.backward(torch.nn.functional.mse_loss(model(x), y))
    out["sharded clip_val"] = _raised(lambda: fabric.clip_gradients(model, opt, clip_val=1.0))
    opt.step()
    stepped = torch.optim.Adam(model.module.parameters())  # an optimizer that has stepped:
    stepped.state[next(iter(stepped.param_groups[0]["params"]))]["step"] = torch.tensor(1.0)
    out["sharded optimizer with state"] = _raised(lambda: fabric.setup_optimizers(stepped))
    other = torch.optim.Adam(_model("adam", rank).parameters())
    out["sharded optimizer of another model"] = _raised(lambda: fabric.setup_optimizers(other))
    return out


def _plain(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = Net()
    del model.unused
    return model


def full_shard(rank: int) -> dict:
    """GradmgrStrategy(shard="full") next to plain FSDP2 (fully_shard on each Linear, then
    the root; loss.backward(); set_requires_gradient_sync for the accumulation) in the same
    process, on the same data: each micro-batch's loss and every parameter shard after the
    steps, compared bit for bit; and what full sharding refuses."""
    from lightning_fabric import Fabric
    from torch.distributed.fsdp import fully_shard

    from gradmgr.integrations.lightning import GradmgrStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=GradmgrStrategy(
        timeout=TIMEOUT, shard="full", blocks=[torch.nn.Linear]))
    fabric.launch()
    early = _plain(0)
    out = {"optimizer made before": _raised(lambda: fabric.setup(
        early, torch.optim.Adam(early.parameters(), lr=1e-2)))}
    model = fabric.setup_module(_plain(0))
    made = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(made, 1, 0.5)  # before Fabric's, as usual
    opt = fabric.setup_optimizers(made)
    ref = _plain(0)
    for layer in (ref.fc1, ref.fc2, ref.fc3, ref):
        fully_shard(layer)
    for layer in (ref.fc1, ref.fc2, ref.fc3, ref):  # FSDP2 averaging correctly over gloo
        layer.set_force_sum_reduction_for_comms(True)  # (its average is the sum on torch 2.8)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5)
    data, losses, clipped, rates = _batches(rank, STEPS * 2), [], [], []
    for step in range(STEPS):
        for m in range(2):
            x, y = data[2 * step + m]
            with fabric.no_backward_sync(model, enabled=m == 0):
                loss = torch.nn.functional.mse_loss(model(x), y) / 2
                fabric.backward(loss)
            ref.set_requires_gradient_sync(m == 1)
            theirs = torch.nn.functional.mse_loss(ref(x), y) / 2
            theirs.backward()
            losses.append(torch.equal(loss.detach(), theirs.detach()))
        clipped.append(_clip_both(fabric, model, opt, ref, by_norm=step < 2))
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            opt.step()
            opt.zero_grad()
            scheduler.step()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_scheduler.step()
        rates.append((opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"],
                      [str(w.message) for w in warned]))
    out["losses"], out["clipped"], out["rates"] = losses, clipped, rates
    out["shards"] = [torch.equal(a.to_local(), b.to_local())
                     for a, b in zip(model.parameters(), ref.parameters())]
    out["moved"] = any(not torch.equal(a.full_tensor(), b)
                       for a, b in zip(model.parameters(), _plain(0).parameters()))
    out["resumed"] = _resumed(fabric, model, opt,
                              os.path.join(os.environ["FABRIC_CKPT_DIR"], "full_shard"))
    return out


CLIP_NORM, CLIP_VALUE = 0.05, 0.01  # below this script's gradients: both clip


def _clip_both(fabric, model, opt, ref, by_norm: bool) -> tuple:
    """fabric.clip_gradients on gradmgr's side, torch's clip on plain FSDP2's (as Fabric's
    FSDP2 strategy does): (whether the norms, then the clipped gradient shards, are equal bit
    for bit; whether clipping changed anything)."""
    if by_norm:
        ours = fabric.clip_gradients(model, opt, max_norm=CLIP_NORM)
        theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP_NORM)
        same_norm = torch.equal(ours.full_tensor(), theirs.full_tensor())
        cut = bool(theirs.full_tensor() > CLIP_NORM)
    else:
        cut = any(bool(p.grad.to_local().abs().max() > CLIP_VALUE) for p in ref.parameters())
        fabric.clip_gradients(model, opt, clip_val=CLIP_VALUE)
        torch.nn.utils.clip_grad_value_(ref.parameters(), CLIP_VALUE)
        same_norm = True
    same = all(torch.equal(a.grad.to_local(), b.grad.to_local())
               for a, b in zip(model.parameters(), ref.parameters()))
    return same_norm, same, cut


def _shards(model, opt) -> list:
    """This rank's parameter shards and optimizer state, as local tensors."""
    local = [p.to_local().clone() for p in model.parameters()]
    for p in model.parameters():
        local += [v.to_local().clone() if hasattr(v, "to_local") else v.clone()
                  for _, v in sorted(opt.state[p].items())]
    return local


def _fabric_steps(fabric, model, opt, steps: range) -> None:
    data = _batches(fabric.global_rank, STEPS * 2 + 4)
    for step in steps:
        x, y = data[step]
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()


def _resumed(fabric, model, opt, path: str) -> dict:
    """fabric.save after the steps, two more steps (the uninterrupted run); fabric.load into
    a new set-up pair, which had stepped elsewhere, and the same two steps: every shard and
    state tensor bit for bit, and the user's metadata back."""
    fabric.save(path, {"model": model, "optimizer": opt, "step": STEPS})
    saved = _shards(model, opt)
    _fabric_steps(fabric, model, opt, range(STEPS * 2, STEPS * 2 + 2))
    uninterrupted = _shards(model, opt)
    other = fabric.setup_module(_plain(1))
    other_opt = fabric.setup_optimizers(torch.optim.Adam(other.parameters(), lr=1e-2))
    _fabric_steps(fabric, other, other_opt, range(1))  # state of its own, to be replaced
    state = {"model": other, "optimizer": other_opt, "step": 0}
    remainder = fabric.load(path, state)
    loaded = _shards(other, other_opt)
    _fabric_steps(fabric, other, other_opt, range(STEPS * 2, STEPS * 2 + 2))
    return {"step": state["step"], "remainder": sorted(remainder),
            "loaded": [torch.equal(a, b) for a, b in zip(loaded, saved)],
            "resumed": [torch.equal(a, b) for a, b in zip(_shards(other, other_opt),
                                                          uninterrupted)],
            "count": (len(saved), len(loaded))}


def main(rank: int, outdir: str, scenarios: list) -> None:
    torch.set_num_threads(1)
    results: dict = {}
    for scenario in scenarios:
        if scenario in ("misuses", "full_shard"):
            results[scenario] = (misuses if scenario == "misuses" else full_shard)(rank)
            continue
        results[scenario] = {}
        for side, make in sides(scenario).items():
            try:
                results[scenario][side] = train(scenario, make(), rank)
            except Exception as error:  # noqa: BLE001 - the test shows it, with its side
                results[scenario][side] = {"error": f"{type(error).__name__}: {error}"}
                traceback.print_exc()
                torch.distributed.barrier()
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
