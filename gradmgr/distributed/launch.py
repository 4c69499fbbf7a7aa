"""Start a data-parallel job on this machine: one process per rank, rendezvous on a free port."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(fn: Callable[..., Any], world: int = 2, *args: Any) -> int:
    """Run ``fn(rank, world, port, *args)`` in ``world`` local processes; return an exit code.

    Uses ``torch.multiprocessing.spawn``; ``port`` is free for the rendezvous
    (``init_process_group(init_method=f"tcp://127.0.0.1:{port}")``), and gloo is told to use the
    loopback interface unless ``GLOO_SOCKET_IFNAME`` is already set. A failed rank is reported
    on stderr and gives exit code 1.

    Example:
        >>> # sys.exit(spawn_local(train, 2, steps))  # train(rank, world, port, steps)
    """
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)
    except mp.ProcessExitedException as exc:
        print(f"a rank failed: {exc}", file=sys.stderr)
        return 1
    return 0


def run_ranks(fn: Callable[..., Any], world: int = 2, *args: Any) -> int:
    """Run ``fn(rank, world, port, *args)`` as one rank of a job started by ``torchrun``
    (``RANK`` and ``WORLD_SIZE`` set: this process is that rank, ``port`` is 0, meaning
    ``init_method="env://"``), or else start ``world`` ranks here with :func:`spawn_local`.

    Example:
        >>> # sys.exit(run_ranks(train, 2, steps))   # python x.py  or  torchrun ... x.py
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, *args)
        return 0
    return spawn_local(fn, world, *args)

