"""The data-parallel allreduce callback: bucketed, launched during backward, overlapping it."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, List, Optional, Set

from .._state import get_backwarding_grad_manager
from ..future import Future
from .bucket import BucketPlan
from .ops import TensorOps, ops_for
from .transport import Handle, Transport, TransportSpec, check_transport, resolve_transport

_REDUCE = ("mean", "sum")
_COMPRESSION = (None, "fp16", "bf16")
_FIRST_BUCKET_BYTES = 2**20  # as DDP: start communicating early, then use bigger buckets


class _Reduction:
    """One launched bucket; splits the reduced buffer on first use."""

    __slots__ = ("_ops", "_handle", "_shapes", "_dtype", "_compressed", "_local", "_parts",
                 "_lock")

    def __init__(self, ops: TensorOps, handle: Handle, shapes: List[tuple], dtype: str,
                 compressed: bool, local: List[Any]) -> None:
        self._ops, self._handle, self._shapes = ops, handle, shapes
        self._dtype, self._compressed, self._local = dtype, compressed, local
        self._parts: Optional[List[Any]] = None
        self._lock = threading.Lock()

    def result(self, slot: int) -> Any:
        with self._lock:
            if self._parts is None:
                flat = self._handle.wait()
                if self._compressed:
                    flat = self._ops.cast(flat, self._dtype)
                parts = self._ops.split(flat, self._shapes)
                for i, local in enumerate(self._local):
                    if local is not None:  # .grad already holds this part: deliver the rest
                        parts[i] = self._ops.sub(parts[i], local)
                self._parts = parts
            return self._parts[slot]


class _Step:
    """What one backward of one manager has gathered so far."""

    def __init__(self, record_id: Any, plan: BucketPlan, sync: bool) -> None:
        self.record_id = record_id
        self.sync = sync
        n = len(plan.buckets)
        self.parts: List[List[Any]] = [[None] * len(b.members) for b in plan.buckets]
        self.local: List[List[Any]] = [[None] * len(b.members) for b in plan.buckets]
        self.filled: List[List[bool]] = [[False] * len(b.members) for b in plan.buckets]
        self.count = [0] * n
        self.launched: List[Optional[_Reduction]] = [None] * n
        self.next_launch = 0


class _ManagerState:
    __slots__ = ("plan", "ops", "transport", "step", "unsynced")

    def __init__(self) -> None:
        self.plan: Optional[BucketPlan] = None
        self.ops: Optional[TensorOps] = None
        self.transport: Optional[Transport] = None
        self.step: Optional[_Step] = None
        self.unsynced: Set[int] = set()  # ids whose .grad holds micro-batches not reduced yet


class AllreduceCallback:
    """Averages (or sums) gradients over all processes, data-parallel style.

    Use one instance for all parameters of a model: ``gm.attach(params, callbacks=[cb])``.
    Called as ``cb(tensor, grad)`` while the backward runs, it copies the gradient into a
    bucket and returns a :class:`gradmgr.Future` of the reduced gradient (same shape, dtype
    and device). Buckets are planned from ``gm.attached_tensors(with_callback=cb)`` in reverse
    attach order, by dtype and device, about ``bucket_bytes`` each (the first one at most
    1 MiB, as in DDP, so communication starts early); every rank plans the same
    buckets and launches them in the same order, each as soon as all its members are ready,
    so communication overlaps the rest of the backward. The remaining buckets are launched by
    an after-backward callback that ``cb`` registers once per manager.

    Unused tensors: an attached tensor that gets no gradient on a rank in a step is reduced
    as zeros there, and the result reaches it through ``gm.add_gradient``. So it gets the mean
    (or sum) of all ranks' gradients with zeros from that rank, never a hang; a tensor unused
    on every rank gets zeros. Every backward of a manager that ``cb`` serves is therefore a
    collective step that all ranks must take (as with PyTorch's DDP). A rank that calls
    ``gm.backward()`` with no output before ``cb`` ever ran for ``gm`` must call
    ``cb.bind(gm)`` first.

    Gradient accumulation: inside ``with cb.no_sync():`` backwards only accumulate locally;
    the next synced backward reduces what ``.grad`` holds plus the new gradient, so ``.grad``
    ends as PyTorch DDP's does with ``no_sync()``.

    Example:
        >>> # torch.distributed.init_process_group("gloo", ...) in every process
        >>> # cb = make_allreduce_cb("mean")
        >>> # gm = GradManager().attach(model.parameters(), callbacks=[cb])
        >>> # with gm:
        >>> #     gm.backward(loss_fn(model(x), y))   # .grad is now the mean over ranks

    Args:
        reduce: ``"mean"`` or ``"sum"`` over processes.
        group: the process group (torch ``ProcessGroup`` / megengine ``Group``); None: all.
        bucket_bytes: target bucket size in bytes (a bucket closes once it reaches it).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the dtype sent over the wire (a mean
            is divided by the world size before the cast, so fp16 rarely overflows).
        transport: None (pick from the tensors' framework: torch.distributed; for MegEngine its
            own collectives when initialised, else torch.distributed through numpy), a name
            (``"torch"``, ``"megengine"``, ``"megengine-via-torch"``) or any object with
            ``world_size()`` and ``allreduce_async(flat) -> handle`` (``handle.wait()`` returns
            the summed buffer).
    """

    def __init__(
        self,
        reduce: str = "mean",
        group: Any = None,
        bucket_bytes: int = 25 * 2**20,
        compression: Optional[str] = None,
        transport: TransportSpec = None,
    ) -> None:
        if reduce not in _REDUCE:
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        if compression not in _COMPRESSION:
            raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        check_transport(transport)
        self.reduce = reduce
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.compression = compression
        self._transport_spec = transport
        self._sync = True
        self._bound: weakref.WeakSet = weakref.WeakSet()
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.RLock()  # CUDA backwards call from engine worker threads

    # ------------------------------------------------------------------ public
    def __call__(self, tensor: Any, grad: Any) -> Any:
        gm = get_backwarding_grad_manager()
        if gm is None:
            raise RuntimeError(
                "an allreduce callback must be called by a GradManager during backward "
                "(attach it: gm.attach(params, callbacks=[cb]))"
            )
        with self._lock:
            self.bind(gm)
            state = self._states[gm]
            step = self._begin(gm, state)
            where = state.plan.where.get(id(tensor))
            if where is None:
                raise RuntimeError("allreduce callback got a tensor it was not attached with")
            if not step.sync:
                state.unsynced.add(id(tensor))
                return grad
            b, slot = where
            if step.filled[b][slot]:
                raise RuntimeError(
                    "allreduce callback called twice for one tensor in one backward: attach "
                    "each tensor with a given allreduce callback only once"
                )
            step.filled[b][slot] = True
            if id(tensor) in state.unsynced:
                local = getattr(tensor, "grad", None)
                step.local[b][slot] = local
                if local is not None:
                    grad = state.ops.add(local, grad)
            step.parts[b][slot] = grad
            step.count[b] += 1
            self._launch_ready(state, step)
            return _Pending(step.launched, b, slot)

    def bind(self, gm: Any) -> None:
        """Register this callback's flush with ``gm`` (done automatically on first use)."""
        with self._lock:
            if gm in self._bound:
                return
            self._states[gm] = _ManagerState()
            gm_ref = weakref.ref(gm)
            me = weakref.ref(self)

            def flush() -> None:
                cb, manager = me(), gm_ref()
                if cb is not None and manager is not None:
                    cb._flush(manager)

            gm.register_after_backward_callback(flush)
            self._bound.add(gm)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate gradients locally (no communication).

        Example:
            >>> # with cb.no_sync():
            >>> #     with gm: gm.backward(loss(micro_batch_1))
            >>> # with gm: gm.backward(loss(micro_batch_2))   # reduces both micro-batches
        """
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def buckets(self, gm: Any) -> List[Any]:
        """The current bucket plan for ``gm`` (for inspection), or [] before the first step."""
        state = self._states.get(gm)
        return list(state.plan.buckets) if state is not None and state.plan is not None else []

    # ------------------------------------------------------------------ internals
    def _begin(self, gm: Any, state: _ManagerState) -> _Step:
        record_id = gm.step
        step = state.step
        if step is not None and step.record_id == record_id:
            return step
        tensors = gm.attached_tensors(with_callback=self)
        if state.plan is None or not state.plan.matches(tensors):
            if gm.backend is None:
                raise RuntimeError("allreduce callback: the manager has no backend yet")
            state.ops = ops_for(gm.backend.name)
            first = min(self.bucket_bytes, _FIRST_BUCKET_BYTES)
            state.plan = BucketPlan(tensors, state.ops, self.bucket_bytes, first)
            state.unsynced &= {id(t) for t in tensors}
        state.step = _Step(record_id, state.plan, self._sync)
        return state.step

    def _launch_ready(self, state: _ManagerState, step: _Step) -> None:
        buckets = state.plan.buckets
        while step.next_launch < len(buckets):
            b = step.next_launch
            if step.count[b] < len(buckets[b].members):
                return
            self._launch(state, step, b)

    def _launch(self, state: _ManagerState, step: _Step, b: int) -> None:
        ops, bucket = state.ops, state.plan.buckets[b]
        if state.transport is None:
            state.transport = resolve_transport(self._transport_spec, ops.name, self.group)
        tensors = state.plan.tensors()
        like = [tensors[m] for m in bucket.members]
        flat = ops.flatten(step.parts[b], like)
        if self.reduce == "mean":
            flat = ops.scale(flat, 1.0 / state.transport.world_size())
        if self.compression is not None:
            flat = ops.compress(flat, self.compression)
        handle = state.transport.allreduce_async(flat)
        step.launched[b] = _Reduction(ops, handle, bucket.shapes, bucket.key[0],
                                      self.compression is not None, step.local[b])
        step.parts[b] = []  # the buffer holds them now
        step.next_launch = b + 1

    def _flush(self, gm: Any) -> None:
        with self._lock:
            state = self._states.get(gm)
            if state is None:
                return
            step = self._begin(gm, state)
            state.step = None
            if not step.sync:
                return
            missing = self._fill_missing(state, step)
            for b in range(step.next_launch, len(state.plan.buckets)):
                self._launch(state, step, b)
            state.unsynced.clear()
        for tensor, b, slot in missing:
            gm.add_gradient(tensor, _Pending(step.launched, b, slot))

    def _fill_missing(self, state: _ManagerState, step: _Step) -> List[tuple]:
        """Members with no gradient this step on this rank: contribute zeros (or what their
        ``.grad`` holds from ``no_sync`` steps) and still receive the other ranks' part."""
        missing = []
        tensors = state.plan.tensors()
        for b in range(step.next_launch, len(state.plan.buckets)):
            bucket = state.plan.buckets[b]
            for slot, position in enumerate(bucket.members):
                if step.filled[b][slot]:
                    continue
                tensor = tensors[position]
                if tensor is None:
                    raise RuntimeError("an attached tensor died during its allreduce step")
                if id(tensor) in state.unsynced:
                    local = getattr(tensor, "grad", None)
                    step.local[b][slot] = local
                    step.parts[b][slot] = local
                step.filled[b][slot] = True
                missing.append((tensor, b, slot))
        return missing


class _Pending(Future):
    """The reduced gradient of one bucket member: a Future without the cost of an event per
    tensor (the manager only asks for it after the flush has launched every bucket)."""

    __slots__ = ("_launched", "_bucket", "_slot")

    def __init__(self, launched: List[Optional[_Reduction]], bucket: int, slot: int) -> None:
        self._launched, self._bucket, self._slot = launched, bucket, slot

    def get(self, timeout: Optional[float] = None) -> Any:
        reduction = self._launched[self._bucket]  # filled in place when the bucket launches
        if reduction is None:
            raise RuntimeError(
                "allreduce bucket never launched: the manager's after-backward flush did not run"
            )
        return reduction.result(self._slot)

    def done(self) -> bool:
        return self._launched[self._bucket] is not None

    def set(self, value: Any) -> None:
        raise TypeError("an allreduce result is set by its collective, not by set()")


def make_allreduce_cb(
    reduce: str = "mean",
    group: Any = None,
    bucket_bytes: int = 25 * 2**20,
    compression: Optional[str] = None,
    transport: TransportSpec = None,
) -> AllreduceCallback:
    """A data-parallel allreduce callback; see :class:`AllreduceCallback`.

    Example:
        >>> cb = make_allreduce_cb("mean", bucket_bytes=4 * 2**20)
        >>> cb.reduce, cb.bucket_bytes
        ('mean', 4194304)
    """
    return AllreduceCallback(reduce, group, bucket_bytes, compression, transport)


__all__: List[str] = ["AllreduceCallback", "make_allreduce_cb"]
