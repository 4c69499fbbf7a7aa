"""A data-parallel step reduced after its backward rather than during it.

Where a backward is traced into a graph (PyTorch's compiled autograd: ``torch.compile``
capturing the backward), a Python hook per tensor breaks that graph at every tensor, and torch's
C++ reducer refuses to run at all. There, a step takes this path (the backend's
:class:`~gradmgr.distributed.contract.PostBackwardPath` says when): the engine accumulates every
gradient into ``.grad`` itself, as a plain ``loss.backward()`` does, with no gradmgr hook in the
backward; after it, gradmgr's buckets reduce what ``.grad`` holds, with the same flags (unused
tensors, a failed rank), the same plan check and the same wire as the per-tensor path, so ranks
on either path reduce together. What it costs: no overlap of communication with the backward.

So that ``.grad`` afterwards is exactly the per-tensor path's (and DDP's), ``.grad`` is set
aside before the engine runs: the engine then leaves this backward's gradient alone in
``.grad``, which goes into its bucket with what ``.grad`` held (the same sum the per-tensor
path makes), and a step that fails anywhere puts back what ``.grad`` held before it.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ..errors import sparse_error
from .steps import PendingGradient, Step


class PostBackwardStep:
    """One backward on this path: :meth:`begin` before the engine runs, then :meth:`finish`
    after it or :meth:`abort` if it raised (the manager's backward delegate protocol).
    ``synchronizer``: the :class:`~gradmgr.distributed.reduce.synchronizer.Synchronizer` whose step
    this is (its wire, its ``used`` set, its lock, and :meth:`close` for a synced step)."""

    __slots__ = ("_synchronizer", "_step", "_tensors", "_saved", "_closed")

    def __init__(self, synchronizer: Any, step: Step, tensors: List[Any]) -> None:
        self._synchronizer, self._step, self._tensors = synchronizer, step, tensors
        self._saved: Optional[List[Any]] = None  # .grad before the backward
        self._closed = False  # the step's buckets are all launched

    def begin(self) -> None:
        """Set ``.grad`` aside, so that the engine leaves this backward's gradient alone in
        it."""
        tensors = self._tensors
        self._saved = self._synchronizer.ops.exchange_grads(tensors, [None] * len(tensors))

    def finish(self) -> None:
        synchronizer, step, tensors = self._synchronizer, self._step, self._tensors
        ops = synchronizer.ops
        new = ops.exchange_grads(tensors, self._saved)  # .grad holds what it held again
        with synchronizer.lock:
            if not step.sync:  # accumulate locally, as the per-tensor path's delivery does
                for tensor, grad in zip(tensors, new):
                    if grad is not None:
                        synchronizer.used.add(id(tensor))
                        synchronizer.backend.accumulate(tensor, grad)
                return
            for grad, tensor in zip(new, tensors):
                if grad is not None and ops.is_sparse(grad):
                    raise sparse_error(ops, tensor)
            pending = self._put(new)
            new = None  # (the buckets hold the sums now)
            self._closed = True  # (where closing raises, its collectives are done)
            missing = synchronizer.close(step)
        synchronizer.wire.settle(step)
        if synchronizer.shards is not None:
            return  # the shards hold the reduced gradients and set .grad (see close)
        pending += [(t, PendingGradient(step.launched, b, slot, True)) for t, b, slot in missing]
        self._deliver(pending)

    def _put(self, new: List[Any]) -> List[tuple]:
        """Every gradient into its bucket, in plan order (full buckets go out at once)."""
        synchronizer, step, tensors = self._synchronizer, self._step, self._tensors
        wire, pending = synchronizer.wire, []
        for b, bucket in enumerate(step.plan.buckets):
            for slot, position in enumerate(bucket.members):
                grad = new[position]
                if grad is not None:
                    tensor = tensors[position]
                    pending.append((tensor, step.put(wire, tensor, grad, b, slot)))
        return pending

    def _deliver(self, pending: List[tuple]) -> None:
        """The reduced gradients become ``.grad`` (views into the buckets, as
        ``gradient_as_bucket_view``); a tensor no rank used keeps its ``.grad``. The last
        bucket is read first: it says whether some rank failed, and then nothing changes."""
        launched = self._step.all_launched()
        if launched:
            launched[-1].result(0)  # raises RankFailedError where a rank failed
        results = [(tensor, future.get()) for tensor, future in pending]
        set_grad = self._synchronizer.backend.set_grad
        for tensor, result in results:
            if result is not None:
                set_grad(tensor, result)

    def abort(self) -> None:
        """The backward (or :meth:`finish`) raised: ``.grad`` gets back what it held before;
        a synced step whose buckets did not all go out launches them with the failure marker
        set, so the other ranks raise RankFailedError instead of waiting."""
        if self._saved is not None:
            self._synchronizer.ops.exchange_grads(self._tensors, self._saved)
        if self._step.sync and not self._closed:
            self._closed = True
            self._synchronizer.fail(self._step)


__all__: List[str] = ["PostBackwardStep"]
