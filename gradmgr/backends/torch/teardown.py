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

Where a group's last reference dies matters too. Freeing a gloo group joins its worker
threads; on torch 2.13 a worker may still be dropping a finished collective whose captured
thread-local state holds the last reference to a Python object (the ``contextvars.Context``
that ``_engine_run_backward`` stashes for each backward), which needs the GIL. The group's
Python object frees it with the GIL released (torch's pybind holder for process groups does);
torch's C++ ``Reducer`` frees it with the GIL held, and the two threads wait for each other
forever. So ``TorchReducer`` keeps the group's Python object and drops its C++ reducer first:
``destroy_process_group()`` then ``del gm`` terminates. (DDP, whose reducer holds its group
the same way, deadlocks in that order: in each of 5 two-rank runs of 10 rounds, here.)
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
