"""Split backward (``backward_split`` then ``finish()``) against one ``backward``, on PyTorch.

A pipeline stage's step: the stage input ``x`` is attached while recording, the stage output
is backwarded with a given ``dy``; "single" is ``gm.backward(out, dy)``, "split" is
``gm.backward_split(out, dy, first=[x])`` followed by ``finish()``. Both variants train copies
of the same model on the same batch, in a new random order every round; ratios are of medians.
Target: split/single <= 1.10 on compute-bound models (issue 27: ``mlp-1024``, 4 x
Linear(1024, 1024) on a batch of 128); the small MLP and CNN (issue 17's) and a 2-layer
transformer stage are timed for reference.

For reference, the same rounds time plain PyTorch (no gradmgr): one ``torch.autograd.backward``
and PyTorch's own split, ``stage_backward_input`` then ``stage_backward_weight`` of
``torch.distributed.pipelining`` (private functions; the row is left out where they are
missing). Any split runs the engine again for the weights (once per group of weights no path
joins, e.g. once per layer of an MLP), which costs a fixed amount per run on top of the same
arithmetic: the "torch split" column shows what that costs without gradmgr. The "floor" column
is the least an exact split costs: gradmgr's own plan and boundary hooks, then the engine runs
called directly, with nothing else of gradmgr around them (no recording, no attach, no manager).

    python bench/bench_split.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Callable, Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import grad_clearers, interleaved, machine_info, result, samples_for  # noqa: E402
from torch import nn  # noqa: E402

from gradmgr import GradManager  # noqa: E402

TARGET = 1.10


def cases() -> Dict[str, tuple]:
    g = torch.Generator().manual_seed(0)
    mlp = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())][:-1])
    cnn = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                        nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    # Compute-bound: each layer's arithmetic (64 MFLOP per matmul) dwarfs an engine run's
    # fixed cost, as in a real pipeline stage.
    wide = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())][:-1])
    torch.manual_seed(0)
    stage = nn.Sequential(*[nn.TransformerEncoderLayer(256, 4, 512, dropout=0.0, batch_first=True)
                            for _ in range(2)])
    return {"mlp-256": (mlp, torch.randn(64, 256, generator=g)),
            "cnn": (cnn, torch.randn(16, 3, 16, 16, generator=g)),
            "mlp-1024": (wide, torch.randn(128, 1024, generator=g)),
            # A pipeline stage of a realistic shape (no target: the issue names the two above).
            "tf-stage": (stage, torch.randn(8, 64, 256, generator=g))}


def step_fns(model: nn.Module, x0: torch.Tensor):
    models = {name: copy.deepcopy(model) for name in ("single", "split")}
    managers = {name: GradManager().attach(m.parameters()) for name, m in models.items()}
    dy = torch.randn_like(model(x0))

    def single() -> None:
        gm = managers["single"]
        with gm:
            x = x0.clone()
            gm.attach(x)
            gm.backward(models["single"](x), dy)

    def split() -> None:
        gm = managers["split"]
        with gm:
            x = x0.clone()
            gm.attach(x)
            rest = gm.backward_split(models["split"](x), dy, first=[x])
        rest.finish()

    variants: Dict[str, Callable[[], None]] = {"single": single, "split": split}
    params = {k: list(m.parameters()) for k, m in models.items()}
    variants.update(_plain_torch(model, x0, dy, params))
    return variants, grad_clearers(params)


def _plain_torch(model: nn.Module, x0: torch.Tensor, dy: torch.Tensor,
                 params: Dict[str, list]) -> Dict[str, Callable[[], None]]:
    """PyTorch without gradmgr: one backward, and its pipelining split where available."""
    try:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError:
        stage_backward_input = stage_backward_weight = None
    models = {name: copy.deepcopy(model) for name in ("torch single", "torch split")}

    def torch_single() -> None:
        x = x0.clone().requires_grad_()
        m = models["torch single"]
        torch.autograd.backward(m(x), dy, inputs=[x, *m.parameters()])

    def torch_split() -> None:
        x = x0.clone().requires_grad_()
        m = models["torch split"]
        _, groups = stage_backward_input([m(x)], [dy], [x], m.parameters())
        stage_backward_weight(m.parameters(), groups)

    variants = {"torch single": torch_single}
    if stage_backward_input is not None:
        variants["torch split"] = torch_split
    variants["floor"] = _engine_floor(copy.deepcopy(model), x0, dy)
    models["floor"] = variants["floor"].model
    params.update({k: list(m.parameters()) for k, m in models.items() if k in variants})
    return variants


def _engine_floor(model: nn.Module, x0: torch.Tensor, dy: torch.Tensor) -> Callable[[], None]:
    """An exact split with nothing of gradmgr but its plan and boundary hooks (see the module
    docstring): the first part, then one engine run per group, all straight to the engine."""
    from torch.autograd.graph import GradientEdge

    from gradmgr.backends.torch import split as split_impl
    from gradmgr.backends.torch.engine import run_engine
    from gradmgr.backends.torch.split_plan import split_plan

    weights = list(model.parameters())

    def floor() -> None:
        x = x0.clone().requires_grad_()
        out = model(x)
        plan = split_plan([out], [x], weights)
        hooks = {}
        for node in plan.boundary:
            hooks[node] = split_impl._Handover("")
            node.register_prehook(hooks[node])
        run_engine([out], [dy], True, False, [x], accumulate=True)
        for nodes, _, tensors in plan.groups:  # one boundary node each, in these models
            hook = hooks[nodes[0]]
            hook.state = split_impl._REPLAY
            starts = hook.stand_ins()
            run_engine([GradientEdge(nodes[0], i) for i, _ in starts], [z for _, z in starts],
                       False, False, tensors, accumulate=True)

    floor.model = model  # type: ignore[attr-defined]
    return floor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (noisier)")
    parser.add_argument("--models", default=None, help="comma-separated (default: all)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the thread's CPU (time.thread_time), not the wall clock: "
                             "on a machine busy with other jobs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(__doc__.split("\n\n")[0])
    print(machine_info(["torch"]) + ", torch threads: 1")
    print(f"{'model':>9} {'samples':>7} {'single us':>10} {'split us':>9} {'ratio':>6} "
          f"{'torch single us':>15} {'torch split us':>14} {'torch ratio':>11} "
          f"{'floor us':>8} {'floor ratio':>11}")
    rows = []
    for name, (model, x0) in cases().items():
        if args.models and name not in args.models.split(","):
            continue
        variants, setups = step_fns(model, x0)
        n = samples_for(variants["single"], 0.3 if args.quick else 2.0,
                        lo=30 if args.quick else 200, setup=setups["single"])
        t = interleaved(variants, n, setups,
                        clock=time.thread_time if args.cpu_time else time.perf_counter)
        ratio = t["split"].median / t["single"].median
        plain = t["torch single"].median
        own = t.get("torch split")
        own_text = (f"{own.median * 1e6:14.1f} {own.median / plain:11.3f}" if own is not None
                    else f"{'-':>14} {'-':>11}")
        floor = t["floor"].median
        print(f"{name:>9} {n:7d} {t['single'].median * 1e6:10.1f} "
              f"{t['split'].median * 1e6:9.1f} {ratio:6.3f} {plain * 1e6:15.1f} {own_text} "
              f"{floor * 1e6:8.1f} {floor / t['single'].median:11.3f}", flush=True)
        rows.append((name, ratio, None if own is None else own.median / plain,
                     floor / t["single"].median))
    print()
    for name, ratio, own_ratio, floor_ratio in rows:
        if name == "tf-stage":
            result(f"torch {name} split/single backward (reference)", ratio)
        else:
            result(f"torch {name} split/single backward", ratio, TARGET)
        if own_ratio is not None:
            result(f"torch {name} PyTorch's own split/single (reference)", own_ratio)
        result(f"torch {name} exact-split floor/gradmgr single (reference)", floor_ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
