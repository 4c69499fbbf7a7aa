"""Checking, when a ShardedOptimizer is made, that every rank made it alike.

Each rank steps its own slice of the parameters with its own wrapped optimizer: ranks given
different parameter groups or options (one rank ``weight_decay=0.01``, another two groups with
0.5 and 0.0) would each step their slices by their own rules, and the all-gathered model would
be a mixture of both, with no error anywhere. So the ranks compare a digest of what they were
given (the optimizer class, ``master_dtype``, each group's options and parameters) in one small
collective; where the digests differ, two more gather every rank's description, and every rank
raises the same RankMismatchError naming the first difference and each rank's value of it.

The comparison is a plan check (:class:`~.consistency.PlanCheck`) in the checks' own group
(``Transport.control()``), with a stage of its own: a rank that does not shard, and so makes
no ShardedOptimizer, meets it with its first step's check, and every rank raises
RankMismatchError saying which ranks make one; and a rank that nobody joins gives up as a step
check does (RanksOutOfStepError), so the user's process group never holds a collective that
only some ranks started.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from ..consistency import MAKING_OPTIMIZER, PlanCheck, every_rank, text_fingerprint
from ..errors import RankMismatchError

Entry = Tuple[str, str]  # (what, its value as text)


def describe(ops: Any, optimizer_class: Any, master_dtype: Any, groups: Sequence[Dict[str, Any]],
             params: Sequence[Sequence[Any]]) -> List[Entry]:
    """What the ranks must agree on, in the order a difference is reported: the optimizer,
    then group by group its options (the wrapped optimizer's, defaults filled in) and its
    parameters (shape and dtype, in order), then the number of groups."""
    module = getattr(optimizer_class, "__module__", "")
    name = f"{module}.{getattr(optimizer_class, '__qualname__', optimizer_class)}"
    entries = [("the optimizer class", name), ("master_dtype", repr(master_dtype))]
    for g, (group, tensors) in enumerate(zip(groups, params)):
        for key in sorted(k for k in group if k != "params"):
            entries.append((f"parameter group {g}'s {key}", _text(ops, group[key])))
        entries.append((f"the number of parameters in group {g}", str(len(tensors))))
        for i, tensor in enumerate(tensors):
            entries.append((f"parameter {i} of group {g}",
                            f"{ops.dtype_name(tensor)}{list(ops.shape(tensor))}"))
    entries.append(("the number of parameter groups", str(len(groups))))
    return entries


def _text(ops: Any, value: Any) -> str:
    if ops.is_tensor(value):
        return (f"tensor({ops.item(value)!r})" if ops.numel(value) == 1
                else f"a tensor of shape {list(ops.shape(value))}")
    return repr(value)


def check_agreement(ops: Any, checks: Any, like: Any, entries: List[Entry]) -> None:
    """Raise RankMismatchError on every rank where the ranks' ``entries`` differ (a collective
    over ``checks``, the plan checks' transport: every rank calls it, one small allreduce
    where they agree)."""
    if checks.world_size() < 2:
        return
    text = "\n".join(f"{what}\t{value}" for what, value in entries)
    check = PlanCheck(checks, ops, text_fingerprint(len(entries), text), like,
                      accumulated=MAKING_OPTIMIZER)
    if check.agreed():
        return
    stage = check.stage_error()  # a rank that is not making one: it does not shard
    if stage is not None:
        raise stage
    encoded = text.encode()
    lengths = every_rank(checks, ops, [len(encoded)], like)
    if lengths is None:
        raise RankMismatchError(_UNNAMED)
    sizes = [int(row[0]) for row in lengths]
    texts = every_rank(checks, ops, list(encoded) + [0] * (max(sizes) - len(encoded)), like)
    if texts is None:  # (the same transport as for the lengths: never, said for mypy)
        raise RankMismatchError(_UNNAMED)
    described = [_decoded(row[:n]) for row, n in zip(texts, sizes)]
    raise RankMismatchError(_message(described))


_UNNAMED = (
    "the ranks built ShardedOptimizer differently (their plan checks' transport knows no "
    "rank(), so the difference cannot be named here). Every rank must build it with the same "
    "optimizer class, the same params (the same parameter groups, in the same order) and the "
    "same options"
)


def _decoded(codes: Sequence[float]) -> List[Entry]:
    text = bytes(int(c) for c in codes).decode(errors="replace")
    return [tuple(line.split("\t", 1)) for line in text.split("\n")]  # type: ignore[misc]


def _message(described: List[List[Entry]]) -> str:
    longest = max(len(entries) for entries in described)
    for i in range(longest):
        here = [entries[i] if i < len(entries) else None for entries in described]
        if any(entry != here[0] for entry in here):
            break
    what = next(entry[0] for entry in here if entry is not None)
    per_rank = "; ".join(
        f"rank {r}: {entry[1]}" if entry is not None and entry[0] == what
        else f"rank {r}: {entry[0] if entry is not None else 'nothing'} there"
        for r, entry in enumerate(here))
    return (f"the ranks built ShardedOptimizer differently, so each would step its slice of "
            f"the parameters by other rules and the gathered model would mix them: the first "
            f"difference is {what} ({per_rank}). Every rank must build it with the same "
            f"optimizer class, the same params (the same parameter groups, in the same order) "
            f"and the same options")
