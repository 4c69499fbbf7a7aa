"""The two halves of tests/test_parity_dump.py's cross-environment test, each run by the
python of one project environment: ``dump PATH`` (.venv: MegEngine's CNN of
tests/parity_small_mge.py, one step with cross-entropy, written by gradmgr.parity.dump) and
``compare PATH`` (.venv-latest: the dump against tests/parity_small_torch.py's port, correct
with BatchNorm's eps wrong, and with MegEngine's momentum
0.9 copied as PyTorch's), which prints its findings as one JSON line."""

from __future__ import annotations

import json
import platform
import sys

import numpy as np


def _dump(path: str) -> dict:
    import megengine
    import parity_small_mge as G

    from gradmgr.parity import dump

    megengine.config.async_level = 0  # as tests/conftest.py does, and why
    megengine.random.seed(3)
    rng = np.random.RandomState(0)
    batch = (rng.randn(4, 3, 8, 8).astype(np.float32), np.array([1, 0, 3, 9]))
    recorded = dump(G.CNN(), batch, path, loss=G.cross_entropy)
    return {"python": platform.python_version(), "loss": recorded.header["loss_value"]}


def _compare(path: str) -> dict:
    import parity_small_torch as T
    import torch

    from gradmgr.parity import compare_step, load, transfer_weights

    recorded = load(path)
    found = {"python": platform.python_version(), "torch": torch.__version__,
             "header": recorded.header}
    ports = (("good", T.CNN()), ("eps", T.CNN(bn_eps=1e-3)), ("momentum", T.CNN(momentum=0.9)))
    for name, port in ports:
        mapping = transfer_weights(recorded, port, probe=recorded.batch, strict=False)
        report = compare_step(recorded, port, recorded.batch, loss_b=T.cross_entropy)
        found[name] = {
            "mapped": len(mapping.pairs), "ok": report.ok, "text": report.text(),
            "verdicts": {e.name: e.verdict for e in report.entries},
            "max_rel": max(e.max_rel for e in report.entries),
            "first_forward": report.first_forward and report.first_forward.layer,
            "findings": [(f.layer_src, f.key) for f in report.findings]}
    return found


if __name__ == "__main__":
    mode, target = sys.argv[1], sys.argv[2]
    result = _dump(target) if mode == "dump" else _compare(target)
    print("RESULT " + json.dumps(result))
