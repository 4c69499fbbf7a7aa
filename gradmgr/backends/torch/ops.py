"""The tensor operations data parallelism needs on PyTorch, and its bucket buffer."""

from __future__ import annotations

import operator
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch._utils import _flatten_dense_tensors

from gradmgr.distributed.contract import Idioms, PostBackwardPath, ReducerPath, TensorOps

from .grads import any_present, storage_unshared
from .shard_grad import ShardedGradient, stand_in_grad

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DTYPE = operator.attrgetter("dtype")
_GRAD = operator.attrgetter("grad")
# torch's optimizers whose step on a slice of a parameter is not their step on the whole
_NOT_ELEMENTWISE = {
    "LBFGS": "torch.optim.LBFGS steps from dot products over all its parameters together",
    "Adafactor": "torch.optim.Adafactor scales each parameter's step by the root mean square "
                 "of that whole parameter and of its update, and factors a matrix's second "
                 "moments over its rows and columns",
}
IDIOMS = Idioms(no_grad="torch.no_grad()", grad_call="torch.autograd.grad", wrapper="DDP",
                save="torch.save")


class TorchOps(TensorOps):
    def key(self, tensor: Any) -> Tuple[str, str]:
        return str(tensor.dtype).replace("torch.", ""), str(tensor.device)

    def nbytes(self, tensor: Any) -> int:
        return tensor.numel() * tensor.element_size()

    def trainable(self, tensor: Any) -> bool:
        return tensor.requires_grad

    def all_trainable(self, tensors: Sequence[Any]) -> bool:
        try:  # one C-level pass: it runs at every recording
            return all(map(_REQUIRES_GRAD, tensors))
        except AttributeError:  # None: a tensor died
            return False

    def dtypes(self, tensors: Sequence[Any]) -> List[Any]:
        # module.double() (.half(), .to(dtype)) swaps each parameter's data in place: the same
        # objects, another dtype. One C-level pass: it runs at every recording.
        return list(map(_DTYPE, tensors))

    def any_trainable(self, tensors: Sequence[Any]) -> bool:
        return any(t.requires_grad for t in tensors if t is not None)

    def is_sparse(self, grad: Any) -> bool:
        return grad.is_sparse

    def local_grad(self, tensor: Any) -> Any:
        if tensor.is_leaf:
            grad = tensor.grad
            # A sharded step's stand-in: what this rank had is in the shards already.
            return None if type(grad) is ShardedGradient else grad
        with warnings.catch_warnings():  # reading .grad of a non-leaf warns
            warnings.simplefilter("ignore")
            return tensor.grad

    def grad_snapshot(self, tensors: Sequence[Any]) -> Any:
        """``(.grad of each tensor, the versions of those that have one)``: an in-place
        accumulation keeps the object and changes its version."""
        grads = _grads(tensors)
        if not any_present(grads):
            return grads, None  # the usual step (after zero_grad(set_to_none=True))
        return grads, [None if g is None else g._version for g in grads]

    def grads_changed(self, tensors: Sequence[Any], snapshot: Any) -> bool:
        if snapshot is None:
            return False
        before, versions = snapshot
        now = _grads(tensors)
        if versions is None:
            return any_present(now)
        return any(g is not old or (old is not None and old._version != version)
                   for g, old, version in zip(now, before, versions))

    def new_buffer(self, bucket: Any, like: Any,
                   factor: Optional[float] = None) -> TorchBuffer:
        return TorchBuffer(bucket, like, factor)

    def unpack(self, flat: Any, bucket: Any) -> Tuple[List[Any], Any]:
        pieces = flat.split([*(bucket.sizes[slot] for slot in bucket.layout),
                             len(bucket.sizes) + 1])
        parts: List[Any] = [None] * len(bucket.sizes)
        for piece, slot in zip(pieces, bucket.layout):
            parts[slot] = piece.view(bucket.shapes[slot])
        return parts, pieces[-1]

    def flag(self, flags: Any, i: int) -> float:
        return float(flags[i])

    def scale(self, flat: Any, factor: float) -> Any:
        return flat.mul_(factor)  # in place: callers' own buffers (a broadcast's, the shards)

    def cast(self, flat: Any, dtype: str) -> Any:
        return flat.to(getattr(torch, dtype))

    def vector(self, values: Sequence[float], like: Any) -> Any:
        vector = torch.tensor(list(values), dtype=torch.float32)
        return vector if like is None else vector.to(like.device)

    def values(self, vector: Any) -> List[float]:
        return [float(v) for v in vector.cpu().tolist()]

    def flatten(self, tensors: Sequence[Any]) -> Any:
        with torch.no_grad():
            return torch.cat([t.detach().reshape(-1) for t in tensors])

    def assign(self, tensors: Sequence[Any], flat: Any) -> None:
        with torch.no_grad():
            start = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[start:start + n].view(t.shape))
                start += n

    # sharding (ZeRO-2)
    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def numel(self, tensor: Any) -> int:
        return tensor.numel()

    def copy(self, tensor: Any) -> Any:
        return tensor.detach().clone()

    def zeros(self, numel: int, like: Any, dtype: Optional[str] = None) -> Any:
        kind = like.dtype if dtype is None else getattr(torch, dtype)
        return torch.zeros(numel, dtype=kind, device=like.device)

    def padded(self, flat: Any, numel: int) -> Any:
        if flat.numel() == numel:
            return flat
        return torch.nn.functional.pad(flat, (0, numel - flat.numel()))

    def add(self, total: Any, more: Any) -> Any:
        return total.add_(more)

    def write(self, flat: Any, start: int, values: Any) -> None:
        with torch.no_grad():
            flat[start:start + values.numel()].copy_(values.reshape(-1))

    def item(self, value: Any) -> float:
        return float(value.item()) if isinstance(value, torch.Tensor) else float(value)

    def sum_squares(self, tensors: Sequence[Any]) -> float:
        if not tensors:
            return 0.0
        return float(sum(t.detach().float().square().sum() for t in tensors))

    def norm(self, tensor: Any) -> float:
        return float(torch.linalg.vector_norm(tensor.detach()))

    def segment(self, param: Any, start: int, stop: int, master_dtype: Optional[str]) -> Any:
        part = param.detach().reshape(-1)[start:stop]  # a view where param is contiguous
        if master_dtype is not None and str(param.dtype) != f"torch.{master_dtype}":
            return part.to(getattr(torch, master_dtype)).clone()
        return part if param.is_contiguous() else part.clone()

    def refresh_segment(self, segment: Any, param: Any, start: int, stop: int) -> None:
        if _same_storage(segment, param):
            return  # a view
        current = param.detach().reshape(-1)[start:stop]
        with torch.no_grad():
            if segment.dtype == param.dtype:  # a copy of a parameter that is not contiguous
                segment.copy_(current)
            else:  # a master copy: no device sync, the test is elementwise
                changed = segment.to(param.dtype) != current
                segment.copy_(torch.where(changed, current.to(segment.dtype), segment))

    def param_slice(self, param: Any, start: int, stop: int) -> Any:
        return param.detach().view(-1)[start:stop] if param.is_contiguous() else None

    def write_segment(self, segment: Any, target: Any) -> None:
        if segment.data_ptr() != target.data_ptr():  # a copy, or a master in another dtype
            with torch.no_grad():
                target.copy_(segment)

    def write_part(self, param: Any, start: int, values: Any) -> None:
        flat = param.detach().reshape(-1)  # a copy: the parameter is not contiguous
        flat[start:start + values.numel()] = values
        with torch.no_grad():
            param.copy_(flat.view(param.shape))

    def set_segment_grad(self, segment: Any, grad: Any) -> None:
        segment.grad = None if grad is None else grad.to(segment.dtype)

    def optimizer_base(self) -> Optional[type]:
        from .sharded_base import TorchShardedBase

        return TorchShardedBase

    def not_elementwise(self, optimizer_class: Any) -> Optional[str]:
        for name, why in _NOT_ELEMENTWISE.items():
            known = getattr(torch.optim, name, None)  # (Adafactor: torch 2.5 and later)
            if known is not None and isinstance(optimizer_class, type) and issubclass(
                    optimizer_class, known):
                return why
        return None

    def optimizer_state(self, optimizer: Any, param: Any) -> Dict[str, Any]:
        return dict(optimizer.state.get(param, {}))

    def set_optimizer_state(self, optimizer: Any, param: Any, state: Dict[str, Any]) -> None:
        optimizer.state[param] = {k: (v.to(param.device) if isinstance(v, torch.Tensor) else v)
                                  for k, v in state.items()}

    def reset_optimizer_state(self, optimizer: Any, param: Any) -> None:
        optimizer.state.pop(param, None)  # made again at its next step

    def scalar_like_state(self, value: float, like: Any) -> Any:
        return torch.tensor(value, dtype=torch.float32)

    def idioms(self) -> Idioms:
        return IDIOMS

    def wrapper_problem(self, module: Any) -> Optional[str]:
        from .modules import wrapper_problem

        return wrapper_problem(module)

    def hook_parameter_reads(self, module: Any, wait_for: Any, wait_all: Any) -> Any:
        from .gather_hooks import hook_parameter_reads

        return hook_parameter_reads(module, wait_for, wait_all)

    def watch_forwards(self, module: Any, refusal: Any) -> Optional[Any]:
        from .modules import watch_forwards

        return watch_forwards(module, refusal)

    def stand_in_grad(self, tensor: Any, member: Any) -> Any:
        """The ``.grad`` of a tensor whose reduced gradient the shards hold (see
        :mod:`gradmgr.distributed.sharded.shard_grads`)."""
        return stand_in_grad(tensor, member)

    def post_backward_path(self) -> Optional[PostBackwardPath]:
        from .compile import COMPILED_AUTOGRAD_PATH

        return COMPILED_AUTOGRAD_PATH

    def reducer_path(self, transport: Any) -> Optional[ReducerPath]:
        from .reducer import reducer_path  # torch.distributed's private reducer API

        return reducer_path(transport)

    def comm_hook(self, hook: Any, state: Any) -> Any:
        from .comm_hook import TorchCommHook  # imports torch.distributed

        return TorchCommHook(hook, state)

    def join_support(self) -> Any:
        from .join import TorchJoin  # torch.distributed.algorithms.join

        return TorchJoin()

    def full_shard_path(self) -> Any:
        from .full_shard import full_shard_path  # torch.distributed.fsdp

        return full_shard_path()

    def distributed_checkpoint(self) -> Any:
        from .dcp import TorchCheckpoints  # torch.distributed.checkpoint

        return TorchCheckpoints()

    def state_from_checkpoint(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor:
            from .dcp import refuse_sliced  # a ShardedTensor is torch.distributed's

            refuse_sliced(value)
        return value


def _same_storage(a: Any, b: Any) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


TORCH_OPS = TorchOps()


def _grads(tensors: Sequence[Any]) -> List[Any]:
    with warnings.catch_warnings():  # reading .grad of a non-leaf warns
        warnings.simplefilter("ignore")
        return list(map(_GRAD, tensors))


class TorchBuffer:
    """A bucket's buffer, allocated when its first member arrives: a large member is copied in
    at once (the engine's gradient is then freed, as with DDP's bucket views), small ones are
    kept and packed in one copy by ``finish``. With a ``factor``, each copy scales too (one
    pass, as DDP's ``mul_out`` into its bucket view), giving what scaling the finished buffer
    in place gave: the same multiplication by the same Python float, in the buffer's dtype."""

    __slots__ = ("bucket", "like", "factor", "flat", "parts")

    def __init__(self, bucket: Any, like: Any, factor: Optional[float] = None) -> None:
        self.bucket, self.like, self.factor = bucket, like, factor
        self.flat: Any = None
        self.parts: List[Any] = [None] * len(bucket.sizes)

    def _allocate(self) -> Any:
        """The bucket's last buffer if nothing holds it any more (the previous step's ``.grad``
        views were dropped, as ``zero_grad()`` does, and its collective is done), else a new
        one: a steady training loop then allocates no gradient memory, as DDP's persistent
        buckets do."""
        like, bucket = self.like, self.bucket
        spare, need = bucket.spare, bucket.buffer_numel
        if spare is not None and storage_unshared(spare) and spare.numel() >= need:
            self.flat = spare if spare.numel() == need else spare[:need]  # one of a pool
        else:
            self.flat = bucket.spare = torch.empty(need, dtype=like.dtype, device=like.device)
        return self.flat

    def put(self, slot: int, grad: Any, local: Any) -> None:
        bucket = self.bucket
        if not bucket.large[slot]:
            if grad is None or local is None:
                self.parts[slot] = grad if local is None else local
            else:
                self.parts[slot] = grad + local  # as AccumulateGrad's local + grad, bit for bit
            return
        flat = self.flat if self.flat is not None else self._allocate()
        view = flat.narrow(0, bucket.offsets[slot], bucket.sizes[slot]).view(bucket.shapes[slot])
        with torch.no_grad():
            if grad is None and local is None:
                view.zero_()  # zeros scaled are zeros
            elif grad is not None and local is not None:
                _sum_into(view, grad, local)
                if self.factor is not None:
                    view.mul_(self.factor)  # (grad + local) * factor: two roundings, as before
            else:
                _scaled_into(view, grad if grad is not None else local, self.factor)

    def finish(self, unused: Sequence[int], failed: bool = False) -> Any:
        bucket = self.bucket
        flat = self.flat if self.flat is not None else self._allocate()
        with torch.no_grad():
            if bucket.small:
                pieces = [self.parts[slot] if self.parts[slot] is not None
                          else torch.zeros(bucket.shapes[slot], dtype=flat.dtype,
                                           device=flat.device)
                          for slot in bucket.small]
                _scaled_into(flat[:bucket.small_numel], _flatten_dense_tensors(pieces),
                             self.factor)
            flags = flat[bucket.numel:]
            flags.fill_(1)
            for slot in unused:
                flags[slot] = 0  # a kernel on the device, no host round trip
            if not failed:
                flags[-1] = 0
            if self.factor is not None:
                flags.mul_(self.factor)  # 1 * factor rounded as the values' scaling rounds it
        self.parts = []
        return flat


def _scaled_into(out: Any, values: Any, factor: Optional[float]) -> None:
    """``out = values * factor`` in one pass where dtypes and shapes agree; else (or without a
    factor) the copy, then the scaling in ``out``'s dtype, as the whole buffer was scaled."""
    if factor is not None and values.dtype == out.dtype and values.shape == out.shape:
        torch.mul(values, factor, out=out)
        return
    out.copy_(values)
    if factor is not None:
        out.mul_(factor)


def _sum_into(out: Any, grad: Any, local: Any) -> None:
    """``out = grad + local`` rounded once in ``out``'s dtype (a copy then ``add_``, where the
    dtypes differ)."""
    if grad.dtype == local.dtype == out.dtype and grad.shape == local.shape == out.shape:
        torch.add(grad, local, out=out)
        return
    out.copy_(grad)
    out.add_(local)
