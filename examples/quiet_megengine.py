"""Import MegEngine without the CUDA banner it prints on a machine without a GPU.

On such a machine MegEngine's CUDA stub (a C library, not MegEngine's Python logger) writes a
five-line ``info: +++ Failed to load CUDA driver library ...`` banner and a few
``debug: failed to load cuda func: ...`` lines straight to file descriptor 2, at the first
device query and again at the first tensor. No log level turns them off: the lines are
``fprintf(stderr, ...)`` calls (``MEGENGINE_LOGGING_LEVEL``, ``megengine.logger.set_log_level``
and ``RUNTIME_OVERRIDE_LOG_LEVEL`` leave them in place). So :func:`import_megengine` makes those
two first queries with descriptor 2 captured, drops the stub's lines and writes everything else
back: a real warning printed meanwhile still reaches stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Any, Iterator

STUB_LINES = ("info: +", "debug: failed to load cuda func")
"""How the CUDA stub's lines start (dnn/cuda-stub in MegEngine's sources)."""


def import_megengine() -> Any:
    """``import megengine``, its CUDA stub's banner and debug lines dropped; returns the module.

    Call it before anything else creates a MegEngine tensor: the stub prints only once per
    process (per query path), at the first query.
    """
    import megengine

    with stub_lines_dropped():
        megengine.get_device_count("gpu")  # the stub's first load: the banner
        megengine.Tensor(0.0)  # the default device's first resolution: debug lines
    return megengine


@contextlib.contextmanager
def stub_lines_dropped() -> Iterator[None]:
    """Capture file descriptor 2 meanwhile; write back every line but the stub's."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(x for x in lines if not x.startswith(STUB_LINES)))
