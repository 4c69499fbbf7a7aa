"""The handful of tensor operations data parallelism needs, per framework (imported lazily).

Bucketing packs gradients into one flat buffer (with one "used here" flag per gradient at the
end), casts it for compression and unpacks the reduced buffer; the cross-rank checks and the
initial broadcast move small vectors and whole parameter sets. These adapters do that for
PyTorch and MegEngine tensors.
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

    def trainable(self, tensor: Any) -> bool:
        """Whether the tensor gets gradients now (a frozen one is left out of the buckets)."""
        return True

    def pack(self, parts: Sequence[Optional[Any]], like: Sequence[Any],
             unused: Sequence[int]) -> Any:
        """One 1-D buffer: each part flattened (None: zeros like the matching tensor of
        ``like``), then one flag per part: 1, or 0 for the positions in ``unused``."""
        raise NotImplementedError

    def unpack(self, flat: Any, shapes: Sequence[Tuple[int, ...]]) -> Tuple[List[Any], Any]:
        """The parts of a :meth:`pack`ed buffer (views where the framework has them), and the
        flags."""
        raise NotImplementedError

    def flag(self, flags: Any, i: int) -> float:
        """The i-th flag as a Python float (on a GPU: a device-to-host copy)."""
        raise NotImplementedError

    def scale(self, flat: Any, factor: float) -> Any:
        return flat * factor

    def add(self, a: Any, b: Any) -> Any:
        return a + b

    def cast(self, flat: Any, dtype: str) -> Any:
        raise NotImplementedError

    def compress(self, flat: Any, compression: str) -> Any:
        return self.cast(flat, _COMPRESSED[compression])

    def vector(self, values: Sequence[float], like: Any) -> Any:
        """A float32 vector on ``like``'s device (for the small cross-rank collectives)."""
        raise NotImplementedError

    def values(self, vector: Any) -> List[float]:
        raise NotImplementedError

    def local_grad(self, tensor: Any) -> Any:
        """What ``tensor.grad`` holds (None if nothing)."""
        return tensor.grad

    def flatten(self, tensors: Sequence[Any]) -> Any:
        """The tensors' values in one 1-D buffer (for a broadcast)."""
        raise NotImplementedError

    def assign(self, tensors: Sequence[Any], flat: Any) -> None:
        """Overwrite ``tensors`` in place with the values of a :meth:`flatten`ed buffer."""
        raise NotImplementedError

    def dtype_name(self, tensor: Any) -> str:
        return self.key(tensor)[0]


class TorchOps(TensorOps):
    name = "torch"

    def key(self, tensor: Any) -> Tuple[str, str]:
        return str(tensor.dtype).replace("torch.", ""), str(tensor.device)

    def nbytes(self, tensor: Any) -> int:
        return tensor.numel() * tensor.element_size()

    def trainable(self, tensor: Any) -> bool:
        return tensor.requires_grad

    def local_grad(self, tensor: Any) -> Any:
        if tensor.is_leaf:
            return tensor.grad
        import warnings

        with warnings.catch_warnings():  # reading .grad of a non-leaf warns
            warnings.simplefilter("ignore")
            return tensor.grad

    def pack(self, parts, like, unused):
        import torch

        with torch.no_grad():
            pieces = [
                (p if p is not None else torch.zeros_like(t, requires_grad=False)).reshape(-1)
                for p, t in zip(parts, like)
            ]
            flags = torch.ones(len(pieces), dtype=pieces[0].dtype, device=pieces[0].device)
            for i in unused:
                flags[i] = 0  # a kernel on the device, no host round trip
            pieces.append(flags)
            return torch.cat(pieces)

    def unpack(self, flat, shapes):
        sizes = [_numel(s) for s in shapes]
        pieces = flat.split([*sizes, len(sizes)])
        return [piece.view(shape) for piece, shape in zip(pieces, shapes)], pieces[-1]

    def flag(self, flags, i):
        return float(flags[i])

    def scale(self, flat: Any, factor: float) -> Any:
        return flat.mul_(factor)  # flat is a fresh buffer from pack()

    def cast(self, flat: Any, dtype: str) -> Any:
        import torch

        return flat.to(getattr(torch, dtype))

    def vector(self, values, like):
        import torch

        return torch.tensor(list(values), dtype=torch.float32).to(like.device)

    def values(self, vector):
        return [float(v) for v in vector.cpu().tolist()]

    def flatten(self, tensors):
        import torch

        with torch.no_grad():
            return torch.cat([t.detach().reshape(-1) for t in tensors])

    def assign(self, tensors, flat):
        import torch

        with torch.no_grad():
            start = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[start:start + n].view(t.shape))
                start += n


class MegEngineOps(TensorOps):
    name = "megengine"

    def key(self, tensor: Any) -> Tuple[str, str]:
        import numpy as np

        return np.dtype(tensor.dtype).name, str(tensor.device)

    def nbytes(self, tensor: Any) -> int:
        import numpy as np

        return int(tensor.size) * np.dtype(tensor.dtype).itemsize

    def pack(self, parts, like, unused):
        import megengine.functional as F
        import numpy as np

        pieces = []
        for p, t in zip(parts, like):
            if p is None:
                p = F.zeros((int(t.size),), dtype=t.dtype, device=t.device)
            pieces.append(p.reshape(-1))
        flags = np.ones(len(pieces), dtype=np.dtype(like[0].dtype))
        flags[list(unused)] = 0
        pieces.append(F.copy(_mge_tensor(flags), like[0].device))
        return F.concat(pieces)

    def unpack(self, flat, shapes):
        out, start = [], 0
        for shape in shapes:
            end = start + _numel(shape)
            out.append(flat[start:end].reshape(shape))
            start = end
        return out, flat[start:]

    def flag(self, flags, i):
        return float(flags[i].numpy())

    def cast(self, flat: Any, dtype: str) -> Any:
        if dtype == "bfloat16":
            raise ValueError(
                "bf16 compression needs a bfloat16 dtype, which MegEngine tensors lack; "
                "use compression='fp16'"
            )
        return flat.astype(dtype)

    def vector(self, values, like):
        import megengine.functional as F
        import numpy as np

        return F.copy(_mge_tensor(np.asarray(list(values), dtype="float32")), like.device)

    def values(self, vector):
        return [float(v) for v in vector.numpy().tolist()]

    def flatten(self, tensors):
        import megengine.functional as F

        return F.concat([t.reshape(-1) for t in tensors])

    def assign(self, tensors, flat):
        start = 0
        for t in tensors:
            n = int(t.size)
            t._reset(flat[start:start + n].reshape(t.shape))
            start += n


def _mge_tensor(array: Any) -> Any:
    import megengine

    return megengine.Tensor(array)


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
