"""What ``data_parallel(module)`` watches on a ``torch.nn.Module``: its forwards.

DistributedDataParallel does its per-step work in its own forward; gradmgr has no wrapper, so it
puts forward hooks on the module itself (see ``TensorOps.watch_forwards``). They also refuse the
ways a DDP user's habits would reduce gradients twice: ``data_parallel(DDP(model))``
(:func:`wrapper_problem`), a forward through a DDP wrapper kept around the module
(``net = DDP(model)`` after or before ``data_parallel(model)``, training through ``net``), and
a DDP wrapper around a submodule (``model.encoder = DDP(model.encoder)``, before
``data_parallel(model)`` or after: looked for at a forward only after some module was
assigned somewhere, so the usual forward pays one comparison).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional

import torch
from torch.autograd.graph import Node, get_gradient_edge

from gradmgr.distributed.contract import ArmedHooks

from .full_shard import wrapped_here

_grad_enabled = torch.is_grad_enabled
_DDP_MODULE = "torch.nn.parallel.distributed"

_DDP_AROUND = (
    "data_parallel(): this module's forward runs inside a DistributedDataParallel's forward: "
    "DDP reduces every gradient over the ranks and gradmgr's data-parallel manager reduces it "
    "again (each gradient twice DDP's, or the two reducers fighting over .grad). Drop the DDP "
    "wrapper: data_parallel(model) does what DDP did (broadcasts, gradient averaging, buffer "
    "sync, no_sync); call model(x) itself and gm.backward(loss) inside `with gm:`"
)

_DDP_INSIDE = (
    "{who} a DistributedDataParallel at submodule {name!r}: DDP reduces that submodule's "
    "gradients over the ranks and gradmgr's data-parallel manager reduces them again, so "
    "each would be twice DDP's. Put the module it wraps (its .module) there instead: "
    "data_parallel(model) averages every parameter's gradient, that submodule's too"
)

_FOUND: list = []  # DistributedDataParallel, once found


def _ddp_class() -> Any:
    """``DistributedDataParallel``, only where the user's program imported it (looking it up
    would import torch.distributed's Python layer into programs that never use it)."""
    if _FOUND:
        return _FOUND[0]
    module = sys.modules.get(_DDP_MODULE)
    ddp = None if module is None else getattr(module, "DistributedDataParallel", None)
    if ddp is not None:
        _FOUND.append(ddp)
    return ddp


_FSDP = (
    "data_parallel() was given a model already wrapped with FSDP2's fully_shard: its "
    "parameters are shards, and FSDP2 reduce-scatters their gradients itself. Pass the plain "
    "model: data_parallel(model, shard='full', blocks=[the classes you wrapped]) wraps it "
    "with fully_shard itself"
)


_FULL_AGAIN = (
    "data_parallel() was given a model that an earlier data_parallel(model, shard='full') "
    "wrapped with FSDP2's fully_shard, which cannot be undone (its parameters stay shards, "
    "also after that manager is dropped). Keep using the manager that call returned; to wrap "
    "the model another way (other blocks=, or another path), build the model again"
)


def wrapper_problem(module: Any) -> Optional[str]:
    """Why ``data_parallel(module)`` cannot take ``module``: it is a DDP wrapper, or
    already wrapped with FSDP2's ``fully_shard`` (by full sharding, or by the user)."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp is not None and any(isinstance(m, fsdp) for m in module.modules()):
        return _FULL_AGAIN if wrapped_here(module) else _FSDP
    ddp = _ddp_class()
    if ddp is None:
        return None
    if not isinstance(module, ddp):
        name = ddp_inside(module)
        return None if name is None else _DDP_INSIDE.format(
            who="data_parallel() was given a model that holds", name=name)
    return (
        "data_parallel() was given a DistributedDataParallel wrapper: DDP would reduce every "
        "gradient over the ranks and gradmgr again, so each gradient would be twice DDP's. "
        "Drop the DDP wrapper and pass the model itself (net.module): data_parallel(model) "
        "does what DDP did; then call model(x) itself, not the wrapper"
    )


def ddp_inside(module: Any) -> Optional[str]:
    """The name of a DDP wrapper among ``module``'s submodules (not ``module``), as
    ``named_modules`` names it; None: none (or DDP was never imported)."""
    ddp = _ddp_class()
    if ddp is None:
        return None
    for name, sub in module.named_modules():
        if sub is not module and isinstance(sub, ddp):
            return name
    return None


def _inside_ddp_forward(module: Any) -> bool:
    """A DDP wrapper around ``module`` (or a module holding it) is running its forward: DDP
    marks itself in ``_inside_ddp_forward`` (torch 2.x, its C++ reducer's path)."""
    ddp = _ddp_class()
    active = None if ddp is None else getattr(ddp, "_active_ddp_module", None)
    if active is None:
        return False
    inner = getattr(active, "module", None)
    return inner is not None and any(m is module for m in inner.modules())


def _refuse_backward(message: str, grad: Any) -> None:
    raise RuntimeError(message)


class _Refusal:
    """A pre-hook on a parameter's gradient accumulator: it runs where a backward is about to
    write ``.grad`` (``loss.backward()``), before it does. ``torch.autograd.grad(out,
    params)`` takes the gradient at the parameter instead, writes no ``.grad`` and passes:
    this rank's gradient, what it gives under DDP too (a gradient penalty, a saliency map,
    gradient norms). The accumulator is held: the graphs built from now on use this one."""

    __slots__ = ("_node", "_handle")

    def __init__(self, param: Any, refuse: Callable[[Any], None]) -> None:
        self._node: Optional[Node] = get_gradient_edge(param).node
        self._handle = self._node.register_prehook(refuse)

    def remove(self) -> None:
        self._handle.remove()
        self._node = None


class ForwardWatch(ArmedHooks):
    """The hooks on one module's forward, and the parameter hooks a forward arms.

    A forward with gradients enabled for which ``refusal()`` gives a message (outside a
    recording) arms a hook on every trainable parameter that raises it when a backward is
    about to accumulate that parameter's gradient into ``.grad``: ``loss.backward()``
    (``torch.autograd.grad`` writes no ``.grad`` and passes, see :class:`_Refusal`).
    A manager's backward of another model through this one's outputs (a GAN's generator step
    through the discriminator) computes no gradient for these parameters and passes. The
    manager disarms them when a recording starts, so its own backwards run without them."""

    def __init__(self, module: Any, refusal: Callable[[], Optional[str]]) -> None:
        super().__init__()  # the parameter hooks a forward armed: _Refusal objects
        self._refusal = weakref.WeakMethod(refusal)
        self._module = weakref.ref(module)
        self._params = [weakref.ref(p) for p in module.parameters()]
        self._seen = _watch_registrations()
        self._looked = self._seen  # the registrations when the submodules were last looked at
        # One forward hook, run after the forward (still inside a DDP wrapper's): a pre-hook
        # as well would cost every forward a Python call more (bench/bench_zero.py's
        # `gradmgr` variant times data_parallel's whole step against DDP's).
        self._handle = module.register_forward_hook(self._after)
        _copy_plain(module)

    def _after(self, module: Any, args: Any, output: Any) -> None:
        if not _grad_enabled():
            return  # an evaluation under no_grad (also through a DDP wrapper): no backward
        if _inside_ddp_forward(module):
            raise RuntimeError(_DDP_AROUND)
        if self._looked != _REGISTRATIONS[0]:  # a module was assigned somewhere since
            self._refuse_ddp_inside(module)
        if self._armed:
            return
        refusal = self._refusal()
        message = None if refusal is None else refusal()
        if message is not None:
            refuse = functools.partial(_refuse_backward, message)
            self._armed = [_Refusal(p, refuse) for p in module.parameters() if p.requires_grad]

    def _refuse_ddp_inside(self, module: Any) -> None:
        """Refuse a DDP wrapper put around a submodule since data_parallel: its forward,
        inside this one's, readies DDP's reducer, which reduces that submodule's gradients in
        the manager's backward too."""
        name = ddp_inside(module)
        if name is not None:
            raise RuntimeError(_DDP_INSIDE.format(who="data_parallel(): the model now holds",
                                                  name=name))
        self._looked = _REGISTRATIONS[0]

    def changed(self) -> Optional[str]:
        """The name of the first parameter of the module that it did not have when watched
        (a layer replaced or added since); None: none. Cheap: the parameters are looked at
        only after a module or parameter was assigned somewhere."""
        module = self._module()
        if module is None or self._seen == _REGISTRATIONS[0]:
            return None
        seen, known = _REGISTRATIONS[0], {id(ref()) for ref in self._params}
        for name, param in module.named_parameters():
            if id(param) not in known:
                return name
        self._seen = seen
        return None

    def remove(self) -> None:
        self.disarm()
        self._handle.remove()
        module = self._module()
        if module is not None and not any(map(_ours, module._forward_hooks.values())):
            module.__dict__.pop("__getstate__", None)


_REGISTRATIONS = [0]  # modules and parameters assigned on any module (torch's global hooks)
_HOOKS: list = []


def _registered(module: Any, name: str, value: Any) -> None:
    _REGISTRATIONS[0] += 1


def _watch_registrations() -> int:
    """Count every assignment of a module or parameter from now on (torch calls these hooks
    in ``Module.__setattr__`` and ``register_parameter``): no cost at a step."""
    if not _HOOKS:
        registration = torch.nn.modules.module
        _HOOKS.append(registration.register_module_module_registration_hook(_registered))
        _HOOKS.append(registration.register_module_parameter_registration_hook(_registered))
    return _REGISTRATIONS[0]


def _ours(hook: Any) -> bool:
    return isinstance(getattr(hook, "__self__", None), ForwardWatch)


def _copy_plain(module: Any) -> None:
    """``copy.deepcopy(model)`` and ``torch.save(model)`` copy a plain model, as DDP's
    ``module`` is: without the watch's hook (which no copy could use, and which pickles a
    weak reference). Both take a module's state from ``__getstate__`` looked up on the
    instance first, so the module itself carries the one that leaves the hook out (torch
    already leaves out the compiled forward there)."""
    module.__dict__["__getstate__"] = functools.partial(_plain_state, weakref.ref(module))


def _plain_state(ref: Any) -> dict:
    module = ref()
    getstate: Any = type(module).__getstate__  # the module's class's (nn.Module's: a copy)
    state: Dict[str, Any] = getstate(module)
    state.pop("__getstate__", None)
    hooks = state.get("_forward_hooks")
    if hooks is not None and any(map(_ours, hooks.values())):
        state["_forward_hooks"] = OrderedDict(
            (key, hook) for key, hook in hooks.items() if not _ours(hook))
    return state


def watch_forwards(module: Any, refusal: Callable[[], Optional[str]]) -> Optional[ForwardWatch]:
    """Hooks on ``module``'s forward (see ``TensorOps.watch_forwards``); None: not a Module."""
    if not isinstance(module, torch.nn.Module):
        return None
    return ForwardWatch(module, refusal)
