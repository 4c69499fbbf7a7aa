"""What ``data_parallel(module)`` watches on a ``torch.nn.Module``: its forwards.

DistributedDataParallel does its per-step work in its own forward; gradmgr has no wrapper, so it
puts forward hooks on the module itself (see ``TensorOps.watch_forwards``). They also refuse the
two ways a DDP user's habits would reduce every gradient twice: ``data_parallel(DDP(model))``
(:func:`wrapper_problem`) and a forward through a DDP wrapper kept around the module
(``net = DDP(model)`` after or before ``data_parallel(model)``, training through ``net``).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable, Optional

import torch

_grad_enabled = torch.is_grad_enabled
_DDP_MODULE = "torch.nn.parallel.distributed"

_DDP_AROUND = (
    "data_parallel(): this module's forward runs inside a DistributedDataParallel's forward: "
    "DDP reduces every gradient over the ranks and gradmgr's data-parallel manager reduces it "
    "again (each gradient twice DDP's, or the two reducers fighting over .grad). Drop the DDP "
    "wrapper: data_parallel(model) does what DDP did (broadcasts, gradient averaging, buffer "
    "sync, no_sync); call model(x) itself and gm.backward(loss) inside `with gm:`"
)


def _ddp_class() -> Any:
    """``DistributedDataParallel``, only where the user's program imported it (looking it up
    would import torch.distributed's Python layer into programs that never use it)."""
    module = sys.modules.get(_DDP_MODULE)
    return None if module is None else getattr(module, "DistributedDataParallel", None)


def wrapper_problem(module: Any) -> Optional[str]:
    """Why ``data_parallel(module)`` cannot take ``module``: it is a DDP wrapper."""
    ddp = _ddp_class()
    if ddp is None or not isinstance(module, ddp):
        return None
    return (
        "data_parallel() was given a DistributedDataParallel wrapper: DDP would reduce every "
        "gradient over the ranks and gradmgr again, so each gradient would be twice DDP's. "
        "Drop the DDP wrapper and pass the model itself (net.module): data_parallel(model) "
        "does what DDP did; then call model(x) itself, not the wrapper"
    )


def _inside_ddp_forward(module: Any) -> bool:
    """A DDP wrapper around ``module`` (or a module holding it) is running its forward: DDP
    marks itself in ``_inside_ddp_forward`` (torch 2.x, its C++ reducer's path)."""
    ddp = _ddp_class()
    active = None if ddp is None else getattr(ddp, "_active_ddp_module", None)
    if active is None:
        return False
    inner = getattr(active, "module", None)
    return inner is not None and any(m is module for m in inner.modules())


def _before(module: Any, args: Any) -> None:
    if _inside_ddp_forward(module):
        raise RuntimeError(_DDP_AROUND)


def _after(refusal_ref: weakref.WeakMethod, module: Any, args: Any, output: Any) -> None:
    if not _grad_enabled():
        return  # an evaluation under no_grad: no backward can come through it
    refusal = refusal_ref()
    message = None if refusal is None else refusal()
    if message is not None:
        refuse = functools.partial(_refuse_backward, message)
        for tensor in _tensors(output):
            # Non-leaves only: a hook on a leaf (a parameter returned as it is) would stay.
            if tensor.requires_grad and tensor.grad_fn is not None:
                tensor.register_hook(refuse)


def _refuse_backward(message: str, grad: Any) -> None:
    raise RuntimeError(message)


def _tensors(output: Any) -> list:
    """The tensors in a forward's output (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


def watch_forwards(module: Any, refusal: Callable[[], Optional[str]]) -> Optional[Any]:
    """Hooks on ``module``'s forward (see ``TensorOps.watch_forwards``); returns what removes
    them (None: not a Module, nothing to hook)."""
    if not isinstance(module, torch.nn.Module):
        return None
    handles = [module.register_forward_pre_hook(_before),
               module.register_forward_hook(functools.partial(_after,
                                                              weakref.WeakMethod(refusal)))]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove
