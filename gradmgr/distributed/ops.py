"""The handful of tensor operations bucketing needs, per framework (imported lazily).

Bucketing flattens gradients into one buffer, casts it for compression and splits the
reduced buffer back; these small adapters do that for PyTorch and MegEngine tensors.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

_COMPRESSED = {"fp16": "float16", "bf16": "bfloat16"}


class TensorOps:
    """Framework-specific tensor operations (one instance per framework)."""

    name: str

    def key(self, tensor: Any) -> Tuple[str, str]:
        """``(dtype name, device name)``: gradients sharing a key share a bucket."""
        raise NotImplementedError

    def shape(self, tensor: Any) -> Tuple[int, ...]:
        return tuple(int(n) for n in tensor.shape)

    def nbytes(self, tensor: Any) -> int:
        raise NotImplementedError

    def flatten(self, parts: Sequence[Optional[Any]], like: Sequence[Any]) -> Any:
        """Concatenate ``parts`` flattened into one 1-D buffer; a None part is zeros shaped
        like the matching tensor of ``like``."""
        raise NotImplementedError

    def split(self, flat: Any, shapes: Sequence[Tuple[int, ...]]) -> List[Any]:
        raise NotImplementedError

    def scale(self, flat: Any, factor: float) -> Any:
        return flat * factor

    def add(self, a: Any, b: Any) -> Any:
        return a + b

    def sub(self, a: Any, b: Any) -> Any:
        return a - b

    def copy(self, tensor: Any) -> Any:
        raise NotImplementedError

    def cast(self, flat: Any, dtype: str) -> Any:
        raise NotImplementedError

    def compress(self, flat: Any, compression: str) -> Any:
        return self.cast(flat, _COMPRESSED[compression])

    def dtype_name(self, tensor: Any) -> str:
        return self.key(tensor)[0]


class TorchOps(TensorOps):
    name = "torch"

    def key(self, tensor: Any) -> Tuple[str, str]:
        return str(tensor.dtype).replace("torch.", ""), str(tensor.device)

    def nbytes(self, tensor: Any) -> int:
        return tensor.numel() * tensor.element_size()

    def flatten(self, parts: Sequence[Optional[Any]], like: Sequence[Any]) -> Any:
        import torch

        pieces = [
            (p if p is not None else torch.zeros_like(t, requires_grad=False)).reshape(-1)
            for p, t in zip(parts, like)
        ]
        with torch.no_grad():
            return torch.cat(pieces)

    def split(self, flat: Any, shapes: Sequence[Tuple[int, ...]]) -> List[Any]:
        sizes = [_numel(s) for s in shapes]
        return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]

    def scale(self, flat: Any, factor: float) -> Any:
        return flat.mul_(factor)  # flat is a fresh buffer from flatten()

    def copy(self, tensor: Any) -> Any:
        return tensor.detach().clone()

    def cast(self, flat: Any, dtype: str) -> Any:
        import torch

        return flat.to(getattr(torch, dtype))


class MegEngineOps(TensorOps):
    name = "megengine"

    def key(self, tensor: Any) -> Tuple[str, str]:
        import numpy as np

        return np.dtype(tensor.dtype).name, str(tensor.device)

    def nbytes(self, tensor: Any) -> int:
        import numpy as np

        return int(tensor.size) * np.dtype(tensor.dtype).itemsize

    def flatten(self, parts: Sequence[Optional[Any]], like: Sequence[Any]) -> Any:
        import megengine.functional as F

        pieces = []
        for p, t in zip(parts, like):
            if p is None:
                p = F.zeros((int(t.size),), dtype=t.dtype, device=t.device)
            pieces.append(p.reshape(-1))
        return pieces[0] if len(pieces) == 1 else F.concat(pieces)

    def split(self, flat: Any, shapes: Sequence[Tuple[int, ...]]) -> List[Any]:
        out, start = [], 0
        for shape in shapes:
            end = start + _numel(shape)
            out.append(flat[start:end].reshape(shape))
            start = end
        return out

    def copy(self, tensor: Any) -> Any:
        import megengine.functional as F

        return F.copy(tensor)

    def cast(self, flat: Any, dtype: str) -> Any:
        if dtype == "bfloat16":
            raise ValueError(
                "bf16 compression needs a bfloat16 dtype, which MegEngine tensors lack; "
                "use compression='fp16'"
            )
        return flat.astype(dtype)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


_OPS: Dict[str, TensorOps] = {"torch": TorchOps(), "megengine": MegEngineOps()}


def ops_for(backend_name: str) -> TensorOps:
    """The ops of a gradmgr backend, e.g. ``ops_for("torch")``."""
    try:
        return _OPS[backend_name]
    except KeyError:
        raise TypeError(
            f"allreduce callbacks support torch and megengine tensors, not {backend_name!r}"
        ) from None
