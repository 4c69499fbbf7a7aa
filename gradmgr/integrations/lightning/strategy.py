"""Lightning Fabric's strategy for gradmgr: ``Fabric(strategy=GradmgrStrategy())`` trains as
Fabric's ``DDPStrategy`` does, with ``data_parallel(module)`` in place of the DDP wrapper.

Reached through its package :mod:`gradmgr.integrations.lightning`, which imports this module (and
with it Lightning Fabric and PyTorch) only when ``GradmgrStrategy`` is first asked for.

Fabric runs ``out = model(x)`` and ``fabric.backward(loss)`` with nothing around the two, where
gradmgr wants both inside one recording: the module :meth:`GradmgrStrategy.setup_module`
returns starts the recording at a forward run with gradients enabled, and the strategy's
:meth:`~GradmgrStrategy.backward` ends it after ``gm.backward(loss)``. One set-up module
records at a time (a backward while another manager records would be gradmgr's higher-order
one): another's forward ends a waiting recording, whose backward then records again.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional

import torch
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.plugins.precision import MixedPrecision, Precision
from lightning_fabric.strategies.ddp import DDPStrategy
from lightning_fabric.strategies.strategy import _BackwardSyncControl

from gradmgr.distributed import ShardedOptimizer, broadcast, data_parallel, no_sync
from gradmgr.distributed.reduce.no_sync import is_paused

_OPTIONS = frozenset(inspect.signature(data_parallel).parameters) - {"module"}

_FORWARD_OUTSIDE = (
    "GradmgrStrategy: fabric.backward(loss) found no step of a module set up with this "
    "strategy in progress. A step starts at the forward of the module fabric.setup() "
    "returned, run with gradients enabled (inside fabric.no_backward_sync(model) when the "
    "backward is meant to accumulate): run `out = model(x)` on that module, with gradients "
    "enabled and inside the same no_backward_sync block as its fabric.backward(loss)."
)


_SYNC_CHANGED = (
    "GradmgrStrategy: fabric.backward(loss) runs outside the fabric.no_backward_sync(model) "
    "block its forward ran in: DDP would skip the reduction the forward chose, gradmgr would "
    "not know which to do. Put the forward and fabric.backward(loss) in the same block."
)


_FULL_OPTIMIZER = (
    "GradmgrStrategy(shard='full'): the optimizer holds parameters that are not the set-up "
    "model's: fully_shard replaced them with their shards when the model was set up, so an "
    "optimizer made before would train parameters no forward uses. Set the model up first, "
    "then make the optimizer over its parameters, as with Fabric's FSDP strategies: "
    "`model = fabric.setup_module(model)`, then "
    "`optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`"
)


class GradmgrModule(torch.nn.Module):
    """What :meth:`GradmgrStrategy.setup_module` returns in place of DDP's wrapper: the module,
    whose forward, run with gradients enabled, starts ``gm``'s recording (where none is in
    progress) for the strategy's backward to end. ``module`` is the user's module, ``gm`` its
    data-parallel manager."""

    def __init__(self, module: torch.nn.Module, gm: Any,
                 buffer_options: Optional[Dict[str, Any]]) -> None:
        super().__init__()
        self.module = module
        self.gm = gm
        self._buffers_from = buffer_options  # src, group, transport; None: no broadcast
        self._synced_forward = False  # this recording ran a synced forward with gradients
        # A forward with gradients ran since the last backward: whether it was inside
        # no_backward_sync (None: none is waiting for its backward).
        self.waiting: Optional[bool] = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        gm = self.gm
        if gm.is_recording:
            self._sync_buffers_again()
        if torch.is_grad_enabled():
            if not gm.is_recording:
                _make_room(self)
                gm.record()
                _RECORDING[self] = None
            self.waiting = is_paused(gm)
            self._synced_forward = not self.waiting
        return self.module(*args, **kwargs)

    def _sync_buffers_again(self) -> None:
        """A second forward in one recording (the first was never backwarded: a skipped batch,
        or an evaluation with gradients enabled): DDP broadcasts rank ``src``'s buffers at a
        forward that follows a synced one; gradmgr's broadcast waits for the recording's
        end, so do it here, as DDP would."""
        if self._synced_forward and self._buffers_from is not None:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast(buffers, **self._buffers_from)
        self._synced_forward = False

    def give_up_step(self) -> None:
        """End a recording whose forwards wait for their backward: before a ``no_sync`` one,
        or for another module's recording (two recordings at once would be gradmgr's higher
        order). Ending a synced recording broadcasts rank ``src``'s buffers, for the next
        forward; DDP broadcasts at the next forward only where the last one was synced with
        gradients (not after an evaluation under ``no_grad``, which in training mode updates
        BatchNorm's statistics): elsewhere each rank keeps its own, as with DDP."""
        _RECORDING.pop(self, None)
        keep = []
        if not self._synced_forward and self._buffers_from is not None:
            keep = [(b, b.clone()) for b in self.module.buffers()]
        self._synced_forward = False
        self.gm.release()
        with torch.no_grad():
            for buffer, value in keep:
                buffer.copy_(value)

    def end_step(self) -> None:
        """After the backward: nothing waits any more, the recording ends."""
        self._synced_forward, self.waiting = False, None
        _RECORDING.pop(self, None)
        if self.gm.is_recording:
            self.gm.release()


class _NoBackwardSync(_BackwardSyncControl):
    # Fabric's hook for fabric.no_backward_sync(): every Fabric strategy sets one (a private
    # name of Lightning's, but the only place Fabric looks; DDPStrategy's own is one too).
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> Any:
        if not enabled:
            return contextlib.nullcontext()
        if not isinstance(module, GradmgrModule):
            raise TypeError(
                "GradmgrStrategy.no_backward_sync: the module must be the one fabric.setup() "
                f"returned with this strategy; got {type(module).__name__}."
            )
        return _paused(module)


# The set-up modules whose recording began in their forward, of every strategy, in the order
# they began, held until it ends. Each recording _make_room ends is a collective, so which and
# in what order must be the same on every rank: a WeakSet would order them by address and lose
# a dropped module whenever that rank's garbage collector frees it.
_RECORDING: Dict[GradmgrModule, None] = {}


def _make_room(wrapped: GradmgrModule) -> None:
    """Before ``wrapped`` records: the other set-up modules' recordings end (a GAN's
    generator, whose forward waits while the discriminator steps; a forward whose backward
    raised before it ran). Their forwards still wait, and their backward records again: with
    one manager recording at a time, no backward is taken for a higher-order one (gradmgr's
    rule for a backward while another manager records)."""
    for other in list(_RECORDING):
        if other is not wrapped and other.gm.is_recording:
            other.give_up_step()
        if not other.gm.is_recording:  # (ended by hand: gm.release())
            _RECORDING.pop(other, None)


@contextlib.contextmanager
def _paused(module: GradmgrModule) -> Iterator[None]:
    # A recording still open here had forwards only (their backward never came: a skipped
    # batch, an evaluation with gradients enabled). End it, so that the accumulation starts
    # with its own recording, as no_sync requires. (DDP's reducer, armed by such a forward,
    # reduces the accumulated micro-batch anyway; gradmgr accumulates it locally, as asked:
    # the same sum to float rounding, docs/lightning.md.)
    if module.gm.is_recording:
        module.give_up_step()
    module.waiting = None  # a backward inside would accumulate what DDP reduces: refused
    with no_sync(module.gm):
        yield


class GradmgrStrategy(DDPStrategy):
    """Fabric's ``DDPStrategy`` with gradmgr in place of ``DistributedDataParallel``:
    ``Fabric(accelerator="cpu", devices=2, strategy=GradmgrStrategy())``.

    Keyword options other than DDPStrategy's own (``process_group_backend``, ``timeout``,
    ``start_method``, ...) go to :func:`gradmgr.distributed.data_parallel` (``reduce``,
    ``broadcast_buffers``, ``bucket_bytes``, ``compression``, ``native``, ``verify``,
    ``shard``, ...). With ``shard=True`` each optimizer Fabric sets up is rebuilt as a
    :class:`~gradmgr.distributed.ShardedOptimizer` of the same class and parameter groups (it
    must be new, without state), and ``fabric.clip_gradients(max_norm=...)`` clips the shards.
    With ``shard="full"`` (FSDP2; ``blocks=``, ``reshard_after_forward=``, ``mp_policy=``)
    set the model up first and make the optimizer over its parameters after
    (``fabric.setup_module``, then ``fabric.setup_optimizers``); ``fabric.clip_gradients``
    clips the gradient shards as Fabric's FSDP2 strategy does (torch's ``clip_grad_norm_``
    and ``clip_grad_value_`` on the DTensors), and ``fabric.save`` and ``fabric.load`` save
    and load the shards with torch.distributed.checkpoint as Fabric's FSDP2 strategy
    (``ModelParallelStrategy``) does: a folder of each rank's shards, and ``meta.pt``.

    A step runs as with DDP: ``model(x)`` (with gradients enabled) starts gradmgr's recording,
    ``fabric.backward(loss)`` runs ``gm.backward(loss)`` and ends it; forwards under
    ``torch.no_grad()`` record nothing. ``fabric.no_backward_sync(model)`` is gradmgr's
    :func:`~gradmgr.distributed.no_sync`, around the forward and the backward as Fabric asks.
    """

    def __init__(self, accelerator: Any = None, parallel_devices: Optional[List[Any]] = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 precision: Any = None, process_group_backend: Optional[str] = None,
                 timeout: Any = default_pg_timeout,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
                 **options: Any) -> None:
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise TypeError(
                f"GradmgrStrategy got {unknown}: neither DDPStrategy's arguments nor "
                f"data_parallel()'s options ({', '.join(sorted(_OPTIONS))}). DDP's own "
                "(find_unused_parameters, static_graph, gradient_as_bucket_view) have no "
                "counterpart to set: gradmgr finds unused parameters by itself"
            )
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=precision, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._options = options
        self._backward_sync_control = _NoBackwardSync()
        self._modules: List[GradmgrModule] = []

    @property
    def options(self) -> Dict[str, Any]:
        """The options given to ``data_parallel`` for every module set up."""
        return dict(self._options)

    def setup_module(  # type: ignore[override]  # Fabric takes any module back; ours is no DDP
            self, module: torch.nn.Module) -> GradmgrModule:
        gm = data_parallel(module, **self._options)
        buffers = None
        if self._options.get("broadcast_buffers", True):
            buffers = {k: self._options.get(k, d)
                       for k, d in (("src", 0), ("group", None), ("transport", None))}
        wrapped = GradmgrModule(module, gm, buffers)
        self._modules.append(wrapped)
        return wrapped

    def setup_optimizer(self, optimizer: Any) -> Any:
        shard = self._options.get("shard", False)
        if shard == "full":
            ours = {id(p) for w in self._modules for p in w.module.parameters()}
            if any(id(p) not in ours for group in optimizer.param_groups
                   for p in group["params"]):
                raise ValueError(_FULL_OPTIMIZER)
            return optimizer
        if shard is not True:
            return optimizer
        return _sharded(self._module_of(optimizer).gm, optimizer)

    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Any = None,
                        filter: Any = None) -> None:
        if self._options.get("shard") != "full":
            super().save_checkpoint(path, state, storage_options=storage_options,
                                    filter=filter)
            return
        # Under full sharding, as Fabric's FSDP2 strategy (ModelParallelStrategy) saves: each
        # rank writes its shards with torch.distributed.checkpoint, rank 0 the rest in meta.pt.
        from lightning_fabric.strategies.model_parallel import _save_checkpoint

        if storage_options is not None or filter is not None:
            raise TypeError("GradmgrStrategy(shard='full'): fabric.save() takes no "
                            "storage_options= or filter= (the shards are written by "
                            "torch.distributed.checkpoint, as Fabric's FSDP2 strategy does)")
        path = Path(self.broadcast(path))  # every rank writes into rank 0's folder
        _save_checkpoint(path=path, state=_inner(state), full_state_dict=False,
                         rank=self.global_rank)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        if self._options.get("shard") != "full":
            return super().load_checkpoint(path, state, strict=strict,
                                           weights_only=weights_only)
        from lightning_fabric.strategies.model_parallel import _load_checkpoint

        if not isinstance(state, dict) or not state:
            raise ValueError("GradmgrStrategy(shard='full'): fabric.load(path, state) needs "
                             "state, a dict holding the set-up model (and its optimizers), as "
                             "under Fabric's FSDP2 strategy: fabric.load(path, {'model': "
                             "model, 'optimizer': optimizer})")
        inner = _inner(state)
        remainder = _load_checkpoint(path=Path(self.broadcast(path)), state=inner,
                                     strict=strict, weights_only=weights_only)
        for key, value in inner.items():  # the user's metadata, loaded into inner's entries
            if not isinstance(state[key], (torch.nn.Module, torch.optim.Optimizer)):
                state[key] = value
        return remainder

    def backward(self, tensor: torch.Tensor, module: Optional[torch.nn.Module], *args: Any,
                 **kwargs: Any) -> None:
        if args or kwargs:
            raise TypeError(
                "GradmgrStrategy: fabric.backward(loss) takes no further arguments "
                f"(got {len(args)} positional, {sorted(kwargs)}): gm.backward(loss) runs it "
                "(no retain_graph, no inputs=)"
            )
        wrapped = self._waiting(module)
        self.precision.pre_backward(tensor, module)
        try:
            if not wrapped.gm.is_recording:  # given up for another module's: record again
                _make_room(wrapped)
                wrapped.gm.record()
            wrapped.gm.backward(self._scaled(tensor))
        finally:
            wrapped.end_step()
        self.precision.post_backward(tensor, module)

    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: Any, max_norm: Any,
                            norm_type: Any = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        # Under full sharding .grad holds FSDP2's DTensor shards, which torch's clip_grad_norm_
        # (DDPStrategy's and Fabric's FSDP2 strategy's, from Strategy) takes as they are.
        if not isinstance(optimizer, ShardedOptimizer):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type,
                                               error_if_nonfinite)
        # (a ShardedOptimizer of torch tensors is a torch Optimizer: TorchShardedBase)
        self.precision.unscale_gradients(optimizer)  # type: ignore[arg-type]
        total = optimizer.clip_grad_norm_(max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(torch.tensor(total)):
            raise RuntimeError(f"The total norm of the gradients is {total}: not finite")
        return torch.tensor(total)

    def clip_gradients_value(self, module: torch.nn.Module, optimizer: Any,
                             clip_val: Any) -> None:
        if isinstance(optimizer, ShardedOptimizer):
            raise NotImplementedError(
                "GradmgrStrategy(shard=True): fabric.clip_gradients(clip_val=...) is not "
                "supported (each rank holds a slice of the gradients); use max_norm=..."
            )
        super().clip_gradients_value(module, optimizer, clip_val)

    def get_module_state_dict(self, module: torch.nn.Module) -> Dict[str, Any]:
        if isinstance(module, GradmgrModule):
            module = module.module
        return super().get_module_state_dict(module)

    def load_module_state_dict(self, module: torch.nn.Module, state_dict: Dict[str, Any],
                               strict: bool = True) -> None:
        if isinstance(module, GradmgrModule):
            module = module.module
        super().load_module_state_dict(module, state_dict, strict=strict)

    def teardown(self) -> None:
        # A recording still open (a forward never backwarded) is left to its manager: ending
        # it takes collectives, and a teardown after an error may run on one rank alone.
        self._modules = []
        super().teardown()

    def _waiting(self, module: Optional[torch.nn.Module]) -> GradmgrModule:
        """The set-up module whose step this backward ends: ``model=`` if Fabric passed it."""
        if module is not None:
            found = [w for w in self._modules if w is module]
            if not found:
                raise TypeError("GradmgrStrategy: fabric.backward(loss, model=...) needs a "
                                "module set up with this strategy")
        else:
            found = [w for w in self._modules if w.waiting is not None]
        if len(found) > 1:
            raise RuntimeError(
                "GradmgrStrategy: the forwards of several set-up modules are waiting for "
                "their backward; say which one this loss trains: "
                "fabric.backward(loss, model=model)"
            )
        if not found or found[0].waiting is None:
            raise RuntimeError(_FORWARD_OUTSIDE)
        if found[0].waiting != is_paused(found[0].gm):
            raise RuntimeError(_SYNC_CHANGED)
        return found[0]

    def _scaled(self, tensor: torch.Tensor) -> torch.Tensor:
        """What the precision plugin's backward would backward: the loss, scaled for fp16."""
        precision = self.precision
        if isinstance(precision, MixedPrecision):
            return tensor if precision.scaler is None else precision.scaler.scale(tensor)
        if type(precision).backward is not Precision.backward:
            raise NotImplementedError(
                f"GradmgrStrategy: the precision plugin {type(precision).__name__} runs its "
                "own backward, which gradmgr's would replace; use precision='32-true', "
                "'64-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'"
            )
        return tensor

    def _module_of(self, optimizer: Any) -> GradmgrModule:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        found = [w for w in self._modules if ids & {id(p) for p in w.module.parameters()}]
        if len(found) != 1:
            raise ValueError(
                "GradmgrStrategy(shard=True): an optimizer must hold the parameters of "
                f"exactly one module set up with this strategy ({len(found)} found); set the "
                "module up first (fabric.setup(model, optimizer) does)"
            )
        return found[0]


def _inner(state: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` with each set-up module replaced by the user's (fully sharded) module, so
    that the checkpoint's names are the model's own, as plain FSDP2's."""
    return {k: v.module if isinstance(v, GradmgrModule) else v for k, v in state.items()}


def _sharded(gm: Any, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
    """``optimizer`` rebuilt as a ShardedOptimizer of the same class and groups."""
    if optimizer.state:
        raise ValueError(
            "GradmgrStrategy(shard=True): the optimizer already has state; set it up with "
            "Fabric before its first step (it is rebuilt sharded, and its state would be lost)"
        )
    groups = [dict(group) for group in optimizer.param_groups]
    sharded = ShardedOptimizer(gm, type(optimizer), groups)
    _rebind_schedulers(optimizer, sharded)
    return sharded


def _rebind_schedulers(optimizer: torch.optim.Optimizer, sharded: ShardedOptimizer) -> None:
    """A scheduler made before ``fabric.setup`` (the order many scripts use) holds
    ``optimizer``, which Fabric then drops, and sets its groups' options at every step: give
    ``optimizer`` the sharded optimizer's very groups, whose options the sharded step reads.
    torch's schedulers also check that the optimizer they hold stepped before them (they wrap
    its ``step``): the sharded step tells it so."""
    optimizer.param_groups[:] = sharded.param_groups
    step = sharded.step

    def stepped(closure: Optional[Callable[[], Any]] = None) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]  # torch's mark, set by the wrapper schedulers put
        return step(closure)

    stepped.__doc__ = step.__doc__
    sharded.step = stepped  # type: ignore[method-assign]


__all__ = ["GradmgrModule", "GradmgrStrategy"]
