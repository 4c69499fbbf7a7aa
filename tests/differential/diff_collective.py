"""Programs with collectives inside the recording (issue 29 item 6), run on 2 ranks and
against a one-process reference.

A :class:`CProgram` is a short MegEngine program that every rank runs on data of its own:
leaves (some attached), ops before ``record()`` (constants to MegEngine), ops inside the
recording, among them ``all_reduce_sum`` (MegEngine's own name, called on ranks that gradmgr's
launcher started), and a backward of a seeded sum of some values. The reference runs both
ranks' programs in one process with MegEngine's own ``GradManager``, each ``all_reduce_sum``
being the sum of both ranks' values (one tensor used by both): so a rank's gradient is what
MegEngine's rule gives (the gradient of ``all_reduce_sum`` is the ``all_reduce_sum`` of the
output gradients). Generated from a fixed seed with numpy, so both ranks and the reference
build the same programs. ``python -m differential.diff_collective OUTDIR N SEED`` runs the
ranks (from ``tests/``).
"""

from __future__ import annotations

import datetime
import importlib
import os
import sys
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

SHAPE = (3,)
UNARY = ("neg", "tanh", "sin", "scale")
BINARY = ("add", "mul", "sub")


@dataclass(frozen=True)
class CProgram:
    n_leaves: int
    attached: Tuple[int, ...]
    ops: Tuple[Tuple[str, Tuple[int, ...]], ...]  # (name, args): value n_leaves + i
    recorded_from: int  # ops before this index run before record()
    outputs: Tuple[int, ...]

    def pretty(self) -> str:
        lines = [f"leaves v0..v{self.n_leaves - 1}, attached {list(self.attached)}"]
        for i, (name, args) in enumerate(self.ops):
            if i == self.recorded_from:
                lines.append("record()")
            lines.append(f"v{self.n_leaves + i} = {name}({', '.join(f'v{a}' for a in args)})")
        if self.recorded_from >= len(self.ops):
            lines.append("record()")
        names = ", ".join(f"v{o}" for o in self.outputs)
        lines.append(f"backward(sum of [{names}], seeded)")
        return "\n".join(lines)


def programs(n: int, seed: int) -> List[CProgram]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        n_leaves = int(rng.integers(1, 4))
        attached = tuple(sorted(set(rng.choice(n_leaves, int(rng.integers(1, n_leaves + 1)),
                                               replace=False).tolist())))
        ops = []
        for i in range(int(rng.integers(2, 8))):
            values = n_leaves + i
            draw = rng.random()
            if draw < 0.6:  # a third of all ops: allreduce
                name = "allreduce" if draw < 0.35 else str(rng.choice(UNARY))
                ops.append((name, (int(rng.integers(values)),)))
            else:
                ops.append((str(rng.choice(BINARY)),
                            tuple(int(a) for a in rng.integers(values, size=2))))
        recorded_from = int(rng.integers(0, 3))
        total = n_leaves + len(ops)
        first = n_leaves + min(recorded_from, len(ops))  # outputs from the recording mostly
        pool = list(range(first, total)) or list(range(total))
        outputs = tuple(sorted(set(int(v) for v in rng.choice(pool, min(2, len(pool)),
                                                                replace=False))))
        out.append(CProgram(n_leaves, attached, tuple(ops), recorded_from, outputs))
    return out


def leaf_data(index: int, rank: int, n: int) -> List[np.ndarray]:
    rng = np.random.default_rng(1000 * index + rank)
    return [(rng.standard_normal(SHAPE) * 0.8).astype("float32") for _ in range(n)]


def dy_data(index: int, rank: int, n: int) -> List[np.ndarray]:
    rng = np.random.default_rng(7000 * index + rank + 1)
    return [rng.standard_normal(SHAPE).astype("float32") for _ in range(n)]


def apply(name: str, args: list, allreduce):
    import megengine.functional as F

    if name == "allreduce":
        return allreduce(args[0])
    if name == "neg":
        return -args[0]
    if name == "tanh":
        return F.tanh(args[0])
    if name == "sin":
        return F.sin(args[0])
    if name == "scale":
        return args[0] * 1.5
    a, b = args
    return a + b if name == "add" else a * b if name == "mul" else a - b


def run_rank(program: CProgram, index: int, rank: int, manager_class, allreduce) -> list:
    """One rank's program through ``manager_class``; the attached leaves' gradients."""
    import megengine
    import megengine.functional as F

    values = [megengine.Tensor(d) for d in leaf_data(index, rank, program.n_leaves)]
    gm = manager_class().attach([values[v] for v in program.attached])
    for i, (name, args) in enumerate(program.ops):
        if i == program.recorded_from:
            gm.record()
        values.append(apply(name, [values[a] for a in args], allreduce))
    if program.recorded_from >= len(program.ops):
        gm.record()
    dys = dy_data(index, rank, len(program.outputs))
    loss = None
    for o, dy in zip(program.outputs, dys):
        term = F.sum(values[o] * megengine.Tensor(dy))
        loss = term if loss is None else loss + term
    gm.backward(loss)
    return [None if values[v].grad is None else values[v].grad.numpy()
            for v in program.attached]


def reference(program: CProgram, index: int, world: int = 2) -> list:
    """Both ranks in one process, MegEngine's own manager: ``[rank][attached] -> grad``."""
    import megengine
    import megengine.functional as F
    from megengine.autodiff import GradManager

    ranks = [[megengine.Tensor(d) for d in leaf_data(index, r, program.n_leaves)]
             for r in range(world)]
    gm = GradManager().attach([vals[v] for vals in ranks for v in program.attached])

    def step(i: int) -> None:
        name, args = program.ops[i]
        if name == "allreduce":
            total = ranks[0][args[0]]
            for vals in ranks[1:]:
                total = total + vals[args[0]]
            for vals in ranks:
                vals.append(total)
        else:
            for vals in ranks:
                vals.append(apply(name, [vals[a] for a in args], None))

    for i in range(len(program.ops)):
        if i == program.recorded_from:
            gm.record()
        step(i)
    if program.recorded_from >= len(program.ops):
        gm.record()
    loss = None
    for r, vals in enumerate(ranks):
        for o, dy in zip(program.outputs, dy_data(index, r, len(program.outputs))):
            term = F.sum(vals[o] * megengine.Tensor(dy))
            loss = term if loss is None else loss + term
    gm.backward(loss)
    return [[None if vals[v].grad is None else vals[v].grad.numpy() for v in program.attached]
            for vals in ranks]


def rank_main(rank: int, world: int, port: int, outdir: str, n: int, seed: int) -> None:
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world, timeout=datetime.timedelta(seconds=60))
    import megengine.functional as F

    from gradmgr import GradManager

    out = {}
    for index, program in enumerate(programs(n, seed)):
        grads = run_rank(program, index, rank, GradManager, F.distributed.all_reduce_sum)
        for k, g in enumerate(grads):
            out[f"p{index}_a{k}"] = np.array([]) if g is None else g
            out[f"p{index}_a{k}_none"] = np.array(g is None)
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **out)
    tdist.barrier()
    tdist.destroy_process_group()


def main(argv: list) -> int:
    from gradmgr.distributed import spawn_local

    job = importlib.import_module("differential.diff_collective")
    return spawn_local(job.rank_main, 2, argv[0], int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
