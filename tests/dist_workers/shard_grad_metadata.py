"""Rank program: issue 39 item 5, what code written for DDP or FSDP2 reads of ``.grad`` after a
sharded backward (``data_parallel(model, shard=True)``), next to DDP's ``.grad`` of the same
parameters; each rank pickles what the parent checks to ``OUTDIR/rank{RANK}.pkl``.
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradmgr.distributed import ShardedOptimizer, data_parallel

from .outcomes import raised

# The attributes and metadata methods each .grad is asked, DDP's as the reference.
READS = {
    "shape": lambda g: tuple(g.shape),
    "size()": lambda g: tuple(g.size()),
    "size(0)": lambda g: g.size(0),
    "dtype": lambda g: g.dtype,
    "device": lambda g: g.device,
    "layout": lambda g: g.layout,
    "numel()": lambda g: g.numel(),
    "nelement()": lambda g: g.nelement(),
    "element_size()": lambda g: g.element_size(),
    "itemsize": lambda g: g.itemsize,
    "nbytes": lambda g: g.nbytes,
    "dim()": lambda g: g.dim(),
    "ndim": lambda g: g.ndim,
    "len()": len,
    "stride()": lambda g: g.stride(),
    "is_contiguous()": lambda g: g.is_contiguous(),
    "requires_grad": lambda g: g.requires_grad,
    "is_floating_point()": lambda g: g.is_floating_point(),
    "is_complex()": lambda g: g.is_complex(),
    "is_signed()": lambda g: g.is_signed(),
    "ndimension()": lambda g: g.ndimension(),
    "is_cuda": lambda g: g.is_cuda,
    "get_device()": lambda g: g.get_device(),
    "type()": lambda g: g.type(),
}
# Reads that need the values, which a rank does not hold.
REFUSED = {
    "sum()": lambda g: g.sum(),
    "norm()": lambda g: g.norm(),
    "g + 1": lambda g: g + 1,
    "g[0]": lambda g: g[0],
    "cpu()": lambda g: g.cpu(),
    "numpy()": lambda g: g.numpy(),
    "clone()": lambda g: g.clone(),
    "abs_()": lambda g: g.abs_(),
    "float()": lambda g: g.float(),
    "to(float64)": lambda g: g.to(torch.float64),
    "type(float64)": lambda g: g.type(torch.float64),
    "format .3f": lambda g: f"{g:.3f}",
    "data_ptr()": lambda g: g.data_ptr(),
    "isfinite": torch.isfinite,
}


class Net(nn.Module):
    """Float32 layers, then a float64 one (a bucket of its own dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3, bias=False))
        self.head = nn.Linear(3, 3).double()
        # A parameter laid out transposed: DDP's .grad takes its strides.
        weight = self.body[2].weight.detach()
        self.body[2].weight = nn.Parameter(weight.t().contiguous().t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).double())


def model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).square().mean()


def backward_both(gm, net: nn.Module, ddp: nn.Module, step: int, rank: int) -> None:
    """A synced backward of this rank's batch of ``step``, gradmgr's and DDP's."""
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + rank))
    with gm:
        gm.backward(loss_of(net, x))
    loss_of(ddp, x).backward()



def result(fn) -> object:
    """What ``fn()`` returns, or ``("raised", type name, message)`` (so that old code, where
    the reads raised, fails the parent's assertions, not the ranks)."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - what was raised is the result
        return "raised", type(error).__name__, str(error)


def read(grad: torch.Tensor) -> dict:
    return {name: result(lambda fn=fn: fn(grad)) for name, fn in READS.items()}


def accounted(net: nn.Module) -> int:
    """The memory-accounting habit of DDP and FSDP2 scripts."""
    return sum(p.grad.numel() * p.grad.element_size() for p in net.parameters()
               if p.grad is not None)


def main(rank: int, world: int, outdir: str) -> None:
    net, theirs = model(), model()
    gm = data_parallel(net, shard=True, bucket_bytes=300)
    opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=1e-2)
    ddp = DDP(theirs)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    out: dict = {"steps": []}
    for step in range(2):
        backward_both(gm, net, ddp, step, rank)
        grads = [p.grad for p in net.parameters()]
        out["steps"].append({
            "ours": [read(g) for g in grads],
            "ddp": [read(p.grad) for p in theirs.parameters()],
            "types": [type(g).__name__ for g in grads],
            "accounted": (result(lambda: accounted(net)), accounted(theirs)),
            "local": [result(lambda g=g: (g.local_range(), g.to_local().clone()))
                      for g in grads],
            "ddp_flat": [p.grad.detach().flatten().clone() for p in theirs.parameters()],
        })
        if step == 1:  # a write into to_local() is the gradient's: the step uses it
            for g, p in zip(grads, theirs.parameters()):
                result(lambda g=g: g.to_local().mul_(0.5))
                p.grad.mul_(0.5)
        out["steps"][-1].update({
            "total_norm": (float(nn.utils.get_total_norm(grads))
                           if hasattr(nn.utils, "get_total_norm") else None,
                           float(nn.utils.clip_grad_norm_(theirs.parameters(), 1e9))),
            "clip": (float(nn.utils.clip_grad_norm_(net.parameters(), 1e9)),
                     float(nn.utils.clip_grad_norm_(theirs.parameters(), 1e9))),
        })
        if step == 0:
            grad = grads[0]
            out["refused"] = {name: raised(lambda fn=fn, g=grad: fn(g))
                              for name, fn in REFUSED.items()}
            out["format"] = result(lambda g=grad: f"{g}")
        for o in (opt, ref):
            o.step()
            o.zero_grad()
        out["after_zero_grad"] = [p.grad is None for p in net.parameters()]
        out["stale"] = raised(lambda g=grads[0]: g.to_local())
    out["params"] = ([p.detach().clone() for p in net.parameters()],
                     [p.detach().clone() for p in theirs.parameters()])
    # model.zero_grad() and p.grad = None on the stand-ins, as today.
    with gm:
        gm.backward(loss_of(net, torch.randn(5, 8)))
    net.zero_grad()
    out["model_zero_grad"] = [p.grad is None for p in net.parameters()]
    with gm:
        gm.backward(loss_of(net, torch.randn(5, 8)))
    for p in net.parameters():
        p.grad = None
    out["set_none"] = [p.grad is None for p in net.parameters()]
    del opt, gm
    dist.barrier()
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
