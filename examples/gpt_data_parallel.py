"""A small GPT trained data-parallel on 2 CPU ranks: PyTorch DDP and gradmgr side by side.

What a DDP training script does, written both ways from the same seed on every rank:

* a character-level GPT (token and position embeddings, pre-LayerNorm blocks of causal
  self-attention and an MLP, output head tied to the token embedding) over a short embedded
  text, each rank reading its own batches;
* ranks seeded *differently* on purpose: ``DistributedDataParallel(model)`` broadcasts rank 0's
  parameters and buffers when it wraps the model, ``gradmgr.distributed.data_parallel(model)``
  does the same, so both still train one model;
* gradient accumulation over ``--accum`` micro-batches, the first ones without communication
  (``ddp.no_sync()`` / ``gradmgr.distributed.no_sync(gm)`` around the whole ``with gm:``);
* ``torch.nn.utils.clip_grad_norm_``, AdamW, and bfloat16 autocast on the CPU
  (``--no-autocast`` turns it off).

``--by-hand`` sets gradmgr up without ``data_parallel()``:
``GradManager().attach(model.parameters(), callbacks=[make_allreduce_cb("mean")])``, which
broadcasts rank 0's parameters at the first recording, and ``broadcast(model.buffers())`` once.

``--shard`` trains gradmgr's side sharded (ZeRO-2): ``data_parallel(model, shard=True)``
reduce-scatters the gradients, so each rank keeps its slice of them only, and
``ShardedOptimizer(gm, torch.optim.AdamW, ...)`` keeps AdamW's state for that slice, steps it,
and all-gathers the parameters; clipping is ``opt.clip_grad_norm_`` (the norm over every
rank's slices), since ``.grad`` stays None. (With ``--by-hand``: ``make_reduce_scatter_cb``.)

Rank 0 prints, for every step and rank, that rank's loss (the mean over its micro-batches) and
the loss averaged over the ranks, DDP's and gradmgr's, then both gradient norms. The script
exits non-zero unless at every step gradmgr's losses, gradient norms and parameters equal DDP's
bit for bit (``==`` and ``torch.equal``, no tolerance) on every rank and all ranks agree. It
needs exactly 2 ranks: a sum of two numbers does not depend on the order of its terms, while
with 3 or more ranks the order in which gloo adds the ranks' values depends on where a gradient
sits in its bucket, and DDP lays out its buckets differently from gradmgr, so the two agree
only to rounding (the ranks still agree with each other exactly).

With ``--shard`` the same holds, bit for bit, with two exceptions, both from the gradient norm:
``opt.clip_grad_norm_`` sums the same float32 squares in another order (each rank's slices,
then an allreduce, where torch takes the norm of per-parameter norms), so it equals torch's to
``NORM_RTOL`` (two float32 sums part by about 1e-5 relative at a million elements, torch's the
farther from the float64 norm: see docs/sharded.md); and where it is above ``--clip``, the
factor that scales the gradients may differ from torch's in its last bit. The parameters after
that step are then DDP's to ``STEP_RTOL`` (relative 2-norm of the difference; measured here:
about 1e-8), and from there on the two runs are apart by rounding, as two DDP runs are whose
gradients once differ in their last bit (measured with the defaults: scaling DDP's step-0
gradients by 1 + 2**-23 gives rank 0 the sharded run's losses at steps 1 and 2, digit for
digit). These differences grow over the steps: AdamW divides by the root of its second moment,
so elements whose gradients are near zero move by up to the learning rate, and under bf16
autocast a weight that moved a little may round to another bf16 value. From that step on the
script checks that the ranks agree bit for bit, and prints both runs' numbers. ``--clip 100``
(no step clips) keeps everything but the norm bit for bit.

Run it either way:
    python examples/gpt_data_parallel.py --steps 5      # spawns the 2 ranks itself
    python examples/gpt_data_parallel.py --steps 5 --shard
    torchrun --nproc_per_node 2 examples/gpt_data_parallel.py --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import math
import sys
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from gradmgr import GradManager
from gradmgr.distributed import (
    ShardedOptimizer,
    broadcast,
    data_parallel,
    make_allreduce_cb,
    make_reduce_scatter_cb,
    no_sync,
    run_ranks,
)

WORLD = 2
TEXT = """\
the lighthouse keeper counts the waves at night. one, two, three, and the fourth is always
larger. he writes the numbers in a book with a green cover, and in the morning he reads them
back to the gulls, who do not care. the book is nearly full. when it is full he will start
another one, with a blue cover, and count the waves again, because the sea has not stopped
and neither has he. some nights the fog comes in so thick that he cannot see the water, and
then he counts by sound: a hush, a crash, a long pull of pebbles going back. those pages are
marked with a small circle. there are more circles every year.
"""


# ------------------------------------------------------------------------------- the model
class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        # a fixed lower-triangular mask: position t attends to positions <= t only
        causal = torch.ones(context, context, dtype=torch.bool).tril()
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        q, k, v = (z.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(dim // self.heads)
        scores = scores.masked_fill(~self.causal[:length, :length], float("-inf"))
        mixed = scores.softmax(dim=-1) @ v
        return self.out(mixed.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, context)
        self.ln_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4,
                 context: int = 32) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads, context) for _ in range(layers)))
        self.ln_out = nn.LayerNorm(dim)
        for block in self.blocks:  # residual branches start small
            for proj in (block.attn.out, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * layers))
        nn.init.normal_(self.token.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.blocks(self.token(tokens) + self.position(positions))
        return self.ln_out(x) @ self.token.weight.t()  # output head tied to the embedding


# ------------------------------------------------------------------------------- data
class Text:
    """The embedded text as token ids; every (step, micro-batch, rank) reads its own windows."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.ids = torch.tensor([self.chars.index(c) for c in text])

    def batch(self, step: int, micro: int, rank: int, size: int,
              context: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(((step * 64) + micro) * 64 + rank)
        starts = torch.randint(len(self.ids) - context - 1, (size,), generator=g)
        x = torch.stack([self.ids[s:s + context] for s in starts.tolist()])
        y = torch.stack([self.ids[s + 1:s + context + 1] for s in starts.tolist()])
        return x, y


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # float32 under autocast


def bf16_autocast_works() -> bool:
    """Whether this CPU runs a bfloat16 matmul under ``torch.autocast("cpu")``."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.ones(2, 2) @ torch.ones(2, 2)
        return out.dtype == torch.bfloat16 and bool((out == 2).all())
    except (RuntimeError, TypeError):
        return False


# ------------------------------------------------------------------------------- one step
def micro_batches(accum: int, pause) -> Iterator[Tuple[int, contextlib.AbstractContextManager]]:
    """(index, context) per micro-batch: ``pause`` (no communication) for all but the last."""
    for micro in range(accum):
        yield micro, (pause() if micro < accum - 1 else contextlib.nullcontext())


def step_ddp(ddp: DistributedDataParallel, opt: torch.optim.Optimizer, batches: list,
             args: argparse.Namespace) -> Tuple[torch.Tensor, torch.Tensor]:
    total = torch.zeros(())
    for micro, sync_or_not in micro_batches(len(batches), ddp.no_sync):
        x, y = batches[micro]
        with sync_or_not:
            loss = loss_of(ddp, x, y, args.autocast) / len(batches)
            loss.backward()
        total += loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total, norm


def accumulate(model: nn.Module, gm, batches: list, args: argparse.Namespace) -> torch.Tensor:
    """gradmgr's forward and backward of every micro-batch; the loss summed over them."""
    total = torch.zeros(())
    for micro, sync_or_not in micro_batches(len(batches), lambda: no_sync(gm)):
        x, y = batches[micro]
        # no_sync is entered before the recording starts: that is when its flag is read
        with sync_or_not, gm:
            loss = loss_of(model, x, y, args.autocast) / len(batches)
            gm.backward(loss)  # the last micro-batch's backward reduces across the ranks
        total += loss.detach()
    return total


def step_gradmgr(model: nn.Module, gm, opt: torch.optim.Optimizer, batches: list,
                 args: argparse.Namespace) -> Tuple[torch.Tensor, torch.Tensor]:
    total = accumulate(model, gm, batches, args)  # .grad: the mean over the ranks
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total, norm


def step_sharded(model: nn.Module, gm, opt: ShardedOptimizer, batches: list,
                 args: argparse.Namespace) -> Tuple[torch.Tensor, torch.Tensor]:
    total = accumulate(model, gm, batches, args)  # this rank's slice of the mean; .grad None
    norm = opt.clip_grad_norm_(args.clip)  # the norm over every rank's slices
    opt.step()  # AdamW on this rank's slice, then the ranks all-gather the parameters
    opt.zero_grad()
    return total, torch.tensor(norm)


def setup_gradmgr(model: nn.Module, args: argparse.Namespace) -> tuple:
    """gradmgr's manager, its optimizer (AdamW, as DDP's) and the step function."""
    if args.by_hand:  # the parameters are broadcast at the first recording, the buffers now
        reduce = make_reduce_scatter_cb if args.shard else make_allreduce_cb
        gm = GradManager().attach(model.parameters(), callbacks=[reduce("mean")])
        broadcast(model.buffers())
    else:  # broadcasts now and attaches the parameters with a callback that reduces them
        gm = data_parallel(model, shard=args.shard)
    if args.shard:  # AdamW over this rank's slice of the parameters: its state is that size
        opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
        return gm, opt, step_sharded
    return gm, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1), step_gradmgr


# ------------------------------------------------------------------------------- checking
NORM_RTOL, STEP_RTOL = 1e-5, 1e-6  # --shard only: see the module's docstring


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gather(values: List[float], world: int) -> List[List[float]]:
    """Every rank's ``values`` (float64, so float32 numbers arrive unchanged)."""
    mine = torch.tensor(values, dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    return [row.tolist() for row in rows]


def clipping_scaled(row: List[float], max_norm: float) -> bool:
    """Whether DDP's or gradmgr's clipping scaled the gradients (as clip_grad_norm_ decides)."""
    return any(max_norm / (norm + 1e-6) < 1.0 for norm in row[4:6])


class Comparison:
    """gradmgr's numbers against DDP's, on this rank: losses, gradient norms and parameters
    after every step with ``==`` and ``torch.equal``. Under ``--shard``: gradient norms to
    ``NORM_RTOL``; the parameters after the first step whose clipping scaled to ``STEP_RTOL``;
    from then on, only the ranks against each other."""

    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        self.rank, self.args = rank, args
        self.failures: List[str] = []
        self.same_weights = True  # gradmgr's parameters are still DDP's, bit for bit
        self.apart_from: Optional[int] = None  # the step after which they are not
        self.drift = 0.0  # how far apart then: relative 2-norm of the difference

    def check(self, ok: bool, what: str) -> None:
        if not ok and len(self.failures) < 10:
            self.failures.append(f"rank {self.rank}: {what}")

    def step(self, step: int, rows: List[List[float]], ours: torch.Tensor,
             ddp: torch.Tensor) -> None:
        """``rows``: every rank's losses and norms; ``ours``, ``ddp``: the parameters now."""
        l_ddp, l_gm, m_ddp, m_gm, n_ddp, n_gm = rows[self.rank]
        self.check(m_gm == rows[0][3], f"step {step}: mean loss {m_gm!r} != rank 0's")
        self.check(n_gm == rows[0][5], f"step {step}: gradient norm {n_gm!r} != rank 0's")
        if not self.same_weights:
            return
        self.check(l_gm == l_ddp, f"step {step}: loss {l_gm!r} != DDP's {l_ddp!r}")
        self.check(m_gm == m_ddp, f"step {step}: mean loss {m_gm!r} != DDP's {m_ddp!r}")
        if self.args.shard:
            self.check(math.isclose(n_gm, n_ddp, rel_tol=NORM_RTOL),
                       f"step {step}: gradient norm {n_gm!r} is not DDP's {n_ddp!r} to rel "
                       f"{NORM_RTOL}")
        else:
            self.check(n_gm == n_ddp, f"step {step}: gradient norm {n_gm!r} != DDP's {n_ddp!r}")
        if self.args.shard and clipping_scaled(rows[0], self.args.clip):
            self.same_weights, self.apart_from = False, step
            self.drift = float((ours - ddp).norm() / ddp.norm())
            self.check(self.drift <= STEP_RTOL, f"step {step}: parameters differ from DDP's "
                                                f"by {self.drift:.2g} (relative 2-norm)")
        else:
            self.check(torch.equal(ours, ddp), f"step {step}: parameters differ from DDP's")

    def final(self, ours: torch.Tensor, world: int) -> None:
        copies = [torch.empty_like(ours) for _ in range(world)]
        dist.all_gather(copies, ours)
        self.check(all(torch.equal(copies[0], c) for c in copies),
                   "ranks ended with different parameters")

    def memory(self, rows: List[List[float]]) -> None:
        """Each rank's (DDP's AdamW state, ShardedOptimizer's): about half of it each."""
        full, sharded = rows[0][0], [row[1] for row in rows]
        self.check(max(sharded) < 0.6 * full and sum(sharded) >= full,
                   f"ShardedOptimizer's AdamW state {sharded} bytes, DDP's {full}")


# ------------------------------------------------------------------------------- training
def train(rank: int, world: int, args: argparse.Namespace) -> bool:
    text = Text(TEXT)
    torch.manual_seed(args.seed + rank)  # different weights on every rank, on purpose
    model = TinyGPT(len(text.chars), args.dim, args.layers, args.heads, args.context)
    own_start = flat_params(model)
    ddp_model, gm_model = copy.deepcopy(model), copy.deepcopy(model)

    ddp = DistributedDataParallel(ddp_model)  # broadcasts rank 0's parameters and buffers
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.1)
    gm, opt_gm, step_gm = setup_gradmgr(gm_model, args)

    starts = [torch.empty_like(own_start) for _ in range(world)]
    dist.all_gather(starts, own_start)
    compare = Comparison(rank, args)
    compare.check(not torch.equal(starts[0], starts[1]), "the ranks were seeded alike")
    compare.check(torch.equal(flat_params(ddp_model), starts[0]),
                  "DDP did not broadcast rank 0's parameters")
    compare.check(args.by_hand or torch.equal(flat_params(gm_model), starts[0]),
                  "data_parallel() did not broadcast rank 0's parameters")
    if rank == 0:
        print_setup(model, text, world, args)

    for step in range(args.steps):
        batches = [text.batch(step, m, rank, args.batch, args.context)
                   for m in range(args.accum)]
        loss_ddp, norm_ddp = step_ddp(ddp, opt_ddp, batches, args)
        loss_gm, norm_gm = step_gm(gm_model, gm, opt_gm, batches, args)
        means = torch.stack([loss_ddp, loss_gm])  # float32, like the losses
        dist.all_reduce(means)
        means /= world
        rows = gather([loss_ddp.item(), loss_gm.item(), *means.tolist(),
                       norm_ddp.item(), norm_gm.item()], world)
        compare.step(step, rows, flat_params(gm_model), flat_params(ddp_model))
        if rank == 0:
            print_step(step, rows, args)

    compare.final(flat_params(gm_model), world)
    memory = gather([state_bytes(opt_ddp), opt_gm.memory()["optimizer"] if args.shard else 0],
                    world)
    if args.shard:
        compare.memory(memory)
    return report(compare, rank, world, args, memory)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """The bytes of an optimizer's state tensors (AdamW: two moments and a step count)."""
    return sum(v.numel() * v.element_size() for state in opt.state.values()
               for v in state.values() if torch.is_tensor(v))


# ------------------------------------------------------------------------------- printing
def print_setup(model: nn.Module, text: Text, world: int, args: argparse.Namespace) -> None:
    params = sum(p.numel() for p in model.parameters())
    how = "make_reduce_scatter_cb" if args.shard else "make_allreduce_cb"
    how = how if args.by_hand else "data_parallel(shard=True)" if args.shard else "data_parallel()"
    print(f"TinyGPT: vocab {len(text.chars)}, {args.layers} layers, dim {args.dim}, "
          f"context {args.context}, {params} parameters; {world} ranks x {args.accum} "
          f"micro-batches of {args.batch}; bf16 autocast {'on' if args.autocast else 'off'}; "
          f"gradmgr set up with {how}" + (" and ShardedOptimizer" if args.shard else ""))
    print("losses (ddp / gradmgr): each rank's own, then the mean over ranks "
          "as each rank computed it; then the gradient norms (ddp / gradmgr)")


def print_step(step: int, rows: List[List[float]], args: argparse.Namespace) -> None:
    for r, (l_ddp, l_gm, m_ddp, m_gm, _, _) in enumerate(rows):
        print(f"step {step:3d} rank {r}  loss {l_ddp:.9g} / {l_gm:.9g}  "
              f"mean {m_ddp:.9g} / {m_gm:.9g}", flush=True)
    scaled = clipping_scaled(rows[0], args.clip)
    print(f"step {step:3d} gradient norm {rows[0][4]:.9g} / {rows[0][5]:.9g}"
          + (f"  (above --clip {args.clip:g}: scaled)" if scaled else ""), flush=True)


def report(compare: Comparison, rank: int, world: int, args: argparse.Namespace,
           memory: List[List[float]]) -> bool:
    every_rank: List[List[str]] = [[] for _ in range(world)]
    dist.all_gather_object(every_rank, compare.failures)
    if rank == 0:
        for r, theirs in enumerate(every_rank):
            for line in theirs:
                print(f"ERROR {line}", flush=True)
            if not theirs:
                print(f"  rank {r}: {args.steps} steps checked", flush=True)
    ok = not any(every_rank)
    if rank == 0 and ok:
        print_checks(compare, args, memory)
    return ok


def print_checks(compare: Comparison, args: argparse.Namespace,
                 memory: List[List[float]]) -> None:
    ours = "sharded gradmgr's" if args.shard else "gradmgr's"
    cb = "make_reduce_scatter_cb" if args.shard else "make_allreduce_cb"
    how = (f"{cb} (at the first recording, so rank 1's step-0 loss equals DDP's only because "
           f"of it)" if args.by_hand else "data_parallel() (at once)")
    print(f"check initial broadcast: ranks seeded differently all start from rank 0's "
          f"weights, under DDP and {how}: matches")
    if compare.same_weights:
        print(f"check losses: {ours} equal DDP's bit for bit at all {args.steps} steps on every "
              f"rank, and every rank computed the same mean: matches")
        print(f"check gradient norms: {ours} equal DDP's "
              + (f"to rel {NORM_RTOL}" if args.shard else "bit for bit") + ": matches")
        print("check parameters after every step: torch.equal to DDP's, and across ranks at "
              "the end: matches")
    else:
        k = compare.apart_from
        print(f"check losses: {ours} equal DDP's bit for bit at steps 0-{k} on every rank, and "
              f"every rank computed the same mean at every step: matches")
        print(f"check gradient norms: {ours} equal DDP's to rel {NORM_RTOL} at steps 0-{k}, "
              f"and every rank's are the same at every step: matches")
        before = f"torch.equal to DDP's after steps 0-{k - 1}; " if k else ""
        print(f"check parameters: {before}step {k}'s clipping scaled the gradients by a factor "
              f"that may differ from DDP's in its last bit: after it DDP's to rel {STEP_RTOL} "
              f"(relative 2-norm of the difference: {compare.drift:.2g}), from there on two "
              f"runs apart by rounding; torch.equal across ranks at the end: matches")
    if args.shard:
        print(f"check optimizer state: AdamW's takes {memory[0][0]:.0f} bytes on each rank "
              f"under DDP, {' and '.join(f'{row[1]:.0f}' for row in memory)} under "
              f"ShardedOptimizer: matches")


def run(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """One rank; ``port`` 0 means torchrun set MASTER_ADDR / MASTER_PORT."""
    if world != WORLD:
        if rank == 0:
            print(f"this example compares with DDP bit for bit, which needs {WORLD} ranks, "
                  f"not {world} (see its docstring)", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    init = f"tcp://127.0.0.1:{port}" if port else "env://"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        ok = train(rank, world, args)
    finally:
        # DDP's reducer (kept alive by reference cycles) must go before its process group, and
        # both ranks must be done communicating: torch 2.13's gloo otherwise sometimes aborts
        # at exit ("terminate called without an active exception"), DDP alone too.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--accum", type=int, default=2,
                        help="micro-batches per step, all but the last under no_sync (default 2)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per micro-batch and rank")
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max norm")
    parser.add_argument("--seed", type=int, default=0, help="rank r uses seed + r")
    parser.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                        help="bfloat16 autocast on the CPU (default: on where it works)")
    parser.add_argument("--by-hand", action="store_true",
                        help="set gradmgr up with make_allreduce_cb (make_reduce_scatter_cb "
                             "with --shard) and broadcast() instead of data_parallel()")
    parser.add_argument("--shard", action="store_true",
                        help="gradmgr sharded (ZeRO-2): data_parallel(model, shard=True) and "
                             "ShardedOptimizer over AdamW")
    args = parser.parse_args(argv)
    if args.accum < 1 or args.steps < 0:
        parser.error("--accum must be at least 1 and --steps not negative")
    if args.dim % args.heads:
        parser.error("--dim must be a multiple of --heads")
    if args.autocast is None:
        args.autocast = bf16_autocast_works()
    return args


def main(argv=None) -> int:
    return run_ranks(run, WORLD, parse(argv))  # torchrun's rank, or WORLD ranks started here


if __name__ == "__main__":
    sys.exit(main())
