"""Generated data-parallel programs on 2 gloo ranks: ``data_parallel(model)`` on one path
against DDP on a copy of the model, step by step, in the same processes.

A :class:`Program` is a few training steps on a small model (:class:`Net`: a layer used twice,
a layer frozen at the start, a side branch). What the ranks must agree on is drawn once for
every rank: the ``no_sync`` micro-batches before each synced recording, the layers frozen for
a step, how gradients are dropped after it. What DDP lets one rank do alone is drawn per rank
and per recording (:class:`Rec`): attach its input or activations inside ``with gm:`` (DDP:
``requires_grad`` on the input, ``retain_grad()``), tensor hooks on activations,
``torch.autograd.grad`` of an activation with ``retain_graph`` inside the recording, leaving
the side branch unused. Generated from a fixed seed with numpy, so every rank builds the same
programs.

Each rank saves, per recording, its input's and activations' gradients and the
``autograd.grad`` results of both sides, and after each synced step every parameter's
``.grad`` (not on the sharded path, where gradients live in shards) and every parameter after
an SGD step, as ``{key}/gm`` and ``{key}/ddp`` in ``rank{r}.npz`` (written after each program,
so a rank that dies leaves what it did). ``python -m differential.diff_dp OUTDIR PATH STEPS
SEED`` runs the ranks (from ``tests/``); PATH is ``native`` (torch's reducer, the default),
``python`` (``native=False``) or ``shard`` (``shard=True`` with a ``ShardedOptimizer``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import numpy as np

WORLD = 2
LR = 0.1
LAYERS = ("fc1", "shared", "frozen", "side", "head")
TOGGLED = ("fc1", "shared", "frozen", "side")  # the head stays trainable: a loss to backward
SCALES = (0.5, 2.0, -1.0, 3.0)  # what a tensor hook multiplies by
ZERO_STYLES = ("none", "zeros", "keep")  # zero_grad(set_to_none=True / False), or no zero_grad
N_ACTS = 4
# What full sharding refuses, and how its error begins (gradmgr/distributed/sharded/full.py,
# gradmgr/backends/torch/full_shard.py): a gradient penalty by torch.autograd.grad(...,
# create_graph=True), one by an inner manager's backward, and a backward_split.
REFUSALS = {
    "autograd": "RuntimeError: data_parallel(shard='full'): a backward that keeps its graph",
    "manager": "UnsupportedGraphError: a backward that data_parallel(shard='full')'s manager "
               "would differentiate",
    "split": "UnsupportedGraphError: gm.backward_split() under full sharding",
}


@dataclass(frozen=True)
class Rec:
    """What one rank does in one recording, besides the forward and the backward."""

    attach_input: bool  # x.requires_grad_(); gm.attach(x) inside the recording
    attach: Tuple[int, ...]  # activations attached inside the recording (DDP: retain_grad)
    hooks: Tuple[Tuple[int, float], ...]  # (activation, scale): register_hook(g * scale)
    hooks_first: bool  # the hooks registered before the attach
    grad_of: Optional[int]  # torch.autograd.grad(loss, h, retain_graph=True) before backward
    skip_side: bool  # the side branch left out of this rank's forward
    rows: int  # this rank's batch size
    param_hook: Optional[Tuple[str, float]]  # (layer, scale): its weight's hook, this recording


@dataclass(frozen=True)
class Step:
    frozen: Tuple[Tuple[str, ...], ...]  # [recording]: layers frozen then, on every rank
    micro: int  # recordings inside no_sync before the synced one
    zero: str  # after the optimizer's step (ZERO_STYLES)
    recs: Tuple[Tuple[Rec, ...], ...]  # [rank][recording]
    # (m, kind): on every rank, a recording that full sharding refuses (REFUSALS) just before
    # recording m, inside no_sync where m < micro (the full path only)
    refused: Tuple[Tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Wrap:
    """How the full path wraps the model, on both sides: ``fully_shard`` on every Linear
    first (``blocks=[nn.Linear]``) or on the root alone (``blocks=()``)."""

    blocks: bool
    reshard_after_forward: bool


@dataclass(frozen=True)
class Program:
    steps: Tuple[Step, ...]
    wrap: Optional[Wrap] = None  # the full path's

    def pretty(self) -> str:
        lines = [] if self.wrap is None else [f"wrapped: {self.wrap}"]
        for j, step in enumerate(self.steps):
            lines.append(f"step {j}: {step.micro} no_sync micro-batch(es), then zero_grad "
                         f"style {step.zero!r}; frozen at each recording "
                         f"{[list(f) for f in step.frozen]}"
                         + "".join(f"; a refused {kind!r} recording before recording {m}"
                                   for m, kind in step.refused))
            for rank, recs in enumerate(step.recs):
                for m, rec in enumerate(recs):
                    lines.append(f"  rank {rank} recording {m}: {rec}")
        return "\n".join(lines)


def grad_flags(frozen: Tuple[str, ...], rec: Rec) -> List[bool]:
    """Whether each activation of :meth:`Net.forward` requires grad (only those may be
    attached, hooked or differentiated, on DDP's side too)."""
    live = {name: name not in frozen for name in LAYERS}
    h0 = live["fc1"] or rec.attach_input
    h1 = live["shared"] or h0
    h2 = live["frozen"] or h1
    h3 = live["shared"] or h2 or (not rec.skip_side and (live["side"] or h1))
    return [h0, h1, h2, h3]


def draw_rec(rng: np.random.Generator, frozen: Tuple[str, ...]) -> Rec:
    attach_input, skip_side = bool(rng.random() < 0.3), bool(rng.random() < 0.2)
    rows = int(rng.integers(1, 6))
    flags = grad_flags(frozen, Rec(attach_input, (), (), False, None, skip_side, rows, None))
    live = [i for i in range(N_ACTS) if flags[i]]
    attach = tuple(i for i in live if rng.random() < 0.25)
    hooks = tuple((i, float(rng.choice(SCALES))) for i in live if rng.random() < 0.2)
    grad_of = int(rng.choice(live)) if live and rng.random() < 0.25 else None
    trainable = [name for name in LAYERS if name not in frozen]
    param_hook = ((str(rng.choice(trainable)), float(rng.choice(SCALES)))
                  if rng.random() < 0.15 else None)
    return Rec(attach_input, attach, hooks, bool(rng.random() < 0.5), grad_of, skip_side, rows,
               param_hook)


def toggle(rng: np.random.Generator, frozen: Tuple[str, ...]) -> Tuple[str, ...]:
    """Freeze or unfreeze one layer."""
    return tuple(sorted(set(frozen) ^ {str(rng.choice(TOGGLED))}))


def programs(n_steps: int, seed: int, zero_styles: Tuple[str, ...] = ZERO_STYLES,
             window_freeze: float = 0.25, full: bool = False) -> List[Program]:
    """Programs of 1-4 steps each, ``n_steps`` steps in all; a layer frozen or unfrozen
    between two recordings of a ``no_sync`` window with probability ``window_freeze``; with
    ``full``, the same programs with a :class:`Wrap` and refused recordings (:func:`fully`)."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < n_steps:
        frozen = ("frozen",) if rng.random() < 0.7 else ()
        steps = []
        for _ in range(min(int(rng.integers(1, 5)), n_steps - total)):
            if steps and rng.random() < 0.4:  # between steps
                frozen = toggle(rng, frozen)
            micro = int(rng.choice([0, 0, 1, 2]))
            at = [frozen]
            for _ in range(micro):  # now and then inside the no_sync window too
                at.append(toggle(rng, at[-1]) if rng.random() < window_freeze else at[-1])
            frozen = at[-1]
            recs = tuple(tuple(draw_rec(rng, f) for f in at) for _ in range(WORLD))
            steps.append(Step(tuple(at), micro, str(rng.choice(zero_styles)), recs))
        total += len(steps)
        out.append(Program(tuple(steps)))
    return fully(out, seed) if full else out


def fully(programs: List[Program], seed: int) -> List[Program]:
    """``programs`` made fit for FSDP2 (:func:`agreed`) with the full path's draws, from a
    generator of their own."""
    rng = np.random.default_rng([seed, 1])
    out = []
    for program in programs:
        wrap = Wrap(bool(rng.random() < 0.5), bool(rng.random() < 0.5))
        steps = []
        for step in program.steps:
            recs = tuple(tuple(agreed(rec, first, frozen) for rec, first, frozen
                               in zip(per_rank, step.recs[0], step.frozen))
                         for per_rank in step.recs)
            refused = sorted((int(rng.integers(0, step.micro + 1)), str(rng.choice(
                list(REFUSALS)))) for _ in range(int(rng.choice([0, 0, 1, 2]))))
            steps.append(replace(step, recs=recs, refused=tuple(refused)))
        out.append(Program(tuple(steps), wrap))
    return out


def agreed(rec: Rec, first: Rec, frozen: Tuple[str, ...]) -> Rec:
    """``rec`` with rank 0's ``first`` unused branch and ``autograd.grad`` (where it is of an
    activation that requires grad on every rank), its input attached or not where that
    decides which activations require grad (a frozen first layer), and only the attaches and
    hooks that still require grad. FSDP2's gathers and reduce-scatters follow each rank's
    forward and backward: where the ranks differ in those (a layer's backward, or one of the
    shared layer's two, on one rank alone), plain FSDP2 crashes inside gloo or hangs
    (measured on torch 2.8), and so does full sharding."""
    rec = replace(rec, skip_side=first.skip_side)
    if grad_flags(frozen, replace(rec, attach_input=True)) != grad_flags(
            frozen, replace(rec, attach_input=False)):
        rec = replace(rec, attach_input=first.attach_input)
    flags = grad_flags(frozen, rec)
    common = grad_flags(frozen, replace(rec, attach_input=False))
    grad_of = first.grad_of if first.grad_of is not None and common[first.grad_of] else None
    return replace(rec, grad_of=grad_of, attach=tuple(i for i in rec.attach if flags[i]),
                   hooks=tuple(h for h in rec.hooks if flags[h[0]]))


def programs_of(path: str, n_steps: int, seed: int) -> List[Program]:
    """The programs the ranks run on ``path``."""
    return programs(n_steps, seed, zero_styles_of(path), full=path == "full")


def zero_styles_of(path: str) -> Tuple[str, ...]:
    # Sharded, the next recording drops the stand-ins a step left (docs/sharded.md,
    # "Clipping"): no zero_grad at all is not DDP's accumulation there.
    return ("none", "zeros") if path == "shard" else ZERO_STYLES


def batch(program: int, step: int, micro: int, rank: int, rows: int):
    import torch

    g = torch.Generator().manual_seed(((program * 100 + step) * 10 + micro) * 10 + rank)
    return torch.randn(rows, 3, generator=g)


def make_net(program: int, rank: int):
    import torch
    from torch import nn

    class Net(nn.Module):
        """A layer used twice (``shared``), one frozen at the start, a side branch a rank may
        leave out."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.shared = nn.Linear(3, 4), nn.Linear(4, 4)
            self.frozen, self.side, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x, keep: list, skip_side: bool = False):
            h0 = torch.tanh(self.fc1(x))
            h1 = torch.tanh(self.shared(h0))
            h2 = torch.tanh(self.frozen(h1))
            z = self.shared(h2)
            if not skip_side:
                z = z + 0.5 * self.side(h1)
            h3 = torch.tanh(z)
            keep.extend([h0, h1, h2, h3])
            return self.head(h3).pow(2).mean()

    torch.manual_seed(17 * program + rank)  # each rank its own: the broadcast must happen
    return Net()


def numpy_of(t) -> np.ndarray:
    return t.detach().numpy().copy()
