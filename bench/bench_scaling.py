"""The scaling curve (issue 27 item 5): memory, bytes sent and step time per rank, 2 to 8 ranks.

Model: 8 x ``nn.Linear(1024, 1024)`` (32 MiB of fp32 parameters: memory is parameters,
gradients and AdamW's two moments, 128 MiB a rank unsharded), AdamW, MSE loss, a batch of
16 x 1024 per rank; gloo on the CPU, one thread per rank, 2, 4 and 8 ranks. Systems:

- ``ddp``: ``DistributedDataParallel(model)`` + AdamW
- ``ddp-view``: the same with ``gradient_as_bucket_view=True``
- ``zero1``: DDP with bucket views + ``ZeroRedundancyOptimizer(AdamW)`` (ZeRO-1)
- ``fsdp2``: ``fully_shard(reshard_after_forward=False)`` on every Linear and the root (the
  parameters stay gathered from the forward to the end of the backward: ZeRO-2's traffic)
- ``fsdp2-reshard``: the same with ``reshard_after_forward=True`` (ZeRO-3, gathered again for
  the backward)
- ``gradmgr``: gradmgr ``data_parallel(model)`` + AdamW (its default path: torch's reducer)
- ``sharded``: gradmgr ``data_parallel(model, shard=True)`` + ``ShardedOptimizer(AdamW)``

Each round spawns the ranks for each number of ranks and runs the systems in a new random
order. Per rank and system, as ``bench_zero.py`` does: a warm-up on a small model (library
code loads), then the model and the batches, then **base** (the resident set; the peak
``VmHWM`` reset to it), the wrapping, the optimizer, one warm-up step, the timed steps (each
behind a barrier; a step's time is its slowest rank's), then one more step under the
profiler (below). The systems run one after the other in the same processes, each from its
own base (``--fresh``: new processes for each, as ``bench_zero.py``; the peaks measured so
were 0-2.4 MiB higher on 2 ranks, the same library code loading again). glibc mmaps blocks
of 128 KiB and more, so freed tensors leave the resident set. Columns:

- ``peak``: the highest resident set during the steps minus base, on the busiest rank
  (everything the system adds above the model: state, gradients, buffers, activations);
- ``grads+optim``: bytes of ``.grad`` (or gradient shards) after a backward plus the optimizer's
  state tensors after a step, on the busiest rank;
- ``sent/rank``: bytes each rank sends per step by a ring algorithm, from the collectives the
  step called. They are counted exactly: one more step runs under ``torch.profiler``, which
  records every collective the process group runs, the C++ reducer's too (``c10d::*`` events
  name the collective called, ``gloo:*`` events what gloo ran and its tensor's size and dtype).
  A collective of S bytes costs a rank ``2(N-1)/N S`` (allreduce), ``(N-1)/N S`` (reduce-scatter
  of an S-byte input, all-gather of an S-byte output, broadcast: every byte reaches the N-1
  others once). ``control`` are gradmgr's small allreduces (its plan check, sharded's
  flags: under 4 KiB), ``data`` everything else. ``formula``: ``bench/cost_model.py``'s
  prediction of the data bytes for this model (equal to the byte, or the run fails);
- ``on gloo``: the same for what gloo ran: gloo's ``reduce_scatter_tensor`` is an allreduce of
  the whole input, and gradmgr's CPU transport allreduces in place (``ChunkOfSum``), so on the
  CPU a reduce-scatter costs an allreduce's bytes. With nccl each is what was called;
- ``step``: median step time (forward, backward, optimizer step, ``zero_grad``), and its ratio
  to DDP's of the same round. With more ranks than cores (4 and 8 ranks on a 2-core machine)
  the ranks take turns on the cores, and the time measures the scheduler: marked ``(over)``.

Results go to ``bench/results/scaling.json`` (``scaling-quick.json`` with ``--quick``,
``scaling-partial.json`` for other ranks or systems) and, from them, ``scaling.png``
(``--plot`` redraws it from the JSON alone).

    python bench/bench_scaling.py [--worlds 2 4 8] [--rounds R] [--steps N] [--quick] [--plot]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, HERE)

import cost_model  # noqa: E402  (pure Python: the byte formulas the counts are checked against)

VARIANTS = ("ddp", "ddp-view", "zero1", "fsdp2", "fsdp2-reshard", "gradmgr", "sharded")
SYSTEM = {  # the cost model's name for each variant's traffic
    "ddp": "ddp", "ddp-view": "ddp", "zero1": "zero1", "fsdp2": "fsdp2-noreshard",
    "fsdp2-reshard": "fsdp2", "gradmgr": "gradmgr", "sharded": "gradmgr-sharded",
}
WIDTH, LAYERS, BATCH, LR = 1024, 8, 16, 1e-4
CONTROL_BYTES = 4096  # allreduces below this are control traffic (plan check, flags)
MIB = 2**20
DTYPE_BYTES = {"float": 4, "double": 8, "int": 4, "long": 8, "c10::Half": 2,
               "c10::BFloat16": 2, "bool": 1, "unsigned char": 1, "signed char": 1}


def layer_sizes() -> List[int]:
    """The model's parameter tensors' element counts, in order (weight, bias per layer)."""
    return [n for _ in range(LAYERS) for n in (WIDTH * WIDTH, WIDTH)]


# ---------------------------------------------------------------------------------- counting
def _op_kind(c10d_name: str) -> str:
    name = c10d_name.split("::", 1)[-1]
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    if "allreduce" in name:
        return "allreduce"
    if "broadcast" in name:
        return "broadcast"
    return name.strip("_")


GLOO_KIND = {"gloo:all_reduce": "allreduce", "gloo:broadcast": "broadcast",
             "gloo:all_gather": "all_gather", "gloo:reduce_scatter": "reduce_scatter"}


def ring_bytes(kind: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends for a collective whose buffer (allreduce, broadcast), whole input
    (reduce-scatter) or whole output (all-gather) holds ``nbytes``."""
    return cost_model.ring_bytes_per_rank(kind, nbytes, world)


def collectives_of(events: List[Any], world: int) -> Dict[str, List[Dict[str, Any]]]:
    """From a profiled step's kineto events: the collectives called (``c10d::*``, each given
    its size from its own shapes or from the gloo event that ran it) and what gloo ran."""
    calls = sorted((e for e in events if e.name().startswith("c10d::")),
                   key=lambda e: e.start_ns())
    runs = sorted((e for e in events if e.name().startswith("gloo:")), key=lambda e: e.start_ns())
    ran = []
    for e in runs:
        shapes, dtypes = e.shapes(), e.dtypes()
        numel = 1
        for d in (shapes[0] if shapes else []):
            numel *= d
        size = numel * DTYPE_BYTES.get(dtypes[0] if dtypes else "float", 4)
        kind = GLOO_KIND.get(e.name(), e.name())
        if kind == "all_gather":  # gloo's event holds the input chunk; count the output
            size *= world
        ran.append({"op": kind, "bytes": size})
    pending = list(ran)
    called: List[Dict[str, Any]] = []
    sized = []  # calls whose own event gives no size: matched once the others took theirs
    for e in calls:
        kind = _op_kind(e.name())
        if kind == "barrier":
            continue
        shapes, dtypes = e.shapes(), e.dtypes()
        entry: Dict[str, Any] = {"op": kind, "bytes": 0}
        called.append(entry)
        if kind in ("reduce_scatter", "all_gather") and len(shapes) >= 2 and shapes[1]:
            elem = DTYPE_BYTES.get(dtypes[1] if len(dtypes) > 1 else "float", 4)
            # a reduce-scatter's input, an all-gather's output; gloo ran an allreduce of the
            # input (reduce-scatter) or an all_gather (whose event we count by its output)
            entry["bytes"] = _numel(shapes[1 if kind == "reduce_scatter" else 0]) * elem
            want = ("allreduce", "reduce_scatter") if kind == "reduce_scatter" else ("all_gather",)
            _take(pending, want, entry["bytes"])
        else:
            sized.append(entry)
    for entry in sized:
        run = _take(pending, (entry["op"],), None)
        entry["bytes"] = run["bytes"] if run else 0
    for c in called + ran:
        c["sent"] = ring_bytes(c["op"], c["bytes"], world)
    return {"called": called, "ran": ran}


def _numel(shape: List[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _take(pending: List[Dict[str, Any]], kinds: Tuple[str, ...],
          nbytes: Optional[int]) -> Optional[Dict[str, Any]]:
    """Remove and return the first gloo run of one of ``kinds`` (and of ``nbytes``, if given)."""
    for i, run in enumerate(pending):
        if run["op"] in kinds and (nbytes is None or run["bytes"] == nbytes):
            return pending.pop(i)
    return None


def is_control(c: Dict[str, Any]) -> bool:
    """gradmgr's plan check and sharded flags: small allreduces of fixed size. (A size alone
    would not do: ZeRO-1 broadcasts each 4 KiB bias, sharded gathers small segments.)"""
    return c["op"] == "allreduce" and c["bytes"] < CONTROL_BYTES


def summed(collectives: List[Dict[str, Any]]) -> Dict[str, float]:
    data = [c for c in collectives if not is_control(c)]
    control = [c for c in collectives if is_control(c)]
    return {"data_sent": sum(c["sent"] for c in data),
            "control_sent": sum(c["sent"] for c in control),
            "data_payload": sum(c["bytes"] for c in data),
            "data_calls": len(data), "control_calls": len(control)}


# ---------------------------------------------------------------------------------- a run
def rank_main(rank: int, world: int, port: int, names: List[str], steps: int,
              outdir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13's renamed collectives
    warnings.filterwarnings("ignore", category=UserWarning)  # FSDP2 on the CPU, the profiler
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        for name in names:
            record = _run(rank, world, name, steps)
            with open(os.path.join(outdir, f"{name}-rank{rank}.json"), "w") as f:
                json.dump(record, f)
            gc.collect()
    finally:
        dist.destroy_process_group()


def _run(rank: int, world: int, name: str, steps: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from _common import peak_rss, reset_peak_rss, rss
    from bench_zero import batches, model

    small = _variant(name, model(64, 2), world)  # library code and lazy state load first
    for x, y in batches(2, rank, 64):
        small.step(x, y)
    del small
    gc.collect()

    torch.manual_seed(0)
    net = model(WIDTH, LAYERS)
    data = batches(steps + 2, rank, WIDTH)  # BATCH x WIDTH each (bench_zero's batch is ours)
    gc.collect()
    dist.barrier()
    base = rss()
    reset_peak_rss()
    variant = _variant(name, net, world)
    del net
    counted: Dict[str, int] = {}

    def probe() -> None:
        counted["grads"] = variant.grads()

    variant.step(*data[0], probe=probe)
    counted["state"] = variant.state()
    times = []
    for x, y in data[1:steps + 1]:
        dist.barrier()
        start = time.perf_counter()
        variant.step(x, y)
        times.append(time.perf_counter() - start)
    peak = peak_rss() - base
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    dist.barrier()
    extra = iter(data[steps + 1:] + data[1:steps + 1])  # more steps where the profiler missed
    collectives = profiled_step(lambda: variant.step(*next(extra)), world)
    return {"rank": rank, "peak": peak, "grads": counted["grads"], "state": counted["state"],
            "times": slowest.tolist(), **collectives}


def profiled_step(step: Callable[[], Any], world: int, tries: int = 5) -> Dict[str, Any]:
    """:func:`collectives_of` one ``step()`` run under ``torch.profiler``, on every rank of the
    default group. A collective's size comes from gloo's event, which ends on gloo's worker
    thread: now and then the step has returned (and the profiler stopped) just before it
    ended, and a collective reads 0 bytes (about once in five steps of a one-rank group). Such
    a step counts nothing: the ranks agree on that (so that they run the same steps) and the
    next step is read, up to ``tries`` steps; after that the last one is returned as it is."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    for _ in range(tries):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        found = collectives_of(list(prof.profiler.kineto_results.events()), world)
        missed = torch.tensor([float(any(c["bytes"] == 0 for c in found["called"]))])
        dist.all_reduce(missed, op=dist.ReduceOp.MAX)
        if not missed.item():
            break
    return found


def _variant(name: str, net: Any, world: int) -> Any:
    """One system training ``net``: bench_zero.py's ``Variant`` (imported here: it imports
    torch, which this module's cost-model helpers do not need)."""
    from bench_zero import Variant

    return Variant(name, net, world)


def run_all(worlds: List[int], variants: List[str], rounds: int, steps: int, fresh: bool,
            log: Any) -> Dict[str, Any]:
    """Every system on every number of ranks: by default each round spawns the ranks once and
    runs the systems one after the other in them (in a new random order each round; each
    measured from its own base); ``fresh``: new processes for every system, as bench_zero.py
    does (slower: each spawn imports torch again)."""
    from gradmgr.distributed import spawn_local

    out: Dict[str, Any] = {}
    for world in worlds:
        per: Dict[str, List[Dict[str, Any]]] = {v: [] for v in variants}
        for r in range(rounds):
            order = list(variants)
            random.Random(100 * world + r).shuffle(order)
            batches = [[name] for name in order] if fresh else [order]
            with tempfile.TemporaryDirectory(prefix="bench_scaling-") as outdir:
                for names in batches:
                    start = time.perf_counter()
                    if spawn_local(rank_main, world, names, steps, outdir):
                        raise RuntimeError(f"{names} on {world} ranks failed (round {r + 1})")
                    for name in names:
                        ranks = []
                        for rank in range(world):
                            with open(os.path.join(outdir, f"{name}-rank{rank}.json")) as f:
                                ranks.append(json.load(f))
                        per[name].append(_merge(ranks, world))
                        rec = per[name][-1]
                        log(f"  {world} ranks, round {r + 1}/{rounds}: {name:<13} step "
                            f"{rec['step'] * 1e3:7.1f} ms, peak {rec['peak'] / MIB:6.1f} MiB, "
                            f"sent {rec['called']['data_sent'] / MIB:6.1f} MiB")
                    log(f"  ({len(names)} system(s) in {time.perf_counter() - start:.0f} s)")
        out[str(world)] = per
    return out


def _merge(ranks: List[Dict[str, Any]], world: int) -> Dict[str, Any]:
    """One round of one system: the busiest rank's memory, rank 0's times, and the bytes (the
    same on every rank for these systems; the largest is kept)."""
    rec: Dict[str, Any] = {k: max(r[k] for r in ranks) for k in ("peak", "grads", "state")}
    rec["step"] = statistics.median(ranks[0]["times"])
    for which in ("called", "ran"):
        sums = [summed(r[which]) for r in ranks]
        rec[which] = {k: max(s[k] for s in sums) for k in sums[0]}
    rec["ops"] = _op_table(ranks[0]["called"])
    return rec


def _op_table(called: List[Dict[str, Any]]) -> Dict[str, List[int]]:
    """Per kind of collective: [calls, bytes] of the data collectives (for the JSON)."""
    table: Dict[str, List[int]] = {}
    for c in called:
        if not is_control(c):
            entry = table.setdefault(c["op"], [0, 0])
            entry[0] += 1
            entry[1] += c["bytes"]
    return table


def summarise(raw: Dict[str, Any], cores: int) -> List[Dict[str, Any]]:
    """One row per (ranks, system): medians over the rounds, ratios to DDP's of the same round,
    and the cost model's formula for the data bytes."""
    rows = []
    param_bytes = 4 * sum(layer_sizes())
    for world_s, per in raw.items():
        world = int(world_s)
        ddp = per.get("ddp") or []
        for name, recs in per.items():
            if not recs:
                continue
            formula = cost_model.bytes_per_rank(SYSTEM[name], param_bytes, world, "gloo",
                                                tensors=layer_sizes())
            ratio = ([r["step"] / d["step"] for r, d in zip(recs, ddp)] if ddp else [])
            rows.append({
                "ranks": world, "system": name,
                "peak_mib": statistics.median(r["peak"] for r in recs) / MIB,
                "held_mib": statistics.median(r["grads"] + r["state"] for r in recs) / MIB,
                "sent_mib": recs[0]["called"]["data_sent"] / MIB,
                "control_kib": recs[0]["called"]["control_sent"] / 1024,
                "control_calls": recs[0]["called"]["control_calls"],
                "gloo_sent_mib": recs[0]["ran"]["data_sent"] / MIB,
                "formula_mib": formula / MIB,
                "bytes_match": abs(recs[0]["called"]["data_sent"] - formula) < 0.5,
                "ops": recs[0]["ops"],
                "step_ms": statistics.median(r["step"] for r in recs) * 1e3,
                "time_vs_ddp": statistics.median(ratio) if ratio else None,
                "oversubscribed": world > cores,
                "rounds": len(recs),
            })
    return rows


def print_table(rows: List[Dict[str, Any]]) -> None:
    print(f"\n{'ranks':>5} {'system':>13} {'peak MiB':>9} {'grads+optim':>11} {'sent/rank':>10} "
          f"{'formula':>8} {'on gloo':>8} {'control':>12} {'step ms':>9} {'/DDP':>6}")
    for r in rows:
        ratio = "-" if r["time_vs_ddp"] is None else f"{r['time_vs_ddp']:.3f}"
        over = " (over)" if r["oversubscribed"] else ""
        match = "" if r["bytes_match"] else " !="
        print(f"{r['ranks']:5d} {r['system']:>13} {r['peak_mib']:9.1f} {r['held_mib']:11.1f} "
              f"{r['sent_mib']:10.2f} {r['formula_mib']:8.2f}{match} {r['gloo_sent_mib']:8.2f} "
              f"{r['control_calls']:3d} x {r['control_kib'] / max(r['control_calls'], 1):4.2f}K "
              f"{r['step_ms']:9.1f} {ratio:>6}{over}")
    print("MiB per rank (the busiest); sent/rank, formula and on gloo: MiB each rank sends per "
          "step by a ring, data collectives; control: gradmgr's small allreduces (plan check, "
          "flags: calls x KiB each); (over): more ranks than cores, the time measures the "
          "scheduler")


# ---------------------------------------------------------------------------------- plot
def plot(results: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    systems = [v for v in VARIANTS if any(r["system"] == v for r in rows)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for name in systems:
        mine = sorted((r for r in rows if r["system"] == name), key=lambda r: r["ranks"])
        ranks = [r["ranks"] for r in mine]
        style = dict(marker="o", label=name, linestyle="--" if name.startswith("ddp") else "-")
        axes[0].plot(ranks, [r["peak_mib"] for r in mine], **style)
        axes[1].plot(ranks, [r["sent_mib"] for r in mine], **style)
        axes[2].plot(ranks, [r["step_ms"] for r in mine], **style)
    cores = results["machine"]["cores"]
    worlds = sorted({r["ranks"] for r in rows})
    titles = ("peak memory per rank above the model (MiB)",
              "bytes sent per rank per step (MiB; equal bytes overlap)",
              f"step time (ms; shaded: more ranks than the {cores} cores)")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ranks (gloo, CPU)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds)
        ax.set_xticklabels([str(w) for w in worlds])
        ax.grid(alpha=0.3)
    if worlds[-1] > cores:
        axes[2].axvspan(cores * 1.2, worlds[-1] * 1.2, color="grey", alpha=0.12)
    axes[0].legend(fontsize=8)
    load = results["machine"]["load"][0]
    fig.suptitle(f"bench_scaling.py: 8 x Linear(1024), AdamW, batch {BATCH} per rank; "
                 f"{results['machine']['cpu']}, {cores} cores, 1-minute load {load:.1f} as the "
                 f"run ended (its ranks' own); torch {results['machine']['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------- main
def save(results: Dict[str, Any], name: str) -> None:
    """Write ``bench/results/<name>.json`` with the machine and the model, and its plot."""
    import torch
    from _common import cpu_model

    import gradmgr

    results = {
        "machine": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "gradmgr": gradmgr.__version__, "load": os.getloadavg()},
        "model": {"layers": LAYERS, "width": WIDTH, "params": sum(layer_sizes()),
                  "batch": BATCH},
        **results,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    json_path = os.path.join(RESULTS, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    try:
        plot(results, os.path.join(RESULTS, f"{name}.png"))
    except ImportError:
        print("no matplotlib here: the plot is left out (run it with .venv)")
    print(f"\nwrote {os.path.relpath(json_path)}")


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="+", default=["2", "4", "8"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 ranks, 2 timed steps, to scaling-quick.json")
    parser.add_argument("--fresh", action="store_true",
                        help="new processes for every system (as bench_zero.py; slower)")
    parser.add_argument("--plot", action="store_true",
                        help="only redraw scaling.png from scaling.json")
    args = parser.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    worlds = [int(w) for item in args.worlds for w in item.split(",") if w]
    steps = args.steps
    if args.quick:
        worlds, steps = [2], 2
    variants = [v for v in args.variants.split(",") if v]
    # the committed results (tests/test_cost_model.py reads them) come from the full set only
    name = ("scaling-quick" if args.quick else "scaling" if sorted(worlds) == [2, 4, 8]
            and set(variants) == set(VARIANTS) else "scaling-partial")
    json_path = os.path.join(RESULTS, f"{name}.json")
    if args.plot:
        with open(json_path) as f:
            plot(json.load(f), os.path.join(RESULTS, f"{name}.png"))
        return 0
    unknown = set(variants) - set(VARIANTS)
    if unknown or steps < 1:
        parser.error(f"unknown systems {sorted(unknown)}" if unknown else "--steps >= 1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from _common import MMAP_THRESHOLD, allocator, machine_info

    print(__doc__.split("\n\n")[0])
    print(machine_info(["torch"]))
    cores = len(os.sched_getaffinity(0))
    params = sum(layer_sizes())
    print(f"model: {LAYERS} x Linear({WIDTH}, {WIDTH}), {params:,} parameters "
          f"({4 * params / MIB:.1f} MiB fp32); batch {BATCH} x {WIDTH} per rank; AdamW; gloo")
    start = time.perf_counter()
    with allocator(MMAP_THRESHOLD):  # every rank's peak RSS is measured
        raw = run_all(worlds, variants, args.rounds, steps, args.fresh,
                      lambda s: print(s, file=sys.stderr, flush=True))
    rows = summarise(raw, cores)
    print_table(rows)
    save({"steps": steps, "rounds": args.rounds, "rows": rows, "raw": raw}, name)
    print(f"took {time.perf_counter() - start:.0f} s")
    bad = [f"{r['system']} at {r['ranks']}" for r in rows if not r["bytes_match"]]
    if bad:
        print(f"MISMATCH: the bytes counted differ from cost_model's formula: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
