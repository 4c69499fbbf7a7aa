"""``data_parallel(module)``: a GradManager set up as ``DistributedDataParallel(module)`` is."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..registry import backend_for
from .broadcasting import broadcast, broadcast_tensors
from .consistency import (
    RECORDINGS,
    CheckTerms,
    PlanCheck,
    every_rank,
    names_from,
    plan_fingerprint,
    step_terms,
    verify_mode,
)
from .contract import NEUTRAL_IDIOMS, ModuleWatch, TensorOps
from .errors import RankMismatchError, RanksOutOfStepError
from .join.joinable import DataParallelManager
from .join.joining import Joining
from .reduce.allreduce import AllreduceCallback, Compression, Reduce, ReduceScatterCallback, Verify
from .reduce.no_sync import is_paused
from .sharded.full import SPELLINGS, FullSharding, check_options, spelling_problem
from .sharded.full_check import full_shard_check
from .transport import TransportSpec, control_transport, resolve_transport


def data_parallel(
    module: Any,
    reduce: Reduce = "mean",
    *,
    broadcast_buffers: bool = True,
    src: int = 0,
    group: Any = None,
    bucket_bytes: Optional[int] = None,
    compression: Optional[Compression] = None,
    transport: TransportSpec = None,
    verify: Verify = True,
    native: Optional[bool] = None,
    shard: Union[bool, str] = False,
    comm_hook: Any = None,
    comm_state: Any = None,
    blocks: Optional[Sequence[Any]] = None,
    reshard_after_forward: Optional[bool] = None,
    mp_policy: Any = None,
) -> DataParallelManager:
    """A GradManager that trains ``module`` data-parallel, set up as
    ``DistributedDataParallel(module)`` is: rank ``src``'s parameters and buffers are broadcast
    now (the buffers only with ``broadcast_buffers``), the trainable parameters are attached
    with an allreduce callback, and (with ``broadcast_buffers``) rank ``src``'s buffers are
    broadcast again when a synced recording ends (not one inside a :func:`no_sync`
    accumulation window; a split backward's when its ``finish()`` ends): the values DDP
    broadcasts at the next forward, an evaluation's too.
    Where the backend watches forwards (PyTorch, Paddle), after a forward run with gradients
    enabled outside a recording, a backward that writes the module's ``.grad`` raises
    ``RuntimeError`` (``loss.backward()`` without ``with gm:``; the framework's functional
    gradient call, ``torch.autograd.grad`` or ``paddle.grad``, writes none and gives this
    rank's gradients, as under DDP), in the framework's words (``TensorOps.idioms``; Paddle
    hands it back inside its ``OSError``); on PyTorch a forward inside a DDP wrapper raises
    ``RuntimeError`` too (two reducers).

    Before broadcasting, the ranks compare their modules (every parameter and buffer, in
    order, with its shape and dtype) and ``shard=``: where they differ, every rank raises
    :class:`RankMismatchError` naming the ranks that shard and those that do not, or else the
    first differing tensor (``fc2.weight``), as DDP refuses to wrap at once. The other
    options are :class:`AllreduceCallback`'s; ``verify=False`` also skips this first
    comparison. ``shard=True`` reduce-scatters the gradients instead
    (:class:`ReduceScatterCallback`: each rank keeps its slice, for a
    :class:`ShardedOptimizer`; ``native`` does not apply, ``comm_hook`` raises ``ValueError``).
    ``comm_hook=hook, comm_state=state`` is DDP's ``register_comm_hook(state, hook)``.
    ``shard="full"`` shards the parameters too, on PyTorch's FSDP2
    (:mod:`gradmgr.distributed.sharded.full`): each submodule whose class is in ``blocks``
    (a list of module classes), then the root, is wrapped with ``fully_shard``
    (``reshard_after_forward``, default True, and ``mp_policy``, a ``MixedPrecisionPolicy``,
    passed through); train with a plain optimizer over ``model.parameters()`` (``DTensor``
    shards). The allreduce options (``reduce``, ``bucket_bytes``, ``compression``,
    ``transport``, ``group``, ``native``, ``comm_hook``) raise ``ValueError`` there, and
    ``blocks``, ``reshard_after_forward`` and ``mp_policy`` without it.
    ``data_parallel(DDP(model))`` raises ``TypeError``: pass the model itself. The manager is
    a joinable of torch's ``Join`` context for uneven inputs (``with Join([gm]):``, or
    ``gm.join()`` as DDP's ``model.join()``; see :mod:`gradmgr.distributed.join.joining`).

    Example:
        Here a process group of one rank; under ``torchrun`` every rank runs the same lines
        and ``.grad`` is the mean over the ranks (the README's data-parallel quick start):

        >>> import torch
        >>> import torch.distributed as dist
        >>> from gradmgr.distributed import free_port
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> gm = data_parallel(model)
        >>> with gm:
        ...     gm.backward(model(torch.ones(3, 2)).sum())
        >>> model.weight.grad
        tensor([[3., 3.]])
        >>> del gm  # before the group goes, as with DDP
        >>> dist.destroy_process_group()
    """
    problem = spelling_problem(shard)
    if problem is not None:
        raise problem
    check_options(shard, {"blocks": blocks, "reshard_after_forward": reshard_after_forward,
                          "mp_policy": mp_policy},
                  {"reduce": reduce != "mean", "bucket_bytes": bucket_bytes is not None,
                   "compression": compression is not None, "transport": transport is not None,
                   "group": group is not None, "native": native is not None,
                   "comm_hook": comm_hook is not None or comm_state is not None})
    params, buffers = list(module.parameters()), list(module.buffers())
    tensors = params + buffers
    backend = backend_for(tensors[0]) if tensors else None  # (the only look-up)
    _refuse_wrapper(module, backend if params else None)
    _refuse_second_manager(module)
    if shard == "full":
        return _fully_sharded(module, tensors, backend, verify, broadcast_buffers, src,
                              blocks or (), reshard_after_forward is not False, mp_policy)
    kind = ReduceScatterCallback if shard else AllreduceCallback
    cb = kind(reduce, group, bucket_bytes, compression, transport, broadcast=False, src=src,
              verify=verify, native=False if shard else native, names=module,
              comm_hook=comm_hook, comm_state=comm_state)
    if verify:
        _refuse_modules_that_differ(module, tensors, backend, group, transport, shard)
    shared = params + (buffers if broadcast_buffers else [])
    if shared:
        broadcast_tensors(shared, backend, src, group, transport)
    gm = DataParallelManager()
    ops = _tensor_ops(params, backend)
    step = _Step(gm, module, broadcast_buffers, src, group, transport, ops, cb)
    gm.register_record_callback(step.check_module)  # before any collective of the step
    support = ops.join_support() if ops is not None else None
    if support is not None:  # uneven inputs: its record callback comes before the step's
        gm.joining = Joining(gm, module, cb, support, broadcast_buffers)
        gm.register_record_callback(gm.joining.record)
    gm.attach(params, callbacks=[cb])
    step.register()
    _remember(module, gm)
    with contextlib.suppress(TypeError):  # a module that takes no weak reference
        gm.module_ref = weakref.ref(module)
    if params:
        watch = ops.watch_forwards(module, step.refusal) if ops is not None else None
        if watch is not None:
            step.watch = watch
            weakref.finalize(gm, watch.remove)
    return gm


def _fully_sharded(module: Any, tensors: List[Any], backend: Any, verify: Verify,
                   broadcast_buffers: bool, src: int, blocks: Sequence[Any],
                   reshard_after_forward: bool, mp_policy: Any) -> DataParallelManager:
    """``shard="full"``: the ranks compared and rank ``src``'s tensors broadcast as on the
    other paths, then the model wrapped by the framework (:mod:`.sharded.full`), its
    recordings compared across ranks as the other paths' steps (:mod:`.sharded.full_check`)."""
    verify_mode(verify)
    if verify:
        _refuse_modules_that_differ(module, tensors, backend, None, None, "full")
    params = list(module.parameters())
    shared = params + (list(module.buffers()) if broadcast_buffers else [])
    if shared:
        broadcast_tensors(shared, backend, src, None, None)
    gm = DataParallelManager()
    ops = _tensor_ops(params, backend)
    sharding = FullSharding.install(gm, module, ops, blocks, reshard_after_forward, mp_policy)
    if ops is not None:  # FSDP2's parameters now: wrapping replaced them
        sharding.check = full_shard_check(ops, resolve_transport(None, backend, None), module,
                                          list(module.parameters()), verify)
    _Step(gm, module, broadcast_buffers, src, None, None, ops, None).register()
    _remember(module, gm)
    return gm


def _tensor_ops(params: List[Any], backend: Any) -> Optional[TensorOps]:
    """The tensor operations of the parameters' framework (``backend``: the first
    parameter's; None: no parameters)."""
    if not params:
        return None
    if backend is None:
        raise TypeError(f"data_parallel: the module's parameters are "
                        f"{type(params[0]).__qualname__}, not tensors of a framework with a "
                        f"gradmgr backend")
    return backend.tensor_ops()


def _refuse_wrapper(module: Any, backend: Any) -> None:
    """``data_parallel(DDP(model))``: two reducers, every gradient reduced twice
    (``backend``: the first parameter's)."""
    if backend is not None:
        problem = backend.tensor_ops().wrapper_problem(module)
        if problem is not None:
            raise TypeError(problem)


_SECOND = (
    "data_parallel(): this model already has a data-parallel manager, from an earlier "
    "data_parallel(model), and it is still alive: its hooks on the model would take the new "
    "manager's steps for forwards outside a recording, and two managers would reduce every "
    "gradient. Keep using the first manager, or drop it before wrapping again: `del gm` (and "
    "any other reference to it), then `gm = data_parallel(model, ...)` (assigning the new one "
    "over the old name drops the old one only after the new one is made)"
)

# id(module) -> (the module, its manager), both weakly: the model's live data-parallel manager
_MANAGERS: Dict[int, Tuple[Any, Any]] = {}


_DROPPED_PATIENCE_S = 1.0
"""How long a dropped manager may take to be freed before a second one on its model is refused."""


def _refuse_second_manager(module: Any) -> None:
    """A model's live manager keeps its forward watch and buffer broadcasts: a second one on
    the same model would fight it (its watch refuses the new manager's steps)."""
    # A manager the user dropped can still be held for a moment: in a cycle (hence the
    # collection), or by something still finishing a failed step (seen on torch 2.13 under
    # load: 2 of 200 re-wraps right after a comm hook's error found the dropped manager alive,
    # and freed a moment later; what held it was not found). Only a manager still alive after
    # that patience is in the way.
    deadline = time.monotonic() + _DROPPED_PATIENCE_S
    while _manager_of(module) is not None:
        gc.collect()
        if _manager_of(module) is None:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(_SECOND)
        time.sleep(0.01)


def _manager_of(module: Any) -> Any:
    entry = _MANAGERS.get(id(module))
    if entry is None or entry[0]() is not module:
        return None
    return entry[1]()


def _remember(module: Any, gm: DataParallelManager) -> None:
    key = id(module)

    def forget(dead: Any) -> None:
        if _MANAGERS.get(key, (None, None))[1] is dead:
            del _MANAGERS[key]

    with contextlib.suppress(TypeError):  # a module that takes no weak reference: unwatched
        _MANAGERS[key] = (weakref.ref(module), weakref.ref(gm, forget))


def _refuse_modules_that_differ(module: Any, tensors: List[Any], backend: Any, group: Any,
                                transport: TransportSpec, shard: Any) -> None:
    """One collective compares every rank's parameters and buffers, and ``shard``; where they
    differ, a few more find the first difference and every rank raises RankMismatchError
    naming it (``backend``: the first tensor's)."""
    if not tensors:
        return
    if backend is None:
        raise TypeError(f"data_parallel() expects a module of tensors, got "
                        f"{type(tensors[0]).__name__} parameters")
    ops, chosen = backend.tensor_ops(), resolve_transport(transport, backend, group)
    if chosen.world_size() < 2:
        return
    mode = "the module's parameters and buffers, in order"
    # shard= too: a sharded rank's next collective (its ShardedOptimizer's comparison) and a
    # plain rank's (its first step's plan check) pair with nothing on the other side.
    check = PlanCheck(chosen, ops, plan_fingerprint(ops, tensors, f"{mode}; shard={shard}"),
                      tensors[0])
    if not check.agreed():
        _refuse_mixed_sharding(chosen, ops, shard, tensors[0])
        raise check.error(tensors, mode, "their modules' parameters and buffers",
                          names_from(module))
    # The check group is made here, in the checking path's terms: its errors (a rank that
    # never comes to make it) are the path's, which under full sharding are recordings.
    _open_checks(chosen, RECORDINGS if shard == "full" else step_terms(ops))


_MIXED = (
    "data_parallel(): the ranks disagree about sharding: sharded on {sharded} (shard=True: "
    "gradients reduce-scattered, for a ShardedOptimizer), plain on {plain} (shard=False: "
    "gradients allreduced, for a plain optimizer). Their collectives would never pair: each "
    "side would wait for the other until the process group's timeout. Pass the same shard= "
    "to data_parallel() on every rank, with a ShardedOptimizer on every rank where it is "
    "True. Nothing was broadcast or reduced: the process group is as it was"
)


_MIXED_FULL = (
    "data_parallel(): the ranks disagree about sharding: {listing}. Their collectives would "
    "never pair: each side would wait for the other until the process group's timeout. Pass "
    "the same shard= to data_parallel() on every rank. Nothing was broadcast or reduced: the "
    "process group is as it was"
)


def _refuse_mixed_sharding(transport: Any, ops: Any, shard: Any, like: Any) -> None:
    """Where ``shard`` differs between the ranks, raise RankMismatchError saying which ranks
    shard how (a collective: every rank calls it once the opening check disagreed)."""
    mine = SPELLINGS.index(shard)
    rows = every_rank(transport, ops, [float(mine)], like)
    if rows is None:  # a transport that knows no rank: how many shard each way
        world = transport.world_size()
        counts = [round(c) for c in ops.values(transport.allreduce_async(ops.vector(
            [float(mine == i) for i in range(len(SPELLINGS))], like)).wait())]
        if max(counts) == world:
            return
        if counts[2] == 0:
            here = "this rank among them" if shard else "not this rank"
            raise RankMismatchError(_MIXED.format(
                sharded=f"{counts[1]} of the {world} ranks ({here})", plain="the others"))
        raise RankMismatchError(_MIXED_FULL.format(listing="; ".join(
            f"shard={s!r} on {c} of the {world} ranks" for s, c in zip(SPELLINGS, counts)
            if c) + f" (this rank: shard={shard!r})"))
    codes = [round(row[0]) for row in rows]
    if len(set(codes)) < 2:
        return
    if 2 not in codes:
        raise RankMismatchError(_MIXED.format(
            sharded=_ranks([r for r, c in enumerate(codes) if c]),
            plain=_ranks([r for r, c in enumerate(codes) if not c])))
    raise RankMismatchError(_MIXED_FULL.format(listing="; ".join(
        f"shard={s!r} on {_ranks([r for r, c in enumerate(codes) if c == i])}"
        for i, s in enumerate(SPELLINGS) if i in codes)))


def _ranks(ranks: List[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def _open_checks(transport: Any, terms: CheckTerms) -> None:
    """Open the transport of the plan checks while every rank is here: torch's makes its
    process group, a collective, which a rank with no batch at all would otherwise never join
    (the others' first step would wait for it in vain); its errors speak in ``terms``."""
    checks = control_transport(transport, terms)
    if checks is not transport and hasattr(checks, "open"):
        checks.open()


_FORGOTTEN = (
    "data_parallel(): a backward writes the model's .grad after a forward that ran with "
    "gradients enabled outside `with gm:` (loss.backward(), typed by habit after dropping "
    "{idioms.wrapper}?): it would compute this rank's gradients only, so the ranks' gradients, "
    "and then their parameters, would differ. Run the forward and gm.backward(loss) inside the "
    "recording: `with gm: gm.backward(loss_fn(model(x), y))`. (A forward for evaluation: under "
    "{idioms.no_grad}, or simply never backwarded, is fine; so is {idioms.grad_call}, which "
    "writes no .grad and gives this rank's gradients, as under {idioms.wrapper}.)"
)
"""In the words of the model's framework (``TensorOps.idioms``)."""


_CHANGED = (
    "data_parallel(): the model has a parameter it did not have when data_parallel(model) "
    "made this manager: {name} (a layer replaced or added since). The manager reduces the "
    "parameters it was given, so the new ones would get no gradient, or this rank's only. "
    "Make a new manager for the changed model, as DDP needs DDP(model) again: drop this one "
    "(`del gm`), then `gm = data_parallel(model)` on every rank (it broadcasts rank src's "
    "new weights) and a new optimizer over model.parameters()"
)


class _Step:
    """What ``data_parallel`` adds to each step, as DDP does in its forward.

    Buffers: DDP broadcasts rank ``src``'s buffers at a forward that follows a synced one (with
    gradients, outside ``no_sync``), an evaluation's too, so that every rank computes with
    rank ``src``'s. Here they are broadcast when a synced recording ends, where every rank is
    in step: the next forward, a training step's or an evaluation's, sees the very values DDP
    would have broadcast there (nothing changes buffers between the end of a step and the next
    forward), and a forward on one rank alone (rank 0 evaluating) takes no collective. The
    difference: between steps, the other ranks hold rank ``src``'s buffers, not their own
    updated ones (which DDP overwrites before they are used). A split backward's recording
    broadcasts them when its ``finish()`` ends instead: the second part still reads buffers
    the forward saved (BatchNorm's running statistics), and torch refuses to differentiate
    through a tensor overwritten since.

    Forwards (where the backend can watch them): after one with gradients enabled outside a
    recording, a backward that computes the parameters' gradients raises :data:`_FORGOTTEN`
    (until the next recording starts)."""

    def __init__(self, gm: DataParallelManager, module: Any, buffers: bool, src: int,
                 group: Any, transport: TransportSpec, ops: Optional[TensorOps],
                 cb: Optional[AllreduceCallback]) -> None:
        self._gm = weakref.ref(gm)
        self._forgotten = _FORGOTTEN.format(idioms=NEUTRAL_IDIOMS if ops is None else ops.idioms())
        self._module = module if buffers else None
        self._src, self._group, self._transport = src, group, transport
        self._synced = False  # the recording started outside no_sync
        self._failed = False  # its backward raised
        self._alone = False  # with RanksOutOfStepError
        self._cb = cb  # its synced steps tell when a split backward's finish() ends
        self.watch: Optional[ModuleWatch] = None  # the backend's, where it watches forwards

    def register(self) -> None:
        gm = self._gm()
        if gm is None:
            return
        gm.register_record_callback(self.record)
        gm.register_backward_error_callback(self.backward_failed)
        gm.register_release_callback(self.release)

    def record(self) -> None:
        watch = self.watch
        if watch is not None and watch.armed:
            watch.disarm()  # a forward outside a recording armed it; this recording's is fine
        gm = self._gm()
        self._synced = gm is not None and not is_paused(gm)
        self._failed = self._alone = False

    def check_module(self) -> None:
        """At the start of a recording, before its collectives: refuse a changed module (on
        every rank that changed it; DDP raises at its next step too)."""
        watch = self.watch
        name = None if watch is None else watch.changed()
        if name is not None:
            raise RuntimeError(_CHANGED.format(name=name))

    def backward_failed(self) -> None:
        self._failed = True
        # (called inside the backward's `except`: sys.exc_info() is its error) A rank out of
        # step broadcasts nothing: no other rank is in this step to meet the broadcast.
        self._alone = isinstance(sys.exc_info()[1], RanksOutOfStepError)

    def release(self, backward_ran: bool) -> None:
        synced, self._synced = self._synced, False
        if not synced or self._module is None or self._alone:
            return
        gm = self._gm()
        if gm is not None and gm.joining is not None and gm.joining.defer_buffers(gm):
            return  # inside torch's Join: at the next step, from DDP's rank (see .joining)
        if backward_ran and not self._failed and gm is not None and self._cb is not None:
            synchronizer = self._cb.synchronizer(gm)
            if synchronizer.step_open(gm.step):  # a split backward's first part ended it
                synchronizer.when_closed(gm.step, lambda: self._broadcast(failed=False))
                return
        self._broadcast(self._failed)

    def _broadcast(self, failed: bool) -> None:
        """Rank ``src``'s buffers to every rank (``failed``: the backward raised, and its
        error, a broken group, propagates instead of the broadcast's)."""
        if self._module is None:
            return
        buffers = list(self._module.buffers())  # as DDP, again: .to() replaces them
        if not buffers:
            return
        try:
            broadcast(buffers, self._src, group=self._group, transport=self._transport)
        except Exception:
            if not failed:
                raise

    def refusal(self) -> Optional[str]:
        """After a forward with gradients enabled: refuse its backward outside a recording."""
        gm = self._gm()
        return None if gm is None or gm.is_recording else self._forgotten


__all__: List[str] = ["data_parallel"]
