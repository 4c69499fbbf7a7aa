"""The collectives' half of the data-parallel adapter contract (:mod:`.contract` has the rest,
and names these too): :class:`Transport` starts collectives over flat buffers, each handing back
a :class:`Handle` to wait on; :class:`Done` is a handle that already finished, the one piece the
backends and the core both use as it is. Imports nothing of gradmgr.
"""

from __future__ import annotations

from typing import Any, Protocol


class Handle(Protocol):
    """A collective in flight (:class:`Done`: one that already finished).

    Example:
        >>> handle = Done([1.0, 2.0])   # what allreduce_async(flat) hands back
        >>> handle.wait()
        [1.0, 2.0]
    """

    def wait(self) -> Any:
        """Block until the collective is done; return the reduced buffer."""


class Done:
    """A finished collective's result, holding nothing else (not the collective, nor its
    input buffer): for transports whose collectives are done when they return, and for
    handles kept after their wait.

    Example:
        >>> Done([1.0, 2.0]).wait()
        [1.0, 2.0]
    """

    __slots__ = ("_value",)

    def __init__(self, value: Any) -> None:
        self._value = value

    def wait(self) -> Any:
        return self._value


class Transport(Protocol):
    """Starts collectives over flat buffers and hands back something to wait on::

        handle = transport.allreduce_async(flat)   # starts the sum over ranks, returns at once
        reduced = handle.wait()                    # same type, dtype and device as ``flat``

    Optional methods: ``rank() -> int`` (names ranks in errors about ranks that disagree, and
    carries the plan check exactly through lossy wires), ``broadcast(flat, src) -> flat``
    (the initial sync; without it a sum with zeros from the other ranks is used, which turns
    -0.0 into 0.0) and ``control() -> Transport``: the transport of the plan checks, the
    small collective that starts every synced step (without it, this one). One of its own
    (torch's: a gloo group of its own) meets only the other ranks' checks, never a collective
    of the user's program, and can give up on ranks that never come
    (:class:`~gradmgr.distributed.RanksOutOfStepError`); with ``on_host = True`` its buffers
    are built on the host (:meth:`TensorOps.vector`), and an ``open()`` of its is called by
    ``data_parallel()``, while every rank is there.

    Example:
        >>> import torch.distributed as dist
        >>> class Sum:                        # torch.distributed's allreduce, as a transport
        ...     def world_size(self): return dist.get_world_size()
        ...     def rank(self): return dist.get_rank()
        ...     def allreduce_async(self, flat):
        ...         work = dist.all_reduce(flat, async_op=True)
        ...         class Handle:
        ...             def wait(self): work.wait(); return flat
        ...         return Handle()
        >>> # cb = make_allreduce_cb("mean", transport=Sum())
    """

    def world_size(self) -> int:
        """Number of processes taking part (the divisor of a mean)."""

    def allreduce_async(self, flat: Any) -> Handle:
        """Start summing ``flat`` over all processes; ``flat`` may be reduced in place."""


class ShardingTransport(Transport, Protocol):
    """What sharded data parallelism needs on top (the backends' own transports have it).

    Optional: ``broadcast_async(tensor, src) -> Handle``, which starts overwriting ``tensor``
    on every rank with rank ``src``'s. With it (and :meth:`TensorOps.param_slice`) the
    sharded optimizer gathers the updated parameters straight into them, every slice from
    its owner, with no gather buffer.
    """

    def rank(self) -> int:
        """This process's rank in the group."""

    def reduce_scatter_async(self, flat: Any) -> Handle:
        """Start summing ``flat`` (a length divisible by the world size) over all processes;
        ``wait()`` returns this rank's chunk of the sum: ``flat[rank * n:(rank + 1) * n]``
        summed, ``n = len(flat) // world``. ``flat`` (a bucket's buffer) may be overwritten; a
        chunk in memory of its own lets the next bucket reuse it."""

    def all_gather_async(self, chunk: Any) -> Handle:
        """Start gathering every rank's ``chunk`` (the same length on all); ``wait()`` returns
        them concatenated in rank order."""


__all__ = ["Done", "Handle", "ShardingTransport", "Transport"]
