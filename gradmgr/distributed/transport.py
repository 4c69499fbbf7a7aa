"""Transports: start a sum-allreduce of one flat buffer and hand back something to wait on.

A transport is deliberately tiny so that any collective engine fits::

    handle = transport.allreduce_async(flat)   # starts the collective, returns at once
    reduced = handle.wait()                    # same type, dtype and device as ``flat``

Three engines are wrapped, none re-implemented: ``torch.distributed`` (gloo on CPU, nccl on
CUDA), ``megengine.distributed`` (its GPU collectives) and, for MegEngine tensors on a machine
without GPU collectives, ``torch.distributed`` gloo reached through numpy.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Union


class Handle(Protocol):
    def wait(self) -> Any:
        """Block until the collective is done; return the reduced buffer."""


class Transport(Protocol):
    """What the allreduce callback needs. Optionally also ``rank() -> int`` (names ranks in
    errors about ranks that disagree) and ``broadcast(flat, src) -> flat`` (initial sync; without
    it a sum with zeros from the other ranks is used, which turns -0.0 into 0.0)."""

    def world_size(self) -> int:
        """Number of processes taking part (the divisor of a mean)."""

    def allreduce_async(self, flat: Any) -> Handle:
        """Start summing ``flat`` over all processes; ``flat`` may be reduced in place."""


def _torch_dist() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call "
            "torch.distributed.init_process_group('gloo' or 'nccl', ...) in every process "
            "before the first backward, or pass transport= to make_allreduce_cb"
        )
    return dist


class _TorchWork:
    __slots__ = ("_work", "_flat")

    def __init__(self, work: Any, flat: Any) -> None:
        self._work, self._flat = work, flat

    def wait(self) -> Any:
        self._work.wait()
        return self._flat


class _TorchCollective:
    """What the transports over ``torch.distributed`` share: the process group."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def world_size(self) -> int:
        return _torch_dist().get_world_size(self.group)

    def rank(self) -> int:
        return _torch_dist().get_rank(self.group)

    def _start_sum(self, buffer: Any) -> Any:
        dist = _torch_dist()
        return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def _broadcast(self, buffer: Any, src: int) -> None:
        dist = _torch_dist()
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        dist.broadcast(buffer, src=root, group=self.group)


class TorchTransport(_TorchCollective):
    """``torch.distributed.all_reduce(async_op=True)`` on torch tensors (gloo, nccl, ...).

    Example:
        >>> # torch.distributed.init_process_group("gloo", ...)
        >>> # cb = make_allreduce_cb("mean", transport=TorchTransport())
    """

    def allreduce_async(self, flat: Any) -> Handle:
        return _TorchWork(self._start_sum(flat), flat)

    def broadcast(self, flat: Any, src: int) -> Any:
        self._broadcast(flat, src)
        return flat


class _NumpyBridgeWork:
    __slots__ = ("_work", "_buffer", "_device")

    def __init__(self, work: Any, buffer: Any, device: Any) -> None:
        self._work, self._buffer, self._device = work, buffer, device

    def wait(self) -> Any:
        self._work.wait()
        return _from_host(self._buffer, self._device)


class MegEngineViaTorchTransport(_TorchCollective):
    """MegEngine tensors reduced by ``torch.distributed`` (gloo) through host memory.

    MegEngine's own collectives need a GPU; this lets CPU-only machines train MegEngine
    models data-parallel: tensor -> numpy -> torch -> allreduce -> back, on the tensor's device.
    """

    def allreduce_async(self, flat: Any) -> Handle:
        buffer = _host_copy(flat)
        return _NumpyBridgeWork(self._start_sum(buffer), buffer, flat.device)

    def broadcast(self, flat: Any, src: int) -> Any:
        buffer = _host_copy(flat)
        self._broadcast(buffer, src)
        return _from_host(buffer, flat.device)


def _host_copy(flat: Any) -> Any:
    """A torch CPU tensor holding a copy of a MegEngine tensor's values."""
    import numpy as np
    import torch

    return torch.from_numpy(np.array(flat.numpy(), copy=True))


def _from_host(buffer: Any, device: Any) -> Any:
    """The values of a torch CPU tensor as a MegEngine tensor on ``device``."""
    import megengine

    return megengine.Tensor(buffer.numpy(), device=device)


class _Done:
    __slots__ = ("_value",)

    def __init__(self, value: Any) -> None:
        self._value = value

    def wait(self) -> Any:
        return self._value


class MegEngineTransport:
    """``megengine.distributed.functional.all_reduce_sum`` (nccl/rccl, GPU only).

    MegEngine dispatches the collective asynchronously on the device; the handle holds the
    result tensor, which later operations wait for on the device, not on the host.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def _group(self) -> Any:
        import megengine.distributed as mdist

        if not mdist.is_distributed():
            raise RuntimeError(
                "megengine.distributed is not initialised: call "
                "megengine.distributed.init_process_group(...) first (GPU only); on a CPU, "
                "initialise torch.distributed with gloo instead"
            )
        return self.group if self.group is not None else mdist.WORLD

    def world_size(self) -> int:
        import megengine.distributed as mdist

        group = self._group()
        return mdist.get_world_size() if group is mdist.WORLD else group.size

    def rank(self) -> int:
        import megengine.distributed as mdist

        group = self._group()
        return mdist.get_rank() if group is mdist.WORLD else group.rank

    def allreduce_async(self, flat: Any) -> Handle:
        from megengine.distributed.functional import all_reduce_sum

        return _Done(all_reduce_sum(flat, group=self._group()))

    def broadcast(self, flat: Any, src: int) -> Any:
        from megengine.distributed.functional import broadcast

        if src != 0:
            raise ValueError("megengine.distributed broadcasts from the group's rank 0 only; "
                             "use src=0")
        return broadcast(flat, group=self._group())


TransportSpec = Union[None, str, Transport]

_NAMED = {
    "torch": TorchTransport,
    "megengine": MegEngineTransport,
    "megengine-via-torch": MegEngineViaTorchTransport,
}


def resolve_transport(spec: TransportSpec, backend_name: str, group: Any) -> Transport:
    """The transport for ``backend_name`` tensors: ``spec`` itself, a named one, or the default
    (torch: torch.distributed; megengine: its own collectives when initialised, else
    torch.distributed gloo through numpy)."""
    if spec is not None and not isinstance(spec, str):
        return spec
    if isinstance(spec, str):
        if spec not in _NAMED:
            raise ValueError(f"unknown transport {spec!r}; choose one of {sorted(_NAMED)}")
        return _NAMED[spec](group)
    if backend_name == "torch":
        return TorchTransport(group)
    if backend_name == "megengine":
        import megengine.distributed as mdist

        if mdist.is_distributed():
            return MegEngineTransport(group)
        if _torch_initialised():
            return MegEngineViaTorchTransport(group)
        raise RuntimeError(
            "no collective engine for MegEngine tensors: initialise megengine.distributed "
            "(GPU) or torch.distributed with gloo (CPU) before the first backward"
        )
    raise TypeError(f"no default transport for {backend_name!r} tensors; pass transport=")


def _torch_initialised() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def check_transport(transport: Optional[Any]) -> None:
    """Raise early for a transport that cannot work."""
    if transport is None:
        return
    if isinstance(transport, str):
        if transport not in _NAMED:
            raise ValueError(f"unknown transport {transport!r}; choose one of {sorted(_NAMED)}")
        return
    for attr in ("world_size", "allreduce_async"):
        if not callable(getattr(transport, attr, None)):
            raise TypeError(
                f"transport must have world_size() and allreduce_async(flat); "
                f"{type(transport).__name__} has no {attr}()"
            )
