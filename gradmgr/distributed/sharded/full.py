"""Full sharding, ``data_parallel(model, shard="full")``: parameters, gradients and optimizer
state sharded over the ranks by the framework's own engine for it (PyTorch's FSDP2,
``fully_shard``), as the default path hands whole steps to DDP's reducer.

The framework's part is a path (``TensorOps.full_shard_path()``): it wraps the model's blocks
and its root, switches gradient sync for ``no_sync``, and runs each backward itself (FSDP2
needs a plain ``loss.backward()``: its hooks reduce-scatter each block's gradients into the
shards' ``.grad``). Gradmgr's part: the recording, ``no_sync``, and the callbacks attached to
the shards, which run once the engine has written the reduced shards (the ``(tensor, grad)``
each receives: the sharded parameter and this backward's reduced gradient shard, both
``DTensor``s on PyTorch; what a callback returns is added to what ``.grad`` held before).
"""

from __future__ import annotations

import weakref
from typing import Any, List, Sequence

from ...hooks import (
    after_backward_callbacks,
    refuse_higher_order,
    refuse_split,
    set_backward_delegate,
)
from ...manager import callback_chains
from ..reduce.no_sync import is_paused
from .replaced import ReplacedParameters

SPELLINGS = (False, True, "full")

_NO_PATH = (
    "data_parallel(shard='full'): full sharding is built on PyTorch's FSDP2 "
    "(torch.distributed.fsdp.fully_shard, torch 2.6 or later), which these tensors' framework "
    "or this torch does not have. Use shard=True (ZeRO-2: gradients and optimizer state "
    "sharded, with a ShardedOptimizer)"
)
_NOT_FULL = (
    "data_parallel(): {names} {verb} only for shard='full' (FSDP2's options); this call has "
    "shard={shard!r}. Drop {them}, or pass shard='full'"
)
_UNSUPPORTED = (
    "data_parallel(shard='full'): {name} is not supported under full sharding: FSDP2 "
    "reduce-scatters the gradients itself, {why}. Drop {name}, or use shard=False (DDP's "
    "path) or shard=True (ZeRO-2), which take it"
)
_NO_JOIN = (
    "gm.join() / Join([gm]) under full sharding (shard='full'): there is no Join here, as "
    "there is none for FSDP2, which full sharding is built on (torch's fully_shard modules "
    "are not Joinable): a rank that ran out of batches cannot stand in for the others' "
    "parameter gathers and gradient reduce-scatters. Give every rank the same number of "
    "batches (DistributedSampler(..., drop_last=True), or drop the last incomplete ones), "
    "or use data_parallel(model) or shard=True, whose managers take Join"
)
_SKIPPED = (
    "a recording under full sharding (shard='full') ended without gm.backward(), but the "
    "attached tensors' .grad changed during it: loss.backward() (typed by habit?) let FSDP2 "
    "reduce the gradients, but the gradient callbacks attached to {count} of them never ran. "
    "Call gm.backward(loss) inside `with gm:` instead; .grad now holds FSDP2's reduced "
    "gradients without the callbacks' changes"
)
_NO_SPLIT = (
    "gm.backward_split() under full sharding (shard='full'): FSDP2 reduce-scatters the "
    "gradients from hooks that only a plain backward over everything runs (the forward "
    "computes with gathered copies of the sharded parameters, which a split backward's two "
    "parts cannot reach), so every parameter would be left without a gradient. Use "
    "gm.backward(loss), or shard=True (ZeRO-2) or shard=False, which take backward_split"
)
_NO_HIGHER = (
    "a backward that data_parallel(shard='full')'s manager would differentiate (second "
    "derivatives: this manager began recording inside its recording, so its backward keeps a "
    "graph for it; a gradient penalty such as WGAN-GP's) is not supported under full "
    "sharding: FSDP2 frees each block's gathered parameters during a backward, and the "
    "manager's own backward through this one's graph would then leave gradients missing or "
    "wrong (measured: a Linear's weight got none, silently). Nothing ran. Use "
    "data_parallel(model) or shard=True, which give DDP's gradients with a gradient penalty"
)
_WHY = {
    "reduce": "always as a mean over the ranks (reduce='mean')",
    "bucket_bytes": "in one collective per wrapped block (choose blocks= instead)",
    "compression": "in the parameters' dtype or mp_policy's reduce_dtype (pass "
                   "mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) instead)",
    "transport": "over torch.distributed's default process group",
    "group": "over the default process group (a group of its own is not supported yet)",
    "native": "always on its own engine",
    "comm_hook": "with no DDP communication hook (attach a callback: it runs on the reduced "
                 "shards)",
}


def spelling_problem(shard: Any) -> Any:
    """A ValueError for a ``shard=`` that is not one of :data:`SPELLINGS`, else None."""
    if any(shard is s or (isinstance(shard, str) and shard == s) for s in SPELLINGS):
        return None
    return ValueError(
        f"data_parallel(): shard={shard!r} is not a sharding: pass shard=False (DDP: every "
        f"rank holds everything), shard=True (ZeRO-2: gradients and optimizer state sharded, "
        f"with a ShardedOptimizer) or shard='full' (FSDP2: parameters too, with a plain "
        f"optimizer over model.parameters())")


def check_options(shard: Any, full_options: dict, others: dict) -> None:
    """Refuse FSDP2's options without ``shard='full'``, and what full sharding cannot take
    (``others``: the other options that differ from their defaults)."""
    if shard != "full":
        given = [name for name, value in full_options.items() if value is not None]
        if given:
            names = ", ".join(f"{n}=" for n in given)
            raise ValueError(_NOT_FULL.format(names=names, shard=shard,
                                              verb="applies" if len(given) == 1 else "apply",
                                              them="it" if len(given) == 1 else "them"))
        return
    for name, changed in others.items():
        if changed:
            raise ValueError(_UNSUPPORTED.format(name=f"{name}=", why=_WHY[name]))


class FullSharding:
    """A manager's full sharding: the model wrapped by the path, ``no_sync`` switching the
    engine's gradient sync at each recording, and each backward delegated to the path."""

    def __init__(self, gm: Any, module: Any, path: Any, ops: Any,
                 replaced: ReplacedParameters, units: Sequence[Any]) -> None:
        self._gm = weakref.ref(gm)
        self._module, self._path, self._ops = module, path, ops
        self._units = list(units)  # the modules the path wrapped, the root last
        self._engine_ran = False  # in this recording
        self._replaced = replaced  # the parameters wrapping took off the module
        self._watched: List[Any] = []  # the tensors with callbacks, at this recording
        self._grads: Any = None  # their .grad then (ops.grad_snapshot)
        self._sync = True  # the engine's setting now (FSDP2's default)
        self.check: Any = None  # the ranks compared at each recording (.full_check)

    @classmethod
    def install(cls, gm: Any, module: Any, ops: Any, blocks: Sequence[Any],
                reshard_after_forward: bool, mp_policy: Any) -> FullSharding:
        """Wrap ``module`` and set ``gm`` up: it attaches the sharded parameters."""
        path = None if ops is None else ops.full_shard_path()
        if path is None:
            raise NotImplementedError(_NO_PATH)
        replaced = ReplacedParameters(list(module.parameters()),
                                      {id(p): n for n, p in module.named_parameters()})
        units = path.wrap(module, blocks, reshard_after_forward, mp_policy)
        replaced.keep_only_replaced(list(module.parameters()))
        path.watch_optimizers(replaced)
        sharding = cls(gm, module, path, ops, replaced, units)
        gm.no_join = _NO_JOIN
        gm.register_record_callback(sharding.record)
        gm.register_release_callback(sharding.release)
        set_backward_delegate(gm, sharding.delegate)
        refuse_split(gm, _NO_SPLIT)
        refuse_higher_order(gm, _NO_HIGHER)
        gm.attach([p for p in module.parameters() if p.requires_grad])
        return sharding

    def record(self) -> None:
        gm = self._gm()
        if gm is not None:  # before the plan check: no collective starts on a rank refusing
            self._replaced.check(gm)
        sync = gm is not None and not is_paused(gm)
        if self.check is not None:  # before the engine's first gather of this recording
            self.check.record(sync)
        if sync != self._sync:
            self._path.set_sync(self._module, sync)
            self._sync = sync
        self._engine_ran = False
        if gm is not None:
            self._watched = [t for t, chain in callback_chains(gm) if chain]
            self._grads = self._ops.grad_snapshot(self._watched) if self._watched else None

    def release(self, backward_ran: bool) -> None:
        """Reshard what a forward without a backward of this manager left gathered (a
        recording refused before its engine ran, or ended by an error): the modules hold
        their sharded parameters again, as before the recording. Refuse a recording whose
        ``.grad`` a backward other than ``gm.backward`` wrote (``loss.backward()``): FSDP2
        reduced it, but the callbacks were skipped."""
        if not self._engine_ran:
            self._path.reshard(self._units)
        watched, self._watched = self._watched, []
        grads, self._grads = self._grads, None
        if not backward_ran and self._ops.grads_changed(watched, grads):
            raise RuntimeError(_SKIPPED.format(count=len(watched)))

    def delegate(self) -> Any:
        gm = self._gm()
        return None if gm is None else FullShardStep(gm, self._path, self._ran)

    def _ran(self) -> None:
        self._engine_ran = True


class FullShardStep:
    """One backward under full sharding (the manager's backward delegate protocol, see
    :func:`gradmgr.hooks.set_backward_delegate`). Where callbacks are attached, ``.grad`` is
    set aside first, so that they see this backward's reduced shard alone, as DDP's callbacks
    see this step's gradient; it is added back after them."""

    __slots__ = ("_after", "_attached", "_chains", "_held", "_path", "_ran")

    def __init__(self, gm: Any, path: Any, ran: Any) -> None:
        self._path, self._ran = path, ran  # ran(): called as the engine starts
        chains = callback_chains(gm)
        self._attached = [t for t, _ in chains]
        self._chains = [(t, chain) for t, chain in chains if chain]
        self._after = after_backward_callbacks(gm)
        self._held = []
        for tensor, _ in self._chains:
            self._held.append(tensor.grad)
            tensor.grad = None

    def run_engine(self, ys: Sequence[Any], dys: Sequence[Any], create_graph: bool,
                   retain_graph: bool) -> None:
        self._ran()
        self._path.run_engine(ys, dys, create_graph, retain_graph, self._attached)

    def finish(self) -> None:
        for (tensor, chain), held in zip(self._chains, self._held):
            grad = tensor.grad
            if grad is not None:  # None: nothing reduced (inside no_sync, or unused)
                for callback in chain:
                    grad = _resolved(callback(tensor, grad))
                grad = grad if held is None else held + grad
            tensor.grad = held if grad is None else grad
        self._held = []
        for callback in self._after:
            callback()

    def abort(self) -> None:
        for (tensor, _), held in zip(self._chains, self._held):
            tensor.grad = held  # as before the backward: its gradient is lost with it
        self._held = []


def _resolved(value: Any) -> Any:
    """A callback's Future (an object with ``get()``, not a tensor) resolved to its value."""
    get = getattr(value, "get", None)
    return get() if callable(get) and not hasattr(value, "grad") else value


__all__: List[str] = ["FullShardStep", "FullSharding", "SPELLINGS", "check_options",
                      "spelling_problem"]
