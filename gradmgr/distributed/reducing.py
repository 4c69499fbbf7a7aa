"""The adapter contract's half for reducing gradients: what a backend hands out so that a step's
gradients can be reduced its way (:mod:`gradmgr.distributed.contract`'s ``TensorOps`` hands each
of these out; the names are importable from there too).

:class:`BucketBuffer` assembles one bucket's flat buffer on gradmgr's own path; a backend whose
engine reduces whole backwards itself offers a :class:`ReducerPath` (building a
:class:`Reducer`), one whose backwards should take no per-tensor hook a
:class:`PostBackwardPath`; a user's communication hook runs as a :class:`CommHook`. Like the
contract, this module imports nothing of gradmgr but the collectives' protocols.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, List, Optional, Protocol, Sequence

from .collectives import Handle, Transport

RANK_FAILED = (
    "another rank's backward raised during this data-parallel step (its own error says why), "
    "so the step's reduced gradients are incomplete; no rank uses them, and .grad keeps what "
    "it held before the step. Skip the step on every rank (catch this error where that rank "
    "catches its own), or stop all ranks"
)
"""What every path raises (``RankFailedError``) on a bucket that came back with some rank's
failure marker set (:meth:`BucketBuffer.finish`, :meth:`Reducer.finish`)."""


class BucketBuffer(Protocol):
    """Assembles one step's flat buffer of one bucket (see ``TensorOps.new_buffer``)."""

    def put(self, slot: int, grad: Any, local: Any) -> None:
        """Member ``slot``'s new gradient ``grad`` plus its ``.grad`` so far ``local`` (either
        None: left out; both None: zeros)."""

    def finish(self, unused: Sequence[int], failed: bool = False) -> Any:
        """The flat buffer: the members' values laid out as ``bucket.layout`` says, one flag per
        member (1, or 0 for the slots in ``unused``), then the failure marker (1 if
        ``failed``)."""


class Reducer(Protocol):
    """A framework's own reducer running whole backwards (torch's C++ ``Reducer``)."""

    tensors: List[Any]
    """The planned tensors in plan order, held strongly (the reducer holds them)."""
    broken: bool
    """A backward failed midway, or building it raised: build a new one."""

    def begin(self, sync: bool) -> None:
        """Before a backward's engine run."""

    def finish(self, sync: bool, used: Collection[int] = ()) -> None:
        """After the engine accumulated into ``.grad``: reduce (a synced step); ``used``: ids
        of tensors that had a local gradient in earlier steps the Python path took. Raises
        RankFailedError (and puts ``.grad`` back as it was) where another rank failed."""

    def abort(self) -> None:
        """The backward raised: this reducer's step can never finish."""

    def fail_step(self, used: Collection[int] = ()) -> None:
        """A synced step with no backward on this rank (its recording ended without one):
        take part in the step's collectives with the failure marker set, so that the other
        ranks raise RankFailedError; ``.grad`` stays as it is here."""

    def used_since_window(self) -> List[int]:
        """Ids of the tensors whose ``.grad`` changed since the accumulation window opened
        (and close it)."""

    def shadow(self) -> bool:
        """A joined rank's part of a synced step (uneven inputs): the step's collectives with
        zero gradients, no tensor used; the sums dropped. Whether no rank failed."""


class CommHook(Protocol):
    """A user's communication hook as the backend runs it (see ``TensorOps.comm_hook``):
    opaque to the core, which only launches it on a bucket."""

    def describe(self) -> str:
        """A name for the hook, compared across ranks with the plan."""

    def launch(self, flat: Any, bucket: Any, last: bool, transport: Transport,
               parameters: Callable[[], List[Any]]) -> Handle:
        """Start the hook on one step's ``flat`` buffer of ``bucket`` (values, then flags, as
        :meth:`BucketBuffer.finish` lays them out), undivided; ``wait()`` returns the buffer
        with the values reduced as the hook says and the flags summed over the ranks.
        ``parameters()``: the bucket's tensors in slot order."""


class ReducerPath(Protocol):
    """How a backend's own reducer can take whole backwards over from the Python buckets."""

    delivers_others: bool
    """The backward's tape delivers the attached tensors the reducer does not take (through
    their callbacks; non-leaves): a tensor attached with callbacks of its own keeps a step on
    this path (see ``Tape.backward_accumulating``'s ``taken``)."""

    def accepts(self, attached: Sequence[Any], planned: Sequence[Any]) -> bool:
        """Whether it can reduce ``planned`` (checked when planning; ``attached``: every tensor
        the manager holds, which the engine accumulates into directly on this path)."""

    def still_accepts(self, planned: Sequence[Any]) -> bool:
        """What may change between recordings without a new plan (checked at each one)."""

    def build(self, plan: Any, bucket_bytes: int, first_bucket_bytes: int,
              comm_hook: Optional[CommHook] = None) -> Reducer:
        """A reducer over the plan's tensors (collective: every rank builds one together),
        reducing each bucket with ``comm_hook`` where given."""


class PostBackwardPath(Protocol):
    """When a data-parallel step runs its backward with no per-tensor hook and gradmgr reduces
    ``.grad`` after it (see :mod:`gradmgr.distributed.reduce.post_backward`): a backward traced into
    a graph (PyTorch's compiled autograd), where each Python hook would break the graph."""

    delivers_others: bool
    """As :attr:`ReducerPath.delivers_others` (compiled autograd: False, no hook)."""

    def wanted(self) -> bool:
        """Whether backwards run now want no per-tensor hook (PyTorch: compiled autograd is
        on). Asked at every recording of a data-parallel manager, so it must be cheap."""

    def accepts(self, attached: Sequence[Any], planned: Sequence[Any]) -> bool:
        """Whether the engine can accumulate into ``.grad`` of ``attached`` itself and gradmgr
        reduce ``planned`` afterwards (checked when planning)."""

    def still_accepts(self, planned: Sequence[Any]) -> bool:
        """What may change between recordings without a new plan (checked at each step that
        wants this path)."""


__all__ = ["BucketBuffer", "CommHook", "PostBackwardPath", "RANK_FAILED", "Reducer",
           "ReducerPath"]
