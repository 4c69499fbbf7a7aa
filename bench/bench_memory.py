"""gradmgr on PyTorch: peak memory of a step relative to a plain ``loss.backward()``.

Method (CPU): each step runs once under ``torch.profiler.profile(profile_memory=True)``, which
records every allocation and free of PyTorch's CPU allocator with its size and time; sorting
those events by time and taking the largest running sum gives the peak of bytes held by tensors
during the step, relative to what was alive before it (inputs, weights and anything alive
across steps do not count). "retained" is what is still allocated when the step ends (the new
gradients). On CUDA (when a GPU is visible) ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats`` is used instead. Allocations are deterministic, so one measured step
per variant suffices (after one untimed warm-up step).

Two situations: ``.grad`` is None before the step (the usual ``zero_grad(set_to_none=True)``
loop) and ``.grad`` already holds a gradient (accumulation over micro-batches), where the engine
adds in place but a manager that collects gradients first may hold a second copy.

    python bench/bench_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
from typing import Callable, Dict, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import machine_info, result  # noqa: E402
from bench_torch import cases  # noqa: E402

from gradmgr import GradManager  # noqa: E402


def cpu_peak(step: Callable[[], None]) -> Tuple[int, int]:
    """(peak, retained) bytes of CPU tensor memory allocated during ``step``."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live


def cuda_peak(step: Callable[[], None]) -> Tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base


def measure(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: str,
            accumulate: bool) -> Dict[str, Tuple[int, int]]:
    """Peak/retained bytes of one step of each variant."""
    loss_fn = torch.nn.functional.cross_entropy
    x, y = x.to(device), y.to(device)
    models = {k: copy.deepcopy(model).to(device) for k in ("plain", "gradmgr", "+noop")}
    managers = {
        "gradmgr": GradManager().attach(models["gradmgr"].parameters()),
        "+noop": GradManager().attach(models["+noop"].parameters(), callbacks=lambda t, g: g),
    }

    def step(name: str) -> None:
        m = models[name]
        if name == "plain":
            loss_fn(m(x), y).backward()
            return
        gm = managers[name]
        with gm:
            gm.backward(loss_fn(m(x), y))

    peak_of = cuda_peak if device == "cuda" else cpu_peak
    out = {}
    for name, m in models.items():
        step(name)  # warm-up: lazy initialisation stays out of the measurement
        if not accumulate:
            for p in m.parameters():
                p.grad = None
        out[name] = peak_of(lambda name=name: step(name))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="peak memory: gradmgr vs plain backward")
    parser.add_argument("--quick", action="store_true", help="accepted for run_all; no effect")
    parser.parse_args(argv)
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(__doc__.split("\n\n")[0])
    print(machine_info(["torch"]))
    method = ("torch.cuda.max_memory_allocated" if device == "cuda"
              else "torch.profiler allocator events (peak of running sum)")
    print(f"device: {device}; method: {method}")
    print(f"{'model':>13} {'.grad before':>12} {'plain peak':>11} {'gradmgr peak':>12} "
          f"{'ratio':>6} {'+noop peak':>11} {'ratio':>6} {'retained plain/gm/+noop':>26}")
    rows = []
    for name, (model, x, y, _) in cases().items():
        for accumulate in (False, True):
            r = measure(model, x, y, device, accumulate)
            plain = r["plain"][0]
            ratio, noop = r["gradmgr"][0] / plain, r["+noop"][0] / plain
            kib = {k: v[0] / 1024 for k, v in r.items()}
            kept = "/".join(f"{v[1] / 1024:.0f}" for v in r.values())
            when = "exists" if accumulate else "None"
            print(f"{name:>13} {when:>12} {kib['plain']:9.0f}Ki {kib['gradmgr']:10.0f}Ki "
                  f"{ratio:6.3f} {kib['+noop']:9.0f}Ki {noop:6.3f} {kept + ' Ki':>26}",
                  flush=True)
            rows.append((name, when, ratio, noop))
    print()
    for name, when, ratio, noop in rows:
        result(f"memory {name} (.grad {when}) gradmgr/plain peak", ratio)
        result(f"memory {name} (.grad {when}) gradmgr+noop/plain peak", noop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
