"""Rank 0's peak memory while saving a ZeRO-2 checkpoint (issue 39): distributed checkpoints
(``gradmgr.distributed.get_state_dict`` + ``torch.distributed.checkpoint.save``, each rank
writing its own slices) against the gathered ``opt.state_dict()`` (every rank gathers the whole
optimizer state; rank 0 ``torch.save``s it with the model's ``state_dict()``); and the same
model under full sharding (``data_parallel(model, shard="full")``, a plain AdamW over its
FSDP2 shards) saved with ``get_state_dict`` + ``dcp.save`` (torch's own functions for FSDP2).

Model: 4 x ``nn.Linear(1024, 1024)`` (16 MiB of fp32 parameters, 32 MiB of AdamW state in
all), ``data_parallel(model, shard=True)`` + ``ShardedOptimizer(gm, AdamW)``, 2 steps, gloo on
the CPU, one thread per rank. Each variant and round runs in fresh processes; glibc is told to
mmap blocks of 128 KiB and more, so that freed tensors leave the resident set. On each rank,
after the steps and a barrier: RSS (the base) and the peak RSS reset to it; then the save
(both the model and the optimizer, into a fresh folder); then the peak RSS minus the base,
rank 0's is reported. A DCP load of the checkpoint on the same ranks must give back every
optimizer tensor bit for bit (through the gathered ``state_dict()``), or the run fails.

    python bench/bench_dcp.py [--worlds 2 4] [--rounds R]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MMAP_THRESHOLD, allocator, machine_info, peak_rss, reset_peak_rss, rss  # noqa: E402

from gradmgr.distributed import (  # noqa: E402
    ShardedOptimizer,
    data_parallel,
    get_state_dict,
    set_state_dict,
    spawn_local,
)

WIDTH, LAYERS = 1024, 4
MIB = 2**20


def optimizer(gm, net: nn.Module, variant: str) -> torch.optim.Optimizer:
    if variant == "full":
        return torch.optim.AdamW(net.parameters(), lr=1e-4)
    return ShardedOptimizer(gm, torch.optim.AdamW, lr=1e-4)


def trained(variant: str) -> tuple:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    gm = data_parallel(net, shard="full" if variant == "full" else True)
    opt = optimizer(gm, net, variant)
    for step in range(2):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step + dist.get_rank()))
        with gm:
            gm.backward(net(x).square().mean())
        opt.step()
        opt.zero_grad()
    return net, gm, opt


def save(variant: str, net: nn.Module, opt: ShardedOptimizer, folder: str) -> None:
    if variant in ("dcp", "full"):
        model_state, optim_state = get_state_dict(net, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    else:
        state = opt.state_dict()  # every rank gathers
        if dist.get_rank() == 0:
            torch.save({"model": net.state_dict(), "optim": state},
                       os.path.join(folder, "checkpoint.pt"))


def reloads(net: nn.Module, gm, opt: ShardedOptimizer, folder: str, variant: str) -> bool:
    """The DCP checkpoint into a fresh optimizer: every tensor of the state bit for bit (under
    full sharding, this rank's shards of it)."""
    want = opt.state_dict()
    fresh = optimizer(gm, net, variant)
    model_state, optim_state = get_state_dict(net, fresh)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    set_state_dict(net, fresh, model_state_dict=model_state, optim_state_dict=optim_state)
    got = fresh.state_dict()
    return all(torch.equal(_local(got["state"][i][k]), _local(v))
               for i in want["state"] for k, v in want["state"][i].items())


def _local(value) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else torch.as_tensor(value)


def rank_main(rank: int, world: int, port: int, variant: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # ShardedTensor's and the collectives' deprecations
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        net, gm, opt = trained(variant)
        gc.collect()
        dist.barrier()
        base = rss()
        reset_peak_rss()
        save(variant, net, opt, folder)
        peak = peak_rss() - base
        dist.barrier()
        exact = reloads(net, gm, opt, folder, variant) if variant != "gathered" else True
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"peak": peak, "exact": exact}, f)
        del opt, gm
    finally:
        dist.destroy_process_group()


def measure(variant: str, world: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-dcp-") as tmp:
        folder, out = os.path.join(tmp, "checkpoint"), os.path.join(tmp, "out.json")
        os.makedirs(folder)
        if spawn_local(rank_main, world, variant, folder, out):
            raise SystemExit(f"{variant} on {world} ranks failed")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(machine_info(["torch"]))
    print(f"{LAYERS} x Linear({WIDTH}), AdamW; rank 0's peak RSS above the base during the "
          f"save, MiB, median of {args.rounds} rounds (least-most)")
    print("| ranks | gathered `state_dict()` + `torch.save` | DCP | DCP / gathered | 1/N "
          "| full sharding, DCP | full / gathered |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for world in args.worlds:
        peaks: dict = {"gathered": [], "dcp": [], "full": []}
        for _ in range(args.rounds):
            for variant in peaks:
                with allocator(MMAP_THRESHOLD):  # rank 0's peak RSS is measured
                    result = measure(variant, world)
                if not result["exact"]:
                    raise SystemExit(f"the DCP checkpoint on {world} ranks did not load back "
                                     "bit for bit")
                peaks[variant].append(result["peak"] / MIB)
        med = {k: statistics.median(v) for k, v in peaks.items()}
        cell = {k: f"{med[k]:.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in peaks.items()}
        print(f"| {world} | {cell['gathered']} | {cell['dcp']} | "
              f"{med['dcp'] / med['gathered']:.3f} | {1 / world:.3f} | {cell['full']} | "
              f"{med['full'] / med['gathered']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
