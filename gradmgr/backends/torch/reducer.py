"""The allreduce callback's fast path on PyTorch: torch's own C++ ``Reducer`` (what DDP runs),
through torch.distributed's private hooks into it (``_autograd_hook``, ``_rebuild_buckets``).

A Python callback per tensor costs time per tensor, which DDP does not pay (bench/bench_ddp.py's
``native=False`` variant against DDP): its reducer hooks the gradient accumulators in C++. When
nothing else needs the per-tensor callbacks (see ``AllreduceCallback``'s ``native``), gradmgr
drives that same reducer instead: the engine accumulates into ``.grad`` as a plain
``loss.backward()`` does, the reducer's hooks copy each gradient into its bucket (divided by
the world size) and launch each full bucket, and at the end of the backward ``.grad`` becomes a
view into the reduced bucket (``gradient_as_bucket_view``), exactly as with DDP.

DDP detects unused parameters only with ``find_unused_parameters=True``, which costs a graph
walk, a collective and a per-parameter check every step. Here the reducer runs without it, and
unused parameters are found after the backward instead, from what changed in ``.grad``: one
extra member of the last bucket, a flag tensor holding 1 for each tensor that got a gradient
since the last synced step, is reduced with the gradients. Tensors that got none are marked
ready after the backward (their slot holds their ``.grad``, or zeros); a tensor no rank used
keeps its ``.grad`` as it was, as with DDP's ``find_unused_parameters=True``.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Collection, List, Optional, Sequence

import torch
import torch.distributed as dist

from gradmgr.distributed.contract import RANK_FAILED, ReducerPath
from gradmgr.distributed.errors import RankFailedError, SparseGradientError, sparse_message

from .engine import EngineAccumulates
from .grads import any_missing, any_present
from .transport import TorchTransport


def available() -> bool:
    """This torch has the reducer and the private hooks into it that this module uses."""
    reducer = getattr(dist, "Reducer", None)
    return reducer is not None and all(
        hasattr(reducer, name) for name in ("_autograd_hook", "_rebuild_buckets",
                                            "_push_all_rebuilt_params", "prepare_for_backward"))


def reducer_path(transport: Any) -> Optional[ReducerPath]:
    """The reducer path over ``transport`` where it is torch.distributed's own transport (the
    reducer talks to the process group itself) and this torch has what it needs."""
    if type(transport) is not TorchTransport or not available():
        return None
    return TorchReducerPath(transport.group)


class TorchReducerPath(EngineAccumulates):
    """When torch's reducer can take a step over (see :class:`gradmgr.distributed.contract.
    ReducerPath`): where the engine can accumulate into ``.grad`` itself
    (:class:`.engine.EngineAccumulates`). A tensor attached for its own gradient (an
    activation, or one with callbacks of its own) keeps a step here, the tape delivering it:
    on one rank alone it must not send that rank's step elsewhere, where its collectives
    would meet the other ranks' reducer's (gloo aborts)."""

    delivers_others = True

    def __init__(self, group: Any) -> None:
        self.group = group

    def build(self, plan: Any, bucket_bytes: int, first_bucket_bytes: int,
              comm_hook: Any = None) -> TorchReducer:
        return TorchReducer(plan, self.group, bucket_bytes, first_bucket_bytes, comm_hook)


class TorchReducer:
    """One torch ``Reducer`` over a bucket plan's tensors, plus the used-flags tensor.

    Holds the planned tensors strongly (the C++ reducer does), as DDP holds its module.
    """

    def __init__(self, plan: Any, group: Any, bucket_bytes: int,
                 first_bucket_bytes: int, comm_hook: Any = None) -> None:
        planned = plan.tensors()
        if any(t is None for t in planned):
            raise RuntimeError("an attached tensor died while planning its allreduce")
        # The tensors in the order their buckets go out (late layers first), and the flags
        # first in the last bucket: they always share it (it goes out only once they are
        # known) instead of making a bucket, and a collective, alone; and, at its start, a
        # communication hook gets the rest of that bucket as a view (see comm_hook.py).
        tensors = [planned[m] for bucket in plan.buckets for m in bucket.members]
        last = tensors[-1]
        # One "used" flag per tensor, then a "this rank failed" marker.
        # Padded to a multiple of 64 bytes: the hook's view of the last bucket, after the
        # flags, then starts where DDP's bucket starts, at 64-byte alignment (torch's kernels,
        # matmul's among them, may round differently on a misaligned buffer: PowerSGD's did).
        per_line = max(1, 64 // last.element_size())
        count = -(-(len(tensors) + 1) // per_line) * per_line
        self.flags = torch.zeros(count, dtype=last.dtype, device=last.device,
                                 requires_grad=True)
        self._tensors: List[torch.Tensor] = tensors  # in bucket order, as the flags are
        self.tensors: List[torch.Tensor] = planned  # in plan order (the contract's)
        at = len(tensors) - len(plan.buckets[-1].members)  # the flags' parameter index
        params = tensors[:at] + [self.flags] + tensors[at:]
        self._index = [i if i < at else i + 1 for i in range(len(tensors))]  # tensor -> param
        indices, start = [], 0
        for bucket in plan.buckets:
            indices.append([self._index[i] for i in range(start, start + len(bucket.members))])
            start += len(bucket.members)
        indices[-1].insert(0, at)
        # The group's Python object, kept until after the C++ reducer is gone (``__del__``):
        # the group's last reference must not die in the reducer (see teardown.py).
        self._group = group if group is not None else dist.group.WORLD
        if self._group is None:
            raise RuntimeError("torch's reducer needs a process group: call "
                               "torch.distributed.init_process_group() first (torchrun sets "
                               "its environment)")
        self._reducer = dist.Reducer(  # type: ignore[call-arg]  # see first_bucket_bytes_cap
            params, indices, [bucket_bytes] * len(indices), self._group,
            expect_sparse_gradients=[False] * len(params), bucket_bytes_cap=bucket_bytes,
            find_unused_parameters=False, gradient_as_bucket_view=True,
            # (torch's stub spells it first_bucket_types_cap; the binding takes this name)
            first_bucket_bytes_cap=first_bucket_bytes,
        )
        # Without find_unused_parameters the reducer records the order gradients arrive in
        # until it has re-formed its buckets once (DDP's second layout, by arrival), and that
        # would put the flags, always last, in a bucket of their own. So it re-forms them now,
        # from the order given (the plan's; one broadcast, at the same plan on every rank).
        self._reducer._push_all_rebuilt_params()
        self._reducer._rebuild_buckets()
        self._hook: Any = None
        if comm_hook is not None:  # as DDP registers one (the hook divides, not the reducer)
            self._hook = comm_hook.for_reducer(self.flags, self._group)
            dist._register_comm_hook(self._reducer, comm_hook.state, self._hook)
        self._unmarked: Sequence[int] = ()  # reducer indices: no gradient in this engine run
        self.flags.register_post_accumulate_grad_hook(_marker(weakref.ref(self)))
        # .grad (and its version) of every tensor when the current accumulation window (the
        # no_sync steps before a synced one, and that one) began; None: no window open.
        self._window: Optional[tuple] = None
        self._step: Optional[tuple] = None  # the same when this synced step began
        self.broken = False

    def __del__(self) -> None:
        # The C++ reducer first; the group's Python object (released after this) then frees
        # a destroyed group with the GIL released, where gloo's threads can finish.
        self.__dict__.pop("_reducer", None)

    def begin(self, sync: bool) -> None:
        """Before a backward's engine run."""
        if self._window is None:
            self._window = self._step = self._open_window()
        elif sync:
            self._step = _snapshot(self._tensors)
        if sync:
            if self._hook is not None:
                self._hook.begin()
            self._reducer.prepare_for_backward([])

    def _open_window(self) -> tuple:
        """Snapshot ``.grad``, after giving each one that is a view (into a bucket, from the
        last synced step) a copy of its own: views of one bucket share one version counter,
        so accumulating into any of them would look like a gradient for all."""
        return _snapshot(self._tensors, own_views=True)

    def used_since_window(self) -> List[int]:
        """Ids of the tensors whose ``.grad`` changed since the window opened (and close it):
        for a synced step that the Python path takes (a split backward)."""
        if self._window is None:
            return []
        unchanged = set(_unchanged(self._tensors, self._window))
        self._window = self._step = None
        return [id(t) for i, t in enumerate(self._tensors) if i not in unchanged]

    def finish(self, sync: bool, used: Collection[int] = (), failed: bool = False) -> None:
        """After the engine run: mark what got no gradient in it, and reduce the flags of
        what got one since the window opened (or is in ``used``: ids of tensors that had a
        gradient in earlier steps the Python path took). Where a rank failed (``failed``
        here, or another rank's marker), ``.grad`` is put back as it was before the step; the
        other ranks raise RankFailedError."""
        if not sync:
            return
        tensors = self._tensors
        step, window = self._step, self._window
        self._window = self._step = None
        if step is None or window is None:  # begin(sync=True) snapshots both
            raise RuntimeError("gradmgr: torch's reducer finished a synced step it never began "
                               "(an internal error: please report it with `gradmgr env`)")
        unreached = _unchanged(tensors, step)
        unused = [i for i in (unreached if window is step else _unchanged(tensors, window))
                  if id(tensors[i]) not in used]
        # A tensor no rank used keeps its .grad; the reducer reads it into the bucket, and
        # then points .grad at the bucket.
        saved = {i: tensors[i].grad for i in unused}
        flags = torch.ones_like(self.flags, requires_grad=False)  # (the padding: ones too)
        if unused:
            flags[unused] = 0
        if not failed:
            flags[-1] = 0
        self._unmarked = [self._index[i] for i in unreached]
        self.flags.grad = None
        try:
            # A backward of its own: the reducer launches the last bucket and finalizes (writes
            # .grad) at the end of the engine's graph task, as it does at the end of DDP's.
            _backward_of_one_leaf(self.flags, flags)
        except BaseException as error:
            # (a comm hook's future failed) .grad as before the step, as on gradmgr's buckets
            for tensor, old in zip(tensors, step[0]):
                tensor.grad = old
            original = None if self._hook is None else self._hook.take_error()
            if original is None or not isinstance(error, RuntimeError):
                raise
            raise original from error  # the hook's own error (ValueError...), not torch's
        finally:
            self._unmarked = ()
        reduced = self.flags.grad
        if reduced is None:  # the reducer's backward writes it, or raised
            raise RuntimeError("gradmgr: torch's reducer wrote no flags (an internal error)")
        if failed or reduced[-1].item() != 0:  # (a host read: the step must not be used)
            for tensor, old in zip(tensors, step[0]):
                tensor.grad = old
            if failed:
                return
            raise RankFailedError(RANK_FAILED)
        if unused:
            used_anywhere = reduced.tolist()
            for i in unused:
                if not used_anywhere[i]:
                    tensors[i].grad = saved[i]

    def fail_step(self, used: Collection[int] = ()) -> None:
        """A synced step with no backward on this rank: take part in its collectives with the
        failure marker set (``.grad`` stays as it is)."""
        self.begin(True)
        self.finish(True, used, failed=True)

    def shadow(self) -> bool:
        """A joined rank's part of a synced step (uneven inputs, as DDP's join hook does it):
        every bucket of zeros, the flags among them (no tensor used, no failure here), through
        the reducer's own collectives in its bucket order; the sums are dropped. Returns
        whether the step completed (no rank's failure marker set: the others skip it)."""
        self.used_since_window()  # a window this rank opened before it joined is over
        buckets = self._reducer._get_zeros_like_grad_buckets()
        futures = [self._reducer._run_comm_hook(bucket) for bucket in buckets]
        for future in futures:
            future.wait()
        end = 0  # where the flags end in the last bucket: the failure marker just before
        for param in buckets[-1].parameters():
            end += param.numel()
            if param is self.flags:
                break
        return buckets[-1].buffer()[end - 1].item() == 0

    def abort(self) -> None:
        """The backward failed midway: this reducer's step can never finish. Raises a clear
        error where the cause was a sparse gradient (the reducer's own error does not say)."""
        self.broken = True
        step, self._window, self._step = self._step, None, None
        sparse = [t for t in self._tensors if t.grad is not None and t.grad.is_sparse]
        if step is not None:  # what had no .grad has none again (the others keep local sums)
            for tensor, old in zip(self._tensors, step[0]):
                if old is None:
                    tensor.grad = None
        if sparse:
            raise SparseGradientError(sparse_message(sparse[0].shape))


def _backward_of_one_leaf(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """``torch.autograd.backward(leaf, grad)`` without its argument checks (what they cost a
    step: bench/bench_torch.py's ``bare`` variant against ``plain``)."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        torch.autograd.backward(leaf, grad)
    else:
        run((leaf,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def _snapshot(tensors: Sequence[torch.Tensor], own_views: bool = False) -> tuple:
    """``(.grad of each tensor, its version)``; versions None when no tensor has a ``.grad``.
    ``own_views``: first replace each ``.grad`` that is a view by a copy of its own."""
    grads = list(map(_GRAD, tensors))
    if not any_present(grads):
        return grads, None  # the usual step (after zero_grad(set_to_none=True))
    if own_views:
        for i, old in enumerate(grads):
            if old is not None and old._is_view():
                # (never old.data = ...: the reducer's own bucket view is the same tensor)
                grads[i] = tensors[i].grad = old.clone()
    return grads, [-1 if g is None else g._version for g in grads]


def _unchanged(tensors: Sequence[torch.Tensor], snapshot: tuple) -> List[int]:
    """Positions of the tensors whose ``.grad`` is the same object, unmodified, as then."""
    before, versions = snapshot
    if versions is None:
        grads = list(map(_GRAD, tensors))
        if not any_missing(grads):
            return []  # the usual step: every tensor got a gradient
        return [i for i, g in enumerate(grads) if g is None]
    return [i for i, (g, old) in enumerate(zip(map(_GRAD, tensors), before))
            if g is old and (old is None or old._version == versions[i])]


_GRAD = operator.attrgetter("grad")


def _marker(reducer_ref: weakref.ref) -> Any:
    """The flags' post-accumulate hook: marks the tensors that got no gradient ready, inside
    the flags' backward, just before the reducer's own hook marks the flags (and with them the
    last bucket)."""

    def mark_unreached(flags: torch.Tensor) -> None:
        owner = reducer_ref()
        if owner is not None:
            mark = owner._reducer._autograd_hook
            for i in owner._unmarked:
                _mark_once(mark, i)

    return mark_unreached


def _mark_once(mark: Any, index: int) -> None:
    """Mark ``index`` ready unless the reducer's own hook already did: a tensor whose
    ``.grad`` did not change may still have been reached, by a backward that gave it no
    gradient (a custom ``autograd.Function`` returning None for it). The engine then ran its
    accumulator, and the reducer's hook with it, which put ``.grad`` (or zeros) in its bucket
    slot, as marking it here would. Only that tells the two apart, so the reducer's refusal
    to mark it twice (raised before it changes anything) is the answer; any other error is
    the transport's, and propagates."""
    try:
        mark(index)
    except RuntimeError as error:
        if "ready only once" not in str(error):
            raise
