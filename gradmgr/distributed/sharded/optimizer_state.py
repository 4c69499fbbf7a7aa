"""The sharded optimizer's checkpoints: the unsharded optimizer's numbering of ``params``,
loading a saved state dict into this rank's segments, and consolidating every rank's segments'
state into the whole model's (collectives over the sharding transport)."""

from __future__ import annotations

import numbers
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

from ..reduce.bucket import BucketPlan
from .sharding import Segment, chunk_numel


class Ranks(NamedTuple):
    """What consolidating needs of the ranks: the ops, the transport, this rank and the world
    size, and a tensor whose device the small collectives use."""

    ops: Any
    transport: Any
    rank: int
    world: int
    like: Any


class Layout(NamedTuple):
    """This rank's segments of one bucket plan (the reduced parameters', or the frozen
    ones'), the tensors the wrapped optimizer holds for them, and where each of the plan's
    members sits in the unsharded optimizer's numbering (``numbering[position]``; not
    ``index``, which would hide the tuple's method)."""

    plan: BucketPlan
    segments: List[Segment]
    tensors: List[Any]
    numbering: List[int]


def elementwise(ops: Any, key: str, value: Any, shape: tuple) -> bool:
    """A saved state entry with one value per element of its parameter (Adam's moments), as
    opposed to one per parameter (its step count: 0-d, and called "step" where the parameter
    itself is 0-d)."""
    if not ops.is_tensor(value) or ops.shape(value) != shape:
        return False
    return shape != () or key != "step"


class Numbering:
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

    def wrapped_groups(self, layouts: Sequence[Layout]) -> List[Dict[str, Any]]:
        """The wrapped optimizer's groups: each user group's options, over its segments."""
        groups: List[Dict[str, Any]] = [{**o, "params": []} for o in self.options]
        for layout in layouts:
            for segment, tensor in zip(layout.segments, layout.tensors):
                group = self.group_of[layout.numbering[segment.position]]
                groups[group]["params"].append(tensor)
        return groups


def user_groups(params: Iterable[Any]) -> List[Dict[str, Any]]:
    listed = list(params)
    if listed and isinstance(listed[0], dict):
        return [{**g, "params": list(g["params"])} for g in listed]
    return [{"params": listed}]


# ---------------------------------------------------------------------- loading
def saved_states(ops: Any, numbering: Numbering,
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
def consolidate(ranks: Ranks, layouts: Sequence[Layout],
                states: List[List[Dict[str, Any]]]) -> Dict[int, Dict[str, Any]]:
    """Every parameter's full state by index, from every rank's ``states`` (per layout, per
    segment). A collective: every rank calls it."""
    keys = _agreed_keys(ranks, [(s, t) for layout, held in zip(layouts, states)
                                for s, t in zip(held, layout.tensors)])
    full: Dict[int, Dict[str, Any]] = {}
    for layout, held in zip(layouts, states):
        _consolidate(ranks, layout, held, keys, full)
    return full


def _agreed_keys(ranks: Ranks, held: List[Tuple[Dict[str, Any], Any]]) -> List[str]:
    """The state keys of every rank together (two small gathers), so that every rank takes
    part in every key's collectives: a rank may hold fewer, or none (its segments never got
    a gradient, so a lazy optimizer made no state for them; it holds no segment at all).
    A rank whose state cannot be consolidated says so in the first gather (length -1), so
    that every rank raises, none left waiting."""
    ops, transport, like = ranks.ops, ranks.transport, ranks.like
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
    agreed: Set[str] = set()
    for rank in range(ranks.world):
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


def _consolidate(ranks: Ranks, layout: Layout, states: List[Dict[str, Any]],
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
            _consolidate_key(ranks, layout, bucket, key, mine, like, out)


def _consolidate_key(ranks: Ranks, layout: Layout, bucket: Any, key: str, mine: list,
                     like: Any, out: Dict[int, Dict[str, Any]]) -> None:
    ops = ranks.ops
    # per member: the scalar values held, by how many segments, and how many hold elementwise
    scalars = [0.0] * (3 * len(bucket.members))
    per_element = []
    for segment, state, tensor in mine:
        value = state.get(key)
        if ops.is_tensor(value) and ops.shape(value) == ops.shape(tensor):
            per_element.append((segment, value))
            scalars[3 * segment.slot + 2] += 1.0
        elif value is not None:
            scalars[3 * segment.slot] += float(ops.item(value))
            scalars[3 * segment.slot + 1] += 1.0
    counts = ops.values(ranks.transport.allreduce_async(ops.vector(scalars, like)).wait())
    # The counts are summed over the ranks: every rank skips the bucket-sized sum alike.
    summed = (_summed(ranks, bucket, per_element, like) if any(counts[2::3]) else None)
    for slot, position in enumerate(bucket.members):
        index = layout.numbering[position]
        if counts[3 * slot + 1]:
            value = counts[3 * slot] / counts[3 * slot + 1]
            out.setdefault(index, {})[key] = ops.scalar_like_state(value, like)
        elif counts[3 * slot + 2]:
            begin = bucket.offsets[slot]
            part = ops.part(summed, begin, begin + bucket.sizes[slot])
            shape = ops.shape(layout.plan.tensor(position))
            out.setdefault(index, {})[key] = ops.reshape(ops.copy(part), shape)


def _summed(ranks: Ranks, bucket: Any, per_element: list, like: Any) -> Any:
    """The bucket's elementwise values of one key, every rank's chunk in its place."""
    ops, world = ranks.ops, ranks.world
    size = chunk_numel(bucket, world)
    flat = ops.zeros(size * world, like, "float32")
    for segment, value in per_element:
        ops.write(flat, ranks.rank * size + segment.offset, ops.cast(value, "float32"))
    return ranks.transport.allreduce_async(flat).wait()
