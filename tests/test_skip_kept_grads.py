"""A recording that ends without a backward (a skipped batch) while ``.grad`` holds the last
step's gradients, kept (no ``zero_grad`` yet): on torch's reducer path (native) its release
raised "ended without gm.backward(), but the attached tensors' .grad changed" although nothing
changed them: the reducer's failed step replaced each ``.grad`` (a view into its bucket) by a
copy before the check compared them. Found through Lightning Fabric (a GAN's discriminator,
whose forward in the generator's step is never backwarded by its own manager)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from ranks import spawn  # noqa: E402


@pytest.mark.torch
@pytest.mark.slow
def test_a_skipped_batch_with_kept_grads_is_ddps(tmp_path):
    for rank, saved in enumerate(spawn("skip_kept_grads", str(tmp_path))):
        for path in ("native", "buckets"):
            assert int(saved[f"{path}_raised"]) == 0, (rank, path)
            # exact: the same reduced .grad kept, then the same sum
            assert np.array_equal(saved[f"{path}_skipped"], saved["ddp_skipped"]), (rank, path)
            assert np.array_equal(saved[f"{path}_next"], saved["ddp_next"]), (rank, path)
