"""The porting tool against the steps it checks: ``compare_step`` (and one ``train_drift``
step) on a MegEngine model and its PyTorch port, against the two native steps alone (MegEngine's
own ``GradManager`` step plus torch's ``loss.backward()``, forward and backward each, nothing
watched). Models: examples/porting's ResNet-18 (batch 8 x 3 x 32 x 32) and BERT-style encoder.
Each round times the native pair, then the tool, on the same batch; medians over the rounds.
MegEngine runs synchronously (``async_level = 0``), as docs/porting.md asks on a CPU.
Target (issue 36): ``compare_step`` <= 3x the two native steps on ResNet-18.

    python bench/bench_parity.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # quiet_megengine

import numpy as np  # noqa: E402
from _common import machine_info, result  # noqa: E402
from quiet_megengine import import_megengine  # noqa: E402

mge = import_megengine()
mge.config.async_level = 0

import megengine.functional as MF  # noqa: E402
import megengine.optimizer as mge_optim  # noqa: E402
import torch  # noqa: E402
from megengine.autodiff import GradManager as NativeGradManager  # noqa: E402
from porting import mge_encoder, mge_resnet, torch_encoder, torch_resnet  # noqa: E402

from gradmgr import parity  # noqa: E402

BATCH = 8


def mge_loss(out: Any, labels: Any) -> Any:
    return MF.nn.cross_entropy(out, labels)


def torch_loss(out: Any, labels: Any) -> Any:
    return torch.nn.functional.cross_entropy(out, labels.long())


def models(name: str) -> Tuple[Any, Any, Tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    torch.manual_seed(0)
    mge.random.seed(0)
    if name == "resnet18":
        a, b = mge_resnet.resnet18(relu_modules=True), torch_resnet.resnet18()
        x = rng.standard_normal((BATCH, 3, 32, 32)).astype("float32")
        labels = rng.integers(0, 10, BATCH).astype("int32")
    else:
        a, b = mge_encoder.EncoderClassifier(), torch_encoder.EncoderClassifier()
        cfg = torch_encoder.EncoderConfig()
        x = rng.integers(0, cfg.vocab_size, (BATCH, cfg.max_len)).astype("int32")
        labels = rng.integers(0, cfg.num_classes, BATCH).astype("int32")
    parity.transfer_weights(a, b, probe=x)
    return a, b, (x, labels)


def native_pair(a: Any, b: Any, batch: Tuple[np.ndarray, np.ndarray]) -> Callable[[], None]:
    gm = NativeGradManager().attach(a.parameters())
    xa, ya = mge.tensor(batch[0]), mge.tensor(batch[1])
    xb, yb = torch.from_numpy(batch[0]), torch.from_numpy(batch[1])

    def step() -> None:
        with gm:
            gm.backward(mge_loss(a(xa), ya))
        for p in a.parameters():
            p.grad = None
        torch_loss(b(xb), yb).backward()
        b.zero_grad(set_to_none=True)
    return step


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, rounds: int) -> Dict[str, float]:
    a, b, batch = models(name)
    native = native_pair(a, b, batch)
    check = lambda: parity.compare_step(a, b, batch, loss_a=mge_loss,  # noqa: E731
                                        loss_b=torch_loss)
    opt_a = mge_optim.SGD(a.parameters(), lr=0.0)  # lr 0: the models stay as transferred
    opt_b = torch.optim.SGD(b.parameters(), lr=0.0)
    drift = lambda: parity.train_drift(a, b, opt_a, opt_b, [batch], loss_a=mge_loss,  # noqa: E731
                                       loss_b=torch_loss, progress=False)
    native(), check(), drift()  # warm-up
    times: Dict[str, List[float]] = {"native": [], "compare_step": [], "train_drift": []}
    for _ in range(rounds):
        times["native"].append(timed(native))
        times["compare_step"].append(timed(check))
        times["train_drift"].append(timed(drift))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, ResNet-18 only")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    names = ["resnet18"] if args.quick else ["resnet18", "encoder"]
    print(machine_info(["torch", "megengine"]))
    print(f"medians of {rounds} rounds, batch {BATCH}, seconds")
    print(f"{'model':<10} {'native pair':>12} {'compare_step':>13} {'ratio':>6} "
          f"{'train_drift step':>17} {'ratio':>6}")
    for name in names:
        m = measure(name, rounds)
        print(f"{name:<10} {m['native']:>12.3f} {m['compare_step']:>13.3f} "
              f"{m['compare_step'] / m['native']:>6.2f} {m['train_drift']:>17.3f} "
              f"{m['train_drift'] / m['native']:>6.2f}")
        if name == "resnet18":
            result("compare_step / native pair, resnet18", m["compare_step"] / m["native"],
                   target=3.0)


if __name__ == "__main__":
    main()
