"""How often MegEngine's own CPU backward gives a wrong gradient, on a program shaped like
batch normalisation: ``y = x * (s + 1) ** -0.5 * w`` with ``s`` the per-channel sum of squares
of ``x`` (``F.sum`` over axes 0, 2, 3, kept) and ``w`` a per-channel weight, differentiated
again and again on the same numbers with MegEngine's native ``GradManager`` and with
gradmgr's, other tensors made and freed between. Every run should give the same gradients; the
probe counts the runs whose gradients (of ``x`` and ``w``) differ from what most runs give.

On MegEngine 1.13 (CPU) about one backward in a hundred is garbage (values of 1e12 to 1e36, or
NaN), for the native manager as for gradmgr's, which drives the same engine. ``SyncBatchNorm``
over gradmgr's gloo ranks computes such statistics (``tests/test_edges.py`` met one in CI).
docs/megengine.md has the measured numbers; ``python bench/probe_megengine_cpu_reduce.py [RUNS]``
measures here; ``--sync`` runs MegEngine synchronously (``megengine.config.async_level = 0``),
where none has been seen.
"""

from __future__ import annotations

import collections
import sys

import numpy as np


def _other_work(F) -> None:
    """What a training step does between two backward passes: other tensors made, read and
    freed (without it the garbage is rarer)."""
    for t in [F.full((1, 7, 1, 1), 1e13 + j) * 3 for j in range(30)]:
        t.numpy()


def count_differing(manager_class, runs: int, data: dict) -> int:
    """Runs whose gradients are not bit-identical to the most common result."""
    import megengine
    import megengine.functional as F

    results = []
    for _ in range(runs):
        _other_work(F)
        x, w = megengine.tensor(data["x"]), megengine.Parameter(data["w"])
        gm = manager_class().attach([x, w])
        with gm:
            squares = F.sum(x * x, axis=(0, 2, 3), keepdims=True)
            y = x * (squares + 1.0) ** -0.5 * w.reshape(1, -1, 1, 1)
            gm.backward(F.sum(y * megengine.tensor(data["c"])))
        results.append(x.grad.numpy().tobytes() + w.grad.numpy().tobytes())
    _, most = collections.Counter(results).most_common(1)[0]
    return runs - most


def main(argv: list) -> int:
    import megengine
    from megengine.autodiff import GradManager as NativeGradManager

    from gradmgr import GradManager

    sync = "--sync" in argv
    argv = [a for a in argv if a != "--sync"]
    runs = int(argv[0]) if argv else 600
    if sync:
        megengine.config.async_level = 0
    rng = np.random.RandomState(0)
    data = {"x": rng.randn(2, 3, 2, 2).astype("float32"),
            "c": rng.randn(2, 3, 2, 2).astype("float32"), "w": rng.randn(3).astype("float32")}
    print(f"MegEngine {megengine.__version__} (CPU), async_level "
          f"{megengine.config.async_level}, {runs} backward passes per manager")
    for name, manager in (("native GradManager", NativeGradManager),
                          ("gradmgr GradManager", GradManager)):
        print(f"{name:20s} runs differing from the most common result: "
              f"{count_differing(manager, runs, data)} of {runs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
