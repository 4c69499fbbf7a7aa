"""The data-parallel allreduce callback: bucketed, launched during backward, overlapping it.

This module holds the public face (the options, the callback that receives each gradient,
``no_sync`` and inspection); the work for each manager it serves is done by that manager's
:class:`~gradmgr.distributed.reduce.synchronizer.Synchronizer`.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Dict, Iterator, List, Literal, Optional, Union

from ...hooks import set_backward_delegate
from ...manager import get_backwarding_grad_manager
from ..consistency import names_from, verify_mode
from ..contract import Transport
from ..sharded.shard_grads import StandIns
from ..sharded.sharding import GradientShards
from ..transport import TransportSpec, check_transport
from .paths import delegate
from .synchronizer import Synchronizer

# The string options, typed so that a checker (mypy) catches reduce="avg" before a run does
Reduce = Literal["mean", "sum"]
Compression = Literal["fp16", "bf16"]
Verify = Union[bool, Literal["step", "plan"]]

_REDUCE = ("mean", "sum")
_COMPRESSION = (None, "fp16", "bf16")


# The environment's switch for the reducer path: the name, and the older one still read.
REDUCER_VARIABLES = ("GRADMGR_REDUCER", "GRADMGR_NATIVE_REDUCER")


def reducer_from_environment() -> bool:
    """Whether the environment lets plain backwards go to the framework's own reducer: on,
    unless ``GRADMGR_REDUCER`` (or ``GRADMGR_NATIVE_REDUCER``, its older name) is ``0``."""
    set_to = {name: os.environ[name] for name in REDUCER_VARIABLES if name in os.environ}
    if len({value != "0" for value in set_to.values()}) > 1:
        both = " and ".join(f"{name}={value}" for name, value in set_to.items())
        raise ValueError(f"the environment sets both {both}, which disagree (the second is "
                         f"the first's older name): unset {REDUCER_VARIABLES[1]}")
    return all(value != "0" for value in set_to.values())


class AllreduceCallback:
    """Averages (or sums) gradients over all processes, data-parallel style, like PyTorch's
    ``DistributedDataParallel``.

    Use one instance for all parameters of a model: ``gm.attach(params, callbacks=[cb])``.
    Attaching binds it to the manager; from then on, at the start of every recording of that
    manager, it:

    * plans buckets from the attached tensors that are trainable (on PyTorch: that require
      grad; a frozen parameter is left out and keeps ``.grad`` as it is, as with DDP), in
      reverse attach order, by dtype and device, about ``bucket_bytes`` each (the first at most
      1 MiB, as in DDP, so communication starts early); and again when they change
      (attached, frozen, unfrozen, or converted in place: ``model.double()`` after attaching);
    * at every synced step (and the first), launches one small collective that compares
      every rank's plan (count, order, shapes, dtypes, and how they are reduced) and where
      each rank is in its accumulation (inside :meth:`no_sync` or not, and how many
      recordings inside it came before); the step reads it before launching anything else,
      so it overlaps the forward. Where they differ (one rank alone attached, froze or
      unfroze a tensor, say, or entered ``no_sync`` where another did not), every rank raises
      :class:`gradmgr.distributed.RankMismatchError` naming the first difference, rather
      than reducing mismatched buffers or pairing one step's collectives with another's;
    * on the first plan, with ``broadcast=True`` (default), overwrites the planned tensors on
      every rank with rank ``src``'s values, as DDP does when it wraps a model (buffers: see
      :func:`gradmgr.distributed.broadcast` and :func:`gradmgr.distributed.data_parallel`);
    * reads whether this step synchronises (see :meth:`no_sync`).

    During the backward, ``cb(tensor, grad)`` puts the gradient into its bucket and returns a
    :class:`gradmgr.Future`; each bucket is reduced as soon as all its members are in, in the
    same order on every rank, so communication overlaps the rest of the backward. An
    after-backward callback launches the remaining buckets. Where ``native`` allows, a plain
    ``gm.backward`` skips all of that and the framework's own reducer does the same work
    (torch's C++ ``Reducer``, DDP's: see :mod:`gradmgr.backends.torch.reducer`).

    What ``.grad`` holds afterwards is exactly what DDP's gives: every rank's ``.grad`` (from
    earlier ``no_sync`` steps, or kept from before) plus its new gradient, averaged over the
    ranks; it replaces ``.grad`` and is bit-identical on every rank. The new ``.grad`` tensors
    are views into the reduced bucket buffers (DDP's ``gradient_as_bucket_view``): nothing is
    copied, and two ``.grad`` tensors share a buffer without overlapping.

    Unused tensors: an attached, trainable tensor that gets no gradient on a rank in a step is
    reduced as zeros there, and the result reaches it through ``gm.add_gradient``; one that no
    rank used since the last synced step keeps its ``.grad`` (``None`` stays ``None``), as with
    DDP's ``find_unused_parameters=True``. Every backward of a manager that ``cb`` serves is a
    collective step that all ranks must take, and so is every ``record()`` of a synced step.

    A recording that ends without a backward (its forward raised and the loop skips the
    batch) still takes part in its step's collectives, as a failed step: the other ranks'
    backward raises :class:`gradmgr.distributed.RankFailedError` and ``.grad`` stays as it
    was everywhere. One that ends without ``gm.backward`` while ``.grad`` changed (a
    ``loss.backward()`` typed by habit) raises ``RuntimeError`` at its end, on every rank
    that did it.

    Example:
        Here a process group of one rank; under ``torchrun`` every rank runs the same lines
        and ``.grad`` is the mean over the ranks:

        >>> import torch
        >>> import torch.distributed as dist
        >>> from gradmgr import GradManager
        >>> from gradmgr.distributed import free_port, make_allreduce_cb
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> cb = make_allreduce_cb("mean")
        >>> gm = GradManager().attach(model.parameters(), callbacks=[cb])
        >>> with gm:
        ...     gm.backward(model(torch.ones(3, 2)).sum())
        >>> model.weight.grad
        tensor([[3., 3.]])
        >>> del gm, cb  # before the group goes, as with DDP
        >>> dist.destroy_process_group()

    Args:
        reduce: ``"mean"`` or ``"sum"`` over processes.
        group: the process group (torch ``ProcessGroup`` / megengine ``Group``); None: all.
        bucket_bytes: target bucket size in bytes (a bucket closes once it reaches it);
            None: 25 MiB, DDP's (16 MiB for :class:`ReduceScatterCallback`).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the dtype sent over the wire (a mean
            is divided by the world size before the cast, so fp16 rarely overflows).
        transport: None (the tensors' backend picks: torch.distributed for PyTorch; for
            MegEngine its own collectives when initialised, else torch.distributed through
            host memory), a name the backend knows (``"torch"``, ``"megengine"``,
            ``"megengine-via-torch"``) or any object with ``world_size()`` and
            ``allreduce_async(flat) -> handle`` (``handle.wait()`` returns the summed buffer;
            see :class:`gradmgr.distributed.contract.Transport`).
        broadcast: broadcast the planned tensors from ``src`` at the first recording.
        src: the rank whose values the broadcast spreads.
        verify: compare the ranks' plans: ``True`` or ``"step"``, at every synced step (one
            small collective each, overlapping the forward; catches a change made on one
            rank alone, and ranks that disagree about ``no_sync``); ``"plan"``, only at steps
            where this rank re-planned (no per-step cost, but a rank that alone attaches,
            freezes or unfreezes a tensor then takes a collective the others do not, and
            ranks that disagree about ``no_sync`` pair one step's collectives with another's:
            gloo aborts or hangs, or gradients are wrong); ``False``: never (the same).
        names: a module (its ``named_parameters()`` and ``named_buffers()``) or a mapping from
            tensor to name: errors about ranks that planned different tensors name them
            (:func:`gradmgr.distributed.data_parallel` passes its module).
        native: let plain backwards go to the framework's own reducer (on PyTorch, torch's
            C++ ``Reducer``, DDP's) where nothing else needs the per-tensor callbacks:
            ``"mean"`` without compression over the backend's default transport, every
            reduced tensor's chain this callback alone (the other attached tensors' empty,
            or, where the backend's tape delivers them, as PyTorch's does, any), no other
            after-backward callback, and what the backend asks (PyTorch: the reduced tensors
            leaves, dense, with no post-accumulate-grad hook). Same results, DDP's cost; it
            holds the planned tensors while bound. None: on unless the environment sets
            ``GRADMGR_REDUCER=0`` (or its older spelling, ``GRADMGR_NATIVE_REDUCER=0``).
        comm_hook: a DDP communication hook, ``hook(state, bucket) -> Future`` as
            ``DistributedDataParallel.register_comm_hook`` takes it (torch's own:
            ``fp16_compress_hook``, ``powerSGD_hook``, ...; PyTorch only): each bucket goes
            to it undivided and its result becomes the bucket's reduced gradients, as with
            DDP, on torch's reducer and on gradmgr's buckets. Replaces ``compression``
            (give one of the two) and ``reduce`` (leave it ``"mean"``).
        comm_state: the hook's ``state`` (``PowerSGDState``, a process group, None).
    """

    DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb=25

    def __init__(
        self,
        reduce: Reduce = "mean",
        group: Any = None,
        bucket_bytes: Optional[int] = None,
        compression: Optional[Compression] = None,
        transport: TransportSpec = None,
        *,
        broadcast: bool = True,
        src: int = 0,
        verify: Verify = True,
        native: Optional[bool] = None,
        names: Any = None,
        comm_hook: Any = None,
        comm_state: Any = None,
    ) -> None:
        self._check_comm_hook(comm_hook, comm_state, reduce, compression)
        if reduce not in _REDUCE:
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        if compression not in _COMPRESSION:
            raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")
        if bucket_bytes is None:
            bucket_bytes = self.DEFAULT_BUCKET_BYTES
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        mode = verify_mode(verify)
        check_transport(transport)
        self.reduce = reduce
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.compression = compression
        self.broadcast = broadcast
        self.src = src
        self.verify: Optional[str] = mode
        self.native = reducer_from_environment() if native is None else native
        self.transport_spec = transport
        self.comm_hook, self.comm_state = comm_hook, comm_state
        self._names = names_from(names)
        self._sync = True
        self._synchronizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # The served managers' recordings in progress, by their hooks (which hold neither the
        # manager nor its synchronizer strongly): in at record(), out at release(). no_sync
        # reads it, not the managers: a manager dropped while recording is freed whenever each
        # rank's garbage collector gets to it, and the ranks' answers must not differ.
        self._recording: Dict[_Hooks, None] = {}

    def _check_comm_hook(self, hook: Any, state: Any, reduce: str,
                         compression: Optional[str]) -> None:
        if hook is None:
            if state is not None:
                raise ValueError("comm_state= is the state of a comm_hook=: pass the hook too")
            return
        if not callable(hook):
            raise TypeError(f"comm_hook must be callable as hook(state, bucket), got "
                            f"{type(hook).__name__}")
        if compression is not None:
            raise ValueError(
                f"comm_hook= and compression={compression!r} both say how buckets travel: "
                "choose one (fp16_compress_hook, or compression='fp16' without a hook)")
        if reduce != "mean":
            raise ValueError(
                f"comm_hook= decides the reduction (torch's hooks average), so reduce must "
                f"stay 'mean', got {reduce!r}")

    # ------------------------------------------------------------------ public
    def __call__(self, tensor: Any, grad: Any) -> Any:
        gm = get_backwarding_grad_manager()
        if gm is None:
            raise RuntimeError(
                "an allreduce callback must be called by a GradManager during backward "
                "(attach it: gm.attach(params, callbacks=[cb]))"
            )
        synchronizer = self._synchronizers.get(gm)
        if synchronizer is None:
            self.bind(gm)
            synchronizer = self._synchronizers[gm]
        return synchronizer.on_gradient(gm, tensor, grad)

    def bind(self, gm: Any) -> None:
        """Register this callback's work with ``gm`` (at every recording, after every
        backward, when a backward raises, when a recording ends, and as the backward delegate
        where ``native``); attaching does it (again calls are no-ops)."""
        if gm in self._synchronizers:
            return
        if gm.backend is None:
            raise RuntimeError("allreduce callback: bind a manager once it has tensors")
        synchronizer = Synchronizer(self, gm.backend, self._names, self._shards_for(gm.backend))
        self._synchronizers[gm] = synchronizer
        hooks = _Hooks(synchronizer, gm, self._recording)
        if gm.is_recording:  # (bound in a backward, or attached while recording)
            self._recording[hooks] = None
        synchronizer.flush_hook = hooks.flush
        gm.register_record_callback(hooks.record)
        gm.register_after_backward_callback(hooks.flush)
        gm.register_backward_error_callback(hooks.abort)
        gm.register_release_callback(hooks.release)
        if self.native or synchronizer.post_path is not None:
            set_backward_delegate(gm, hooks.delegate)

    __gradmgr_bind__ = bind

    def _shards_for(self, backend: Any) -> Optional[GradientShards]:
        """None: gradients are allreduced (the sharded callback keeps shards instead)."""
        return None

    def synchronizer(self, gm: Any) -> Synchronizer:
        """What this callback does for ``gm`` (the sharded optimizer reads its shards; a
        joined rank shadows its steps)."""
        synchronizer = self._synchronizers.get(gm)
        if synchronizer is None:
            raise ValueError("this callback is not attached to that manager")
        return synchronizer

    @property
    def syncing(self) -> bool:
        """False inside :meth:`no_sync`."""
        return self._sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Recordings that start inside only accumulate gradients locally (no communication),
        for every manager this callback serves; :func:`gradmgr.distributed.no_sync` does it for
        one manager without a handle on the callback. Read when a recording starts, so it
        must be entered before (``with cb.no_sync(), gm:``): entered while one of the managers
        records, it raises ``RuntimeError``. A manager dropped while recording counts as
        recording from then on (when the garbage collector frees it differs between ranks, and
        their answers must not): release a recording before dropping its manager.

        Example:
            Here a process group of one rank:

            >>> import torch
            >>> import torch.distributed as dist
            >>> from gradmgr import GradManager
            >>> from gradmgr.distributed import free_port, make_allreduce_cb
            >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
            ...                         rank=0, world_size=1)
            >>> w = torch.zeros(2, requires_grad=True)
            >>> cb = make_allreduce_cb()
            >>> gm = GradManager().attach(w, callbacks=[cb])
            >>> with cb.no_sync():
            ...     with gm:
            ...         gm.backward(w.sum())       # this rank's own, not reduced
            >>> with gm:
            ...     gm.backward(w.sum())           # reduces both micro-batches
            >>> w.grad
            tensor([2., 2.])
            >>> del gm, cb
            >>> dist.destroy_process_group()
        """
        if self._recording:
            raise RuntimeError(
                "cb.no_sync() was entered while a manager it serves is recording: it applies "
                "to recordings that start inside it, so enter it first: "
                "`with cb.no_sync(), gm:`. (A manager dropped while recording counts as "
                "recording, on every rank alike: release() a recording before dropping it.)"
            )
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def buckets(self, gm: Any) -> List[Any]:
        """The current bucket plan for ``gm`` (for inspection), or [] before the first step.
        On the reducer's path, torch's reducer re-forms the buckets in the order gradients
        became ready after the first synced step, as DDP does; this stays the plan."""
        synchronizer = self._synchronizers.get(gm)
        plan = None if synchronizer is None else synchronizer.plan
        return [] if plan is None else list(plan.buckets)

    def path(self, gm: Any) -> Optional[str]:
        """How ``gm``'s plain backwards are reduced now: ``"reducer"`` (the framework's own,
        see ``native``), ``"buckets"`` (gradmgr's), or None before the first recording."""
        synchronizer = self._synchronizers.get(gm)
        if synchronizer is None or synchronizer.plan is None:
            return None
        return "reducer" if synchronizer.on_reducer else "buckets"

    def transport_of(self, gm: Any) -> Optional[Transport]:
        """The transport reducing ``gm``'s gradients, or None before the first recording."""
        synchronizer = self._synchronizers.get(gm)
        return None if synchronizer is None else synchronizer.transport


class _Hooks:
    """What a synchronizer registers with its manager; holds both weakly (the manager holds
    these functions, and the callback the synchronizer). Also the token of the manager's
    recording in progress in its callback's ``recording`` (entered at record, left at
    release)."""

    __slots__ = ("_synchronizer", "_gm", "_recording")

    def __init__(self, synchronizer: Synchronizer, gm: Any,
                 recording: Dict[_Hooks, None]) -> None:
        self._synchronizer, self._gm = weakref.ref(synchronizer), weakref.ref(gm)
        self._recording = recording

    def _both(self) -> tuple:
        return self._synchronizer(), self._gm()

    def record(self) -> None:
        self._recording[self] = None
        synchronizer, gm = self._both()
        if synchronizer is not None and gm is not None:
            with synchronizer.lock:
                synchronizer.prepare(gm, at_record=True)

    def flush(self) -> None:
        synchronizer, gm = self._both()
        if synchronizer is not None and gm is not None:
            synchronizer.flush(gm)

    def abort(self) -> None:
        synchronizer, gm = self._both()
        if synchronizer is not None and gm is not None:
            synchronizer.abort(gm)

    def release(self, backward_ran: bool) -> None:
        self._recording.pop(self, None)
        synchronizer, gm = self._both()
        if synchronizer is not None and gm is not None and not backward_ran:
            synchronizer.abandon(gm)

    def delegate(self) -> Any:
        synchronizer, gm = self._both()
        return None if synchronizer is None or gm is None else delegate(synchronizer, gm)


class ReduceScatterCallback(AllreduceCallback):
    """Sharded data parallelism (ZeRO-2's gradients): like :class:`AllreduceCallback`, but each
    bucket is reduce-scattered as soon as it is full, so that each rank keeps only its slice of
    the reduced gradients (about 1/world of them) and the full-size gradients are freed as
    soon as their bucket has gone out. After a synced backward ``.grad`` holds no values: None,
    or on PyTorch a stand-in through which ``torch.nn.utils.clip_grad_norm_`` clips the slices
    (see :mod:`gradmgr.distributed.sharded.shard_grads`); the slices are what
    :class:`gradmgr.distributed.ShardedOptimizer` steps. ``no_sync`` steps accumulate
    into ``.grad`` locally, as with the allreduce callback; the next synced step
    reduce-scatters what ``.grad`` holds plus its own gradient.

    Everything else is the allreduce callback's: the plan and its check across ranks, frozen
    tensors left out, the initial broadcast, unused tensors, a failed or skipped step on one
    rank raising :class:`gradmgr.distributed.RankFailedError` on the others. It always uses
    gradmgr's buckets (``native`` does not apply), and needs a transport with
    ``reduce_scatter_async`` and ``all_gather_async`` (the backends' own have them).

    Example:
        Here a process group of one rank (which keeps all of every gradient); under
        ``torchrun`` every rank runs the same lines:

        >>> import torch
        >>> import torch.distributed as dist
        >>> from gradmgr import GradManager
        >>> from gradmgr.distributed import ShardedOptimizer, free_port, make_reduce_scatter_cb
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> torch.nn.init.ones_(model.weight)
        Parameter containing:
        tensor([[1., 1.]], requires_grad=True)
        >>> cb = make_reduce_scatter_cb("mean")
        >>> gm = GradManager().attach(model.parameters(), callbacks=[cb])
        >>> opt = ShardedOptimizer(gm, torch.optim.SGD, lr=0.5)
        >>> with gm:
        ...     gm.backward(model(torch.ones(1, 2)).sum())
        >>> opt.step()
        >>> model.weight
        Parameter containing:
        tensor([[0.5000, 0.5000]], requires_grad=True)
        >>> del opt, gm, cb  # before the group goes
        >>> dist.destroy_process_group()
    """

    DEFAULT_BUCKET_BYTES = 16 * 2**20
    """Smaller than the allreduce path's: a sharded backward's transient memory is the two
    bucket buffers that serve it (one in flight, one filling)."""

    def _check_comm_hook(self, hook: Any, state: Any, reduce: str,
                         compression: Optional[str]) -> None:
        if hook is not None:
            raise ValueError(
                "comm_hook= does not apply to sharded data parallelism (shard=True, a "
                "reduce-scatter callback): DDP's hooks return a whole allreduced bucket, "
                "where each rank keeps only its slice here. Use compression='fp16' or "
                "'bf16' there, or shard=False to keep the hook")
        super()._check_comm_hook(hook, state, reduce, compression)

    def _shards_for(self, backend: Any) -> Optional[GradientShards]:
        return GradientShards(backend.tensor_ops(), StandIns)



def make_reduce_scatter_cb(
    reduce: Reduce = "mean",
    group: Any = None,
    bucket_bytes: Optional[int] = None,
    compression: Optional[Compression] = None,
    transport: TransportSpec = None,
    **options: Any,
) -> ReduceScatterCallback:
    """A sharded data-parallel callback; see :class:`ReduceScatterCallback` (``options``:
    ``broadcast``, ``src``, ``verify``, ``names``).

    Example:
        >>> cb = make_reduce_scatter_cb("mean")
        >>> cb.reduce
        'mean'
    """
    options["native"] = False
    return ReduceScatterCallback(reduce, group, bucket_bytes, compression, transport, **options)


def make_allreduce_cb(
    reduce: Reduce = "mean",
    group: Any = None,
    bucket_bytes: Optional[int] = None,
    compression: Optional[Compression] = None,
    transport: TransportSpec = None,
    **options: Any,
) -> AllreduceCallback:
    """A data-parallel allreduce callback; see :class:`AllreduceCallback` (``options``:
    ``broadcast``, ``src``, ``verify``, ``native``, ``names``, ``comm_hook``, ``comm_state``).

    Example:
        >>> cb = make_allreduce_cb("mean", bucket_bytes=4 * 2**20)
        >>> cb.reduce, cb.bucket_bytes
        ('mean', 4194304)
    """
    return AllreduceCallback(reduce, group, bucket_bytes, compression, transport, **options)


__all__: List[str] = ["AllreduceCallback", "ReduceScatterCallback", "make_allreduce_cb",
                      "make_reduce_scatter_cb"]
