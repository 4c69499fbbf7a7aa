"""Helpers shared by the benchmarks: machine description, interleaved timing, result lines.

Timing method: every round runs each variant being compared once, in a new random order, so
that drift in machine load and the state one step leaves for the next hit them alike; each
sample is one step timed with ``perf_counter``; the result is the median over all samples.
Set-up work (clearing ``.grad``) is outside the timed region.
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

RESULT_PREFIX = "RESULT"
"""Lines starting with this are collected by run_all.py into its summary."""


MMAP_THRESHOLD = 128 * 1024
"""glibc's ``MALLOC_MMAP_THRESHOLD_`` for ranks whose peak RSS is measured: every block of 128
KiB and more is a mapping of its own, so a freed tensor leaves the resident set at once (under
glibc's default, adaptive threshold freed blocks stay in the heap, and a peak taken after them
counts them). It also gives every such block fresh pages to fault in, which slows a step that
allocates afresh each time: time steps under glibc's default (bench/RESULTS.md, wt/zprofile)."""


def allocator_label(threshold: Optional[int]) -> str:
    return "glibc's default allocator" if threshold is None else \
        f"MALLOC_MMAP_THRESHOLD_={threshold}"


@contextlib.contextmanager
def allocator(threshold: Optional[int]) -> Iterator[str]:
    """Processes started inside run with glibc's ``MALLOC_MMAP_THRESHOLD_=threshold`` (None:
    unset, glibc's default allocator); yields :func:`allocator_label`. glibc reads it when a
    process starts, so this process keeps its own; ``os.environ`` is restored on the way out."""
    key = "MALLOC_MMAP_THRESHOLD_"
    before = os.environ.pop(key, None)
    if threshold is not None:
        os.environ[key] = str(threshold)
    try:
        yield allocator_label(threshold)
    finally:
        os.environ.pop(key, None)
        if before is not None:
            os.environ[key] = before


def ranks_output(rank_main: Callable[..., Any], world: int, *args: Any) -> Optional[str]:
    """Run ``rank_main(rank, world, port, *args, out)`` on ``world`` local ranks
    (``gradmgr.distributed.spawn_local``) and return what they wrote to the file ``out`` (rank
    0, as a rule); None where a rank failed."""
    from gradmgr.distributed import spawn_local

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out = os.path.join(tmp, "out")
        if spawn_local(rank_main, world, *args, out):
            return None
        with open(out) as f:
            return f.read()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(frameworks: Optional[List[str]] = None) -> str:
    """One paragraph: CPU, cores, load, Python and framework versions."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    versions = [f"Python {platform.python_version()}"]
    for name in frameworks or []:
        module = sys.modules.get(name)
        if module is not None:
            versions.append(f"{name} {getattr(module, '__version__', '?')}")
    import gradmgr

    versions.append(f"gradmgr {gradmgr.__version__}")
    return (f"machine: {cpu_model()}, {cores} cores usable, load average {load}\n"
            f"versions: {', '.join(versions)}")


class Timing:
    """Samples of one variant, in seconds."""

    def __init__(self) -> None:
        self.samples: List[float] = []

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)


def grad_clearers(params: Dict[str, List[Any]]) -> Dict[str, Callable[[], None]]:
    """For each variant, an (untimed) set-up that sets ``.grad = None`` on its tensors."""

    def clearer(tensors: List[Any]) -> Callable[[], None]:
        def clear() -> None:
            for t in tensors:
                t.grad = None

        return clear

    return {name: clearer(list(tensors)) for name, tensors in params.items()}


def interleaved(
    variants: Dict[str, Callable[[], None]],
    samples: int,
    setups: Optional[Dict[str, Callable[[], None]]] = None,
    warmup: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> Dict[str, Timing]:
    """Time each variant ``samples`` times, in a new random order every round.

    A step's time depends on what ran just before it (the allocator's free lists, caches): with
    a fixed or alternating order, a variant that always follows the same neighbour was measured
    up to 5 % slower or faster for that reason alone (MegEngine mlp-1024). Shuffling every round
    spreads those effects over all variants.

    ``setups[name]`` (untimed) runs before every call of ``variants[name]``. ``clock``:
    ``time.thread_time`` times the calling thread's CPU only (single-threaded CPU work on a
    machine busy with other jobs).
    """
    names = list(variants)
    setups = setups or {}
    nothing: Callable[[], None] = lambda: None  # noqa: E731
    for name in names:
        for _ in range(warmup):
            setups.get(name, nothing)()
            variants[name]()
    timings = {name: Timing() for name in names}
    order = list(names)
    shuffle = random.Random(0).shuffle
    for _ in range(samples):
        shuffle(order)
        for name in order:
            setups.get(name, nothing)()
            fn = variants[name]
            start = clock()
            fn()
            timings[name].samples.append(clock() - start)
    return timings


def samples_for(fn: Callable[[], None], budget_s: float, lo: int = 30, hi: int = 2000,
                setup: Optional[Callable[[], None]] = None) -> int:
    """How many samples of ``fn`` fit in ``budget_s`` seconds, clamped to ``[lo, hi]``."""
    runs = 3
    start = time.perf_counter()
    for _ in range(runs):
        if setup is not None:
            setup()
        fn()
    per_call = (time.perf_counter() - start) / runs
    return max(lo, min(hi, int(budget_s / max(per_call, 1e-9))))


def result(name: str, value: float, target: Optional[float] = None, unit: str = "x") -> str:
    """Print and return one machine-readable result line (``RESULT name value [target]``)."""
    if target is None:
        line = f"{RESULT_PREFIX} {name}: {value:.3f}{unit}"
    else:
        verdict = "OK" if value <= target else "MISS"
        line = f"{RESULT_PREFIX} {name}: {value:.3f}{unit} (target <= {target:.2f}) {verdict}"
    print(line, flush=True)
    return line


def rss() -> int:
    """This process's resident set now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """This process's peak resident set (``VmHWM``) in bytes, since start or
    :func:`reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    """Set ``VmHWM`` to the resident set now (Linux: ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
