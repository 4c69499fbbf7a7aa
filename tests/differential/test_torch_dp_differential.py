"""``data_parallel(model)`` against DDP over generated training steps where the ranks differ
(:mod:`diff_dp`), on 2 gloo ranks, on each path: torch's C++ reducer (the default),
gradmgr's buckets (``native=False``) and ``shard=True`` (parameters compared after SGD steps).

Every rank attaches its input or activations inside the recording, hooks activations, takes
``torch.autograd.grad`` of one, or leaves a branch unused, each on its own; the ranks agree on
``no_sync`` micro-batches, freezing and unfreezing layers between steps, and ``zero_grad``
styles. Per recording the input's and activations' gradients and the ``autograd.grad``
results, per synced step every ``.grad`` (unsharded) and every parameter after SGD must equal
DDP's bit for bit, with the same ``None``s: with 2 ranks both sides sum the same two numbers.
A rank that raises, crashes inside gloo or hangs (gloo's timeout 30 s, the spawn's 240 s)
fails the test with the program's listing. ``GRADMGR_DIFF_EXAMPLES`` steps per path (default
30), seed ``GRADMGR_DIFF_SEED`` (default 13).

Full sharding (``shard="full"``) runs the same programs against plain FSDP2 (``fully_shard``
on the same blocks with the same ``reshard_after_forward``, both drawn per program;
``set_requires_gradient_sync(False)`` for ``no_sync``), comparing each rank's gradient and
parameter shards, with what FSDP2 needs the ranks to agree on made alike
(:func:`diff_dp.agreed`) and recordings full sharding refuses drawn in (``diff_dp.REFUSALS``):
each must raise its error on every rank, and the steps after it must still be FSDP2's
(``GRADMGR_DIFF_EXAMPLES`` steps, default 12).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import diff_dp as job  # noqa: E402
from ranks import TESTS, rank_env, wait_all  # noqa: E402

DEFAULT_STEPS, DEFAULT_SEED, DEFAULT_FULL_STEPS = 30, 13, 12
N_STEPS = int(os.environ.get("GRADMGR_DIFF_EXAMPLES") or DEFAULT_STEPS)
N_FULL_STEPS = int(os.environ.get("GRADMGR_DIFF_EXAMPLES") or DEFAULT_FULL_STEPS)
SEED = int(os.environ.get("GRADMGR_DIFF_SEED") or DEFAULT_SEED)
TIMEOUT = 240


def run_ranks(tmp_path, path: str, n_steps: int = N_STEPS) -> tuple:
    """Exit code, the log, and a function of (rank, program) giving what it saved."""
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "differential.diff_dp_run", str(tmp_path),
                                 path, str(n_steps), str(SEED)], cwd=TESTS, env=rank_env(),
                                stdout=f, stderr=subprocess.STDOUT)
        wait_all([proc], TIMEOUT)

    def saved(rank: int, index: int) -> dict:
        file = tmp_path / f"rank{rank}_p{index}.npz"
        return dict(np.load(file)) if file.exists() else {}
    return proc.returncode, saved, log.read_text()


def mismatches(out: dict, reference: str = "DDP") -> list:
    """Keys where gradmgr's side differs from the reference's (bits, dtype, shape, None), or
    that one side lacks."""
    ours = {k.replace("/gm", "/*", 1): v for k, v in out.items() if "/gm" in k}
    theirs = {k.replace("/ddp", "/*", 1): v for k, v in out.items() if "/ddp" in k}
    bad = [f"{k}: only one side has it" for k in sorted(set(ours) ^ set(theirs))]
    for k in sorted(set(ours) & set(theirs)):
        a, b = ours[k], theirs[k]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            bad.append(f"{k}: gradmgr {a!r}, {reference} {b!r}")
    return bad


def refusals_missed(out: dict, program) -> list:
    """The refused recordings (full sharding) that did not raise their error."""
    bad = []
    for j, step in enumerate(program.steps):
        for n, (_, kind) in enumerate(step.refused):
            said = str(out.get(f"s{j}/r{n}/refusal", "not run"))
            if not said.startswith(job.REFUSALS[kind]):
                bad.append(f"step {j}, refused {kind!r} recording {n}: {said[:300]}")
    return bad


def check_programs(tmp_path, path: str, n_steps: int, reference: str) -> None:
    """Run ``path``'s programs on the ranks and compare every one with ``reference``."""
    code, saved, log = run_ranks(tmp_path, path, n_steps)
    failures = []
    for index, program in enumerate(job.programs_of(path, n_steps, SEED)):
        outs = [saved(rank, index) for rank in range(job.WORLD)]
        if not all(out.get("done") for out in outs):
            errors = [str(out["error"]) for out in outs if "error" in out]
            failures.append(f"program {index} did not complete on every rank (exit {code}):\n"
                            f"{program.pretty()}\n" + "\n".join(errors)
                            + f"\n--- log:\n{log[-3000:]}")
            break  # the ranks stop at the first program that fails
        for rank, out in enumerate(outs):
            bad = mismatches(out, reference) + refusals_missed(out, program)
            if bad:
                failures.append(f"program {index}, rank {rank}:\n" + "\n".join(bad[:6])
                                + f"\n{program.pretty()}")
    assert not failures, "\n\n".join(failures[:3])
    assert code == 0, f"the ranks exited {code}:\n{log[-3000:]}"


@pytest.mark.parametrize("path", ["native", "python", "shard"])
def test_generated_steps_equal_ddp(tmp_path, path):
    check_programs(tmp_path, path, N_STEPS, "DDP")


def test_full_sharding_equals_fsdp2(tmp_path):
    """Bit for bit: both sides run FSDP2's kernels and collectives on the same data."""
    check_programs(tmp_path, "full", N_FULL_STEPS, "FSDP2")


def test_the_programs_draw_every_habit():
    """The default programs exercise every draw (a generator that stopped drawing one would
    leave the comparison above passing for nothing)."""
    programs = job.programs(DEFAULT_STEPS, DEFAULT_SEED)
    steps = [s for p in programs for s in p.steps]
    recs = [r for s in steps for per_rank in s.recs for r in per_rank]
    drawn = {"input": any(r.attach_input for r in recs), "activation": any(r.attach for r in recs),
             "hook": any(r.hooks for r in recs), "grad": any(r.grad_of is not None for r in recs),
             "unused": any(r.skip_side for r in recs),
             "weight hook": any(r.param_hook for r in recs),
             "batch sizes": len({r.rows for r in recs}) > 1,
             "differing ranks": any(s.recs[0] != s.recs[1] for s in steps),
             "no_sync": any(s.micro for s in steps),
             "freeze": any(a.frozen[0] != b.frozen[0]
                           for p in programs for a, b in zip(p.steps, p.steps[1:])),
             "freeze in a window": any(len(set(s.frozen)) > 1 for s in steps),
             "zero styles": {s.zero for s in steps} == set(job.ZERO_STYLES)}
    assert all(drawn.values()), drawn


def test_the_full_programs_draw_every_wrapping_and_refusal():
    """Full sharding's default programs: every wrapping, every refusal (inside a ``no_sync``
    window and at a synced recording), and the habits the ranks may still differ in."""
    programs = job.programs_of("full", DEFAULT_FULL_STEPS, DEFAULT_SEED)
    steps = [s for p in programs for s in p.steps]
    recs = [r for s in steps for per_rank in s.recs for r in per_rank]
    refused = [(m < s.micro, kind) for s in steps for m, kind in s.refused]
    drawn = {"wraps": len({p.wrap for p in programs}) == 4,
             "refusals": {kind for _, kind in refused} == set(job.REFUSALS),
             "refused in a window": any(paused for paused, _ in refused),
             "refused synced": any(not paused for paused, _ in refused),
             "grad": any(r.grad_of is not None for r in recs),
             "unused": any(r.skip_side for r in recs),
             "differing ranks": any(s.recs[0] != s.recs[1] for s in steps),
             "differing inputs": any(a.attach_input != b.attach_input
                                     for s in steps for a, b in zip(*s.recs)),
             "no_sync": any(s.micro for s in steps),
             "freeze in a window": any(len(set(s.frozen)) > 1 for s in steps),
             "zero styles": {s.zero for s in steps} == set(job.ZERO_STYLES)}
    assert all(drawn.values()), drawn
    for s in steps:  # what FSDP2's collectives follow is alike on every rank
        for a, b in zip(*s.recs):
            assert (a.skip_side, a.grad_of) == (b.skip_side, b.grad_of), s
