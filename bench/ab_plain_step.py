"""The plain step of two versions of ``GradManager``, side by side in one process.

Ratios to ``loss.backward()`` of ``with gm: gm.backward(loss)``: "before" is ``GradManager``
from another checkout's ``gradmgr/manager.py`` (loaded as a second module over this tree's
other modules), with the list comprehension ``Watched.trainable`` had before issue 27's
plain-step cuts; "after" is this tree's. Each round interleaves the three variants in shuffled
order (as bench_torch.py); the range is over the rounds. ``--before`` is a checkout of the
commit to compare with (for instance one made by ``git worktree add ../before COMMIT``).

    python bench/ab_plain_step.py --before ../before [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import grad_clearers, interleaved, machine_info  # noqa: E402
from bench_torch import many_tensors, mlp  # noqa: E402
from torch import nn  # noqa: E402

import gradmgr.backends.torch.watched as watched  # noqa: E402
from gradmgr import GradManager  # noqa: E402


def manager_before(checkout: str) -> type:
    path = os.path.join(checkout, "gradmgr", "manager.py")
    spec = importlib.util.spec_from_file_location("gradmgr.manager_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.GradManager


class WatchedBefore(watched.Watched):
    """The usual step's ``trainable()`` as it was: a list comprehension over the references."""

    __slots__ = ()

    def trainable(self):
        order = self.order
        if order is not None and watched.FLAGS.lends_only(self.needs_flag):
            entries, refs = order
            inputs = [ref() for ref in refs]
            try:
                if all(map(watched._REQUIRES_GRAD, inputs)):
                    return entries, inputs
            except AttributeError:
                pass
        return super().trainable()


def compare(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, before: type,
            rounds: int, samples: int) -> None:
    models = {k: copy.deepcopy(model) for k in ("plain", "before", "after")}
    params = {k: list(m.parameters()) for k, m in models.items()}
    loss_fn = nn.functional.cross_entropy
    managers = {"before": before().attach(params["before"]),
                "after": GradManager().attach(params["after"])}

    def plain() -> None:
        loss_fn(models["plain"](x), y).backward()

    def with_manager(k: str):
        gm, m = managers[k], models[k]

        def step() -> None:
            with gm:
                gm.backward(loss_fn(m(x), y))

        return step

    variants = {"plain": plain, "before": with_manager("before"), "after": with_manager("after")}
    variants["before"]()  # (makes the tape)
    managers["before"]._tape.watched.__class__ = WatchedBefore
    ratios = {"before": [], "after": []}
    for r in range(rounds):
        t = interleaved(variants, samples, grad_clearers(params))
        base = t["plain"].median
        for k in ratios:
            ratios[k].append(t[k].median / base)
        print(f"{name} round {r + 1}: plain {base * 1e6:.1f} us, before "
              f"{ratios['before'][-1]:.3f}, after {ratios['after'][-1]:.3f}", flush=True)
    cells = ", ".join(f"{k} {min(v):.3f}-{max(v):.3f} (median {statistics.median(v):.3f})"
                      for k, v in ratios.items())
    print(f"{name}: {cells}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", required=True,
                        help="a checkout of the commit to compare with")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_info(["torch"]) + f", before: {args.before}")
    before = manager_before(args.before)
    g = torch.Generator().manual_seed(0)
    compare("mlp-64", mlp(64), torch.randn(64, 64, generator=g),
            torch.randint(0, 10, (64,), generator=g), before, args.rounds, 1000)
    compare("1000-tensors", many_tensors(), torch.randn(4, 8, generator=g),
            torch.randint(0, 8, (4,), generator=g), before, args.rounds, 100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
