"""What ``paddle.distributed.init_parallel_env()`` reads, on ranks that gradmgr's launcher
(:func:`gradmgr.distributed.spawn_local`) started: a Paddle script run there initialises
Paddle's own collectives unchanged.

Paddle's rank 0 serves the rendezvous itself (its TCP store on ``PADDLE_MASTER``), so it
cannot join a store the launcher holds, as torch's ranks do: where the launcher holds torch's
store (``TORCHELASTIC_USE_AGENT_STORE``), rank 0 picks a free port and hands it to the others
through that store; elsewhere the launcher's port is free and Paddle's rank 0 takes it. A
port found free can be taken by another program before rank 0 binds it, as with Paddle's own
``paddle.distributed.spawn``, which does the same.
"""

from __future__ import annotations

import datetime
import os

import paddle

from gradmgr.distributed.launch import free_port

_KEY = "gradmgr/paddle-master-port"


def install(rank: int, world: int) -> None:
    """Set Paddle's variables for rank ``rank`` of ``world``; nothing where a Paddle
    launcher already set them (``PADDLE_TRAINER_ID``)."""
    if "PADDLE_TRAINER_ID" in os.environ:
        return
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    master = f"{addr}:{_master_port(rank, world, addr)}"
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(world),
                      PADDLE_MASTER=master, PADDLE_CURRENT_ENDPOINT=master,
                      PADDLE_TRAINER_ENDPOINTS=master)
    if not paddle.is_compiled_with_cuda():  # Paddle's CPU collectives: gloo
        os.environ.setdefault("PADDLE_DISTRI_BACKEND", "gloo")


def _master_port(rank: int, world: int, addr: str) -> int:
    port = int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return port  # found free by the launcher, held by no one
    import torch.distributed as tdist

    store = tdist.TCPStore(addr, port, world, is_master=False,
                           timeout=datetime.timedelta(seconds=120))
    if rank == 0:
        store.set(_KEY, str(free_port()))
    return int(store.get(_KEY))
