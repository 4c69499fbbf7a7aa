"""The tensor operations data parallelism needs on Paddle, and its bucket buffer."""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import paddle

from gradmgr.distributed.contract import Idioms, TensorOps

from . import sparse
from .wrappers import given_problem

NO_SHARDING = (
    "gradmgr shards Paddle models in no way yet (ZeRO-2 data_parallel(shard=True), "
    "ShardedOptimizer, shard='full'): use data_parallel(model) without shard=, or Paddle's own "
    "paddle.distributed.sharding"
)

FP16_ON_GLOO = (
    "compression='fp16' on Paddle CPU tensors: Paddle 3.3's gloo all_reduce sums float16 "
    "wrongly (1 + 2 gives inf, measured), so gradmgr refuses it; use compression='bf16' "
    "(summed correctly), or none"
)


IDIOMS = Idioms(no_grad="paddle.no_grad()", grad_call="paddle.grad",
                wrapper="paddle.DataParallel", save="paddle.save")


def _memory(grad: Any) -> Optional[int]:
    return None if grad is None else grad.data_ptr()


def dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).replace("paddle.", "")

class PaddleOps(TensorOps):
    """Paddle tensors are frozen by ``stop_gradient=True``; a frozen one is left out of the
    buckets, as DDP leaves out a parameter with ``requires_grad=False``."""

    def key(self, tensor: Any) -> Tuple[str, str]:
        return dtype_name(tensor), str(tensor.place)

    def nbytes(self, tensor: Any) -> int:
        return self.numel(tensor) * tensor.element_size()

    def numel(self, tensor: Any) -> int:
        return math.prod(int(d) for d in tensor.shape)

    def trainable(self, tensor: Any) -> bool:
        return not tensor.stop_gradient

    def is_sparse(self, grad: Any) -> bool:
        return sparse.is_sparse(grad)

    def grad_snapshot(self, tensors: Sequence[Any]) -> Any:
        # Each ``.grad`` read is a new Python object over the same memory, so the default's
        # identity check would see every kept gradient as changed; the memory tells instead.
        return [_memory(t.grad) for t in tensors]

    def grads_changed(self, tensors: Sequence[Any], snapshot: Any) -> bool:
        return snapshot is not None and any(
            _memory(t.grad) != old for t, old in zip(tensors, snapshot))

    def new_buffer(self, bucket: Any, like: Any,
                   factor: Optional[float] = None) -> PaddleBuffer:
        return PaddleBuffer(bucket, like, factor)

    def flag(self, flags: Any, i: int) -> float:
        return float(flags[i])

    def cast(self, flat: Any, dtype: str) -> Any:
        return flat.astype(dtype)

    def compress(self, flat: Any, compression: str) -> Any:
        if compression == "fp16" and flat.place.is_cpu_place():
            raise ValueError(FP16_ON_GLOO)
        return super().compress(flat, compression)

    def comm_hook(self, hook: Any, state: Any) -> Any:
        raise ValueError("comm_hook= takes PyTorch DDP communication hooks, and these tensors "
                         "are Paddle's: use compression='bf16', or a transport "
                         "(make_allreduce_cb(transport=...))")

    def vector(self, values: Sequence[float], like: Any) -> Any:
        place = like.place if like is not None else paddle.CPUPlace()
        return paddle.to_tensor(np.asarray(list(values), dtype="float32"), place=place)

    def values(self, vector: Any) -> List[float]:
        return [float(v) for v in vector.numpy().tolist()]

    def flatten(self, tensors: Sequence[Any]) -> Any:
        return paddle.concat([t.reshape([-1]) for t in tensors])

    def assign(self, tensors: Sequence[Any], flat: Any) -> None:
        start = 0
        for t in tensors:
            n = self.numel(t)
            t.set_value(flat[start:start + n].reshape(list(t.shape)))  # in place, keeps t
            start += n

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, paddle.Tensor)

    def copy(self, tensor: Any) -> Any:
        return tensor.clone()

    def zeros(self, numel: int, like: Any, dtype: Optional[str] = None) -> Any:
        return paddle.zeros([numel], dtype=dtype or like.dtype)

    def item(self, value: Any) -> float:
        return float(value)

    def sum_squares(self, tensors: Sequence[Any]) -> float:
        return float(sum(float((t.astype("float32") ** 2).sum()) for t in tensors))

    def idioms(self) -> Idioms:
        return IDIOMS

    def wrapper_problem(self, module: Any) -> Optional[str]:
        return given_problem(module)

    def watch_forwards(self, module: Any, refusal: Any) -> Optional[Any]:
        from .forwards import watch_forwards

        return watch_forwards(module, refusal)

    def segment(self, param: Any, start: int, stop: int, master_dtype: Optional[str]) -> Any:
        raise NotImplementedError(NO_SHARDING)

    def full_shard_path(self) -> Any:
        raise NotImplementedError(NO_SHARDING)


PADDLE_OPS = PaddleOps()


class PaddleBuffer:
    """A bucket's parts, concatenated by ``finish`` (as MegEngine's: Paddle has no in-place
    copy into a slice of a flat buffer that is cheaper than one ``concat``), then scaled by
    ``factor`` as ``TensorOps.scale`` scaled the buffer."""

    __slots__ = ("bucket", "like", "factor", "parts")

    def __init__(self, bucket: Any, like: Any, factor: Optional[float] = None) -> None:
        self.bucket, self.like, self.factor = bucket, like, factor
        self.parts: List[Any] = [None] * len(bucket.sizes)

    def put(self, slot: int, grad: Any, local: Any) -> None:
        if grad is None or local is None:
            self.parts[slot] = grad if local is None else local.clone()  # .grad is a view
        else:
            self.parts[slot] = grad + local

    def finish(self, unused: Sequence[int], failed: bool = False) -> Any:
        bucket, like = self.bucket, self.like
        pieces = []
        for slot in bucket.layout:
            part = self.parts[slot]
            if part is None:
                part = paddle.zeros([bucket.sizes[slot]], dtype=like.dtype)
            pieces.append(part.reshape([-1]))
        flags = np.ones(len(bucket.sizes) + 1, dtype=dtype_name(like))
        flags[list(unused)] = 0
        flags[-1] = 1 if failed else 0
        pieces.append(paddle.to_tensor(flags, place=like.place))
        self.parts = []
        flat = paddle.concat(pieces)
        return flat if self.factor is None else flat * self.factor
