"""DDP's communication hooks (``hook(state, bucket) -> torch.futures.Future[Tensor]``, as
``DistributedDataParallel.register_comm_hook`` takes them) on both data-parallel paths.

What the hook must not see: gradmgr's used-flags (one per tensor, then the "a rank failed"
marker) travel in a bucket's buffer, on gradmgr's buckets at its end, on torch's reducer at the
start of the bucket that holds them. A hook that compresses, quantizes or feeds back an error
(PowerSGD adds last step's error to the whole buffer) would change them, and a flag read
wrongly makes an unused tensor's ``.grad`` zeros, or a step look failed. So the hook is given
the bucket without them (:class:`HookBucket`, with the ``GradBucket`` methods torch's hooks
call), and the flags are summed by one plain allreduce of their own, launched once the hook's
future is done (on torch's reducer: every hook future of the step), with the failure marker
set where a hook failed, so that every other rank learns of it.

As with DDP, the hook receives the local gradients undivided and returns the reduced buffer:
torch's hooks divide by the world size themselves.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist


class HookBucket:
    """What a hook gets for one bucket: ``torch.distributed.GradBucket``'s methods (that class
    cannot be made from Python) over the bucket's gradients, flags left out."""

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_last")

    def __init__(self, index: int, buffer: torch.Tensor, gradients: List[torch.Tensor],
                 parameters: Callable[[], List[torch.Tensor]], last: bool) -> None:
        self._index, self._buffer, self._gradients = index, buffer, gradients
        self._parameters, self._last = parameters, last

    def index(self) -> int:
        """The bucket's index (PowerSGD keys its per-bucket state by it)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The bucket's gradients as one flat tensor (a view: writing it writes the bucket)."""
        return self._buffer

    def gradients(self) -> List[torch.Tensor]:
        """Each parameter's gradient, a view into :meth:`buffer`, in the bucket's order."""
        return self._gradients

    def parameters(self) -> List[torch.Tensor]:
        """The parameters, in the order of :meth:`gradients`."""
        return self._parameters()

    def is_last(self) -> bool:
        """The last bucket of the step (PowerSGD counts its iterations there)."""
        return self._last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Write ``tensor`` into the bucket (a ``GradBucket`` replaces its buffer by it)."""
        self._buffer.copy_(tensor)


class TorchCommHook:
    """A user's ``(hook, state)``, as :meth:`TorchOps.comm_hook` hands it to the core."""

    def __init__(self, hook: Callable, state: Any) -> None:
        self.hook, self.state = hook, state

    def describe(self) -> str:
        """The hook's name, compared across ranks with the plan (ranks with different hooks
        would pair different collectives)."""
        hook = self.hook
        return getattr(hook, "__qualname__", None) or type(hook).__qualname__

    # ------------------------------------------------------------------ gradmgr's buckets
    def launch(self, flat: torch.Tensor, bucket: Any, last: bool, transport: Any,
               parameters: Callable[[], List[torch.Tensor]]) -> HookWork:
        """Start ``hook`` on one of gradmgr's buckets (the values first, the flags after
        ``bucket.numel``); the handle's ``wait()`` returns ``flat`` reduced. A hook that
        raises is not called again: its error waits for ``wait()`` (see :class:`HookWork`)."""
        _refuse_racing(self, bucket.index, last)
        numel = bucket.numel
        data = flat[:numel]
        gradients = [data.narrow(0, bucket.offsets[slot], bucket.sizes[slot])
                     .view(bucket.shapes[slot]) for slot in range(len(bucket.sizes))]
        try:
            future = _call(self, HookBucket(bucket.index, data, gradients, parameters, last))
        except Exception as error:  # noqa: BLE001 - reported by wait(), after the flags
            return HookWork(None, error, flat, numel, transport)
        return HookWork(future, None, flat, numel, transport)

    # ------------------------------------------------------------------ torch's reducer
    def for_reducer(self, flags: torch.Tensor, group: Any) -> Callable:
        """The hook to register on a C++ ``Reducer`` whose parameters include ``flags``: a
        bucket without them goes to the hook as it is (DDP's very bucket); the one with them
        goes without them, and their allreduce goes out once every hook future of the step is
        done (see :class:`_ReducerHook`)."""
        return _ReducerHook(self, flags, group)


class HookWork:
    """The hook's future and the flags' allreduce on one of gradmgr's buckets (a
    :class:`gradmgr.distributed.contract.Handle`).

    The flags go out once the hook's future is done (or the hook raised), with the failure
    marker set where it failed here, so that every other rank learns of it and raises
    :class:`RankFailedError` (a failure in a future's ``.then()`` on one rank only, too),
    while this rank raises the hook's error. The synchronizer waits for its buckets in plan
    order, so the flags' allreduces pair alike on every rank."""

    __slots__ = ("_future", "_error", "_flat", "_numel", "_transport", "_done")

    def __init__(self, future: Any, error: Optional[BaseException], flat: torch.Tensor,
                 numel: int, transport: Any) -> None:
        self._future, self._error, self._flat, self._numel = future, error, flat, numel
        self._transport = transport
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            self._done = True
            result: Optional[torch.Tensor] = None
            if self._error is None:
                try:
                    result = _value(self._future.wait())
                    _check_shape(result, self._numel)
                except Exception as error:  # noqa: BLE001 - raised below, after the flags
                    self._error = error
            if self._error is not None:
                with torch.no_grad():
                    self._flat[-1].fill_(1)  # the failure marker (see BucketBuffer.finish)
            self._transport.allreduce_async(self._flat[self._numel:]).wait()
            if result is not None and self._error is None:
                _write_back(self._flat[:self._numel], result)
        if self._error is not None:
            raise self._error
        return self._flat


class _ReducerHook:
    """``hook(state, bucket)`` as the C++ reducer calls it (see :meth:`TorchCommHook.
    for_reducer`).

    The reducer launches its buckets in index order, the flags' last; their allreduce waits
    for every hook future of the step and carries the failure marker where one failed here,
    so that every other rank raises :class:`RankFailedError` (a ``.then()`` callback that
    fails on one rank only, too). Until then no bucket's future fails: the reducer waits for
    them in order at the end of the backward, and an earlier bucket's error would end this
    rank's backward with the flags' allreduce still to go out (from a callback thread, next
    to the next step's collectives: unpaired). The flags' bucket's future raises the step's
    first error once the flags are reduced."""

    __slots__ = ("_hook", "_flags", "_group", "_error", "_pending", "__qualname__",
                 "__name__")

    def __init__(self, hook: TorchCommHook, flags: torch.Tensor, group: Any) -> None:
        self._hook, self._flags, self._group = hook, flags, group
        self._error: Optional[BaseException] = None  # what the step raised
        self._pending: List[_Settled] = []  # this step's earlier buckets
        self.__qualname__ = self.__name__ = hook.describe()

    def take_error(self) -> Optional[BaseException]:
        """What the step's hook raised (or a result of the wrong shape): torch raises it
        wrapped in a RuntimeError ("Got the following error when running the callback"),
        and the backward should raise it as it is, as on gradmgr's buckets."""
        error, self._error = self._error, None
        return error

    def begin(self) -> None:
        """A synced step begins: what a backward that failed midway left is dropped."""
        self._pending, self._error = [], None

    def __call__(self, state: Any, bucket: Any) -> Any:
        _refuse_racing(self._hook, bucket.index(), bucket.is_last())
        parameters = bucket.parameters()
        position = _position(parameters, self._flags)
        buffer = bucket.buffer()
        if position is None:  # DDP's very bucket
            settled = _Settled(self._hook, bucket, buffer)
            self._pending.append(settled)
            return settled.future
        gradients = bucket.gradients()
        flags = gradients[position]
        start = flags.storage_offset() - buffer.storage_offset()
        stop = start + flags.numel()
        data = _without(buffer, start, stop)
        others = [i for i in range(len(gradients)) if i != position]
        views = [_moved(data, gradients[i], buffer, start, stop) for i in others]
        rest = [parameters[i] for i in others]
        hooked = HookBucket(bucket.index(), data, views, lambda: rest, bucket.is_last())
        steps = self._pending + [_Settled(self._hook, hooked, data)]
        self._pending = []
        return _flags_after(steps, buffer, start, stop, self._group, self._record)

    def _record(self, error: BaseException) -> None:
        self._error = error


class _Settled:
    """The hook called on one bucket; :attr:`future` never fails: it gives the reduced
    buffer, or, where the hook failed (the step is dropped then), ``buffer`` as it is, the
    error in :attr:`error`. The hook is called once, also when it raises."""

    __slots__ = ("value", "error", "future")

    def __init__(self, hook: TorchCommHook, bucket: Any, buffer: torch.Tensor) -> None:
        self.value: torch.Tensor = buffer
        self.error: Optional[BaseException] = None
        try:
            future = _call(hook, bucket)
        except Exception as error:  # noqa: BLE001 - raised after the flags (_flags_after)
            self.error = error
            self.future = _future(buffer)
            self.future.set_result(buffer)
            return

        def settle(done: Any) -> torch.Tensor:
            try:
                value = _value(done.value())
                _check_shape(value, buffer.numel())
            except Exception as error:  # noqa: BLE001 - as above
                self.error = error
                return buffer
            self.value = value
            return value

        self.future = future.then(settle)


def _future(like: torch.Tensor) -> Any:
    """A future whose value may be ``like``'s kind of tensor (a CUDA one names its device)."""
    if like.device.type == "cpu":
        return torch.futures.Future()
    return torch.futures.Future(devices=[like.device])


def _flags_after(steps: List[_Settled], buffer: torch.Tensor, start: int, stop: int,
                 group: Any, record: Callable[[BaseException], None]) -> Any:
    """The future the reducer gets for the flags' bucket: once every hook future of the step
    (``steps``, the flags' bucket's last) is done, the flags (``buffer[start:stop]``) are
    allreduced, their last element, the failure marker, set where one failed; then it gives
    ``buffer`` with the hook's result put back, or fails with the step's first error."""
    done, failed = _future(buffer), []

    def fail(error: BaseException) -> None:
        record(error)
        failed.append(error)
        done.set_result(buffer)

    def outcome(_: Any) -> torch.Tensor:
        # Raised in a callback, the error fails the future in C++ (the reducer then raises);
        # set_exception would make it the future's value, kept (its traceback, the frames
        # of the step, with them) as long as the reducer keeps the future.
        if failed:
            raise failed[0]
        return buffer

    def finish(flags: Any, error: Optional[BaseException]) -> None:
        try:
            flags.value()  # raises what the flags' allreduce raised
            if error is None:
                _put_back(buffer, start, stop, steps[-1].value)
        except BaseException as failure:  # noqa: BLE001 - the reducer must not wait forever
            error = failure
        if error is None:
            done.set_result(buffer)
        else:
            fail(error)

    def send(_: Any) -> None:
        try:
            error = next((s.error for s in steps if s.error is not None), None)
            flags = buffer[start:stop]
            if error is not None:
                with torch.no_grad():
                    flags[-1].fill_(1)  # the failure marker (see TorchReducer.finish)
            work = dist.all_reduce(flags, group=group, async_op=True)
            work.get_future().then(lambda done: finish(done, error))
        except BaseException as failure:  # noqa: BLE001 - as above
            fail(failure)

    result = done.then(outcome)
    torch.futures.collect_all([s.future for s in steps]).then(send)
    return result


def _refuse_racing(hook: TorchCommHook, index: int, last: bool) -> None:
    """PowerSGD's future callbacks launch collectives (from gloo's threads) while the next
    bucket's go out (from the backward's): over gloo the ranks pair them differently, and
    the step aborts inside gloo (DDP's hangs). Refused at the first of several buckets,
    before anything is launched, alike on every rank."""
    if index != 0 or last:
        return
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    state = hook.state
    if isinstance(state, PowerSGDState) and dist.get_backend(state.process_group) == "gloo":
        raise ValueError(
            f"comm_hook {hook.describe()} over gloo with more than one bucket: PowerSGD "
            "launches collectives from its future callbacks while the next bucket's go out, "
            "and gloo pairs them differently on the ranks (DDP hangs there). Make one bucket "
            "(bucket_bytes= at least the size of all gradients), or use NCCL"
        )


def _call(hook: TorchCommHook, bucket: Any) -> Any:
    future = hook.hook(hook.state, bucket)
    if not all(callable(getattr(future, name, None)) for name in ("wait", "then", "value")):
        raise TypeError(
            f"comm_hook {hook.describe()} returned {type(future).__name__}: a communication "
            "hook returns a torch.futures.Future whose value is the reduced bucket buffer, as "
            "for DistributedDataParallel.register_comm_hook"
        )
    return future


def _value(value: Any) -> torch.Tensor:
    """A hook's future value: the tensor, or a list holding it (what ``all_reduce``'s own
    future gives)."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"a comm_hook's future gave {type(value).__name__}: it must give the reduced "
            "bucket buffer, a tensor of the shape of bucket.buffer()"
        )
    return value


def _position(parameters: Sequence[torch.Tensor], flags: torch.Tensor) -> Optional[int]:
    for i, p in enumerate(parameters):
        if p is flags:
            return i
    return None


def _without(buffer: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``buffer`` less ``[start, stop)``: a view where that is at an end (it is, as the
    reducer is laid out: see reducer.py), else a copy."""
    if start == 0:
        return buffer[stop:]
    if stop == buffer.numel():
        return buffer[:start]
    return torch.cat([buffer[:start], buffer[stop:]])


def _moved(data: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor, start: int,
           stop: int) -> torch.Tensor:
    """``grad`` (a view into ``buffer``) as the same view into ``data``, which is ``buffer``
    less ``[start, stop)``."""
    offset = grad.storage_offset() - buffer.storage_offset()
    if offset >= stop:
        offset -= stop - start
    return data.narrow(0, offset, grad.numel()).view(grad.shape)


def _write_back(target: torch.Tensor, result: torch.Tensor) -> None:
    """The hook's result into the bucket (where it is not the bucket's memory already)."""
    _check_shape(result, target.numel())
    if result.data_ptr() != target.data_ptr():
        with torch.no_grad():
            target.copy_(result)


def _check_shape(result: torch.Tensor, numel: int) -> None:
    if tuple(result.shape) != (numel,):
        raise ValueError(
            f"a comm_hook's future gave a tensor of shape {tuple(result.shape)} for a bucket "
            f"buffer of shape ({numel},): it must give the reduced buffer"
        )


def _put_back(buffer: torch.Tensor, start: int, stop: int, result: torch.Tensor) -> None:
    """The hook's result for ``buffer`` less ``[start, stop)`` into ``buffer``."""
    if start == 0 or stop == buffer.numel():
        _write_back(buffer[stop:] if start == 0 else buffer[:start], result)
        return
    _check_shape(result, buffer.numel() - (stop - start))
    with torch.no_grad():
        buffer[:start].copy_(result[:start])
        buffer[stop:].copy_(result[start:])
