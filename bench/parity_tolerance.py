"""Measure the constant C of gradmgr.parity's tolerance formula (gradmgr/parity/tolerance.py):
for correct ports (the same weights in PyTorch and MegEngine, float32, CPU), the largest
``|a - b| / (eps * sqrt(K) * scale)`` per kind of compared tensor, over several seeds, both
directions. Run: .venv/bin/python bench/parity_tolerance.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import megengine.functional as MF  # noqa: E402
import megengine.module as M  # noqa: E402
import quiet_megengine  # noqa: E402,F401  (drops MegEngine's CUDA banner)
import torch  # noqa: E402
from torch import nn  # noqa: E402

from gradmgr.parity import compare_step, transfer_weights  # noqa: E402
from gradmgr.parity.tolerance import C_GRAD, C  # noqa: E402


def stage(lib, flatten):
    """A ResNet-18 stem and first stages, at ResNet-18's channel counts."""

    class Stage(lib.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = lib.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.bn1 = lib.BatchNorm2d(64)
            self.relu1 = lib.ReLU()
            self.pool = lib.MaxPool2d(3, stride=2, padding=1)
            self.conv2 = lib.Conv2d(64, 64, 3, padding=1, bias=False)
            self.bn2 = lib.BatchNorm2d(64)
            self.relu2 = lib.ReLU()
            self.conv3 = lib.Conv2d(64, 128, 3, stride=2, padding=1, bias=False)
            self.bn3 = lib.BatchNorm2d(128)
            self.relu3 = lib.ReLU()
            self.gap = lib.AdaptiveAvgPool2d(1)
            self.fc = lib.Linear(128, 100)

        def forward(self, x):
            x = self.pool(self.relu1(self.bn1(self.conv1(x))))
            x = self.relu2(self.bn2(self.conv2(x)))
            x = self.gap(self.relu3(self.bn3(self.conv3(x))))
            return self.fc(flatten(x, 1))
    return Stage()


def wide(lib):
    return lib.Sequential(lib.Linear(512, 512), lib.GELU(), lib.Linear(512, 512),
                          lib.LayerNorm(512), lib.Linear(512, 10))


MODELS = {
    "resnet-stage": (lambda: stage(nn, torch.flatten), lambda: stage(M, MF.flatten),
                     lambda rs: rs.randn(8, 3, 64, 64)),
    "wide-mlp": (lambda: wide(nn), lambda: wide(M), lambda rs: rs.randn(32, 512)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    worst = defaultdict(float)
    for name, (make_t, make_m, data) in MODELS.items():
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            x = data(np.random.RandomState(seed)).astype(np.float32)
            for a, b in ((make_t(), make_m()), (make_m(), make_t())):
                transfer_weights(a, b, probe=x)
                report = compare_step(a, b, x)
                for e in report.entries:
                    if e.tol and e.verdict != "unverified":
                        key = (name, e.what, e.kind)
                        worst[key] = max(worst[key], e.max_abs / e.tol
                                         * (C if e.what == "forward" else C_GRAD))
                print(f"{name} seed {seed} {report.a}->{report.b}: ok={report.ok} "
                      f"flips={sum(f.count for f in report.flips)}", flush=True)
    print(f"\nlargest |a-b| / (eps sqrt(K) scale) per model, tensor, kind "
          f"(C = {C}, C_GRAD = {C_GRAD}):")
    for key in sorted(worst):
        print(f"  {key[0]:<14} {key[1]:<8} {key[2]:<18} {worst[key]:.3f}")
    print(f"overall largest: {max(worst.values()):.3f}")


if __name__ == "__main__":
    main()
