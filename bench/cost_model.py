"""A cost model on paper: step time and memory per GPU for data-parallel systems, 8 to 1,024 GPUs.

Pure Python (matplotlib only for the plot). What each system moves per step, per rank, with
Psi parameters of ``b`` bytes each (a ring's costs: an allreduce of S bytes sends 2(N-1)/N S
from each rank, a reduce-scatter of an S-byte input, an all-gather of an S-byte output and a
broadcast of S bytes (N-1)/N S):

- DDP, gradmgr ``data_parallel``: an allreduce of the gradients, in buckets, during the
  backward: 2(N-1)/N b Psi;
- ZeRO-1 (DDP + ``ZeroRedundancyOptimizer``): the same, then each parameter broadcast from
  the rank that stepped it: 3(N-1)/N b Psi;
- gradmgr sharded (ZeRO-2): each bucket reduce-scattered during the backward, then after the
  optimizer step every rank's slices gathered (broadcasts, or an all-gather a bucket):
  2(N-1)/N b Psi;
- FSDP2 ``reshard_after_forward=True`` (ZeRO-3): an all-gather a layer in the forward and again
  in the backward, a reduce-scatter a layer: 3(N-1)/N b Psi;
- FSDP2 ``reshard_after_forward=False``: the all-gathers in the forward only: 2(N-1)/N b Psi;
- gradmgr full sharding (``data_parallel(model, shard="full")``) is FSDP2 (``fully_shard`` per
  block, then the root): FSDP2's rows; ``gather="deferred"`` moves what the eager gather moves.

On the CPU with gloo, gradmgr sharded allreduces each bucket and keeps its chunk (gloo's own
reduce-scatter is an allreduce of a copy): 3(N-1)/N b Psi there (``backend="gloo"``).

Time per step (the alpha-beta model): compute from FLOPs, ``6 Psi T`` for T tokens a GPU
(forward 2, backward 4), at ``MFU`` of the GPU's peak; each collective costs ``hops x alpha +
bytes sent / bandwidth``, with hops = 2(N-1) for a ring allreduce, N-1 for the others, taken
hierarchically (a ring within the node over NVLink, one across the nodes over InfiniBand: the
latency is 2(g-1) alpha_nvlink + 2(n-1) alpha_ib for g GPUs a node and n nodes, and the bytes go
at the slower link's bandwidth). What overlaps with what:

- DDP, gradmgr: the bucket allreduces run during the backward; the last bucket's is exposed;
- ZeRO-1: as DDP, then the optimizer steps 1/N, then the parameter broadcasts, exposed
  (torch's ``overlap_with_ddp`` is off by default);
- gradmgr sharded: the reduce-scatters during the backward (one bucket in flight), the
  optimizer on 1/N, then the gather, exposed (docs/sharded.md: ``step()`` gathers); with
  ``gather="deferred"``, a bucket gathered by broadcasts (its segments 256 KiB or more on
  average: about ``bucket_bytes / N``) runs behind the next forward, all but the first
  bucket hidden; one gathered through a buffer (smaller segments: many ranks) stays exposed;
- FSDP2: each layer's all-gather is prefetched behind the previous layer's compute (forward
  and backward), the reduce-scatters run behind the backward; the first all-gather and the
  last reduce-scatter are exposed.

Memory per GPU (ZeRO's accounting, mixed-precision Adam: 2 bytes of fp16/bf16 parameters, 2 of
gradients, K = 12 of fp32 master parameters and the two moments, per parameter):
DDP (2+2+K) Psi; ZeRO-1 (P_os) 4 Psi + K Psi/N; ZeRO-2 (P_os+g, gradmgr sharded) 2 Psi +
(2+K) Psi/N; ZeRO-3 (P_os+g+p, FSDP2) (2+2+K) Psi/N. Activations are added separately (with
full activation checkpointing: the 2-byte input of each layer, ``2 s b h L``). The plot's
memory is at the step's peak: these, the activations, and the parameters full sharding
gathers (:func:`working_bytes`: two layers with reshard-after-forward, the whole 16-bit model
without it).

Checked against the ZeRO paper's figure 1 (exact: it is arithmetic) and its communication
volumes (ZeRO-2 = DDP, ZeRO-3 = 1.5 x DDP); see :data:`PUBLISHED` and ``tests/test_cost_model.py``.

    python bench/cost_model.py                                  # tables and checks
    python bench/cost_model.py --plot docs/img/cost_model.svg   # and the plot (matplotlib)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

GB = 1e9  # the ZeRO paper's GB (10^9 bytes)
BROADCAST_SEGMENT = 2**18  # gradmgr's sharded gather broadcasts segments this large (gather.py)

SYSTEMS = ("ddp", "gradmgr", "zero1", "gradmgr-sharded", "gradmgr-deferred", "fsdp2",
           "fsdp2-noreshard")
LABELS = {
    "ddp": "DDP",
    "gradmgr": "gradmgr data_parallel",
    "zero1": "ZeRO-1 (DDP + ZeroRedundancyOptimizer)",
    "gradmgr-sharded": "gradmgr shard=True (ZeRO-2), eager gather",
    "gradmgr-deferred": "gradmgr shard=True (ZeRO-2), gather='deferred'",
    "fsdp2": "full: gradmgr shard='full' = FSDP2 (ZeRO-3)",
    "fsdp2-noreshard": "full, reshard_after_forward=False",
}
SAME_AS = {"gradmgr-deferred": "gradmgr-sharded"}
"""Systems that move and hold what another does (the deferred gather moves the same bytes,
later). gradmgr's full sharding is FSDP2 itself (``fully_shard`` per block, then the root;
over gloo it asks FSDP2 for sums, which moves the same bytes): its rows are ``fsdp2``'s."""


# ---------------------------------------------------------------------------------- bytes
def ring_bytes_per_rank(kind: str, nbytes: float, world: int) -> float:
    """Bytes one rank sends in a ring collective over ``world`` ranks. ``nbytes``: the buffer
    (allreduce, broadcast), the whole input (reduce-scatter) or the whole output (all-gather).

    >>> ring_bytes_per_rank("allreduce", 100, 4), ring_bytes_per_rank("all_gather", 100, 4)
    (150.0, 75.0)
    """
    if world < 2:
        return 0.0
    share = (world - 1) / world * nbytes
    if kind == "allreduce":
        return 2 * share
    if kind in ("reduce_scatter", "all_gather", "broadcast"):
        return share
    raise ValueError(f"unknown collective {kind!r}")


def collectives(system: str, param_bytes: float, backend: str = "nccl") -> List[Tuple[str, float]]:
    """The data collectives of one step: (kind, bytes) with the sizes of
    :func:`ring_bytes_per_rank`. ``backend="gloo"``: what gradmgr's CPU transport calls."""
    p = param_bytes
    system = SAME_AS.get(system, system)
    if system in ("ddp", "gradmgr"):
        return [("allreduce", p)]
    if system == "zero1":
        return [("allreduce", p), ("broadcast", p)]
    if system == "gradmgr-sharded":
        scatter = "allreduce" if backend == "gloo" else "reduce_scatter"
        return [(scatter, p), ("all_gather", p)]  # the gather: broadcasts or all-gathers alike
    if system == "fsdp2":
        return [("all_gather", p), ("all_gather", p), ("reduce_scatter", p)]
    if system == "fsdp2-noreshard":
        return [("all_gather", p), ("reduce_scatter", p)]
    raise ValueError(f"unknown system {system!r}")


def bytes_per_rank(system: str, param_bytes: float, world: int, backend: str = "nccl",
                   tensors: Optional[Sequence[int]] = None) -> float:
    """Bytes each rank sends per step (data collectives). ``tensors``: the parameters' element
    counts, for the small terms: gradmgr's reducer path reduces one "used" flag per tensor
    and a failure marker with the last bucket, padded to a whole number of 64-byte lines
    (:func:`reducer_flags`); gradmgr sharded pads each bucket to a multiple
    of ``world`` elements (nothing when each bucket's length divides, as for whole Linear
    layers of even width)."""
    total = 0.0
    system = SAME_AS.get(system, system)
    elem = param_bytes / sum(tensors) if tensors else 0
    for kind, nbytes in collectives(system, param_bytes, backend):
        if system == "gradmgr-sharded" and tensors is not None and kind != "all_gather":
            nbytes += _padding_bytes(tensors, world, elem)
        if system == "gradmgr" and tensors is not None:  # its reducer's used-flags member
            nbytes += reducer_flags(len(tensors), elem) * elem
        total += ring_bytes_per_rank(kind, nbytes, world)
    return total


def reducer_flags(tensors: int, elem: float) -> int:
    """The elements of gradmgr's reducer flags for ``tensors`` tensors of ``elem``-byte
    elements: a "used" flag each and a failure marker, padded to whole 64-byte lines (so that
    a communication hook's view of the last bucket starts where DDP's does)."""
    per_line = max(1, int(64 // elem)) if elem else 1
    return -(-(tensors + 1) // per_line) * per_line


def _padding_bytes(tensors: Sequence[int], world: int, elem: float,
                   first: int = 2**20, cap: int = 16 * 2**20) -> float:
    """gradmgr sharded's buckets (in reverse order, the first closed at 1 MiB, the others at
    16 MiB: its defaults) padded to a multiple of ``world`` elements: the padding's bytes."""
    pad, filled, limit = 0, 0, first
    for n in reversed(list(tensors)):
        filled += n
        if filled * elem >= limit:
            pad += -filled % world
            filled, limit = 0, cap
    if filled:
        pad += -filled % world
    return pad * elem


# ---------------------------------------------------------------------------------- memory
def memory_per_gpu(system: str, psi: float, world: int, k: float = 12,
                   param_b: float = 2, grad_b: float = 2) -> float:
    """Bytes of model states per GPU (ZeRO's accounting; activations not included)."""
    system = SAME_AS.get(system, system)
    if system in ("ddp", "gradmgr"):
        return (param_b + grad_b + k) * psi
    if system == "zero1":  # P_os
        return (param_b + grad_b) * psi + k * psi / world
    if system == "gradmgr-sharded":  # P_os+g
        return param_b * psi + (grad_b + k) * psi / world
    if system in ("fsdp2", "fsdp2-noreshard"):  # P_os+g+p (at rest; gathered layers on top)
        return (param_b + grad_b + k) * psi / world
    raise ValueError(f"unknown system {system!r}")


# ---------------------------------------------------------------------------------- models
class Model(NamedTuple):
    name: str
    psi: float  # parameters
    layers: int
    hidden: int


MODELS = (Model("1.3B", 1.3e9, 24, 2048), Model("7B", 6.7e9, 32, 4096))
"""GPT-3 XL's shape (1.3B: 24 layers, hidden 2048) and LLaMA-7B's (6.7B: 32 x 4096)."""


class Cluster(NamedTuple):
    """The hardware assumed (every number stated where the model is printed)."""

    gpu: str = "A100 80GB SXM"
    peak_flops: float = 312e12  # dense bf16, NVIDIA's A100 datasheet
    mfu: float = 0.40  # fraction of peak the model's matmuls reach (assumed)
    hbm_bytes_s: float = 2.0e12  # HBM2e, for the optimizer step (memory-bound)
    capacity: float = 80 * GB
    gpus_per_node: int = 8
    nvlink_bytes_s: float = 230e9  # NCCL bus bandwidth within a DGX A100 (NVLink 3), assumed
    nvlink_alpha_s: float = 5e-6  # per ring hop within the node, assumed
    ib_bytes_s: float = 25e9  # 200 Gb/s HDR InfiniBand per GPU (DGX A100: one HCA a GPU)
    ib_alpha_s: float = 10e-6  # per ring hop across nodes, assumed


class Workload(NamedTuple):
    seq: int = 2048
    micro_batch: int = 8  # sequences per GPU per step (weak scaling: fixed per GPU)
    bucket_bytes: float = 25 * 2**20  # DDP's and gradmgr's bucket size (25 MiB)
    param_bytes: float = 2  # bf16 parameters and gradients on the wire
    tensors_per_layer: int = 12  # parameter tensors of a transformer layer (broadcasts: ZeRO-1)

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch


DEFAULT_CLUSTER = Cluster()
DEFAULT_WORK = Workload()


def collective_time(kind: str, nbytes: float, world: int, cluster: Cluster) -> float:
    """Hierarchical ring: latency per hop within and across nodes, the bytes at the slower
    link's bandwidth."""
    if world < 2:
        return 0.0
    g = min(world, cluster.gpus_per_node)
    n = math.ceil(world / g)
    hops = (lambda m: 2 * (m - 1)) if kind == "allreduce" else (lambda m: m - 1)
    latency = hops(g) * cluster.nvlink_alpha_s + hops(n) * cluster.ib_alpha_s
    bandwidth = cluster.ib_bytes_s if n > 1 else cluster.nvlink_bytes_s
    return latency + ring_bytes_per_rank(kind, nbytes, world) / bandwidth


class Step(NamedTuple):
    total: float
    compute: float
    comm: float  # all communication time, hidden or not
    exposed: float  # the part of it not behind compute


def step_time(system: str, model: Model, world: int, cluster: Cluster = DEFAULT_CLUSTER,
              work: Workload = DEFAULT_WORK, compute_s: Optional[float] = None,
              gather_behind_forward: bool = False) -> Step:
    """One step's time: compute, communication, and how much of it overlaps (module doc).
    ``compute_s`` replaces the FLOP count's compute time; ``gather_behind_forward``:
    gradmgr sharded's step with ``ShardedOptimizer(gather="deferred")``, which leaves behind
    the next forward only the buckets it gathers by broadcasts (module doc); the system
    ``gradmgr-deferred`` is that step."""
    if system == "gradmgr-deferred":
        system, gather_behind_forward = "gradmgr-sharded", True
    flops = 6 * model.psi * work.tokens
    compute = flops / (cluster.peak_flops * cluster.mfu) if compute_s is None else compute_s
    fwd, bwd = compute / 3, 2 * compute / 3
    grads = work.param_bytes * model.psi
    buckets = max(1, math.ceil(grads / work.bucket_bytes))
    # AdamW reads and writes the fp32 master, both moments, reads the gradient, writes the
    # 16-bit parameter: about 28 bytes a parameter of HBM traffic
    opt_full = 28 * model.psi / cluster.hbm_bytes_s

    def per_bucket(kind: str, nbytes: float, count: int) -> float:
        return count * collective_time(kind, nbytes / count, world, cluster)

    if system in ("ddp", "gradmgr", "zero1", "gradmgr-sharded"):
        kind = "reduce_scatter" if system == "gradmgr-sharded" else "allreduce"
        reduce = per_bucket(kind, grads, buckets)
        tail = reduce / buckets
        behind = fwd + max(bwd, reduce - tail) + tail
        after = 0.0
        opt = opt_full if system in ("ddp", "gradmgr") else opt_full / world
        if system == "zero1":
            count = work.tensors_per_layer * model.layers  # one broadcast per parameter tensor
            after = per_bucket("broadcast", grads, count)
        elif system == "gradmgr-sharded":
            after = per_bucket("all_gather", grads, buckets)
            if gather_behind_forward and work.bucket_bytes / world >= BROADCAST_SEGMENT:
                # the next forward hides it but for the first bucket
                first = after / buckets
                behind += max(0.0, after - first - fwd) + first
                after = 0.0
        total = behind + opt + after
        comm = reduce + after
        return Step(total, compute, comm, total - compute - opt)
    if system in ("fsdp2", "fsdp2-noreshard"):
        layers = model.layers
        gather = per_bucket("all_gather", grads, layers)
        scatter = per_bucket("reduce_scatter", grads, layers)
        regather = gather if system == "fsdp2" else 0.0
        forward = max(fwd, gather) + gather / layers
        backward = max(bwd, regather + scatter) + scatter / layers
        total = forward + backward + opt_full / world
        comm = gather + regather + scatter
        return Step(total, compute, comm, total - compute - opt_full / world)
    raise ValueError(f"unknown system {system!r}")


def activation_bytes(model: Model, work: Workload = DEFAULT_WORK) -> float:
    """With full activation checkpointing: each layer's 2-byte input, ``2 s b h L``."""
    return 2 * work.seq * work.micro_batch * model.hidden * model.layers


def working_bytes(system: str, model: Model, world: int,
                  work: Workload = DEFAULT_WORK) -> float:
    """Bytes a step holds at its peak beyond the model states, for the parameters full
    sharding gathers to compute (16-bit): FSDP2 with reshard-after-forward holds two layers
    gathered (the one computing, the one prefetched) and, in the backward, one layer's
    unsharded gradient before its reduce-scatter; without it every layer stays gathered from
    its forward to its backward (2 Psi, what ZeRO-2 holds anyway), plus that gradient. The
    other systems' working buffers (a bucket or two in flight, 25 MiB each) are left out."""
    layer = work.param_bytes * model.psi / model.layers
    if world < 2:
        return 0.0
    if system == "fsdp2":
        return 2 * layer + layer
    if system == "fsdp2-noreshard":
        return work.param_bytes * model.psi + layer
    return 0.0


# ---------------------------------------------------------------------------------- papers
class Published(NamedTuple):
    what: str
    value: float
    unit: str
    source: str


ZERO_SOURCE = ("Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion "
               "Parameter Models, SC20 (arXiv:1910.02054), figure 1: 7.5B parameters, K = 12, "
               "N_d = 64")
PUBLISHED: Dict[str, Published] = {
    "ddp": Published("ZeRO fig. 1, baseline DP, 7.5B, 64 GPUs", 120, "GB", ZERO_SOURCE),
    "zero1": Published("ZeRO fig. 1, P_os", 31.4, "GB", ZERO_SOURCE),
    "gradmgr-sharded": Published("ZeRO fig. 1, P_os+g", 16.6, "GB", ZERO_SOURCE),
    "fsdp2": Published("ZeRO fig. 1, P_os+g+p", 1.88, "GB", ZERO_SOURCE),
}
COMM_SOURCE = ("ZeRO (SC20), section 7 (communication analysis): P_os and P_os+g move 2 Psi per "
               "step, as data parallelism does; P_os+g+p 3 Psi, 1.5x")
COMM_RATIOS = {"gradmgr-sharded": 1.0, "fsdp2": 1.5}
"""Bytes per step relative to DDP's, as ZeRO states them for P_os+g and P_os+g+p."""


def zero_checks() -> List[Tuple[str, float, float, str]]:
    """(what, model, paper, unit) for the ZeRO memory figure and the communication ratios."""
    rows = []
    for system, pub in PUBLISHED.items():
        model = memory_per_gpu(system, 7.5e9, 64) / GB
        rows.append((f"{pub.what} ({LABELS[system]})", model, pub.value, pub.unit))
    ddp = bytes_per_rank("ddp", 1.0, 64)
    for system, ratio in COMM_RATIOS.items():
        rows.append((f"bytes per step / DDP's, {LABELS[system]}",
                     bytes_per_rank(system, 1.0, 64) / ddp, ratio, "x"))
    return rows


DDP_SOURCE = ("Li et al., PyTorch Distributed: Experiences on Accelerating Data Parallel "
              "Training, PVLDB 13(12), 2020 (arXiv:2006.15704), abstract: DDP 'attains "
              "near-linear scalability using 256 GPUs'")
RESNET50 = Model("ResNet50", 25.557e6, 16, 0)  # torchvision's resnet50: 25,557,032 parameters
"""ResNet50, as DDP's paper trains it: 3.8e9 multiply-adds a 224 x 224 image forward (He et al.,
CVPR 2016, table 1), so 3 x 2 x 3.8e9 FLOPs a training sample."""
V100 = Cluster(gpu="V100 SXM2", peak_flops=15.7e12, mfu=0.40, hbm_bytes_s=0.9e12,
               capacity=32 * GB, nvlink_bytes_s=130e9, ib_bytes_s=12.5e9)
"""The DDP paper's era: V100s (fp32 peak 15.7 TFLOP/s), 8 a server on NVLink, servers on
100 Gb/s InfiniBand (assumed: the paper's exact figures could not be retrieved here)."""


def ddp_scaling_efficiency(world: int, batch: int = 32, cluster: Cluster = V100) -> float:
    """DDP's weak-scaling efficiency for ResNet50 in fp32, ``batch`` images a GPU: the step
    time on 1 GPU over the step time on ``world`` GPUs (1.0: linear)."""
    compute = 3 * 2 * 3.8e9 * batch / (cluster.peak_flops * cluster.mfu)
    work = Workload(param_bytes=4)
    one = step_time("ddp", RESNET50, 1, cluster, work, compute_s=compute).total
    return one / step_time("ddp", RESNET50, world, cluster, work, compute_s=compute).total


def printed_precision(value: float) -> int:
    """Decimals the paper printed (31.4: 1, 1.88: 2, 120: 0)."""
    text = f"{value}".rstrip("0").rstrip(".")
    return len(text.split(".")[1]) if "." in text else 0


# ---------------------------------------------------------------------------------- output
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
PLOTTED = ("ddp", "zero1", "gradmgr-sharded", "gradmgr-deferred", "fsdp2", "fsdp2-noreshard")
"""The plot's lines (``gradmgr``, DDP's reducer, is DDP's line but for a few bytes of flags)."""


def table(cluster: Cluster = DEFAULT_CLUSTER,
          work: Workload = DEFAULT_WORK) -> List[Dict[str, object]]:
    rows = []
    for model in MODELS:
        act = activation_bytes(model, work)
        for world in WORLDS:
            for system in SYSTEMS:
                step = step_time(system, model, world, cluster, work)
                mem = memory_per_gpu(system, model.psi, world)
                peak = mem + working_bytes(system, model, world, work) + act
                rows.append({"model": model.name, "gpus": world, "system": system,
                             "step_s": step.total, "compute_s": step.compute,
                             "exposed_s": step.exposed,
                             "sent_gb": bytes_per_rank(system, work.param_bytes * model.psi,
                                                       world) / GB,
                             "states_gb": mem / GB, "peak_gb": peak / GB,
                             "fits": peak <= cluster.capacity})
    return rows


def series(rows: List[Dict[str, object]]) -> Dict[str, Dict[str, Dict[str, list]]]:
    """What the plot draws: per model and system of :data:`PLOTTED`, the GPUs, the step time
    (s) and the memory per GPU at the step's peak (GB: model states, gathered parameters,
    checkpointed activations)."""
    out: Dict[str, Dict[str, Dict[str, list]]] = {}
    for model in MODELS:
        out[model.name] = {}
        for system in PLOTTED:
            mine = sorted((r for r in rows if r["model"] == model.name
                           and r["system"] == system), key=lambda r: r["gpus"])
            out[model.name][system] = {"gpus": [r["gpus"] for r in mine],
                                       "step_s": [r["step_s"] for r in mine],
                                       "memory_gb": [r["peak_gb"] for r in mine]}
    return out


def assumptions(cluster: Cluster = DEFAULT_CLUSTER, work: Workload = DEFAULT_WORK) -> str:
    return (f"assumed: {cluster.gpu}, {cluster.peak_flops / 1e12:.0f} TFLOP/s bf16 peak at "
            f"{cluster.mfu:.0%} MFU; {work.micro_batch} x {work.seq} tokens per GPU per step "
            f"(6 x params x tokens FLOPs); {cluster.gpus_per_node} GPUs a node on NVLink "
            f"({cluster.nvlink_bytes_s / 1e9:.0f} GB/s bus bandwidth, "
            f"{cluster.nvlink_alpha_s * 1e6:.0f} us a hop), nodes on "
            f"{cluster.ib_bytes_s * 8 / 1e9:.0f} Gb/s InfiniBand a GPU "
            f"({cluster.ib_alpha_s * 1e6:.0f} us a hop); bf16 gradients in "
            f"{work.bucket_bytes / 2**20:.0f} MiB buckets; AdamW memory-bound at "
            f"{cluster.hbm_bytes_s / 1e12:.1f} TB/s; activations checkpointed per layer; "
            f"full sharding per layer")


def print_tables(rows: List[Dict[str, object]]) -> None:
    for model in MODELS:
        print(f"\n{model.name} parameters: step time s (exposed communication s) / memory GB "
              f"per GPU at the step's peak (* does not fit 80 GB)")
        print(f"{'GPUs':>5} " + " ".join(f"{s:>22}" for s in SYSTEMS))
        for world in WORLDS:
            cells = []
            for system in SYSTEMS:
                r = next(r for r in rows if r["model"] == model.name and r["gpus"] == world
                         and r["system"] == system)
                mark = " " if r["fits"] else "*"
                cells.append(f"{r['step_s']:5.2f} ({r['exposed_s']:4.2f}) "
                             f"{r['peak_gb']:6.1f}{mark}")
            print(f"{world:5d} " + " ".join(f"{c:>22}" for c in cells))
    print("columns: " + "; ".join(f"{s} = {LABELS[s]}" for s in SYSTEMS))


def print_checks() -> None:
    print(f"\nchecked against the published figures ({ZERO_SOURCE}; {COMM_SOURCE}):")
    print(f"{'what':<72} {'model':>9} {'paper':>7} {'rel. error':>10}")
    for what, model, paper, unit in zero_checks():
        err = (round(model, printed_precision(paper)) - paper) / paper
        print(f"{what:<72} {model:9.4f} {paper:7g} {err:10.1e}  {unit}")
    print(f"\n{DDP_SOURCE}; the model's DDP weak-scaling efficiency, ResNet50 fp32, 32 images "
          f"a GPU, {V100.gpu}s, 100 Gb/s InfiniBand (assumed): 'near-linear' read as >= 0.90")
    for world in (8, 32, 256):
        print(f"  {world:4d} GPUs: {ddp_scaling_efficiency(world):.3f}")
    print("torch's ZeRO-1 (an allreduce, then broadcasts) moves 1.5 x DDP's bytes, not ZeRO's "
          "P_os 1.0 x (a reduce-scatter, then an all-gather): "
          f"{bytes_per_rank('zero1', 1.0, 64) / bytes_per_rank('ddp', 1.0, 64):.2f}")
    for model in MODELS:
        for world in (8, 256):
            now = step_time("gradmgr-sharded", model, world)
            hidden = step_time("gradmgr-deferred", model, world)
            how = ("by broadcasts, deferred" if DEFAULT_WORK.bucket_bytes / world
                   >= BROADCAST_SEGMENT else "through a buffer, not deferred")
            print(f"{model.name} on {world} GPUs: gradmgr sharded's gather='deferred' "
                  f"({DEFAULT_WORK.bucket_bytes / 2**20:.0f} MiB buckets gathered {how}): "
                  f"{now.total:.2f} s -> {hidden.total:.2f} s a step "
                  f"(DDP {step_time('ddp', model, world).total:.2f} s)")


def plot(rows: List[Dict[str, object]], path: str, cluster: Cluster = DEFAULT_CLUSTER) -> None:
    """Step time and memory per GPU against GPUs, one column a model; ``path``'s suffix
    chooses the format (``.svg``: written without a date, so that a rerun rewrites the same
    file)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "bench/cost_model.py"  # stable ids in the SVG
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text: a smaller file
    styles = {"ddp": "-", "zero1": "-", "gradmgr-sharded": "-", "gradmgr-deferred": "--",
              "fsdp2": "-", "fsdp2-noreshard": ":"}
    drawn = series(rows)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for col, model in enumerate(MODELS):
        for system, line in drawn[model.name].items():
            style = dict(marker="o", markersize=3, label=LABELS[system],
                         linestyle=styles[system])
            axes[0][col].plot(line["gpus"], line["step_s"], **style)
            axes[1][col].plot(line["gpus"], line["memory_gb"], **style)
        compute = next(r["compute_s"] for r in rows if r["model"] == model.name)
        axes[0][col].axhline(compute, color="grey", linewidth=0.8, linestyle="--")
        axes[0][col].set_title(f"{model.name}: step time (s); grey: compute alone",
                               fontsize=10)
        axes[1][col].axhline(cluster.capacity / GB, color="red", linewidth=0.8, linestyle="--")
        axes[1][col].set_title(f"{model.name}: memory per GPU at the step's peak (GB); "
                               f"red: {cluster.capacity / GB:.0f} GB", fontsize=10)
        axes[1][col].set_yscale("log")
        ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200) if t <= 1.5 * cluster.capacity / GB]
        axes[1][col].set_yticks(ticks, [str(t) for t in ticks])
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(WORLDS))
            ax.set_xticklabels([str(w) for w in WORLDS])
            ax.set_xlabel("GPUs")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(f"bench/cost_model.py, on paper ({assumptions(cluster)})",
                                         170)), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    extra = {"metadata": {"Date": None}} if path.endswith(".svg") else {}
    fig.savefig(path, dpi=90, **extra)
    plt.close(fig)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw the plot to PATH (.svg or .png; needs matplotlib), "
                             "e.g. docs/img/cost_model.svg")
    args = parser.parse_args(argv)
    print(__doc__.splitlines()[0])
    print(assumptions())
    rows = table()
    print_tables(rows)
    print_checks()
    if args.plot:
        directory = os.path.dirname(os.path.abspath(args.plot))
        os.makedirs(directory, exist_ok=True)
        plot(rows, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
