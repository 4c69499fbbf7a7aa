"""Measure how far a correct GRU / LSTM port's results lie apart (PyTorch against Paddle,
float32, CPU), and against what reduction length they grow: the recurrent layers' ``K`` of
gradmgr.parity's tolerance formula (gradmgr/parity/tolerance.py).

For each kind, size (input -> hidden), sequence length ``T``, layers ``L`` and directions, a
model ``rnn -> Linear`` is built in both frameworks, the weights transferred, one step
compared (``compare_step``, both directions of the port), and for the recurrent layer's
output and gradients the ratio ``|a - b| / (eps * scale)`` is printed, its ratio to
``sqrt(K)`` for the tool's ``K`` (``recurrent_reduction``: one time step of every layer) and
to ``sqrt(T * K)`` (every step an output element depends on), and ``|a - b|`` over the
tolerance in force. The summary is the largest forward ratio per model and length.
Run: .venv-paddle/bin/python bench/parity_tolerance_rnn.py [--quick] [--json out.json]
[--sizes 3x4 32x64] [--lengths 5 20] [--layers 1 2] (the whole grid: 12 minutes on the
project's 2-core machine at load average 6; MegEngine has no GRU, and its LSTM keeps its
weights flattened, which the weight map does not pair with these)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import paddle  # noqa: E402
import quiet_megengine  # noqa: E402,F401  (drops MegEngine's CUDA banner)
import torch  # noqa: E402

from gradmgr.parity import compare_step, transfer_weights  # noqa: E402
from gradmgr.parity.tolerance import C_GRAD, C, eps, recurrent_reduction  # noqa: E402

SIZES = [(3, 4), (8, 16), (32, 64), (128, 256)]
LENGTHS = [5, 20, 80, 320, 1280]
LAYERS = [1, 2, 4]
BATCH = 4


def models(kind: str, size: tuple, layers: int, directions: int):
    """torch's and Paddle's ``kind`` (batch first), then a Linear to 8."""
    inp, hidden = size

    class TorchRNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(torch.nn, kind)(inp, hidden, num_layers=layers,
                                               batch_first=True, bidirectional=directions == 2)
            self.fc = torch.nn.Linear(hidden * directions, 8)

        def forward(self, x):
            return self.fc(self.rnn(x)[0])

    class PaddleRNN(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(paddle.nn, kind)(
                inp, hidden, num_layers=layers,
                direction="bidirect" if directions == 2 else "forward")
            self.fc = paddle.nn.Linear(hidden * directions, 8)

        def forward(self, x):
            return self.fc(self.rnn(x)[0])

    return TorchRNN(), PaddleRNN()


def reduction(size: tuple, layers: int, directions: int) -> int:
    """The tool's ``K`` of the recurrent layer: one time step of every layer."""
    return recurrent_reduction({"input_size": size[0], "hidden_size": size[1],
                                "num_layers": layers, "bidirectional": directions == 2},
                               (), ())


def one(kind, size, length, layers, directions, seed, backwards):
    torch.manual_seed(seed)
    paddle.seed(seed)
    t, p = models(kind, size, layers, directions)
    a, b = (p, t) if backwards else (t, p)
    x = np.random.RandomState(seed).randn(BATCH, length, size[0]).astype(np.float32)
    transfer_weights(a, b, probe=x)
    report = compare_step(a, b, x)
    k = reduction(size, layers, directions)
    rows = []
    for e in report.entries:
        if e.layer != "rnn" or not e.max_rel:
            continue
        scale = e.max_abs / e.max_rel
        ratio = e.max_abs / (eps("float32") * scale)
        rows.append({"what": e.what, "name": e.name, "ratio": ratio,
                     "per_sqrt_k": ratio / math.sqrt(k),
                     "per_sqrt_tk": ratio / math.sqrt(length * k),
                     "of_tol": e.max_abs / e.tol if e.tol else float("inf"),
                     "verdict": e.verdict})
    return {"kind": kind, "size": list(size), "T": length, "L": layers, "D": directions,
            "seed": seed, "dir": "paddle->torch" if backwards else "torch->paddle",
            "K": k, "ok": report.ok, "rows": rows}


def summary(results: list) -> None:
    """The largest forward ratio per model (rows) and length (columns)."""
    table: dict = {}
    for r in results:
        key = (r["kind"], f"{r['size'][0]}->{r['size'][1]}", r["L"], r["D"])
        ratio = max(x["ratio"] for x in r["rows"] if x["what"] == "forward")
        table.setdefault(key, {})[r["T"]] = max(table.get(key, {}).get(r["T"], 0.0), ratio)
    lengths = sorted({r["T"] for r in results})
    print("\nlargest forward |a-b| / (eps scale) per model (kind, size, layers, directions) "
          "and length T:")
    print(f"{'model':<26}" + "".join(f"{'T=' + str(t):>9}" for t in lengths))
    for key in sorted(table):
        print(f"{' '.join(map(str, key)):<26}" + "".join(
            f"{table[key][t]:>9.2f}" if t in table[key] else f"{'-':>9}" for t in lengths))
    for what, c in (("forward", C), ("grad", C_GRAD)):
        rows = [x for r in results for x in r["rows"] if x["what"] == what]
        print(f"{what}: largest ratio / sqrt(K) {max(x['per_sqrt_k'] for x in rows):.3f}, "
              f"/ sqrt(T K) {max(x['per_sqrt_tk'] for x in rows):.4f} (C = {c}); largest "
              f"|a-b| / tol {max(x['of_tol'] for x in rows):.3f}; "
              f"{sum(not r['ok'] for r in results)} of {len(results)} steps not ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one seed, one direction")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sizes", nargs="*", default=[f"{i}x{h}" for i, h in SIZES])
    parser.add_argument("--lengths", nargs="*", type=int, default=LENGTHS)
    parser.add_argument("--layers", nargs="*", type=int, default=LAYERS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    paddle.set_device("cpu")
    seeds = range(1 if args.quick else args.seeds)
    sizes = [tuple(int(n) for n in s.split("x")) for s in args.sizes]
    results = []
    grid = itertools.product(["GRU", "LSTM"], sizes, args.lengths, args.layers)
    for kind, size, length, layers in grid:
        for directions in ([1, 2] if layers == 2 else [1]):
            for seed in seeds:
                for backwards in ([False] if args.quick else [False, True]):
                    started = time.perf_counter()
                    r = one(kind, size, length, layers, directions, seed, backwards)
                    fwd = max(x["ratio"] for x in r["rows"] if x["what"] == "forward")
                    grad = max(x["ratio"] for x in r["rows"] if x["what"] == "grad")
                    worst = max(x["of_tol"] for x in r["rows"])
                    print(f"{kind} {size[0]}->{size[1]} T={length} L={layers} D={directions} "
                          f"seed {seed} {r['dir']}: ok={r['ok']} K={r['K']} fwd ratio "
                          f"{fwd:.2f} ({fwd / math.sqrt(r['K']):.3f} sqrt K) grad ratio "
                          f"{grad:.2f} worst of tol {worst:.2f} "
                          f"[{time.perf_counter() - started:.1f} s]", flush=True)
                    results.append(r)
    summary(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
