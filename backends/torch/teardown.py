"""Process groups released while the interpreter still runs.

A process group kept alive by a reference cycle (DDP is one; so is any function's frame that
first imported ``torch._dynamo`` on torch 2.13, which ``torch.optim`` does: ``torch.fx.wrap``
keeps ``inspect.currentframe()`` in a local, and with it every caller's locals) is freed by
the last garbage collection of interpreter shutdown. Freeing a gloo group then aborts the
process now and then ("terminate called without an active exception"; pytorch/pytorch#190489).
Collecting once at exit, while the interpreter is whole, frees those groups (and the reducers
and managers that hold them) the normal way. Registered the first time a process builds a
transport over torch.distributed, so only programs that use gradmgr's data parallelism there
get it.
"""

from __future__ import annotations

import atexit
import gc
import threading

_registered = False
_lock = threading.Lock()


def collect_cycles_at_exit() -> None:
    """Run ``gc.collect()`` from ``atexit`` (once per process, however often called)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(gc.collect)
            _registered = True
