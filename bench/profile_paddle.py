"""Where one gradmgr step on Paddle spends its time, against Paddle's own ``loss.backward()``.

For each model of bench_paddle.py named on the command line, one process steps three copies in
turn on the same batch: Paddle's ``loss.backward()``, ``paddle.grad`` over every parameter (the
engine call the Paddle tape makes), and ``with gm: gm.backward(loss)`` (every parameter
attached; ``--callbacks``: each with a no-op callback); ``.grad`` cleared (untimed) before
each. Inside gradmgr's step, the Paddle tape's phases are timed by wrapping them (a profiling
aid: it reaches into the tape's private methods, and changes nothing they do). Median
milliseconds over the steps; the .grad of the gradmgr copy is checked bit for bit against
native's at the end. ``--cprofile`` adds cProfile's top functions of 20 gradmgr steps, by own
time and by cumulative time.

    python bench/profile_paddle.py [--models 1000-tensors,mlp-64] [--steps 30] [--callbacks]
                                    [--cprofile]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from bench_paddle import F, cases, paddle  # noqa: E402

from gradmgr import GradManager  # noqa: E402
from gradmgr import delivery as gm_delivery  # noqa: E402
from gradmgr.backends.paddle import leaf_hooks, split, tape  # noqa: E402

PHASES: Dict[str, float] = {}
ALL, ENGINE = "tape.backward, all", "  engine_run: paddle.grad + written.py"


def _timed(name: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - start
    return wrapper


def instrument() -> None:
    """Wrap the phases of the Paddle tape (and the core's .grad writes) in timers."""
    cls = tape.PaddleTape
    cls.backward = _timed(ALL, cls.backward)  # type: ignore[method-assign]
    cls._live = _timed("  _live: the live attached tensors", cls._live)  # type: ignore
    tape.ready_order = _timed("  order.py: the engine's order", tape.ready_order)
    tape.engine_run = _timed(ENGINE, tape.engine_run)
    split.paddle = type("P", (), {"grad": staticmethod(_timed("    paddle.grad", paddle.grad))})
    cls._deliver = staticmethod(_timed("  _deliver: probes + sinks", cls._deliver))  # type: ignore
    writes = gm_delivery.Delivery.accumulate
    gm_delivery.Delivery.accumulate = _timed("core: .grad writes", writes)  # type: ignore


def run(name: str, steps: int, callbacks: bool, profile: bool) -> None:
    model, x, y = cases()[name]
    native, engine, ours = (copy.deepcopy(model) for _ in range(3))
    gm = GradManager().attach(ours.parameters(), callbacks=(lambda t, g: g) if callbacks else None)
    params = [list(m.parameters()) for m in (native, engine, ours)]
    times: Dict[str, List[float]] = {k: [] for k in ("native: loss.backward()",
                                                     "paddle.grad alone", "gradmgr: gm.backward")}
    phases: List[Dict[str, float]] = []
    for step in range(steps + 5):  # 5 warm-up steps
        for p in params[0] + params[2]:
            p.clear_gradient(False)
        loss = F.cross_entropy(native(x), y)
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        loss = F.cross_entropy(engine(x), y)
        t2 = time.perf_counter()
        paddle.grad([loss], params[1], allow_unused=True)
        t3 = time.perf_counter()
        with gm:
            loss = F.cross_entropy(ours(x), y)
            PHASES.clear()
            t4 = time.perf_counter()
            gm.backward(loss)
            t5 = time.perf_counter()
        if step >= 5:
            for key, dt in zip(times, (t1 - t0, t3 - t2, t5 - t4)):
                times[key].append(dt)
            # per step, so that the engine's own swings (a few ms) stay out of it
            phases.append(dict(PHASES, **{"tape.backward less engine_run": PHASES[ALL]
                                          - PHASES[ENGINE]}))
    probe = probe_ms(params[0])
    for a, b in zip(params[0], params[2]):
        np.testing.assert_array_equal(a.grad.numpy(), b.grad.numpy())
    extra = ", a no-op callback each" if callbacks else ""
    print(f"== {name}: {len(params[2])} tensors{extra}, {steps} steps, median ms")
    for key, values in times.items():
        print(f"  {key:40s} {statistics.median(values) * 1e3:8.3f}")
    for key in phases[0] if phases else ():
        print(f"  {key:40s} {statistics.median(p.get(key, 0.0) for p in phases) * 1e3:8.3f}")
    print(f"  {'leaf_hooks probe of every tensor, once':40s} {probe:8.3f}")
    if profile:
        print_cprofile(gm, ours, params[2], x, y)


def probe_ms(leaves: List[Any]) -> float:
    """What leaf_hooks.py's probe costs over ``leaves`` (the native copy's: a probe on the
    attached ones would count as a registration their tape sees), timed apart: a timer around
    each of its calls would cost about as much as the probe."""
    runs = []
    for _ in range(11):
        probes = [leaf_hooks.HookProbe() for _ in leaves]
        start = time.perf_counter()
        for probe, leaf in zip(probes, leaves):
            probe.may_have_hooks(leaf)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1e3


def print_cprofile(gm: GradManager, model: Any, params: List[Any], x: Any, y: Any) -> None:
    prof = cProfile.Profile()
    for _ in range(20):
        for p in params:
            p.clear_gradient(False)
        prof.enable()
        with gm:
            gm.backward(F.cross_entropy(model(x), y))
        prof.disable()
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(20)
        print(out.getvalue())


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description="gradmgr's step on Paddle, phase by phase")
    parser.add_argument("--models", default="mlp-64,1000-tensors")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--callbacks", action="store_true")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args(argv)
    paddle.set_device("cpu")
    instrument()
    for name in args.models.split(","):
        run(name, args.steps, args.callbacks, args.cprofile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
