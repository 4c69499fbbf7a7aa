"""The tensor operations data parallelism needs on MegEngine, and its bucket buffer."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import megengine
import megengine.functional as F
import numpy as np

from gradmgr.distributed.contract import Idioms, TensorOps

# MegEngine has no no-gradient context nor data-parallel wrapper: their descriptions stay neutral
IDIOMS = Idioms(save="megengine.save")


class MegEngineOps(TensorOps):
    """MegEngine tensors have no ``requires_grad`` flag: every attached tensor is trainable."""

    def key(self, tensor: Any) -> Tuple[str, str]:
        return np.dtype(tensor.dtype).name, str(tensor.device)

    def nbytes(self, tensor: Any) -> int:
        return int(tensor.size) * np.dtype(tensor.dtype).itemsize

    def all_trainable(self, tensors: Sequence[Any]) -> bool:
        return True  # nothing to freeze; a tensor that died changes the manager's attach_epoch

    def any_trainable(self, tensors: Sequence[Any]) -> bool:
        return False  # nothing was left out as frozen

    def new_buffer(self, bucket: Any, like: Any,
                   factor: Optional[float] = None) -> MegEngineBuffer:
        return MegEngineBuffer(bucket, like, factor)

    def flag(self, flags: Any, i: int) -> float:
        return float(flags[i].numpy())

    def cast(self, flat: Any, dtype: str) -> Any:
        if dtype == "bfloat16":
            raise ValueError(
                "bf16 compression needs a bfloat16 dtype, which MegEngine tensors lack; "
                "use compression='fp16'"
            )
        return flat.astype(dtype)

    def vector(self, values: Sequence[float], like: Any) -> Any:
        return F.copy(megengine.Tensor(np.asarray(list(values), dtype="float32")), like.device)

    def values(self, vector: Any) -> List[float]:
        return [float(v) for v in vector.numpy().tolist()]

    def flatten(self, tensors: Sequence[Any]) -> Any:
        return F.concat([t.reshape(-1) for t in tensors])

    def assign(self, tensors: Sequence[Any], flat: Any) -> None:
        start = 0
        for t in tensors:
            n = int(t.size)
            t._reset(flat[start:start + n].reshape(t.shape))
            start += n

    # sharding (ZeRO-2): MegEngine tensors are values, so segments are copies
    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, megengine.Tensor)

    def numel(self, tensor: Any) -> int:
        return int(tensor.size)

    def copy(self, tensor: Any) -> Any:
        return F.copy(tensor, tensor.device)

    def zeros(self, numel: int, like: Any, dtype: Optional[str] = None) -> Any:
        return F.zeros((numel,), dtype=dtype or like.dtype, device=like.device)

    def item(self, value: Any) -> float:
        return float(value.numpy()) if isinstance(value, megengine.Tensor) else float(value)

    def sum_squares(self, tensors: Sequence[Any]) -> float:
        return float(sum(float(F.sum(t.astype("float32") ** 2).numpy()) for t in tensors))

    def segment(self, param: Any, start: int, stop: int, master_dtype: Optional[str]) -> Any:
        part = param.reshape(-1)[start:stop]
        if master_dtype is not None:
            part = part.astype(master_dtype)
        return megengine.Parameter(part)

    def refresh_segment(self, segment: Any, param: Any, start: int, stop: int) -> None:
        current = param.reshape(-1)[start:stop]
        if np.dtype(segment.dtype) == np.dtype(param.dtype):
            segment._reset(current)
        else:  # a master copy
            changed = segment.astype(param.dtype) != current
            segment._reset(F.where(changed, current.astype(segment.dtype), segment))

    def set_segment_grad(self, segment: Any, grad: Any) -> None:
        if grad is not None and np.dtype(grad.dtype) != np.dtype(segment.dtype):
            grad = grad.astype(segment.dtype)
        segment.grad = grad

    def idioms(self) -> Idioms:
        return IDIOMS

    def optimizer_base(self) -> Optional[type]:
        from .sharded_base import MegEngineShardedBase

        return MegEngineShardedBase

    def optimizer_state(self, optimizer: Any, param: Any) -> Dict[str, Any]:
        return dict(optimizer._state.get(param, {}))

    def set_optimizer_state(self, optimizer: Any, param: Any, state: Dict[str, Any]) -> None:
        optimizer._state[param] = {k: megengine.Tensor(v) for k, v in state.items()}

    def reset_optimizer_state(self, optimizer: Any, param: Any) -> None:
        # MegEngine's optimizers make every parameter's state when they are built, from the
        # options of its group (SGD: a momentum buffer only with momentum), and expect it.
        optimizer._state.pop(param, None)
        group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
        optimizer._create_state({**group, "params": [param]})

    def state_from_checkpoint(self, value: Any) -> Any:
        # MegEngine's optimizers save numpy arrays (state_dict(keep_var=False), the default)
        if isinstance(value, (np.ndarray, np.generic)):
            return megengine.Tensor(value)
        return value

    def scalar_like_state(self, value: float, like: Any) -> Any:
        return megengine.Tensor(value, dtype="float32")


MEGENGINE_OPS = MegEngineOps()


class MegEngineBuffer:
    """A bucket's parts, concatenated by ``finish`` (MegEngine tensors are values), then
    scaled by ``factor`` as ``TensorOps.scale`` scaled the buffer (no cheaper fused op)."""

    __slots__ = ("bucket", "like", "factor", "parts")

    def __init__(self, bucket: Any, like: Any, factor: Optional[float] = None) -> None:
        self.bucket, self.like, self.factor = bucket, like, factor
        self.parts: List[Any] = [None] * len(bucket.sizes)

    def put(self, slot: int, grad: Any, local: Any) -> None:
        if grad is None or local is None:
            self.parts[slot] = grad if local is None else local
        else:
            self.parts[slot] = grad + local

    def finish(self, unused: Sequence[int], failed: bool = False) -> Any:
        bucket, like = self.bucket, self.like
        pieces = []
        for slot in bucket.layout:
            part = self.parts[slot]
            if part is None:
                part = F.zeros((bucket.sizes[slot],), dtype=like.dtype, device=like.device)
            pieces.append(part.reshape(-1))
        flags = np.ones(len(bucket.sizes) + 1, dtype=np.dtype(like.dtype))
        flags[list(unused)] = 0
        flags[-1] = 1 if failed else 0
        pieces.append(F.copy(megengine.Tensor(flags), like.device))
        self.parts = []
        flat = F.concat(pieces)
        return flat if self.factor is None else flat * self.factor
