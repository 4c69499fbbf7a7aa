"""bench/cost_model.py against the published figures, and bench_scaling.py's byte counts against
its formulas. Fast, pure Python, no ranks: the counting is checked on recorded events, and on
the committed results of a real run where they exist."""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from types import SimpleNamespace
from typing import List

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import bench_scaling  # noqa: E402  (imports torch only inside its rank functions)
import cost_model  # noqa: E402

GB = 1e9


def test_zero_memory_figure_exactly():
    """ZeRO (SC20) figure 1: 7.5B parameters, K = 12, 64 GPUs: 120 GB (DP), 31.4 GB (P_os),
    16.6 GB (P_os+g), 1.88 GB (P_os+g+p), each to the digits printed there."""
    paper = {"ddp": 120, "gradmgr": 120, "zero1": 31.4, "gradmgr-sharded": 16.6, "fsdp2": 1.88}
    for system, gb in paper.items():
        model = cost_model.memory_per_gpu(system, 7.5e9, 64) / GB
        assert round(model, cost_model.printed_precision(gb)) == gb, system
    # the formulas behind them, exactly: (2+2+K) Psi, 4 Psi + K Psi/N, 2 Psi + (2+K) Psi/N, /N
    assert cost_model.memory_per_gpu("zero1", 7.5e9, 64) == 30e9 + 12 * 7.5e9 / 64
    assert cost_model.memory_per_gpu("gradmgr-sharded", 7.5e9, 64) == 15e9 + 14 * 7.5e9 / 64
    assert cost_model.memory_per_gpu("fsdp2", 7.5e9, 64) == 120e9 / 64


def test_zero_communication_volumes():
    """ZeRO section 7: P_os+g moves what data parallelism moves (2 Psi), P_os+g+p 1.5x; torch's
    ZeRO-1 (allreduce, then broadcasts) 1.5x; every ratio the same at any number of ranks."""
    for world in (2, 8, 64, 1024):
        ddp = cost_model.bytes_per_rank("ddp", 1.0, world)
        assert ddp == pytest.approx(2 * (world - 1) / world)
        assert cost_model.bytes_per_rank("gradmgr-sharded", 1.0, world) == pytest.approx(ddp)
        assert cost_model.bytes_per_rank("fsdp2", 1.0, world) == pytest.approx(1.5 * ddp)
        assert cost_model.bytes_per_rank("zero1", 1.0, world) == pytest.approx(1.5 * ddp)
        assert cost_model.bytes_per_rank("fsdp2-noreshard", 1.0, world) == pytest.approx(ddp)
        # on gloo, gradmgr sharded allreduces each bucket (gloo's reduce-scatter would too)
        assert cost_model.bytes_per_rank("gradmgr-sharded", 1.0, world, "gloo") == \
            pytest.approx(1.5 * ddp)


def test_bench_formula_by_hand():
    """bench_scaling's model, 8 x Linear(1024): 8,396,800 parameters, 33,587,200 bytes; the
    bytes each rank sends, worked out by hand."""
    tensors = bench_scaling.layer_sizes()
    p = 4 * sum(tensors)
    assert p == 33_587_200
    by_hand = {  # (system, ranks): bytes
        ("ddp", 2): p,  # 2 (N-1)/N = 1
        ("ddp", 4): 3 * p // 2,
        ("ddp", 8): 7 * p // 4,
        # 16 "used" flags + a marker in the last bucket, padded to 64-byte lines: 32 floats
        ("gradmgr", 4): 3 * (p + 32 * 4) // 2,
        ("zero1", 8): 21 * p // 8,  # 2 (7/8) + 7/8
        ("fsdp2-noreshard", 4): 3 * p // 2,  # 3/4 + 3/4
        ("fsdp2", 4): 9 * p // 4,  # 3 x 3/4
        ("gradmgr-sharded", 2): p,  # nccl: 1/2 + 1/2
    }
    for (system, world), expected in by_hand.items():
        got = cost_model.bytes_per_rank(system, p, world, "nccl", tensors=tensors)
        assert got == expected, (system, world)
    # gloo: the bucket allreduced (2 (N-1)/N) then gathered ((N-1)/N); no padding: every bucket
    # holds whole layers of 1,049,600 elements, a multiple of 8
    assert cost_model.bytes_per_rank("gradmgr-sharded", p, 8, "gloo", tensors=tensors) == \
        21 * p // 8
    assert cost_model._padding_bytes(tensors, 8, 4.0) == 0
    assert cost_model._padding_bytes([3, 5], 4, 4.0) == 0  # one bucket of 8 elements
    assert cost_model._padding_bytes([3, 6], 4, 4.0) == 12  # 9 elements pad to 12


def _event(name: str, shapes: List[List[int]], dtypes: List[str], at: int) -> SimpleNamespace:
    return SimpleNamespace(name=lambda: name, shapes=lambda: shapes, dtypes=lambda: dtypes,
                           start_ns=lambda: at)


def test_counting_pairs_calls_with_what_gloo_ran():
    """Events as torch 2.8's profiler records them on gloo (the c10d op on the calling thread,
    the gloo op on gloo's, later): an allreduce's size comes from its gloo run; a reduce-scatter
    is counted as called (its input), though gloo ran an allreduce of it; an all-gather's gloo
    event holds the input chunk; small allreduces are control traffic."""
    events = [
        _event("c10d::allreduce_", [[], [], [], [], [], []], ["TensorList", "", "", "", "Scalar",
                                                               "Scalar"], 1),
        _event("c10d::_reduce_scatter_base_", [[5000], [10000], [], [], [], []],
               ["float", "float", "", "", "", ""], 2),
        _event("gloo:all_reduce", [[30]], ["float"], 3),  # the first call's: a plan check
        _event("c10d::_allgather_base_", [[2000], [1000], [], [], []],
               ["float", "float", "", "", ""], 4),
        _event("gloo:all_reduce", [[10000]], ["float"], 5),
        _event("c10d::broadcast_", [[], [], [], [], [], []], ["TensorList"] + [""] * 5, 6),
        _event("gloo:all_gather", [[1000]], ["float"], 7),
        _event("gloo:broadcast", [[1024]], ["double"], 8),
        _event("c10d::barrier", [[]], [""], 9),
    ]
    out = bench_scaling.collectives_of(events, world=2)
    assert [(c["op"], c["bytes"]) for c in out["called"]] == [
        ("allreduce", 120), ("reduce_scatter", 40000), ("all_gather", 8000), ("broadcast", 8192)]
    assert [(c["op"], c["bytes"]) for c in out["ran"]] == [
        ("allreduce", 120), ("allreduce", 40000), ("all_gather", 8000), ("broadcast", 8192)]
    called = bench_scaling.summed(out["called"])
    assert called["control_calls"] == 1 and called["control_sent"] == 120  # 2 (N-1)/N = 1
    assert called["data_sent"] == 20000 + 4000 + 4096  # (N-1)/N each
    assert bench_scaling.summed(out["ran"])["data_sent"] == 40000 + 4000 + 4096


def test_committed_bench_results_match_the_formula():
    """The committed bench/results/scaling.json (a real run of 2, 4 and 8 gloo ranks): every
    system's counted data bytes equal cost_model's formula for the bench's model, to the byte."""
    path = os.path.join(BENCH, "results", "scaling.json")
    if not os.path.exists(path):
        pytest.fail("bench/results/scaling.json is missing: run bench/bench_scaling.py")
    with open(path) as f:
        results = json.load(f)
    tensors = bench_scaling.layer_sizes()
    assert results["model"]["params"] == sum(tensors)
    seen = set()
    for row in results["rows"]:
        formula = cost_model.bytes_per_rank(bench_scaling.SYSTEM[row["system"]],
                                            4 * sum(tensors), row["ranks"], "gloo",
                                            tensors=tensors)
        counted = results["raw"][str(row["ranks"])][row["system"]][0]["called"]["data_sent"]
        assert counted == pytest.approx(formula, abs=0.5), (row["system"], row["ranks"])
        seen.add((row["system"], row["ranks"]))
    assert {w for _, w in seen} == {2, 4, 8}
    assert {s for s, _ in seen} == set(bench_scaling.VARIANTS)


def test_committed_bench_memory_matches_zero_accounting():
    """The same run's gradients + optimizer state per rank (fp32 AdamW: 4 bytes of gradient,
    8 of moments a parameter) equal ZeRO's accounting with those sizes: 12 Psi (DDP), 4 Psi +
    8 Psi/N (ZeRO-1), 12 Psi/N (sharded, FSDP2); plus AdamW's 4-byte step counter for each
    tensor or segment it steps (at most 16 tensors + N segments)."""
    path = os.path.join(BENCH, "results", "scaling.json")
    if not os.path.exists(path):
        pytest.fail("bench/results/scaling.json is missing: run bench/bench_scaling.py")
    with open(path) as f:
        raw = json.load(f)["raw"]
    psi = sum(bench_scaling.layer_sizes())
    for world, per in raw.items():
        for system, records in per.items():
            held = records[0]["grads"] + records[0]["state"]
            formula = cost_model.memory_per_gpu(bench_scaling.SYSTEM[system], psi, int(world),
                                                k=8, param_b=0, grad_b=4)
            assert 0 <= held - formula <= 4 * (16 + int(world)), (system, world)


def test_time_model_overlap_and_shape():
    """The time model: DDP's allreduce hides behind the backward (its exposed part is one
    bucket's); ZeRO-1's and gradmgr sharded's gather after the step is exposed and grows with
    the number of GPUs (the ring's latency); memory per GPU falls as ZeRO says."""
    small, big = cost_model.MODELS
    for model in (small, big):
        ddp8 = cost_model.step_time("ddp", model, 8)
        assert ddp8.exposed < 0.01 * ddp8.total
        for system in ("zero1", "gradmgr-sharded"):
            times = [cost_model.step_time(system, model, n).exposed for n in (16, 256, 1024)]
            assert times == sorted(times) and times[0] > ddp8.exposed
        mem = [cost_model.memory_per_gpu(s, model.psi, 64)
               for s in ("ddp", "zero1", "gradmgr-sharded", "fsdp2")]
        assert mem == sorted(mem, reverse=True)
    assert cost_model.step_time("gradmgr", big, 64) == cost_model.step_time("ddp", big, 64)


def test_ddp_paper_near_linear_at_256_gpus():
    """DDP's paper (PVLDB 2020) reports near-linear scalability on 256 GPUs (its abstract; its
    per-iteration figures could not be retrieved here, so this is the one DDP check): the
    model's weak-scaling efficiency for ResNet50 on V100s is within 10 % of linear (stated
    tolerance), and falls as GPUs are added (the ring's latency, the exposed last bucket)."""
    effs = [cost_model.ddp_scaling_efficiency(n) for n in (8, 32, 256)]
    assert all(e >= 0.90 for e in effs), effs
    assert effs == sorted(effs, reverse=True) and effs[0] <= 1.0


def test_plot_series_full_sharding_and_deferred():
    """The series the plot draws (not the drawing: no matplotlib needed): both models, every
    plotted system from 8 to 1,024 GPUs; memory at the step's peak in ZeRO's order, full
    sharding's by hand; the deferred gather at or below the eager one, below it only where
    its buckets go by broadcasts (25 MiB / N >= 256 KiB: up to 64 GPUs here); full sharding
    at or below DDP's step and below ZeRO-1's from 16 GPUs."""
    drawn = cost_model.series(cost_model.table())
    assert set(drawn) == {"1.3B", "7B"}
    for name, lines in drawn.items():
        assert set(lines) == set(cost_model.PLOTTED)
        for line in lines.values():
            assert line["gpus"] == list(cost_model.WORLDS)
        mem = {s: line["memory_gb"] for s, line in lines.items()}
        step = {s: line["step_s"] for s, line in lines.items()}
        for i, world in enumerate(cost_model.WORLDS):
            assert mem["fsdp2"][i] < mem["gradmgr-sharded"][i] < mem["zero1"][i] < mem["ddp"][i]
            assert mem["gradmgr-deferred"][i] == mem["gradmgr-sharded"][i]
            # reshard off: the whole 16-bit model stays gathered, above ZeRO-2's states
            assert mem["gradmgr-sharded"][i] < mem["fsdp2-noreshard"][i]
            deferred, eager = step["gradmgr-deferred"][i], step["gradmgr-sharded"][i]
            if world <= 64:
                assert deferred < eager, (name, world)
            else:
                assert deferred == eager, (name, world)
            assert step["fsdp2"][i] <= step["ddp"][i], (name, world)
            if world >= 16:
                assert step["fsdp2"][i] < step["zero1"][i], (name, world)
    # 7B on 64 GPUs, full sharding with reshard-after-forward, by hand: 16 Psi / N of states,
    # two layers' 16-bit parameters and one layer's gradient, 2 s b h L of activations
    psi, layer = 6.7e9, 2 * 6.7e9 / 32
    by_hand = 16 * psi / 64 + 3 * layer + 2 * 2048 * 8 * 4096 * 32
    assert drawn["7B"]["fsdp2"]["memory_gb"][3] == pytest.approx(by_hand / GB, rel=1e-12)


def test_docs_scaling_table_is_the_models():
    """docs/sharded.md's 7B table ("How it scales") prints the model's figures: step time on
    8 and 256 GPUs, memory at the peak on 64 and 256, to the digits printed."""
    docs = os.path.join(os.path.dirname(BENCH), "docs", "sharded.md")
    with open(docs) as f:
        text = f.read()
    rows = {"DDP": "ddp", "ZeRO-1": "zero1", "ZeRO-2, eager gather": "gradmgr-sharded",
            'ZeRO-2, `gather="deferred"`': "gradmgr-deferred", "full sharding": "fsdp2",
            "full, `reshard_after_forward=False`": "fsdp2-noreshard"}
    table = cost_model.table()

    def cell(system: str, world: int, key: str) -> float:
        return next(r[key] for r in table if r["model"] == "7B" and r["system"] == system
                    and r["gpus"] == world)

    for label, system in rows.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {label} |"))
        printed = [float(v) for v, _ in re.findall(r"(\d+\.\d+) (s|GB)", line)]
        model = [cell(system, 8, "step_s"), cell(system, 256, "step_s"),
                 cell(system, 64, "peak_gb"), cell(system, 256, "peak_gb")]
        assert printed == [round(m, 2 if i < 2 else 1) for i, m in enumerate(model)], label


def test_docs_scaling_ratios_are_the_models():
    """docs/sharded.md's ratios to DDP's step, over both models: ZeRO-2's eager gather and
    ZeRO-1 from 16 to 1,024 GPUs (8-21 %, 8-44 %), full sharding from 8 (0.985-0.990)."""
    def span(system: str, least: int) -> tuple:
        ratios = [cost_model.step_time(system, m, n).total / cost_model.step_time("ddp", m, n).total
                  for m in cost_model.MODELS for n in cost_model.WORLDS if n >= least]
        return min(ratios), max(ratios)

    low, high = span("gradmgr-sharded", 16)
    assert (round(100 * (low - 1)), round(100 * (high - 1))) == (8, 21)
    low, high = span("zero1", 16)
    assert (round(100 * (low - 1)), round(100 * (high - 1))) == (8, 44)
    for system in ("fsdp2", "fsdp2-noreshard"):
        low, high = span(system, 8)
        assert (round(low, 3), round(high, 3)) == (0.985, 0.99)


def test_formula_counts_the_bytes_the_reducer_path_sends():
    """The formula's small term for gradmgr's default path (its reducer's "used" flags and
    failure marker, padded to 64-byte lines) is what one step of ``data_parallel`` sends: a
    profiled step on a process group of one rank, bench_scaling's 16 tensors at width 64.
    The committed run alone cannot tell: it holds the bytes of the code that made it."""
    import torch
    import torch.distributed as dist

    from gradmgr.distributed import data_parallel, free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(bench_scaling.LAYERS)])
        sizes = [p.numel() for p in net.parameters()]
        assert len(sizes) == len(bench_scaling.layer_sizes())
        step = functools.partial(_train_step, data_parallel(net), net)
        step()  # the first step also checks and plans
        called = bench_scaling.profiled_step(step, 1)["called"]
        payload = bench_scaling.summed(called)["data_payload"]
        assert payload == 4 * (sum(sizes) + cost_model.reducer_flags(len(sizes), 4)), called
        assert cost_model.reducer_flags(len(sizes), 4) == 32  # 17 floats, padded to 2 lines
        del step
    finally:
        dist.destroy_process_group()


def _train_step(gm, net) -> None:
    import torch

    with gm:
        gm.backward(net(torch.ones(4, 64)).sum())
