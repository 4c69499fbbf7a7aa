"""Checking across ranks that every rank reduces the same tensors, before it matters.

Ranks whose bucket plans differ would reduce mismatched buffers: gradients silently swapped
between tensors of equal size, or a crash inside the transport for unequal sizes. So at every
synced step all ranks compare a fingerprint of the planned tensors (count, then shape and dtype
of each, in order) and of how they are reduced (path, reduce, compression, bucket size) in one
small collective that has the same size on every rank, whether or not this rank re-planned: a
rank that alone changed its plan must not be the only one to communicate. If they differ, a
few more collectives find the first differing tensor, and every rank raises an error naming it
(or, for the same tensors, its own reduction settings).

The check also carries where each rank is in its accumulation: whether its recording is
synced, and how many recordings inside ``no_sync`` came before it. Collectives pair by their
order alone, so a rank that syncs a micro-batch that another accumulates would pair its
reductions with the other's next step (silently wrong sums, then a crash inside the
transport or a hang); the check, the first collective of every synced step on every rank,
pairs with the other's check instead and they differ.

Why every synced step, at this cost (issue 27 measured the alternatives): a check made only
where a rank re-planned leaves a rank that alone re-planned the only one in a collective; a
fingerprint carried by a collective that happens anyway arrives too late, since the only such
collectives are the gradient buckets, whose sizes follow the plan (paired across ranks whose
plans differ, gloo crashes or hangs before any fingerprint is read). The check is launched at
``record()`` and read before the step's first bucket goes out, so it overlaps the forward;
reading it at once is no cheaper. Its cost is the collective itself, not its payload: on a
machine whose cores are all busy, the transport's threads wait for one
(``bench/bench_plan_check.py``).
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

from .contract import TensorOps
from .errors import RankMismatchError

_CHUNKS = 8  # a 64-bit fingerprint as 8-bit chunks: sums stay exact in float32
_COUNT_CHUNKS = 3  # tensor counts below 2**24
_MAX_DIMS = 8
_NAME_BYTES = 48  # a tensor's name (a module's parameter or buffer), truncated, in messages

NameOf = Optional[Callable[[Any], Optional[str]]]
"""``name_of(tensor)``: its name where known (a module's parameter), for messages."""


@dataclass(frozen=True)
class CheckTerms:
    """How the check's messages speak of where the ranks are, on the path that checks: what
    the ranks go through (``unit``), which of those start with a check (``checked``), how to
    enter ``no_sync``, what was not done (``nothing``), what a rank with fewer micro-batches
    can do (``fewer``) and how ranks with different numbers of steps get in step
    (``even_out``, the remedy of :class:`~.errors.RanksOutOfStepError`)."""

    unit: str
    checked: str
    no_sync: str
    nothing: str
    fewer: str
    even_out: str


STEPS = CheckTerms(
    unit="step", checked="synced step", no_sync="no_sync(gm) (or cb.no_sync())",
    nothing="Nothing was reduced at this step",
    fewer="a rank with fewer micro-batches can record empty ones "
          "(`with no_sync(gm), gm: gm.backward()`)",
    even_out="Wrap the loop in `with Join([gm]):` (torch.distributed.algorithms.join; "
             "Join([gm, opt]) with a ShardedOptimizer), or take every step on every rank: a "
             "rank with nothing to contribute records an empty step, `with gm: gm.backward()`")
"""The allreduce callback's and ``shard=True``'s terms: a check starts every synced step."""

STEPS_WITHOUT_JOIN = replace(
    STEPS, even_out="Take every step on every rank: a rank with nothing to contribute records "
                    "an empty step, `with gm: gm.backward()` (this framework has no Join, "
                    "the context for uneven inputs, in gradmgr)")
""":data:`STEPS` where the framework has no context for uneven inputs."""


STEPS_BY_HAND = replace(
    STEPS, even_out="Take every step on every rank: a rank with nothing to contribute records "
                    "an empty step, `with gm: gm.backward()`; or make the manager with "
                    "gm = data_parallel(model), which takes part in torch's Join (uneven "
                    "inputs; a manager built by hand with make_allreduce_cb() does not)")
""":data:`STEPS` for a manager built by hand, which torch's Join does not take."""


def step_terms(ops: TensorOps, joinable: bool = True) -> CheckTerms:
    """The terms of a synced step's check on ``ops``'s framework: its remedy for ranks out of
    step names Join only where the framework has one (``TensorOps.join_support``) and the
    manager is ``joinable`` (``data_parallel``'s is; one built by hand is not)."""
    if ops.join_support() is None:
        return STEPS_WITHOUT_JOIN
    return STEPS if joinable else STEPS_BY_HAND

RECORDINGS = CheckTerms(
    unit="recording", checked="recording", no_sync="no_sync(gm)",
    nothing="Nothing was gathered or reduced at this recording",
    fewer="every rank needs as many micro-batches (FSDP2 gathers the parameters in every "
          "forward, inside no_sync too)",
    even_out="Give every rank the same number of batches (DistributedSampler(..., "
             "drop_last=True)): full sharding has no Join, as FSDP2 has none, and every "
             "forward gathers parameters from every rank; or use data_parallel(model) or "
             "shard=True, which take `with Join([gm]):`")
"""Full sharding's (``shard="full"``): a check starts every recording, inside no_sync too."""


def describe(ops: TensorOps, tensor: Any) -> str:
    return f"{ops.dtype_name(tensor)}{list(ops.shape(tensor))}"


def _chunks(text: str) -> List[int]:
    digest = hashlib.blake2b(text.encode(), digest_size=_CHUNKS).digest()
    return list(digest)


def _count_chunks(n: int) -> List[int]:
    return [(n >> (8 * i)) & 0xFF for i in range(_COUNT_CHUNKS)]


_VERIFY = {True: "step", "step": "step", "plan": "plan", False: None}


def verify_mode(verify: Any) -> Optional[str]:
    """``verify=`` as the check's mode: ``"step"`` (``True`` too: every synced step),
    ``"plan"`` (the first and where a plan changed) or None (``False``); else ValueError."""
    if not isinstance(verify, (bool, str)) or verify not in _VERIFY:
        raise ValueError(f"verify must be True, 'step', 'plan' or False, got {verify!r}")
    return _VERIFY[verify]


def plan_fingerprint(ops: TensorOps, tensors: Sequence[Any], mode: str) -> List[int]:
    """What the ranks compare: the count, then shape and dtype of each tensor in order, and
    how they are reduced; a list of small ints, the same length for any plan."""
    return text_fingerprint(len(tensors), ";".join([describe(ops, t) for t in tensors] + [mode]))


def text_fingerprint(count: int, text: str) -> List[int]:
    """A fingerprint of ``count`` things described by ``text``, as :func:`plan_fingerprint`'s
    (the same length: a :class:`PlanCheck` of either pairs with the other's)."""
    return _count_chunks(count) + _chunks(text)


MAKING_OPTIMIZER = -1
"""``PlanCheck``'s ``accumulated`` for the comparison of a ``ShardedOptimizer`` being made
(:mod:`.sharded.optimizer_agreement`): a stage of its own, so that where it meets another
rank's step check (that rank does not shard) both disagree, and every rank raises the same
error."""


class PlanCheck:
    """One rank's side of a comparison of plans across ranks, in flight.

    Launching it is one small collective of the same size on every rank, whatever the plans:
    with a transport that knows its ``rank()``, every rank's fingerprint (bytes, 0-255) in its
    own row of a sum over zeros, which even a transport that sends fp16 or bf16 carries
    exactly; without, the sum of the fingerprints and of their squares (all ranks agree
    exactly when ``world * sum(v**2) == sum(v)**2``), which needs a transport that sums
    float32 exactly. One more element carries ``request`` (0 or 1), so that work all ranks
    must do together (building torch's reducer, which broadcasts) is done by all of them when
    any asks. :meth:`agreed` waits for it; every rank gets the same answer, so where the plans
    differ all ranks go on to :meth:`error` (or :meth:`stage_error`) together.
    """

    __slots__ = ("_transport", "_ops", "_like", "_world", "_rank", "_width", "_handle",
                 "_accumulation", "_terms", "requested")

    def __init__(self, transport: Any, ops: TensorOps, fingerprint: Sequence[int],
                 like: Any, request: bool = False, accumulated: Optional[int] = 0,
                 terms: CheckTerms = STEPS) -> None:
        if getattr(transport, "on_host", False):
            like = None  # (see TensorOps.vector)
        self._transport, self._ops, self._like = transport, ops, like
        self._terms = terms
        self._world = world = transport.world_size()
        rank_of = getattr(transport, "rank", None)
        self._rank = rank_of() if rank_of is not None else None
        # accumulated: recordings inside no_sync since the last synced one, before this synced
        # recording; None: this recording is inside no_sync (its check is the first one).
        self._accumulation = _accumulation_chunks(accumulated)
        row: List[float] = [*fingerprint, *self._accumulation]
        self._width = len(row)
        flat = (_own_row(self._rank, world, row) if self._rank is not None
                else row + [v * v for v in row])
        self._handle = transport.allreduce_async(ops.vector(flat + [int(request)], like))
        self.requested = False  # by any rank; known once agreed() returned

    def agreed(self) -> bool:
        """Whether every rank planned alike (waits for the collective)."""
        summed = self._ops.values(self._handle.wait())
        self.requested = summed.pop() != 0
        n, world = self._width, self._world
        if self._rank is not None:
            rows = _rows(summed, world, n)
            return all(row == rows[0] for row in rows)
        return all(world * summed[n + i] == summed[i] ** 2 for i in range(n))

    def error(self, tensors: Sequence[Any], mode: str, what: str,
              name_of: NameOf = None) -> RankMismatchError:
        """The error every rank raises where the plans (``tensors`` reduced per ``mode``)
        differ; a few more collectives (so call it on every rank) find the first difference,
        which ``name_of(tensor)`` names where it knows the tensor."""
        transport, ops, world, like = self._transport, self._ops, self._world, self._like
        stage = self.stage_error()
        if stage is not None:
            return stage
        return RankMismatchError(_mismatch_message(transport, ops, tensors, what, world, mode,
                                                   like, name_of))

    def stage_error(self) -> Optional[RankMismatchError]:
        """Where the ranks are at different stages (inside no_sync or not, after how many such
        recordings, making a ShardedOptimizer): the error every rank raises; else None. One
        more collective where the transport knows its rank, so call it on every rank, once
        :meth:`agreed` said no."""
        transport = self._transport
        rank_of = getattr(transport, "rank", None)
        if rank_of is None:
            return None
        rows = _gather(transport, self._ops, rank_of(), self._world, self._accumulation,
                       self._like)
        if all(row == rows[0] for row in rows):
            return None
        codes = [_code(row) for row in rows]
        if _OPTIMIZER_CODE in codes:
            return RankMismatchError(_sharding_message(codes, self._terms))
        return RankMismatchError(_accumulation_message(codes, self._terms))


_OPTIMIZER_CODE = 2**(8 * _COUNT_CHUNKS) - 1  # MAKING_OPTIMIZER's


def _accumulation_chunks(accumulated: Optional[int]) -> List[int]:
    """0 for a recording inside no_sync, else 1 + the recordings inside no_sync before it
    (capped: only equality matters), or :data:`_OPTIMIZER_CODE`, as bytes."""
    if accumulated == MAKING_OPTIMIZER:
        return _count_chunks(_OPTIMIZER_CODE)
    code = 0 if accumulated is None else 1 + min(accumulated, _OPTIMIZER_CODE - 2)
    return _count_chunks(code)


def _code(row: Sequence[float]) -> int:
    return sum(int(b) << (8 * i) for i, b in enumerate(row))


def _read_accumulation(code: int, terms: CheckTerms) -> str:
    if code == _OPTIMIZER_CODE:
        return "makes a ShardedOptimizer"
    if code == 0:
        return "records inside no_sync"
    return f"starts a synced {terms.unit} after {code - 1} recording(s) inside no_sync"


def _per_rank(codes: List[int], terms: CheckTerms) -> str:
    return "; ".join(f"rank {r} {_read_accumulation(c, terms)}" for r, c in enumerate(codes))


def _sharding_message(codes: List[int], terms: CheckTerms) -> str:
    per_rank = _per_rank(codes, terms)
    return (f"the ranks disagree about sharding: {per_rank}. A ShardedOptimizer steps the "
            f"slices of reduce-scattered gradients (data_parallel(model, shard=True), or "
            f"make_reduce_scatter_cb), so the ranks that make none reduce their gradients "
            f"otherwise, and the collectives of the two sides would never pair. Shard on "
            f"every rank, with a ShardedOptimizer on each, or on none. Nothing was reduced")


def _accumulation_message(codes: List[int], terms: CheckTerms) -> str:
    return (f"the ranks disagree about no_sync (gradient accumulation): at this {terms.unit} "
            f"{_per_rank(codes, terms)}. "
            f"Collectives pair by their order alone, so a rank that reduces a micro-batch "
            f"that another only accumulates would pair its reductions with another step of "
            f"the others: gradients silently mixed, then a crash or a hang. Enter "
            f"{terms.no_sync} for the same recordings on every rank, e.g. "
            f"`with (no_sync(gm) if micro < k - 1 else contextlib.nullcontext()), gm:` with "
            f"the same k everywhere; {terms.fewer}. {terms.nothing}")


def every_rank(transport: Any, ops: TensorOps, row: Sequence[float],
               like: Any) -> Optional[List[List[float]]]:
    """Every rank's ``row`` (the same length on every rank), in rank order; a collective, so
    call it on every rank. None (and no collective) with a transport that knows no ``rank()``."""
    rank_of = getattr(transport, "rank", None)
    if rank_of is None:
        return None
    return _gather(transport, ops, rank_of(), transport.world_size(), list(row), like)


def _gather(transport: Any, ops: TensorOps, rank: int, world: int, row: Sequence[float],
            like: Any) -> List[List[float]]:
    """Every rank's ``row`` (same length on all ranks), by a sum over zeros elsewhere."""
    flat = _own_row(rank, world, row)
    summed = ops.values(transport.allreduce_async(ops.vector(flat, like)).wait())
    return _rows(summed, world, len(row))


def _own_row(rank: int, world: int, row: Sequence[float]) -> List[float]:
    """``row`` in this rank's place among ``world`` rows of zeros (summed over ranks: every
    rank's row)."""
    width = len(row)
    flat = [0.0] * (world * width)
    flat[rank * width:(rank + 1) * width] = row
    return flat


def _rows(summed: List[float], world: int, width: int) -> List[List[float]]:
    return [summed[r * width:(r + 1) * width] for r in range(world)]


def _mismatch_message(transport: Any, ops: TensorOps, tensors: Sequence[Any], what: str,
                      world: int, mode: str, like: Any, name_of: NameOf = None) -> str:
    advice = (f"Every rank must attach the same tensors ({what}) in the same order, with the "
              f"same shapes, dtypes and requires_grad flags (freeze a parameter on every rank "
              f"or on none).")
    rank_of = getattr(transport, "rank", None)
    if rank_of is None:
        return (f"the ranks planned different tensors for data-parallel reduction, or they "
                f"disagree about no_sync (every rank must enter it for the same recordings). "
                f"{advice}")
    rank = rank_of()
    counts = [int(row[0]) for row in _gather(transport, ops, rank, world, [len(tensors)], like)]
    longest = max(counts)
    rows = _gather(transport, ops, rank, world,
                   [c for t in tensors for c in _chunks(describe(ops, t))]
                   + [0.0] * (_CHUNKS * (longest - len(tensors))), like)
    position = _first_difference(rows, counts, longest)
    if position == longest:  # the same tensors: the ranks would reduce them differently
        return (f"the ranks planned the same tensors for data-parallel reduction, but they "
                f"would reduce them differently (rank {rank}: {mode}; the other ranks' errors "
                f"show theirs). Every rank must create the allreduce callback with the same "
                f"reduce=, compression=, bucket_bytes=, native= and comm_hook= options (or set "
                f"GRADMGR_REDUCER alike), attach the same callbacks to the same tensors, "
                f"register the same after-backward callbacks, and give the same tensors the "
                f"same hooks that run after accumulation (on PyTorch, "
                f"register_post_accumulate_grad_hook): the C++ Reducer serves a step only "
                f"where nothing else needs the per-tensor callbacks or such hooks")
    shown = tensors[position] if position < len(tensors) else None
    rows = _gather(transport, ops, rank, world, _described(ops, shown, name_of), like)
    per_rank = [f"rank {r} has {_read_description(row)}" if row[0]
                else f"rank {r} has no tensor there (it planned {counts[r]})"
                for r, row in enumerate(rows)]
    return (f"the ranks planned different tensors for data-parallel reduction: the first "
            f"difference is at position {position} in attach order: {'; '.join(per_rank)}. "
            f"{advice}")


def _described(ops: TensorOps, tensor: Any, name_of: NameOf) -> List[float]:
    """A tensor as a row of small numbers that survive a sum over zeros: present, dtype code,
    dimensions, then its name's bytes."""
    row = [0.0] * (3 + _MAX_DIMS + _NAME_BYTES)
    if tensor is None:
        return row
    shape = ops.shape(tensor)
    name = ops.dtype_name(tensor)
    code = _DTYPES.index(name) + 1 if name in _DTYPES else 0
    row[:3 + min(len(shape), _MAX_DIMS)] = [1.0, float(code), float(len(shape)),
                                            *shape[:_MAX_DIMS]]
    label = (name_of(tensor) if name_of is not None else None) or ""
    encoded = label.encode()[:_NAME_BYTES]
    row[3 + _MAX_DIMS:3 + _MAX_DIMS + len(encoded)] = [float(b) for b in encoded]
    return row


def _read_description(row: List[float]) -> str:
    _, code, ndim, *rest = row
    dims, name = rest[:_MAX_DIMS], rest[_MAX_DIMS:]
    dtype = _DTYPES[int(code) - 1] if code else "another dtype"
    shape = [int(d) for d in dims[:int(ndim)]]
    label = bytes(int(b) for b in name if b).decode(errors="replace")
    return f"{label} ({dtype}{shape})" if label else f"{dtype}{shape}"


_DTYPES = ["float32", "float16", "bfloat16", "float64", "complex64", "complex128", "float8"]


def _first_difference(rows: List[List[float]], counts: List[int], longest: int) -> int:
    for position in range(longest):
        seen: Optional[List[float]] = None
        for r, row in enumerate(rows):
            if position >= counts[r]:
                return position
            chunk = row[position * _CHUNKS:(position + 1) * _CHUNKS]
            if seen is None:
                seen = chunk
            elif chunk != seen:
                return position
    return longest


def names_from(names: Any) -> NameOf:
    """``name_of(tensor)`` from a module or a mapping (tensors held weakly: by id, checked)."""
    if names is None:
        return None
    if hasattr(names, "named_parameters"):
        pairs = [*names.named_parameters(), *getattr(names, "named_buffers", list)()]
    else:
        pairs = [(name, tensor) for tensor, name in names.items()]
    table: Dict[int, tuple] = {id(t): (weakref.ref(t), name) for name, t in pairs}

    def name_of(tensor: Any) -> Optional[str]:
        found = table.get(id(tensor))
        return found[1] if found is not None and found[0]() is tensor else None

    return name_of
