"""Choosing the transport (the collectives) for a data-parallel callback.

A transport is deliberately tiny so that any collective engine fits (see
:class:`gradmgr.distributed.contract.Transport`). Each backend hands out its framework's own
(:meth:`gradmgr.Backend.transport`): PyTorch's ``torch.distributed`` (gloo on CPU, nccl on
CUDA); MegEngine's collectives (GPU), or ``torch.distributed`` gloo through host memory on a
machine without them. A user passes one by name or as an object.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from ..backend import Backend
from .consistency import STEPS, CheckTerms
from .contract import Transport

TransportSpec = Union[None, str, Transport]
"""None (the backend's default), a name the backend knows, or a transport object."""


def check_transport(spec: Optional[Any]) -> None:
    """Raise early for a transport that cannot work (a name is checked once the tensors'
    backend is known, by :func:`resolve_transport`)."""
    if spec is None or isinstance(spec, str):
        return
    for attr in ("world_size", "allreduce_async"):
        if not callable(getattr(spec, attr, None)):
            raise TypeError(
                f"transport must have world_size() and allreduce_async(flat); "
                f"{type(spec).__name__} has no {attr}()"
            )


def resolve_transport(spec: TransportSpec, backend: Backend, group: Any) -> Transport:
    """``spec`` itself, the backend's transport of that name, or its default one."""
    if spec is not None and not isinstance(spec, str):
        return spec
    return backend.transport(group, spec)


def control_transport(transport: Transport, terms: CheckTerms = STEPS) -> Transport:
    """The transport of the plan checks: ``transport.control(terms)`` where it has one (a
    group of their own, whose errors speak of the checking path's ``terms``), else
    ``transport``."""
    control = getattr(transport, "control", None)
    return transport if control is None else control(terms)


__all__ = ["TransportSpec", "check_transport", "control_transport", "resolve_transport"]
