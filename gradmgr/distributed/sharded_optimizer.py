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

import math
import numbers
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from .bucket import BucketPlan
from .gather import ParameterGather
from .sharding import Segment, chunk_numel, own_segments

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
_ONE_BUCKET = 2**62  # the frozen parameters' plan: one bucket per dtype and device


class ShardedOptimizer:
    """Any optimizer, stepping only this rank's slice of the parameters of a manager whose
    gradients are reduce-scattered (``data_parallel(model, shard=True)``, or a
    :class:`ReduceScatterCallback` attached by hand).

    ``optimizer_class(param_groups, **defaults)`` is built over this rank's segments: its
    state (Adam's moments) covers about 1/world of the parameters. ``params`` is what the
    unsharded optimizer would be given (the parameters, or a list of parameter-group dicts:
    weight decay for some, not others); by default every parameter attached to the manager
    with the reduce-scatter callback, frozen ones too, in attach order (for
    ``data_parallel(model, shard=True)``: ``model.parameters()``). Every parameter the manager
    reduces must be in ``params``; one it does not reduce (frozen) is numbered but not stepped.

    After :meth:`step` every rank holds the same updated parameters. Every method that
    communicates (:meth:`step`, :meth:`clip_grad_norm_`, :meth:`state_dict`) must be called
    on every rank, and :meth:`load_state_dict` with the same dict on every rank. The
    parameter set is fixed when the optimizer is made: after attaching, freezing or
    unfreezing a parameter on every rank, make a new one over the same ``params``
    (``load_state_dict(old.state_dict())`` carries the state over, each parameter's its own).

    Example:
        >>> # gm = data_parallel(model, shard=True)
        >>> # opt = ShardedOptimizer(gm, torch.optim.AdamW, lr=1e-3)
        >>> # with gm:
        >>> #     gm.backward(loss_fn(model(x), y))
        >>> # opt.clip_grad_norm_(1.0)        # over every rank's shards
        >>> # opt.step(); opt.zero_grad()
        >>> # scheduler = torch.optim.lr_scheduler.StepLR(opt.optimizer, 10)
    """

    def __init__(self, gm: Any, optimizer_class: Any, params: Optional[Iterable[Any]] = None,
                 *, master_dtype: Optional[str] = None, **defaults: Any) -> None:
        self._gm = gm
        callback = _sharded_callback(gm)
        self._synchronizer = sync = callback.synchronizer(gm)
        self._plan = plan = sync.plan_now(gm)
        self._ops, self._shards = sync.ops, sync.shards
        transport = sync.transport
        self._world, self._rank = transport.world_size(), transport.rank()
        self._transport = transport
        self._master_dtype = master_dtype
        if params is None:
            params = gm.attached_tensors(with_callback=callback)
        self._numbering = numbering = _Numbering(_user_groups(params))
        self._reduced = self._layout(plan, numbering.of_planned(plan), master_dtype)
        frozen = numbering.not_in(plan)
        # Never stepped: views (or plain copies) are enough, no master copies.
        self._frozen = self._layout(BucketPlan([numbering.params[i] for i in frozen],
                                               self._ops, _ONE_BUCKET), frozen, None)
        self._segments, self._tensors = self._reduced.segments, self._reduced.tensors
        self._gather = ParameterGather(self._ops, transport, plan, self._world,
                                       self._segments, self._tensors)
        self.optimizer = optimizer_class(numbering.wrapped_groups(self._layouts()), **defaults)
        """The wrapped optimizer over this rank's segments (for learning-rate schedulers)."""

    def _layout(self, plan: BucketPlan, index: List[int], master_dtype: Optional[str]) -> _Layout:
        segments = own_segments(plan, self._rank, self._world)
        tensors = [self._ops.segment(plan.tensor(s.position), s.start, s.stop, master_dtype)
                   for s in segments]
        return _Layout(plan, segments, tensors, index)

    def _layouts(self) -> Tuple[_Layout, _Layout]:
        return self._reduced, self._frozen

    # ------------------------------------------------------------------ a step
    def step(self) -> None:
        """Step this rank's segments with their reduced gradients, then all-gather the
        updated parameters."""
        self._check_plan()
        ops, shards, plan = self._ops, self._shards, self._plan
        for segment, tensor in zip(self._segments, self._tensors):
            param = plan.tensor(segment.position)
            if param is not None:
                ops.refresh_segment(tensor, param, segment.start, segment.stop)
            ops.set_segment_grad(tensor, shards.grad_of(segment))
        self.optimizer.step()
        self._gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient shards (and the segments' ``.grad``).

        ``set_to_none`` is taken as ``torch.optim.Optimizer.zero_grad`` takes it; the shards
        are dropped either way (the next synced backward writes them whole), so
        ``set_to_none=False`` only costs a later allocation, never a wrong sum."""
        del set_to_none
        self._shards.zero()
        for tensor in self._tensors:
            self._ops.set_segment_grad(tensor, None)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the gradient shards so that the norm of the whole gradient (every rank's
        shards together, as ``torch.nn.utils.clip_grad_norm_`` computes over full gradients)
        is at most ``max_norm``; returns that norm, before clipping."""
        if norm_type != 2.0:
            raise ValueError("ShardedOptimizer.clip_grad_norm_ computes the 2-norm only")
        ops = self._ops
        grads = [g for g in map(self._shards.grad_of, self._segments) if g is not None]
        local = ops.sum_squares(grads)
        like = self._plan.tensor(0)
        summed = ops.values(self._transport.allreduce_async(ops.vector([local], like)).wait())
        total = math.sqrt(summed[0])
        coef = max_norm / (total + _EPS)
        if coef < 1.0:
            for b, chunk in enumerate(self._shards.chunks):
                if chunk is not None:
                    self._shards.chunks[b] = ops.scale(chunk, coef)
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
        """The wrapped optimizer's parameter groups (their ``lr`` and other options)."""
        return self.optimizer.param_groups

    def _check_plan(self) -> None:
        if self._synchronizer.plan is not self._plan:
            raise RuntimeError(
                "the data-parallel plan changed since this ShardedOptimizer was made (a "
                "parameter attached, frozen or unfrozen): make a new one over the same params, "
                "new.load_state_dict(old.state_dict()) carries the optimizer state over"
            )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The optimizer state of the whole model, as the unsharded optimizer over ``params``
        would give it (state by parameter index over every parameter of ``params``, frozen
        ones included, full-size tensors, none for a parameter never stepped; parameter
        groups with their options): on every rank, whatever the world size, loadable by
        :meth:`load_state_dict` on any world size (or by the unsharded optimizer)."""
        ops, layouts = self._ops, self._layouts()
        states = [[ops.optimizer_state(self.optimizer, t) for t in layout.tensors]
                  for layout in layouts]
        keys = _agreed_keys(self, [(s, t) for layout, held in zip(layouts, states)
                                   for s, t in zip(held, layout.tensors)])
        full: Dict[int, Dict[str, Any]] = {}
        for layout, held in zip(layouts, states):
            _consolidate(self, layout, held, keys, full)
        groups = []
        for group, indices in zip(self.optimizer.param_groups, self._numbering.groups):
            options = {k: v for k, v in group.items() if k != "params"}
            groups.append({**options, "params": list(indices)})
        return {"state": {i: full[i] for i in sorted(full)}, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave (on this or any other world size), or the
        unsharded optimizer's state dict over the same ``params``: each parameter's state
        goes to that parameter, frozen or not; one without saved state starts afresh.

        Raises ValueError, before changing anything, where the dict is not one over these
        parameters (another number of groups or parameters, a state of another shape than
        its parameter's). Every rank decides from the dict alone, so every rank raises."""
        ops = self._ops
        saved, options = _saved_states(ops, self._numbering, state_dict)
        for group, saved_options in zip(self.optimizer.param_groups, options):
            group.update(saved_options)
        for layout in self._layouts():
            for segment, tensor in zip(layout.segments, layout.tensors):
                state = saved.get(layout.index[segment.position])
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
            if _elementwise(ops, key, value, shape):
                part = ops.part(ops.flat(value), segment.start, segment.stop)
                value = ops.cast(ops.copy(part), dtype)
            elif ops.is_tensor(value):  # a step count, which the optimizer adds to in place
                value = ops.copy(value)
            sliced[key] = value
        return sliced


class _Layout(NamedTuple):
    """This rank's segments of one bucket plan (the reduced parameters', or the frozen
    ones'), the tensors the wrapped optimizer holds for them, and where each of the plan's
    members sits in the unsharded optimizer's numbering (``index[position]``)."""

    plan: BucketPlan
    segments: List[Segment]
    tensors: List[Any]
    index: List[int]


def _elementwise(ops: Any, key: str, value: Any, shape: tuple) -> bool:
    """A saved state entry with one value per element of its parameter (Adam's moments), as
    opposed to one per parameter (its step count: 0-d, and called "step" where the parameter
    itself is 0-d)."""
    if not ops.is_tensor(value) or ops.shape(value) != shape:
        return False
    return shape != () or key != "step"


class _Numbering:
    """The unsharded optimizer's numbering: its parameters across its groups, in order."""

    def __init__(self, user_groups: List[Dict[str, Any]]) -> None:
        self.params: List[Any] = []  # by index
        self.groups: List[List[int]] = []  # each group's indices
        self.options = [{k: v for k, v in g.items() if k != "params"} for g in user_groups]
        self._index: Dict[int, int] = {}  # by id(param)
        for group in user_groups:
            indices = []
            for tensor in group["params"]:
                if id(tensor) in self._index:
                    raise ValueError("ShardedOptimizer: some parameters appear more than once "
                                     "in params= (as the unsharded optimizer, each must be in "
                                     "one group, once)")
                self._index[id(tensor)] = len(self.params)
                indices.append(len(self.params))
                self.params.append(tensor)
            self.groups.append(indices)
        self.group_of = [g for g, indices in enumerate(self.groups) for _ in indices]

    def of_planned(self, plan: BucketPlan) -> List[int]:
        """The index of each of the plan's tensors (by position)."""
        found = [self._index.get(id(t)) for t in plan.tensors()]
        missing = sum(i is None for i in found)
        if missing:
            raise ValueError(f"ShardedOptimizer: {missing} reduced parameter(s) are in no "
                             f"group of params= (every parameter the manager reduces needs one)")
        return found  # type: ignore[return-value]

    def not_in(self, plan: BucketPlan) -> List[int]:
        """The indices of the parameters the plan leaves out (frozen, or not attached)."""
        planned = {id(t) for t in plan.tensors()}
        return [i for i, p in enumerate(self.params) if id(p) not in planned]

    def wrapped_groups(self, layouts: Sequence[_Layout]) -> List[Dict[str, Any]]:
        """The wrapped optimizer's groups: each user group's options, over its segments."""
        groups: List[Dict[str, Any]] = [{**o, "params": []} for o in self.options]
        for layout in layouts:
            for segment, tensor in zip(layout.segments, layout.tensors):
                group = self.group_of[layout.index[segment.position]]
                groups[group]["params"].append(tensor)
        return groups


def _user_groups(params: Iterable[Any]) -> List[Dict[str, Any]]:
    listed = list(params)
    if listed and isinstance(listed[0], dict):
        return [{**g, "params": list(g["params"])} for g in listed]
    return [{"params": listed}]


# ---------------------------------------------------------------------- loading
def _saved_states(ops: Any, numbering: _Numbering,
                  state_dict: Dict[str, Any]) -> Tuple[Dict[int, Dict[str, Any]], list]:
    """The loaded dict's state by our index, and its groups' options; ValueError where the
    dict does not fit these parameters (from the dict and the parameters alone, which every
    rank has: no rank raises alone, and none is left waiting in a collective)."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(numbering.groups):
        raise ValueError(f"ShardedOptimizer.load_state_dict: the loaded state dict has "
                         f"{len(saved_groups)} parameter group(s), this optimizer "
                         f"{len(numbering.groups)}")
    ours_of: Dict[int, int] = {}
    for g, (saved, indices) in enumerate(zip(saved_groups, numbering.groups)):
        if len(saved["params"]) != len(indices):
            raise ValueError(f"ShardedOptimizer.load_state_dict: parameter group {g} of the "
                             f"loaded state dict has {len(saved['params'])} parameter(s), this "
                             f"optimizer's {len(indices)} (params= must be the same "
                             f"parameters, frozen ones included, in the same order)")
        ours_of.update(zip((_as_index(i) for i in saved["params"]), indices))
    states = {}
    for key, state in state_dict["state"].items():
        index = ours_of.get(_as_index(key))
        if index is None:
            raise ValueError(f"ShardedOptimizer.load_state_dict: the loaded state dict has a "
                             f"state for parameter {key!r}, which none of its groups lists")
        states[index] = _checked(ops, index, numbering.params[index], state)
    options = [{k: v for k, v in g.items() if k != "params"} for g in saved_groups]
    return states, options


def _as_index(key: Any) -> Any:
    """A parameter index as saved: an int, or its string (a dict gone through JSON)."""
    return int(key) if isinstance(key, str) and key.isdigit() else key


def _checked(ops: Any, index: int, param: Any, state: Dict[str, Any]) -> Dict[str, Any]:
    """One parameter's saved state as the framework's values; each tensor holds one value per
    element of the parameter (its shape) or one value."""
    shape = ops.shape(param)
    state = {k: ops.state_from_checkpoint(v) for k, v in state.items()}
    for key, value in state.items():
        if ops.is_tensor(value) and ops.shape(value) != shape and ops.numel(value) != 1:
            raise ValueError(f"ShardedOptimizer.load_state_dict: the loaded state {key!r} of "
                             f"parameter {index} has shape {ops.shape(value)}, the parameter "
                             f"{shape}: the dict was saved over other parameters, or in "
                             f"another order")
    return state


# ---------------------------------------------------------------------- consolidating
def _agreed_keys(opt: ShardedOptimizer, held: List[Tuple[Dict[str, Any], Any]]) -> List[str]:
    """The state keys of every rank together (two small gathers), so that every rank takes
    part in every key's collectives: a rank may hold fewer, or none (its segments never got
    a gradient, so a lazy optimizer made no state for them; it holds no segment at all).
    A rank whose state cannot be consolidated says so in the first gather (length -1), so
    that every rank raises, none left waiting."""
    ops, transport, like = opt._ops, opt._transport, opt._plan.tensor(0)
    problem = _unconsolidable(ops, held)
    keys = sorted({k for s, _ in held for k in s}) if problem is None else []
    mine = list("\0".join(keys).encode())
    lengths = ops.values(transport.all_gather_async(
        ops.vector([-1 if problem else len(mine)], like)).wait())
    if min(lengths) < 0:
        raise problem or ValueError("ShardedOptimizer.state_dict: another rank's optimizer "
                                    "state cannot be consolidated (that rank's error says why)")
    size = int(max(lengths))
    if size == 0:
        return []
    codes = ops.values(transport.all_gather_async(
        ops.vector(mine + [0] * (size - len(mine)), like)).wait())
    agreed = set()
    for rank in range(opt._world):
        raw = bytes(int(c) for c in codes[rank * size:(rank + 1) * size]).rstrip(b"\0")
        agreed.update(k for k in raw.decode().split("\0") if k)
    return sorted(agreed)


def _unconsolidable(ops: Any, held: List[Tuple[Dict[str, Any], Any]]) -> Optional[Exception]:
    """Why this rank's state cannot be consolidated, or None: keys must be strings, values
    one per element of their segment, one value, or None."""
    for state, tensor in held:
        for key, value in state.items():
            if not isinstance(key, str):
                return TypeError(f"ShardedOptimizer.state_dict: the wrapped optimizer's state "
                                 f"keys must be strings, got {key!r}")
            if ops.is_tensor(value):
                if ops.shape(value) == ops.shape(tensor) or ops.numel(value) == 1:
                    continue
            elif value is None or isinstance(value, numbers.Real):
                continue
            return ValueError(f"ShardedOptimizer.state_dict: the wrapped optimizer's state "
                              f"{key!r} is neither one value per element of its segment nor "
                              f"one value: only elementwise optimizers can be sharded")
    return None


def _consolidate(opt: ShardedOptimizer, layout: _Layout, states: List[Dict[str, Any]],
                 keys: List[str], out: Dict[int, Dict[str, Any]]) -> None:
    """Every parameter's full state, from every rank's segments: per bucket and state key, a
    sum over zeros elsewhere (a small allreduce, and a bucket-sized one where some rank holds
    elementwise values). A parameter whose state no rank holds (never stepped) has none, as
    in the unsharded optimizer."""
    plan = layout.plan
    for b, bucket in enumerate(plan.buckets):
        mine = [(seg, st, t) for seg, st, t in zip(layout.segments, states, layout.tensors)
                if seg.bucket == b]
        like = plan.tensor(bucket.members[0])
        for key in keys:
            _consolidate_key(opt, layout, bucket, key, mine, like, out)


def _consolidate_key(opt: ShardedOptimizer, layout: _Layout, bucket: Any, key: str, mine: list,
                     like: Any, out: Dict[int, Dict[str, Any]]) -> None:
    ops = opt._ops
    # per member: the scalar values held, by how many segments, and how many hold elementwise
    scalars = [0.0] * (3 * len(bucket.members))
    elementwise = []
    for segment, state, tensor in mine:
        value = state.get(key)
        if ops.is_tensor(value) and ops.shape(value) == ops.shape(tensor):
            elementwise.append((segment, value))
            scalars[3 * segment.slot + 2] += 1.0
        elif value is not None:
            scalars[3 * segment.slot] += float(ops.item(value))
            scalars[3 * segment.slot + 1] += 1.0
    counts = ops.values(opt._transport.allreduce_async(ops.vector(scalars, like)).wait())
    # The counts are summed over the ranks: every rank skips the bucket-sized sum alike.
    summed = (_summed(opt, bucket, elementwise, like) if any(counts[2::3]) else None)
    for slot, position in enumerate(bucket.members):
        index = layout.index[position]
        if counts[3 * slot + 1]:
            value = counts[3 * slot] / counts[3 * slot + 1]
            out.setdefault(index, {})[key] = ops.scalar_like_state(value, like)
        elif counts[3 * slot + 2]:
            begin = bucket.offsets[slot]
            part = ops.part(summed, begin, begin + bucket.sizes[slot])
            shape = ops.shape(layout.plan.tensor(position))
            out.setdefault(index, {})[key] = ops.reshape(ops.copy(part), shape)


def _summed(opt: ShardedOptimizer, bucket: Any, elementwise: list, like: Any) -> Any:
    """The bucket's elementwise values of one key, every rank's chunk in its place."""
    ops, world = opt._ops, opt._world
    size = chunk_numel(bucket, world)
    flat = ops.zeros(size * world, like, "float32")
    for segment, value in elementwise:
        ops.write(flat, opt._rank * size + segment.offset, ops.cast(value, "float32"))
    return opt._transport.allreduce_async(flat).wait()


def _sharded_callback(gm: Any) -> Any:
    found = []
    for _, callbacks in gm.callback_chains():
        for cb in callbacks:
            if hasattr(cb, "synchronizer") and cb not in found:
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
