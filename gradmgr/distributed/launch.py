"""Start a data-parallel job on this machine: one process per rank, meeting at a rendezvous
server this process holds (torch's TCPStore on a port the system picks, as torchrun's agent
does: see gradmgr/backends/torch/rendezvous.py for why, and what was measured)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import traceback
from typing import Any, Callable, Dict, List

from ..registry import hold_rendezvous, prepare_ranks


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    Nothing holds it after this returns: another program may take it before rank 0 binds it
    (a race). Fine for the one-process examples in these docstrings; to start ranks, let
    something hold the rendezvous instead: :func:`spawn_local` (it uses this only where torch
    is missing), ``torchrun --standalone``, or a ``TCPStore`` on port 0 held by the launching
    process, which is what gradmgr's own multi-rank tests do (tests/ranks.py).

    Example:
        >>> 1024 < free_port() < 65536
        True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple,
               env: Dict[str, str]) -> None:
    # What torchrun sets, so init_process_group("gloo") works with env:// too.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      **env)
    try:
        prepare_ranks(rank, world)
        fn(rank, world, port, *args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # skip atexit handlers that could wait on the other ranks


def spawn_local(fn: Callable[..., Any], world: int = 2, *args: Any) -> int:
    """Run ``fn(rank, world, port, *args)`` in ``world`` new local processes; return an exit
    code (0: every rank returned; 1: a rank failed, reported on stderr, and the others were
    stopped).

    ``port`` is the rendezvous for ``init_process_group(init_method=f"tcp://127.0.0.1:{port}")``
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are set as torchrun sets them,
    so ``init_method="env://"`` works too): with torch installed, as under torchrun, this
    process holds the store there (a ``TCPStore`` on a port the system picked, so no other
    program can take it first) and every rank joins it as a client
    (``TORCHELASTIC_USE_AGENT_STORE``); without torch, a port found free. Gloo is told
    to use the loopback interface unless ``GLOO_SOCKET_IFNAME`` is already set. ``fn`` must be
    importable by a new process (a module-level function), as with
    ``torch.multiprocessing.spawn``. Each backend is told which rank a process is (MegEngine's
    own ``megengine.distributed.get_rank()`` / ``get_world_size()`` then tell the truth).

    In a script: ``sys.exit(spawn_local(train, 2, steps))`` with a module-level
    ``train(rank, world, port, steps)`` (the guide "Data parallel", docs/data-parallel.md,
    runs one: a doctest's functions cannot be imported by a new process).

    Example:
        Any importable function will do; ``max(rank, world, port)`` returns on both ranks:

        >>> spawn_local(max, 2)
        0
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = multiprocessing.get_context("spawn")  # no forked framework state
    held = hold_rendezvous(world)
    holder, port, env = held if held is not None else (None, free_port(), {})
    procs: List[Any] = [context.Process(target=_rank_main, args=(fn, r, world, port, args, env),
                                        name=f"rank {r}") for r in range(world)]
    for p in procs:
        p.start()
    failed = _wait_for_all(procs)
    del holder  # the rendezvous server closes once every rank is done
    if failed:
        print(f"a rank failed: {failed} (exit code {failed.exitcode}); the others were stopped",
              file=sys.stderr)
        return 1
    return 0


def _wait_for_all(procs: List[Any]) -> Any:
    """Join every process; at the first that fails, stop the others. Returns it, or None."""
    from multiprocessing.connection import wait

    running = list(procs)
    while running:
        wait([p.sentinel for p in running])
        for p in [p for p in running if not p.is_alive()]:
            running.remove(p)
            p.join()
            if p.exitcode != 0:
                for other in running:
                    other.terminate()
                for other in running:
                    other.join()
                return p
    return None


def run_ranks(fn: Callable[..., Any], world: int = 2, *args: Any) -> int:
    """Run ``fn(rank, world, port, *args)`` as one rank of a job started by ``torchrun``
    (``RANK`` and ``WORLD_SIZE`` set: this process is that rank, ``port`` is 0, meaning
    ``init_method="env://"``), or else start ``world`` ranks here with :func:`spawn_local`.

    In a script: ``sys.exit(run_ranks(train, 2, steps))``, then ``python x.py`` or
    ``torchrun --nproc_per_node 2 x.py`` alike.

    Example:
        Outside torchrun it starts the ranks itself (any importable function will do):

        >>> run_ranks(max, 2)
        0
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        prepare_ranks(rank, world)
        fn(rank, world, 0, *args)
        return 0
    return spawn_local(fn, world, *args)
