"""The rendezvous of ranks started by :func:`gradmgr.distributed.spawn_local`: torchrun's own
mechanism. The launching process hosts a c10d ``TCPStore`` on a port the system picks (port
0) and keeps it open until the ranks are done; the ranks run with
``TORCHELASTIC_USE_AGENT_STORE=True``, so ``init_process_group`` (``tcp://`` or ``env://``)
makes every rank a client of it, as under torchrun's agent.

This replaced a port found free by binding and releasing it, then handed to rank 0 to bind
again: another process could take it in between (a race), and rank 0 failed to start its
store. The held store leaves no such gap, and costs nothing measurable: on the project's
2-core machine (busy), ``init_process_group`` on 2 gloo ranks returned 0.1-0.7 s after the
last rank reached it, with either launcher, while each rank took 25-40 s to import torch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, Tuple

import torch.distributed as dist

HOST = "127.0.0.1"


def hold(world: int) -> Tuple[Any, int, Dict[str, str]]:
    """A store for ``world`` ranks, its port, and the ranks' environment."""
    store = dist.TCPStore(HOST, 0, world_size=world, is_master=True,
                          timeout=timedelta(minutes=30), wait_for_workers=False)
    return store, store.port, {"TORCHELASTIC_USE_AGENT_STORE": "True"}
