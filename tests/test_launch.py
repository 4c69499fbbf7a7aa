"""spawn_local's rendezvous: the launching process holds torch's TCPStore on a port the system
picked, as torchrun's agent does, so no other program can take the port between finding it
and the ranks' rendezvous (the old launcher bound a free port, released it, and let rank 0
bind it again: a race)."""

from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
import torch.distributed as dist  # noqa: E402

from gradmgr.distributed import launch, spawn_local  # noqa: E402

pytestmark = pytest.mark.torch


def _sum_ranks(rank: int, world: int, port: int, init: str) -> None:
    """One rank: rendezvous as a script would, then all ranks sum their rank + 1."""
    url = f"tcp://127.0.0.1:{port}" if init == "tcp" else "env://"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    try:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        assert total.item() == world * (world + 1) / 2, total
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("init", ["tcp", "env"])
def test_a_port_taken_by_another_program_meanwhile_does_not_stop_the_ranks(monkeypatch, init):
    """Another program listens on the port a free-port search would have picked (what the race
    left possible): the ranks still meet, at the store this process holds."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launch, "free_port", lambda: taken.getsockname()[1])
        assert spawn_local(_sum_ranks, 2, init) == 0
