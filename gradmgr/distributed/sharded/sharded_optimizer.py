"""The sharded optimizer step (ZeRO-2): each rank steps only its slice of the parameters, with
optimizer state for that slice alone, then the ranks all-gather the updated parameters.

The slices are the gradient shards' segments (:mod:`.sharding`): the part of each parameter
that falls in this rank's chunk of its bucket. Each segment is one parameter of the wrapped
optimizer (on PyTorch a view into the model parameter itself where it can be, so the step
writes the model's own slice in place), with the reduced gradient slice as its ``.grad``. An
elementwise optimizer (SGD, Adam, AdamW, ...) then computes exactly what it computes on the
whole parameters, element for element.

Checkpoints are numbered as the unsharded optimizer over ``params`` numbers its parameters,
frozen ones included: the parameters the manager does not reduce are sliced over the ranks
too (segments that never get a gradient, so never stepped), so that their state, loaded from
a checkpoint, stays with them until they are trainable again.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ...hooks import fail_dropped_splits
from ...manager import GradManager, callback_chains
from ..errors import RankMismatchError
from ..reduce.allreduce import ReduceScatterCallback
from ..reduce.bucket import BucketPlan
from .dcp_state import Slices, param_slices
from .deferred import Gathering, close_with
from .gather import ParameterGather
from .group_options import options, refuse_changes_behind
from .optimizer_agreement import check_agreement, describe
from .optimizer_state import (
    Layout,
    Numbering,
    Ranks,
    consolidate,
    elementwise,
    saved_states,
    user_groups,
)
from .sharded_join import CLIP, STEP, OptimizerJoinHook, active, announce, guard
from .sharding import Segment, own_segments
from .state_meeting import every_rank_here, not_to

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
_SERIALS = itertools.count()  # the ranks make their ShardedOptimizers in the same order
_NOT_ELEMENTWISE = (
    "ShardedOptimizer: {why}, so over each rank's slices of the parameters it would compute "
    "other values than over the whole parameters, silently. Shard with an elementwise "
    "optimizer (SGD, Adam, AdamW, ...), or keep this one without sharding: "
    "data_parallel(model) and the optimizer itself"
)
_ONE_BUCKET = 2**62  # the frozen parameters' plan: one bucket per dtype and device
_WITH_BASE: Dict[Tuple[type, type], type] = {}  # see ShardedOptimizer.__new__


class ShardedOptimizer:
    """Any elementwise optimizer (SGD, Adam, AdamW, ...: torch's Adafactor and LBFGS are
    refused, with ValueError), stepping only this rank's slice of the parameters of a manager
    whose gradients are reduce-scattered (``data_parallel(model, shard=True)``, or a
    :class:`ReduceScatterCallback` attached by hand).

    ``optimizer_class(param_groups, **defaults)`` is built over this rank's segments: its
    state (Adam's moments) covers about 1/world of the parameters. ``params`` is what the
    unsharded optimizer would be given (the parameters, or a list of parameter-group dicts:
    weight decay for some, not others); by default every parameter attached to the manager
    with the reduce-scatter callback, frozen ones too, in attach order (for
    ``data_parallel(model, shard=True)``: ``model.parameters()``). Every parameter the manager
    reduces must be in ``params``; one it does not reduce (frozen) is numbered but not stepped.
    Every rank makes it alike: the ranks compare the optimizer class, ``master_dtype`` and
    each group's options and parameters (one small collective), and where they differ every
    rank raises :class:`RankMismatchError` naming the first difference and each rank's value.

    On PyTorch it is also a ``torch.optim.Optimizer``, on MegEngine a
    ``megengine.optimizer.Optimizer`` (the backend's ``TensorOps.optimizer_base``), so that
    learning-rate schedulers take it; :attr:`param_groups` are the unsharded optimizer's
    groups, whose options :meth:`step` passes to the wrapped optimizer.

    After :meth:`step` every rank holds the same updated parameters. With
    ``gather="deferred"`` (``data_parallel``'s manager only) they arrive behind the next
    forward instead: each module's forward waits for its own parameters, the model's
    ``state_dict()``/``load_state_dict()`` and this optimizer's methods (``zero_grad`` aside)
    wait for all of them,
    and any other read between the step and the next forward needs :meth:`finish_gather`
    first (docs/sharded.md, "The gather behind the next forward"). Making one, and every
    method that communicates (:meth:`step`, :meth:`clip_grad_norm_`, :meth:`state_dict`,
    :meth:`consolidate_state_dict`), must
    be done on every rank, and :meth:`load_state_dict` with the same dict on every rank. The
    parameter set is fixed when the optimizer is made: after attaching, freezing or
    unfreezing a parameter on every rank, make a new one over the same ``params``
    (``load_state_dict(old.state_dict())`` carries the state over, each parameter's its own).

    Example:
        Here a process group of one rank (docs/sharded.md trains on two):

        >>> import torch
        >>> import torch.distributed as dist
        >>> from gradmgr.distributed import free_port
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> from gradmgr.distributed import data_parallel
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> gm = data_parallel(model, shard=True)
        >>> opt = ShardedOptimizer(gm, torch.optim.SGD, lr=0.5)
        >>> scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)  # opt itself
        >>> with gm:
        ...     gm.backward(model(torch.ones(1, 2)).sum())
        >>> opt.clip_grad_norm_(1.0)          # the norm of every rank's slices together
        1.4142135...
        >>> opt.step()
        >>> opt.zero_grad()
        >>> scheduler.step()
        >>> opt.param_groups[0]["lr"]
        0.05
        >>> del scheduler, opt, gm  # they hold the manager: before the group goes
        >>> dist.destroy_process_group()
    """

    def __new__(cls, gm: Any, *args: Any, **kwargs: Any) -> ShardedOptimizer:
        # On a framework with an optimizer base class (torch.optim.Optimizer) the instance is
        # one too, for its schedulers: a subclass made once per (class, base).
        base = _sharded_callback(gm).synchronizer(gm).ops.optimizer_base()
        if base is not None and not issubclass(cls, base):
            made = _WITH_BASE.get((cls, base))
            if made is None:
                made = type(cls.__name__, (cls, base), {"__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})
                _WITH_BASE[(cls, base)] = made
            cls = made
        return object.__new__(cls)

    def __init__(self, gm: Any, optimizer_class: Any, params: Optional[Iterable[Any]] = None,
                 *, master_dtype: Optional[str] = None, gather: str = "eager",
                 **defaults: Any) -> None:
        self._gm = gm  # the manager lives as long as the optimizer that reads its shards
        callback = _sharded_callback(gm)
        fail_dropped_splits(gm)  # before the agreement's collective (as step())
        self._synchronizer = sync = callback.synchronizer(gm)
        self._plan = plan = sync.plan_now(gm)
        self._ops, self._shards = sync.ops, sync.shards
        transport = sync.transport
        self._world, self._rank = transport.world_size(), transport.rank()
        self._transport = transport
        self._master_dtype, self._gather_how = master_dtype, gather
        self._serial, self._gathered = next(_SERIALS), 0
        self._consolidated: Optional[Tuple[int, Any]] = None  # (to, state): see consolidate
        self._join_support = self._ops.join_support()
        # torch's Joinable protocol (uneven inputs, see .sharded_join): the context sets it
        self._join_config = (None if self._join_support is None
                             else self._join_support.disabled_config())
        self._shards.stand_ins.before_collective = guard(self)
        try:
            entries = self._build(gm, callback, optimizer_class, params, defaults)
        except Exception as error:
            # The other ranks are in the comparison: take part, so that they raise too.
            failed = [("an error making it", f"{type(error).__name__}: {error}")]
            with contextlib.suppress(RankMismatchError):
                check_agreement(self._ops, sync.checks, plan.tensor(0), failed)
            raise
        check_agreement(self._ops, sync.checks, plan.tensor(0),
                        [("an error making it", "none"), *entries])

    def _build(self, gm: Any, callback: Any, optimizer_class: Any, params: Any,
               defaults: Dict[str, Any]) -> List[Tuple[str, str]]:
        """Lay out this rank's segments and make the wrapped optimizer over them; what the
        ranks compare (see :mod:`.optimizer_agreement`)."""
        plan, master_dtype = self._plan, self._master_dtype
        why = self._ops.not_elementwise(optimizer_class)
        if why is not None:
            raise ValueError(_NOT_ELEMENTWISE.format(why=why))
        if params is None:
            params = gm.attached_tensors(with_callback=callback)
        self._numbering = numbering = Numbering(user_groups(params))
        self._reduced = self._layout(plan, numbering.of_planned(plan), master_dtype)
        frozen = numbering.not_in(plan)
        # Never stepped: views (or plain copies) are enough, no master copies.
        self._frozen = self._layout(BucketPlan([numbering.params[i] for i in frozen],
                                               self._ops, _ONE_BUCKET), frozen, None)
        self._gather = ParameterGather(self._ops, self._transport, plan, self._world,
                                       self._reduced.segments, self._reduced.tensors)
        self.optimizer = optimizer_class(numbering.wrapped_groups(self._layouts()), **defaults)
        """The wrapped optimizer over this rank's segments."""
        # last: nothing that raises after it leaves the model's hooks behind
        self._gathering = Gathering(self._gather, self._gather_how, gm, self._ops)
        close_with(self, self._gathering)
        self._stepped_with: List[Dict[str, Any]] = []  # its groups' options after its step
        # The groups the program sees: the unsharded optimizer's (the model's parameters, the
        # wrapped groups' options), copied into the wrapped groups at each step.
        self._param_groups = [
            {**{k: v for k, v in wrapped.items() if k != "params"},
             "params": [numbering.params[i] for i in indices]}
            for wrapped, indices in zip(self.optimizer.param_groups, numbering.groups)]
        params_of = [[numbering.params[i] for i in group] for group in numbering.groups]
        return describe(self._ops, optimizer_class, master_dtype, self.optimizer.param_groups,
                        params_of)

    def _layout(self, plan: BucketPlan, index: List[int], master_dtype: Optional[str]) -> Layout:
        segments = own_segments(plan, self._rank, self._world)
        tensors = [self._ops.segment(plan.tensor(s.position), s.start, s.stop, master_dtype)
                   for s in segments]
        return Layout(plan, segments, tensors, index)

    def _layouts(self) -> Tuple[Layout, Layout]:
        return self._reduced, self._frozen

    # ------------------------------------------------------------------ a step
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Step this rank's segments with their reduced gradients, then all-gather the
        updated parameters. Returns what the wrapped optimizer's ``step()`` returns (torch's:
        None), this ShardedOptimizer where that is the wrapped optimizer itself
        (MegEngine's: so that ``opt.step().clear_grad()`` clears the shards too).

        ``closure`` (``opt.step(closure)``, as torch's optimizers take it) is called first,
        once: it records the step (``with gm:``, the forward, ``gm.backward(loss)``), whose
        reduced gradients the step then takes; the step returns what it returned."""
        loss = None if closure is None else closure()
        if active(self):
            announce(self, STEP)
        result = self.step_slice()
        return result if closure is None else loss

    def step_slice(self) -> Any:
        """:meth:`step`'s work (a joined rank's too: see :mod:`.sharded_join`)."""
        fail_dropped_splits(self._gm)  # before the gather, which would pair with their buckets
        self._check_plan()
        self._gathering.finish()  # the last step's parameters, before they are stepped again
        self._consolidated = None  # the state it holds is the state before this step
        ops, shards, plan = self._ops, self._shards, self._plan
        reduced = self._reduced
        for segment, tensor in zip(reduced.segments, reduced.tensors):
            param = plan.tensor(segment.position)
            if param is not None:
                ops.refresh_segment(tensor, param, segment.start, segment.stop)
            ops.set_segment_grad(tensor, shards.grad_of(segment))
        wrapped_groups = self.optimizer.param_groups
        refuse_changes_behind(wrapped_groups, self._stepped_with)
        for ours, wrapped in zip(self._param_groups, wrapped_groups):
            wrapped.update((k, v) for k, v in ours.items() if k != "params")
        result = self.optimizer.step()
        self._stepped_with = [options(group) for group in wrapped_groups]
        self._gathering.after_step()
        return self if result is self.optimizer else result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient shards (and the segments' ``.grad``), as
        ``torch.optim.Optimizer.zero_grad`` drops ``.grad``; ``set_to_none=False`` zeroes
        them instead, so that a parameter that gets no gradient in the next synced step (used
        on no rank there) is stepped with zeros, as torch's optimizer steps a zeroed ``.grad``
        under DDP (momentum and weight decay go on moving it)."""
        if set_to_none:
            self._shards.zero()  # (a deferred gather writes parameters, never these: no wait)
        else:
            self._shards.keep_zeros()
        for tensor in self._reduced.tensors:
            self._ops.set_segment_grad(tensor, None)

    def finish_gather(self) -> None:
        """With ``gather="deferred"``: wait until the last step's parameters have all arrived.
        The next forward, ``model.state_dict()`` and this optimizer's methods (but
        ``zero_grad``, which reads no parameter) wait themselves; any other read of a
        parameter between a step and the next forward, and ``destroy_process_group()``
        (which does not wait for it), need it first. Communicates nothing, so one rank may
        call it alone; with ``gather="eager"`` it returns at once."""
        self._gathering.finish()

    def clear_grad(self) -> None:
        """MegEngine's name for :meth:`zero_grad` (``opt.step().clear_grad()``)."""
        self.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the gradient shards so that the norm of the whole gradient (every rank's
        shards together, as ``torch.nn.utils.clip_grad_norm_`` computes over full gradients)
        is at most ``max_norm``; returns that norm, before clipping.

        The slices' float32 squares are summed with the framework's sum, then over the ranks,
        and the root taken in float64: for a 1024 x 1024 weight on 2 ranks, 1.6e-8 (relative)
        from the float64 norm, where torch's ``clip_grad_norm_`` on the whole gradient is
        1.5e-5 from it on CPU (its float32 norm kernel's rounding grows with the size). So it
        is torch's norm to about 1e-5 on large layers, 1e-6 on small ones, and the closer to
        the exact one."""
        if norm_type != 2.0:
            raise ValueError("ShardedOptimizer.clip_grad_norm_ computes the 2-norm only")
        fail_dropped_splits(self._gm)  # (as step())
        self._gathering.finish()
        if active(self):
            announce(self, CLIP)
        ops = self._ops
        grads = [g for g in map(self._shards.grad_of, self._reduced.segments) if g is not None]
        local = ops.sum_squares(grads)
        like = self._plan.tensor(0)
        summed = ops.values(self._transport.allreduce_async(ops.vector([local], like)).wait())
        total = math.sqrt(summed[0])
        coef = max_norm / (total + _EPS)
        if coef < 1.0:
            self._shards.scale(coef)
        return total

    def memory(self) -> Dict[str, int]:
        """Bytes this rank holds: its gradient shards, and the optimizer's state."""
        ops, state = self._ops, 0
        for layout in self._layouts():
            for tensor in layout.tensors:
                for value in ops.optimizer_state(self.optimizer, tensor).values():
                    state += ops.nbytes(value) if ops.is_tensor(value) else 0
        return {"gradients": self._shards.nbytes(), "optimizer": state}

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The parameter groups as the unsharded optimizer has them: the model's parameters
        (``params``) and the options, which :meth:`step` passes to the wrapped optimizer's
        groups, so that what a learning-rate scheduler sets is what the next step uses.
        The parameters' ``.grad`` after a synced backward are the stand-ins (PyTorch) that
        ``clip_grad_norm_`` and ``torch.amp.GradScaler.unscale_`` work through."""
        return self._param_groups

    def _check_plan(self) -> None:
        if self._synchronizer.plan is not self._plan:
            raise RuntimeError(
                "the data-parallel plan changed since this ShardedOptimizer was made (a "
                "parameter attached, frozen or unfrozen, or its dtype changed): make a new one "
                "over the same params, new.load_state_dict(old.state_dict()) carries the "
                "optimizer state over"
            )

    # ------------------------------------------------------------------ uneven inputs
    def join_hook(self, **kwargs: Any) -> OptimizerJoinHook:
        """A joined rank's part (``with Join([gm, opt]):``; see :mod:`.sharded_join`)."""
        return OptimizerJoinHook(self, self._synchronizer, self._joins())

    @property
    def join_device(self) -> Any:
        """The device of the Join context's own collectives (torch's ``Joinable``)."""
        return self._joins().device(self._plan.tensor(0))

    @property
    def join_process_group(self) -> Any:
        """The process group of the Join context's own collectives: the manager's."""
        return self._joins().process_group(_sharded_callback(self._gm).group)

    def _joins(self) -> Any:
        if self._join_support is None:
            raise NotImplementedError("uneven inputs (Join) are PyTorch's: see "
                                      "data_parallel's manager's join_hook")
        return self._join_support

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The optimizer state of the whole model, as the unsharded optimizer over ``params``
        would give it (state by parameter index over every parameter of ``params``, frozen
        ones included, full-size tensors, none for a parameter never stepped; parameter
        groups with their options): on every rank, whatever the world size, loadable by
        :meth:`load_state_dict` on any world size (or by the unsharded optimizer).

        Every rank calls it. Over torch.distributed the ranks first meet in the process group's
        store: a rank that calls it while the others do not (``if rank == 0:
        torch.save(opt.state_dict(), ...)``) warns, after 20 s (a quarter of the group's timeout
        where that is shorter), that it waits and why, and raises RuntimeError once half the
        group's timeout has passed, having started no collective, instead of waiting in one
        forever.

        After :meth:`consolidate_state_dict` (``to``), until the next :meth:`step` or
        :meth:`load_state_dict`, it communicates nothing: rank ``to`` returns the state
        consolidated then (with the groups' options as they are now, a scheduler's learning
        rate included), and every other rank raises RuntimeError, as
        ``ZeroRedundancyOptimizer`` does."""
        if self._consolidated is not None:
            to, full = self._consolidated
            if self._rank != to:
                raise not_to(self._rank, to, self._ops)
            return {"state": dict(full), "param_groups": self._groups()}
        self._every_rank_here()
        return {"state": self._full_state(), "param_groups": self._groups()}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """``ZeroRedundancyOptimizer``'s checkpoint: gather the whole optimizer state on rank
        ``to`` (a collective: every rank calls it, with the same ``to``), so that rank ``to``
        alone can then call :meth:`state_dict` (``if rank == 0: torch.save(opt.state_dict(),
        path)``) until the next :meth:`step`."""
        if not isinstance(to, int) or not 0 <= to < self._world:
            raise ValueError(f"ShardedOptimizer.consolidate_state_dict: to={to!r} is not a "
                             f"rank of this group (0 to {self._world - 1})")
        self._consolidated = None
        self._every_rank_here()
        full = self._full_state()
        self._consolidated = (to, full if self._rank == to else {})

    def _full_state(self) -> Dict[int, Dict[str, Any]]:
        """Every parameter's full state by index (a collective)."""
        self._gathering.finish()
        ops, layouts = self._ops, self._layouts()
        states = [[ops.optimizer_state(self.optimizer, t) for t in layout.tensors]
                  for layout in layouts]
        ranks = Ranks(ops, self._transport, self._rank, self._world, self._plan.tensor(0))
        full = consolidate(ranks, layouts, states)
        return {i: full[i] for i in sorted(full)}

    def _groups(self) -> List[Dict[str, Any]]:
        """The parameter groups as the unsharded optimizer saves them: options, indices."""
        groups = []
        for group, indices in zip(self._param_groups, self._numbering.groups):
            options = {k: v for k, v in group.items() if k != "params"}
            groups.append({**options, "params": list(indices)})
        return groups

    def checkpoint_slices(self) -> Slices:
        """Each stepped parameter's ranges on every rank and this rank's segments (what
        ``gradmgr.distributed.get_state_dict`` saves, no collective)."""
        self._gathering.finish()
        params = param_slices(self._reduced, self._numbering.group_of, self._rank, self._world)
        return Slices(self._ops, self.optimizer, params, self._param_groups, self._rank,
                      self._world)

    def _every_rank_here(self) -> None:
        """Raise, before any collective, where not every rank calls :meth:`state_dict`; fail
        a dropped split's step first (as :meth:`step`)."""
        key = f"sharded/{self._serial}/state_dict/{self._gathered}"
        if every_rank_here(self._gm, self._transport, self._ops, key, self._rank):
            self._gathered += 1  # a meeting that failed is tried again under its key

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave (on this or any other world size), or the
        unsharded optimizer's state dict over the same ``params``: each parameter's state
        goes to that parameter, frozen or not; one without saved state starts afresh.

        Raises ValueError, before changing anything, where the dict is not one over these
        parameters (another number of groups or parameters, a state of another shape than
        its parameter's). Every rank decides from the dict alone, so every rank raises."""
        ops = self._ops
        self._gathering.finish()  # nothing of the last step left in flight past a reload
        saved, loaded = saved_states(ops, self._numbering, state_dict)
        self._consolidated = None
        for ours, wrapped, saved_options in zip(self._param_groups, self.optimizer.param_groups,
                                                loaded):
            ours.update(saved_options)
            wrapped.update(saved_options)
        self._stepped_with = [options(group) for group in self.optimizer.param_groups]
        for layout in self._layouts():
            for segment, tensor in zip(layout.segments, layout.tensors):
                state = saved.get(layout.numbering[segment.position])
                if state is None:
                    ops.reset_optimizer_state(self.optimizer, tensor)
                else:
                    param = layout.plan.tensor(segment.position)
                    ops.set_optimizer_state(self.optimizer, tensor,
                                            self._slice(state, param, segment))

    def _slice(self, state: Dict[str, Any], param: Any, segment: Segment) -> Dict[str, Any]:
        """A segment's part of its parameter's saved state, in the dtype its segment of the
        reduced plan steps in; copies, so that stepping leaves the loaded dict as it was."""
        ops, shape = self._ops, self._ops.shape(param)
        dtype = self._master_dtype or ops.dtype_name(param)
        sliced = {}
        for key, value in state.items():
            if elementwise(ops, key, value, shape):
                part = ops.part(ops.flat(value), segment.start, segment.stop)
                value = ops.cast(ops.copy(part), dtype)
            elif ops.is_tensor(value):  # a step count, which the optimizer adds to in place
                value = ops.copy(value)
            sliced[key] = value
        return sliced


def _sharded_callback(gm: Any) -> Any:
    if not isinstance(gm, GradManager):
        # ZeroRedundancyOptimizer(params, optimizer_class, ...) habit: the parameters first
        raise TypeError(
            f"ShardedOptimizer takes the manager first, not {type(gm).__name__}: "
            "ShardedOptimizer(gm, optimizer_class, params=None, **defaults) with "
            "gm = data_parallel(model, shard=True). ZeroRedundancyOptimizer's "
            "(params, optimizer_class, ...) order becomes ShardedOptimizer(gm, "
            "torch.optim.AdamW, lr=...) (params defaults to the manager's parameters)")
    found = []
    for _, callbacks in callback_chains(gm):
        for cb in callbacks:
            if isinstance(cb, ReduceScatterCallback) and cb not in found:
                found.append(cb)
    if len(found) != 1:
        raise ValueError(
            "ShardedOptimizer needs a manager whose parameters one reduce-scatter callback "
            "serves: gm = data_parallel(model, shard=True), or "
            "gm.attach(params, callbacks=[make_reduce_scatter_cb()])"
            + (f" (found {len(found)})" if found else "")
        )
    return found[0]


__all__ = ["ShardedOptimizer"]
