"""What a backend hands out for data parallelism: the adapter contract of ``gradmgr.distributed``.

:meth:`gradmgr.Backend.tensor_ops` returns a :class:`TensorOps` (the handful of tensor operations
bucketing needs) and :meth:`gradmgr.Backend.transport` a :class:`Transport` (the collectives).
The core (planning, buckets, the cross-rank check, the callback's state machine) talks to a
framework only through these, so a new engine, or a test double, plugs in by implementing them.
Here: :class:`TensorOps` and what it hands out for the model ``data_parallel`` wraps (the watch
of its forwards, :class:`ModuleWatch`, with :class:`ArmedHooks`, the part every backend's watch
shares; the context for uneven inputs, :class:`JoinSupport`; the framework's words for the
core's messages, :class:`Idioms`). What it hands out for reducing
(:class:`BucketBuffer`, :class:`ReducerPath`, ...) is in :mod:`gradmgr.distributed.reducing`,
the collectives (:class:`Transport`, :class:`Handle`, :class:`Done`) in
:mod:`gradmgr.distributed.collectives`; both are importable from here too. None of the three
imports anything of gradmgr: the backends implement them, the core uses them;
:class:`Done` and :class:`ArmedHooks` are the pieces both use as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from .collectives import Done, Handle, ShardingTransport, Transport
from .reducing import (
    RANK_FAILED,
    BucketBuffer,
    CommHook,
    PostBackwardPath,
    Reducer,
    ReducerPath,
)

_COMPRESSED = {"fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Idioms:
    """How a framework's users write what the core's messages name (:meth:`TensorOps.idioms`),
    so that a message speaks their framework (``{idioms.no_grad}`` in its text). Each
    defaults to a description that fits any framework, for what a framework has not (or a
    backend does not name)."""

    no_grad: str = "the framework's no-gradient context"
    """The context that runs a forward without gradients: ``"torch.no_grad()"``."""
    grad_call: str = "the framework's functional gradient call"
    """The call that returns gradients without writing ``.grad``: ``"torch.autograd.grad"``."""
    wrapper: str = "the framework's data-parallel wrapper"
    """The framework's own data-parallel wrapper, as its users call it: ``"DDP"``."""
    save: str = "save"
    """The function that writes an object to a file, as in ``save(state, path)``:
    ``"torch.save"``."""


NEUTRAL_IDIOMS = Idioms()
"""What a backend that names no idioms of its own gets: descriptions that fit any framework."""


class ModuleWatch(Protocol):
    """The watch of one module's forwards that :meth:`TensorOps.watch_forwards` returns, as
    ``data_parallel``'s steps use it."""

    @property
    def armed(self) -> bool:
        """A forward with gradients enabled outside a recording armed the refusal of a
        backward that writes the parameters' ``.grad``."""

    def disarm(self) -> None:
        """Drop what a forward armed (a recording starts: its backward is the manager's)."""

    def changed(self) -> Optional[str]:
        """The name of a parameter the module did not have when watched (a layer replaced
        since), or None: none, or the framework's watch does not look."""

    def remove(self) -> None:
        """Take the watch's hooks off the module (its manager is gone)."""


class ArmedHooks:
    """What every backend's :class:`ModuleWatch` shares: the parameter hooks (each with
    ``remove()``) a forward armed, until :meth:`disarm` (``data_parallel``'s step calls it
    when a recording starts)."""

    def __init__(self) -> None:
        self._armed: List[Any] = []

    @property
    def armed(self) -> bool:
        return bool(self._armed)

    def disarm(self) -> None:
        armed, self._armed = self._armed, []
        for hook in armed:
            hook.remove()


class JoinSupport(Protocol):
    """The framework's context for uneven inputs (on PyTorch, torch's
    ``torch.distributed.algorithms.Join``), which the manager ``data_parallel`` returns and a
    :class:`gradmgr.distributed.ShardedOptimizer` take part in (see
    :mod:`gradmgr.distributed.join.joining`)."""

    def disabled_config(self) -> Any:
        """What a joinable holds outside the context (its ``_join_config``: ``enable``,
        ``throw_on_early_termination``, ``is_first_joinable``)."""

    def notify(self, joinable: Any) -> Any:
        """Tell the context that this rank has not joined (the first joinable's collective;
        raises where ``throw_on_early_termination`` and a rank has joined)."""

    def context(self, joinables: List[Any], enable: bool, throw_on_early_termination: bool,
                **kwargs: Any) -> Any:
        """The context manager over ``joinables``."""

    def device(self, like: Any) -> Any:
        """The device the context's own collectives use."""

    def process_group(self, group: Any) -> Any:
        """The process group the context's own collectives use (``group``, None: the
        default one)."""


class TensorOps:
    """Framework-specific tensor operations for data parallelism (one instance per backend).

    Subclasses implement the methods that raise ``NotImplementedError``; the others have
    defaults that fit a framework whose tensors are values with a ``.grad`` attribute.

    Example:
        >>> import torch
        >>> from gradmgr import get_backend
        >>> ops = get_backend("torch").tensor_ops()
        >>> ops.key(torch.zeros(2)), ops.nbytes(torch.zeros(2))
        (('float32', 'cpu'), 8)
    """

    def key(self, tensor: Any) -> Tuple[str, str]:
        """``(dtype name, device name)``: gradients sharing a key share a bucket."""
        raise NotImplementedError

    def optimizer_base(self) -> Optional[type]:
        """A class ``ShardedOptimizer`` also derives from on this framework (its optimizer
        base, so that the framework's learning-rate schedulers accept it), or None."""
        return None

    def not_elementwise(self, optimizer_class: Any) -> Optional[str]:
        """Why ``optimizer_class``, one of this framework's known to compute a parameter's
        step from more than its own elements (a norm over the whole parameter), cannot step
        slices of parameters; None where it is not one of those (the default)."""
        return None

    def shape(self, tensor: Any) -> Tuple[int, ...]:
        """The tensor's shape as a tuple of ints."""
        return tuple(int(n) for n in tensor.shape)

    def nbytes(self, tensor: Any) -> int:
        """The tensor's size in bytes."""
        raise NotImplementedError

    def dtype_name(self, tensor: Any) -> str:
        """The dtype's name (``"float32"``), as in :meth:`key`."""
        return self.key(tensor)[0]

    def trainable(self, tensor: Any) -> bool:
        """Whether the tensor gets gradients now (a frozen one is left out of the buckets)."""
        return True

    def all_trainable(self, tensors: Sequence[Any]) -> bool:
        """Whether every tensor is alive (not None) and trainable; checked at every recording,
        so a framework whose tensors can be frozen should make it cheap."""
        return all(t is not None and self.trainable(t) for t in tensors)

    def dtypes(self, tensors: Sequence[Any]) -> Sequence[Any]:
        """The tensors' dtypes, in order, as values that compare equal while every dtype is
        unchanged (the tensors are alive: :meth:`all_trainable` was asked first). Compared
        at every recording with those at planning, so that a dtype changed in place
        (``module.double()`` on PyTorch keeps the parameter objects) makes a new plan: a
        framework whose tensors can do that should make it one cheap pass. The default, for
        tensors that cannot: nothing to compare."""
        return ()

    def any_trainable(self, tensors: Sequence[Any]) -> bool:
        """Whether some tensor (None: died, skipped) is trainable now."""
        return any(t is not None and self.trainable(t) for t in tensors)

    def is_sparse(self, grad: Any) -> bool:
        """A sparse gradient, which the buckets cannot reduce."""
        return False

    def local_grad(self, tensor: Any) -> Any:
        """What ``tensor.grad`` holds (None if nothing)."""
        return tensor.grad

    def grad_snapshot(self, tensors: Sequence[Any]) -> Any:
        """What the tensors' ``.grad`` hold now, for :meth:`grads_changed`."""
        return [self.local_grad(t) for t in tensors]

    def grads_changed(self, tensors: Sequence[Any], snapshot: Any) -> bool:
        """Whether some tensor's ``.grad`` changed since :meth:`grad_snapshot` (None: no
        snapshot, False). The default suits frameworks whose tensors are values."""
        return snapshot is not None and any(
            self.local_grad(t) is not old for t, old in zip(tensors, snapshot))

    def new_buffer(self, bucket: Any, like: Any,
                   factor: Optional[float] = None) -> BucketBuffer:
        """A buffer for one step of ``bucket``, with the dtype and device of ``like``; where
        the framework reuses memory, it may take the start of ``bucket.spare`` (a buffer of
        that dtype and device, at least the size needed) if nothing else holds it. With a
        ``factor`` (``1/world`` for a mean; None: none), the finished buffer holds the
        members' values times ``factor``, flags and failure marker included, exactly (bit for
        bit) as :meth:`scale` of the whole finished buffer would give them: a backend that
        copies each gradient in can scale it in the same pass, as DDP's reducer does."""
        raise NotImplementedError

    def unpack(self, flat: Any, bucket: Any) -> Tuple[List[Any], Any]:
        """The members' parts of a reduced buffer, in slot order (views where the framework
        has them), and the flags (the failure marker last). This default slices and reshapes,
        which every framework's tensors do; a backend with a cheaper split overrides it."""
        parts: List[Any] = [None] * len(bucket.sizes)
        for slot in bucket.layout:
            start = bucket.offsets[slot]
            parts[slot] = flat[start:start + bucket.sizes[slot]].reshape(bucket.shapes[slot])
        return parts, flat[bucket.numel:]

    def flag(self, flags: Any, i: int) -> float:
        """The i-th flag as a Python float (on a GPU: a device-to-host copy)."""
        raise NotImplementedError

    def failed_somewhere(self, flags: Any) -> bool:
        """Whether some rank sent this buffer with its failure marker set: the sum over ranks
        of 0s and (scaled) 1s is 0 exactly when none did, in any wire dtype."""
        return self.flag(flags, -1) != 0

    def scale(self, flat: Any, factor: float) -> Any:
        """``flat * factor`` (in place where ``flat`` is a fresh buffer)."""
        return flat * factor

    def cast(self, flat: Any, dtype: str) -> Any:
        """``flat`` in the dtype called ``dtype`` (``"float16"``, ``"float32"``, ...)."""
        raise NotImplementedError

    def compress(self, flat: Any, compression: str) -> Any:
        """``flat`` in the wire dtype of ``compression`` (``"fp16"`` or ``"bf16"``)."""
        return self.cast(flat, _COMPRESSED[compression])

    def vector(self, values: Sequence[float], like: Any) -> Any:
        """A float32 vector on ``like``'s device (for the small cross-rank collectives); on
        the host where ``like`` is None (asked for by a transport with ``on_host = True``)."""
        raise NotImplementedError

    def values(self, vector: Any) -> List[float]:
        """A :meth:`vector`'s values as Python floats (on a GPU: a device-to-host copy)."""
        raise NotImplementedError

    def flatten(self, tensors: Sequence[Any]) -> Any:
        """The tensors' values in one 1-D buffer (for a broadcast)."""
        raise NotImplementedError

    def assign(self, tensors: Sequence[Any], flat: Any) -> None:
        """Overwrite ``tensors`` in place with the values of a :meth:`flatten`ed buffer."""
        raise NotImplementedError

    # ------------------------------------------------------------- sharding (ZeRO-2)
    def is_tensor(self, value: Any) -> bool:
        """A tensor of this framework (optimizer state may also hold Python numbers)."""
        raise NotImplementedError

    def numel(self, tensor: Any) -> int:
        """The number of elements."""
        n = 1
        for d in self.shape(tensor):
            n *= d
        return n

    def flat(self, tensor: Any) -> Any:
        """The tensor as 1-D (a view where the framework has them)."""
        return tensor.reshape(-1)

    def part(self, flat: Any, start: int, stop: Optional[int]) -> Any:
        """``flat[start:stop]`` of a 1-D tensor (a view where the framework has them)."""
        return flat[start:stop]

    def reshape(self, tensor: Any, shape: Sequence[int]) -> Any:
        """The tensor with another shape of the same number of elements."""
        return tensor.reshape(tuple(shape))

    def copy(self, tensor: Any) -> Any:
        """A copy that shares no memory with ``tensor``."""
        raise NotImplementedError

    def zeros(self, numel: int, like: Any, dtype: Optional[str] = None) -> Any:
        """A 1-D tensor of zeros on ``like``'s device, of ``like``'s dtype or ``dtype``."""
        raise NotImplementedError

    def padded(self, flat: Any, numel: int) -> Any:
        """``flat`` with zeros appended up to ``numel`` elements (``flat`` itself if it has
        them)."""
        have = self.numel(flat)
        if have == numel:
            return flat
        return self.flatten([flat, self.zeros(numel - have, flat)])

    def add(self, total: Any, more: Any) -> Any:
        """``total + more`` (in place where ``total`` is a tensor gradmgr owns)."""
        return total + more

    def write(self, flat: Any, start: int, values: Any) -> None:
        """``flat[start:start + len(values)] = values``, in place."""
        flat[start:start + self.numel(values)] = values

    def item(self, value: Any) -> float:
        """A one-element tensor (or a number) as a Python float."""
        return float(value)

    def sum_squares(self, tensors: Sequence[Any]) -> float:
        """The sum of the squares of every element of ``tensors`` (a host value)."""
        raise NotImplementedError

    def norm(self, tensor: Any) -> float:
        """The 2-norm of ``tensor`` as the framework's own norm computes it (a host value):
        a stand-in ``.grad`` whose whole gradient one rank holds answers exactly that."""
        return math.sqrt(self.sum_squares([tensor]))

    def segment(self, param: Any, start: int, stop: int, master_dtype: Optional[str]) -> Any:
        """What the sharded optimizer steps for ``param.flatten()[start:stop]``: a view into
        the parameter where the framework has them (the step then writes the parameter's own
        values), else a copy; in ``master_dtype`` (``"float32"`` master weights for half
        precision parameters) a copy in that dtype."""
        raise NotImplementedError

    def refresh_segment(self, segment: Any, param: Any, start: int, stop: int) -> None:
        """Before each step, make a segment that is not a view hold
        ``param.flatten()[start:stop]`` as it is now: the parameter may have changed outside
        the optimizer since the segment was made or last gathered (rank 0's values broadcast
        at the first recording, a checkpoint loaded into the model). A copy in the parameter's
        dtype takes its values; a master copy in another dtype takes them only where the
        parameter no longer holds the master's value rounded to its dtype (which the last
        gather wrote), keeping its extra precision elsewhere. The default does nothing: it
        suits an adapter whose segments are always views."""

    def param_slice(self, param: Any, start: int, stop: int) -> Any:
        """``param.flatten()[start:stop]`` as a view that writes into ``param``, or None where
        there is none (the default: the sharded optimizer then gathers through a buffer)."""
        return None

    def write_segment(self, segment: Any, target: Any) -> None:
        """Write a segment's values into ``target`` (its :meth:`param_slice`), cast to the
        target's dtype; nothing where the segment is that very memory."""
        raise NotImplementedError

    def write_part(self, param: Any, start: int, values: Any) -> None:
        """Write ``values`` into ``param.flatten()[start:start + len(values)]``, where
        :meth:`param_slice` gave no view (needed with a transport that has
        ``broadcast_async``)."""
        raise NotImplementedError

    def set_segment_grad(self, segment: Any, grad: Any) -> None:
        """Give a segment its reduced gradient (None: none), cast to the segment's dtype."""
        raise NotImplementedError

    def optimizer_state(self, optimizer: Any, param: Any) -> Dict[str, Any]:
        """The wrapped optimizer's state for one of its parameters (empty before a step)."""
        raise NotImplementedError

    def set_optimizer_state(self, optimizer: Any, param: Any, state: Dict[str, Any]) -> None:
        """Replace the wrapped optimizer's state for one of its parameters."""
        raise NotImplementedError

    def reset_optimizer_state(self, optimizer: Any, param: Any) -> None:
        """Give one of the wrapped optimizer's parameters the state it had before its first
        step (a checkpoint that holds none for it was loaded). The default leaves it empty,
        as optimizers that make their state at the first step (PyTorch's) have it."""
        self.set_optimizer_state(optimizer, param, {})

    def state_from_checkpoint(self, value: Any) -> Any:
        """One value of a saved optimizer state as the wrapped optimizer keeps it: where the
        framework's optimizers save arrays of another kind (MegEngine's ``state_dict()``
        holds numpy arrays), that array as the framework's tensor; anything else unchanged
        (the default). ValueError where it is not a whole value (torch: a ShardedTensor of
        ``get_state_dict``'s), before the optimizer changes."""
        return value

    def scalar_like_state(self, value: float, like: Any) -> Any:
        """A per-parameter scalar of optimizer state (a step count) as the framework's
        optimizers keep it."""
        return value

    # ------------------------------------------------------------- the module (data_parallel)
    def idioms(self) -> Idioms:
        """This framework's words for what the core's messages name (the refusal of a
        backward after a forward outside ``with gm:``, see :meth:`watch_forwards`; a sharded
        optimizer's checkpoint habits). The default, :data:`NEUTRAL_IDIOMS`, describes them
        in no framework's words."""
        return NEUTRAL_IDIOMS

    def wrapper_problem(self, module: Any) -> Optional[str]:
        """Why ``data_parallel(module)`` must refuse ``module`` (a phrase saying what to pass
        instead): it is the framework's own data-parallel wrapper, which would reduce every
        gradient a second time. None (the default): nothing known against it."""
        return None

    def watch_forwards(self, module: Any,
                       refusal: Callable[[], Optional[str]]) -> Optional[ModuleWatch]:
        """Watch every forward of ``module``: one run with gradients enabled inside the
        framework's own data-parallel wrapper raises at once (a second reducer); after one
        run with gradients enabled, ``refusal()`` is called, and where it returns a message,
        a backward that accumulates the gradient of the module's parameters (into ``.grad``)
        raises ``RuntimeError(message)`` before writing any (one that only returns them, as
        :attr:`Idioms.grad_call` does, passes; the watch is then ``armed``), until
        ``disarm()``. ``refusal`` is held weakly (a bound method). Returns the watch
        (a :class:`ModuleWatch`), or None (the default: the framework has no forward
        hooks)."""
        return None

    def hook_parameter_reads(self, module: Any, wait_for: Callable[[Sequence[Any]], None],
                             wait_all: Callable[[], None]) -> Any:
        """Hooks on ``module`` for a gather left behind the step: each submodule's forward
        first calls ``wait_for(its own parameters)``; the module's ``state_dict()`` and
        ``load_state_dict()`` first call ``wait_all()``. Returns the hooks (``remove()``), or
        None (the default: the framework has no module hooks)."""
        return None

    def post_backward_path(self) -> Optional[PostBackwardPath]:
        """When to reduce after the backward instead of during it, or None (the default:
        never; the framework's backwards take per-tensor hooks at no extra cost)."""
        return None

    def exchange_grads(self, tensors: Sequence[Any], grads: Sequence[Any]) -> List[Any]:
        """Give each tensor its ``grad`` (None: none) as ``.grad``, as it is (no hook runs);
        return what they held."""
        old = [self.local_grad(t) for t in tensors]
        for tensor, grad in zip(tensors, grads):
            tensor.grad = grad
        return old

    def reducer_path(self, transport: Any) -> Optional[ReducerPath]:
        """The framework's own reducer over ``transport``, or None (the default: gradmgr's
        buckets do the work)."""
        return None

    def comm_hook(self, hook: Any, state: Any) -> CommHook:
        """A communication hook (``comm_hook=`` of the allreduce callback) as this framework
        runs it. The default refuses: hooks are PyTorch DDP's."""
        raise ValueError(
            "comm_hook= takes PyTorch DDP communication hooks (hook(state, bucket) -> "
            "torch.futures.Future), and these tensors are not PyTorch's: use "
            "compression='fp16' or 'bf16', or a transport (make_allreduce_cb(transport=...))"
        )

    def join_support(self) -> Optional[JoinSupport]:
        """The framework's context for uneven inputs, or None (the default: none)."""
        return None

    def full_shard_path(self) -> Any:
        """The framework's own full sharding (``data_parallel(shard="full")``: PyTorch's
        FSDP2, see ``gradmgr.distributed.sharded.full``), or None (the default: none)."""
        return None

    def distributed_checkpoint(self) -> Any:
        """The framework's distributed checkpoints of a ``ShardedOptimizer`` (what
        :mod:`gradmgr.distributed.sharded.dcp_state` calls: ``model_state``,
        ``optimizer_state``, ``load_model``, ``load_optimizer``; and, for a plain optimizer
        over a fully sharded model, ``is_fully_sharded``, ``full_state``, ``load_full_state``),
        or None (the default)."""
        return None


__all__ = ["ArmedHooks", "BucketBuffer", "CommHook", "Done", "Handle", "Idioms", "JoinSupport",
           "ModuleWatch", "NEUTRAL_IDIOMS", "PostBackwardPath", "RANK_FAILED", "Reducer",
           "ReducerPath", "ShardingTransport", "TensorOps", "Transport"]
