"""The handful of tensor operations data parallelism needs, per framework (imported lazily).

Bucketing packs gradients into one flat buffer (with one "used here" flag per gradient at the
end, then a "this rank failed" marker), casts it for compression and unpacks the reduced
buffer; the cross-rank checks and the initial broadcast move small vectors and whole parameter
sets. These adapters do that for PyTorch and MegEngine tensors.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

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

    def new_buffer(self, bucket: Any, like: Any) -> Any:
        """A :class:`BucketBuffer`-like object that assembles one step's buffer of ``bucket``
        (its dtype and device those of ``like``): ``put(slot, grad, local)`` for each member
        (``grad`` or ``local`` None: left out), then ``finish(unused, failed) -> flat``: the
        members' values laid out as ``bucket.layout`` says, then one flag per member, 1, or 0
        for the slots in ``unused``, then the failure marker: 1 if ``failed``, else 0."""
        raise NotImplementedError

    def unpack(self, flat: Any, bucket: Any) -> Tuple[List[Any], Any]:
        """The members' parts of a reduced buffer, in slot order (views where the framework
        has them), and the flags (the failure marker last)."""
        raise NotImplementedError

    def flag(self, flags: Any, i: int) -> float:
        """The i-th flag as a Python float (on a GPU: a device-to-host copy)."""
        raise NotImplementedError

    def failed_somewhere(self, flags: Any) -> bool:
        """Whether some rank sent this buffer with its failure marker set (its backward
        raised): the sum over ranks of 0s and (scaled) 1s is 0 exactly when none did, in any
        wire dtype."""
        return self.flag(flags, -1) != 0

    def scale(self, flat: Any, factor: float) -> Any:
        return flat * factor

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

    def new_buffer(self, bucket, like):
        return _TorchBuffer(bucket, like)

    def unpack(self, flat, bucket):
        pieces = flat.split([*(bucket.sizes[slot] for slot in bucket.layout),
                             len(bucket.sizes) + 1])
        parts: List[Any] = [None] * len(bucket.sizes)
        for piece, slot in zip(pieces, bucket.layout):
            parts[slot] = piece.view(bucket.shapes[slot])
        return parts, pieces[-1]

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

    def new_buffer(self, bucket, like):
        return _MegEngineBuffer(bucket, like)

    def unpack(self, flat, bucket):
        parts: List[Any] = [None] * len(bucket.sizes)
        for slot in bucket.layout:
            start = bucket.offsets[slot]
            parts[slot] = flat[start:start + bucket.sizes[slot]].reshape(bucket.shapes[slot])
        return parts, flat[bucket.numel:]

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


class _TorchBuffer:
    """A bucket's buffer, allocated when its first member arrives: a large member is copied in
    at once (the engine's gradient is then freed, as with DDP's bucket views), small ones are
    kept and packed in one copy by ``finish``."""

    __slots__ = ("bucket", "like", "flat", "parts")

    def __init__(self, bucket: Any, like: Any) -> None:
        self.bucket, self.like = bucket, like
        self.flat: Any = None
        self.parts: List[Any] = [None] * len(bucket.sizes)

    def _allocate(self) -> Any:
        """The bucket's last buffer if nothing holds it any more (the previous step's ``.grad``
        views were dropped, as ``zero_grad()`` does, and its collective is done), else a new
        one: a steady training loop then allocates no gradient memory, as DDP's persistent
        buckets do."""
        import torch

        from gradmgr.backends.torch.grads import storage_unshared

        like, bucket = self.like, self.bucket
        spare = bucket.spare
        if spare is not None and storage_unshared(spare):
            self.flat = spare
        else:
            self.flat = bucket.spare = torch.empty(bucket.numel + len(bucket.sizes) + 1,
                                                   dtype=like.dtype, device=like.device)
        return self.flat

    def put(self, slot: int, grad: Any, local: Any) -> None:
        import torch

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
                view.zero_()
            else:
                view.copy_(grad if grad is not None else local)
                if grad is not None and local is not None:
                    view.add_(local)

    def finish(self, unused: Sequence[int], failed: bool = False) -> Any:
        import torch
        from torch._utils import _flatten_dense_tensors

        bucket = self.bucket
        flat = self.flat if self.flat is not None else self._allocate()
        with torch.no_grad():
            if bucket.small:
                pieces = [self.parts[slot] if self.parts[slot] is not None
                          else torch.zeros(bucket.shapes[slot], dtype=flat.dtype,
                                           device=flat.device)
                          for slot in bucket.small]
                flat[:bucket.small_numel].copy_(_flatten_dense_tensors(pieces))
            flags = flat[bucket.numel:]
            flags.fill_(1)
            for slot in unused:
                flags[slot] = 0  # a kernel on the device, no host round trip
            if not failed:
                flags[-1] = 0
        self.parts = []
        return flat


class _MegEngineBuffer:
    """A bucket's parts, concatenated by ``finish`` (MegEngine tensors are values)."""

    __slots__ = ("bucket", "like", "parts")

    def __init__(self, bucket: Any, like: Any) -> None:
        self.bucket, self.like = bucket, like
        self.parts: List[Any] = [None] * len(bucket.sizes)

    def put(self, slot: int, grad: Any, local: Any) -> None:
        if grad is None or local is None:
            self.parts[slot] = grad if local is None else local
        else:
            self.parts[slot] = grad + local

    def finish(self, unused: Sequence[int], failed: bool = False) -> Any:
        import megengine.functional as F
        import numpy as np

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
        pieces.append(F.copy(_mge_tensor(flags), like.device))
        self.parts = []
        return F.concat(pieces)


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
