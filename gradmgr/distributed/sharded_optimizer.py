"""The sharded optimizer step (ZeRO-2): each rank steps only its slice of the parameters, with
optimizer state for that slice alone, then the ranks all-gather the updated parameters.

The slices are the gradient shards' segments (:mod:`.sharding`): the part of each parameter
that falls in this rank's chunk of its bucket. Each segment is one parameter of the wrapped
optimizer (on PyTorch a view into the model parameter itself where it can be, so the step
writes the model's own slice in place), with the reduced gradient slice as its ``.grad``. An
elementwise optimizer (SGD, Adam, AdamW, ...) then computes exactly what it computes on the
whole parameters, element for element.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .gather import ParameterGather
from .sharding import Segment, chunk_numel, own_segments

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


class ShardedOptimizer:
    """Any optimizer, stepping only this rank's slice of the parameters of a manager whose
    gradients are reduce-scattered (``data_parallel(model, shard=True)``, or a
    :class:`ReduceScatterCallback` attached by hand).

    ``optimizer_class(param_groups, **defaults)`` is built over this rank's segments: its
    state (Adam's moments) covers about 1/world of the parameters. ``params`` is what the
    unsharded optimizer would be given (the parameters, or a list of parameter-group dicts:
    weight decay for some, not others); by default every parameter the manager reduces.

    After :meth:`step` every rank holds the same updated parameters. Every method that
    communicates (:meth:`step`, :meth:`clip_grad_norm_`, :meth:`state_dict`,
    :meth:`load_state_dict`) must be called on every rank. The parameter set is fixed when
    the optimizer is made: after attaching, freezing or unfreezing a parameter on every rank,
    make a new one (``load_state_dict(old.state_dict())`` carries the state over).

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
        self._synchronizer = _sharded_synchronizer(gm)
        sync = self._synchronizer
        self._plan = plan = sync.plan_now(gm)
        self._ops, self._shards = sync.ops, sync.shards
        transport = sync.transport
        self._world, self._rank = transport.world_size(), transport.rank()
        self._transport = transport
        self._segments = own_segments(plan, self._rank, self._world)
        self._tensors = [self._ops.segment(plan.tensor(s.position), s.start, s.stop,
                                           master_dtype) for s in self._segments]
        self._gather = ParameterGather(self._ops, transport, plan, self._world,
                                       self._segments, self._tensors)
        groups, self._index = _groups(plan, params, self._segments, self._tensors)
        self.optimizer = optimizer_class(groups, **defaults)
        """The wrapped optimizer over this rank's segments (for learning-rate schedulers)."""

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
        for tensor in self._tensors:
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
                "parameter attached, frozen or unfrozen): make a new one, "
                "new.load_state_dict(old.state_dict()) carries the optimizer state over"
            )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The optimizer state of the whole model, as the unsharded optimizer over ``params``
        would give it (state by parameter index, full-size tensors; parameter groups with
        their options): on every rank, whatever the world size, loadable by
        :meth:`load_state_dict` on any world size (or by the unsharded optimizer)."""
        states = [self._ops.optimizer_state(self.optimizer, t) for t in self._tensors]
        full = _consolidate(self, states)
        groups = []
        for group, indices in zip(self.optimizer.param_groups, self._index.group_indices):
            options = {k: v for k, v in group.items() if k != "params"}
            groups.append({**options, "params": list(indices)})
        return {"state": full, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave (on this or any other world size)."""
        ops = self._ops
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for segment, tensor in zip(self._segments, self._tensors):
            index = self._index.of_position[segment.position]
            saved = state_dict["state"].get(index, state_dict["state"].get(str(index)))
            if saved is None:
                continue
            saved = {k: ops.state_from_checkpoint(v) for k, v in saved.items()}
            shape = ops.shape(self._plan.tensor(segment.position))
            state = {k: (ops.cast(ops.copy(ops.part(ops.flat(v), segment.start, segment.stop)),
                                  ops.dtype_name(tensor))
                         if _elementwise(ops, k, v, shape) else v)
                     for k, v in saved.items()}
            ops.set_optimizer_state(self.optimizer, tensor, state)


def _elementwise(ops: Any, key: str, value: Any, shape: tuple) -> bool:
    """A saved state entry with one value per element of its parameter (Adam's moments), as
    opposed to one per parameter (its step count: 0-d, and called "step" where the parameter
    itself is 0-d)."""
    if not ops.is_tensor(value) or ops.shape(value) != shape:
        return False
    return shape != () or key != "step"


class _Index:
    """Where each planned parameter sits in the unsharded optimizer's numbering (its
    parameters across its groups, in order)."""

    def __init__(self) -> None:
        self.of_position: Dict[int, int] = {}
        self.group_indices: List[List[int]] = []


def _groups(plan: Any, params: Optional[Iterable[Any]], segments: Sequence[Segment],
            tensors: Sequence[Any]) -> tuple:
    """The wrapped optimizer's parameter groups (of segments) and the :class:`_Index`."""
    position_of = {id(t): p for p, t in enumerate(plan.tensors())}
    user_groups = _user_groups(plan, params)
    index, group_of, counter = _Index(), {}, 0
    for g, group in enumerate(user_groups):
        indices = []
        for tensor in group["params"]:
            position = position_of.get(id(tensor))
            if position is None:
                continue  # frozen (not reduced): the unsharded optimizer would skip it too
            index.of_position[position] = counter
            group_of[position] = g
            indices.append(counter)
            counter += 1
        index.group_indices.append(indices)
    missing = set(range(len(plan.tensors()))) - set(group_of)
    if missing:
        raise ValueError(f"ShardedOptimizer: {len(missing)} reduced parameter(s) are in no "
                         f"group of params= (every parameter the manager reduces needs one)")
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
              for g in user_groups]
    for segment, tensor in zip(segments, tensors):
        groups[group_of[segment.position]]["params"].append(tensor)
    return groups, index


def _user_groups(plan: Any, params: Optional[Iterable[Any]]) -> List[Dict[str, Any]]:
    if params is None:
        return [{"params": plan.tensors()}]
    listed = list(params)
    if listed and isinstance(listed[0], dict):
        return [{**g, "params": list(g["params"])} for g in listed]
    return [{"params": listed}]


def _consolidate(opt: ShardedOptimizer, states: List[Dict[str, Any]]) -> Dict[int, Any]:
    """Every parameter's full state, from every rank's segments: per bucket and state key, a
    sum over zeros elsewhere (one allreduce each, like the plan check's gathers). A parameter
    whose state no rank holds (never stepped) has none, as in the unsharded optimizer."""
    plan = opt._plan
    keys = _agreed_keys(opt, states)
    out: Dict[int, Dict[str, Any]] = {}
    for b, bucket in enumerate(plan.buckets):
        mine = [(seg, st, t) for seg, st, t in zip(opt._segments, states, opt._tensors)
                if seg.bucket == b]
        like = plan.tensor(bucket.members[0])
        for key in keys:
            _consolidate_key(opt, b, bucket, key, mine, like, out)
    return out


def _agreed_keys(opt: ShardedOptimizer, states: List[Dict[str, Any]]) -> List[str]:
    """The state keys of every rank together (two small gathers), so that every rank takes
    part in every key's collectives: a rank may hold fewer, or none (its segments never got
    a gradient, so a lazy optimizer made no state for them; it holds no segment at all)."""
    ops, transport, like = opt._ops, opt._transport, opt._plan.tensor(0)
    keys = sorted({k for s in states for k in s})
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"ShardedOptimizer.state_dict: the wrapped optimizer's state keys "
                            f"must be strings, got {key!r}")
    mine = list("\0".join(keys).encode())
    lengths = ops.values(transport.all_gather_async(ops.vector([len(mine)], like)).wait())
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


def _consolidate_key(opt: ShardedOptimizer, b: int, bucket: Any, key: str, mine: list,
                     like: Any, out: Dict[int, Dict[str, Any]]) -> None:
    ops, plan, world = opt._ops, opt._plan, opt._world
    size = chunk_numel(bucket, world)
    flat = ops.zeros(size * world, like, "float32")
    # per member: the scalar values held, by how many segments, and how many hold elementwise
    scalars = [0.0] * (3 * len(bucket.members))
    for segment, state, tensor in mine:
        value = state.get(key)
        if ops.is_tensor(value) and ops.shape(value) == ops.shape(tensor):  # elementwise
            start = opt._rank * size + segment.offset
            ops.write(flat, start, ops.cast(value, "float32"))
            scalars[3 * segment.slot + 2] += 1.0
        elif value is not None:
            scalars[3 * segment.slot] += float(ops.item(value))
            scalars[3 * segment.slot + 1] += 1.0
    summed = opt._transport.allreduce_async(flat).wait()
    counts = ops.values(opt._transport.allreduce_async(ops.vector(scalars, like)).wait())
    for slot, position in enumerate(bucket.members):
        index = opt._index.of_position[position]
        tensor = plan.tensor(position)
        if counts[3 * slot + 1]:
            value = counts[3 * slot] / counts[3 * slot + 1]
            out.setdefault(index, {})[key] = ops.scalar_like_state(value, like)
        elif counts[3 * slot + 2]:
            begin = bucket.offsets[slot]
            part = ops.part(summed, begin, begin + bucket.sizes[slot])
            out.setdefault(index, {})[key] = ops.reshape(ops.copy(part), ops.shape(tensor))


def _sharded_synchronizer(gm: Any) -> Any:
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
    return found[0].synchronizer(gm)


__all__ = ["ShardedOptimizer"]
