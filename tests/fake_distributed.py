"""Data parallelism for the pure-Python fake framework: its tensor operations and an in-process
transport whose ranks are threads.

This is what a backend must hand out for ``gradmgr.distributed`` (see
:mod:`gradmgr.distributed.contract`), written against nothing but the contract, so that the
data-parallel contract tests (``tests/test_dp_contract.py``) run without any framework.

Collectives match by launch order, as gloo's do: the i-th collective a rank launches meets the
i-th of every other rank. One whose size differs between ranks raises on every rank (a real
transport would abort the process or mix buffers), so a misaligned step shows as an error.
"""

from __future__ import annotations

import struct
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from gradmgr.distributed.contract import TensorOps


class CollectiveMismatch(RuntimeError):
    """Ranks launched collectives of different sizes at the same position."""


class ThreadWorld:
    """The ranks of one job, threads of this process; ``transport(rank)`` is one rank's view."""

    def __init__(self, world: int, timeout: float = 60.0) -> None:
        self.world = world
        self.timeout = timeout
        self._cond = threading.Condition()
        self._slots: Dict[int, Dict[int, Any]] = {}  # collective index -> rank -> contribution
        self._launched = [0] * world
        self.log: List[Tuple[int, str, int]] = []  # (rank, kind, size) of every launch

    def transport(self, rank: int) -> ThreadTransport:
        return ThreadTransport(self, rank)

    def launch(self, rank: int, kind: str, payload: Any, size: int) -> int:
        with self._cond:
            index = self._launched[rank]
            self._launched[rank] += 1
            self._slots.setdefault(index, {})[rank] = (kind, size, payload)
            self.log.append((rank, kind, size))
            self._cond.notify_all()
            return index

    def gather(self, index: int) -> List[Any]:
        """Every rank's contribution to collective ``index``, once all launched it."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._slots[index]) == self.world,
                                       self.timeout):
                raise TimeoutError(f"collective {index}: not every rank launched it "
                                   f"(launched: {sorted(self._slots[index])})")
            parts = [self._slots[index][r] for r in range(self.world)]
        if len({(kind, size) for kind, size, _ in parts}) > 1:
            raise CollectiveMismatch(f"collective {index}: the ranks launched "
                                     f"{[(kind, size) for kind, size, _ in parts]}")
        return [payload for _, _, payload in parts]


class _Handle:
    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish = finish
        self._value: Any = None
        self._done = False

    def wait(self) -> Any:
        if not self._done:
            self._value, self._done = self._finish(), True
        return self._value


class ThreadTransport:
    """One rank's collectives in a :class:`ThreadWorld` (sums in rank order, as gloo's ring
    does for two ranks)."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self._world, self._rank = world, rank

    def world_size(self) -> int:
        return self._world.world

    def rank(self) -> int:
        return self._rank

    def allreduce_async(self, flat: Any) -> _Handle:
        values = list(flat.data)
        index = self._world.launch(self._rank, "allreduce", values, len(values))

        def finish() -> Any:
            contributions = self._world.gather(index)
            summed = [sum(column) for column in zip(*contributions)]
            flat.data[:] = summed  # in place, as gloo reduces
            return flat

        return _Handle(finish)

    def broadcast(self, flat: Any, src: int) -> Any:
        index = self._world.launch(self._rank, "broadcast", list(flat.data), len(flat.data))
        flat.data[:] = self._world.gather(index)[src]
        return flat

    def reduce_scatter_async(self, flat: Any) -> _Handle:
        values = list(flat.data)
        index = self._world.launch(self._rank, "reduce_scatter", values, len(values))
        n = len(values) // self._world.world

        def finish() -> Any:
            summed = [sum(column) for column in zip(*self._world.gather(index))]
            return type(flat)(summed[self._rank * n:(self._rank + 1) * n], dtype=flat.dtype)

        return _Handle(finish)

    def all_gather_async(self, chunk: Any) -> _Handle:
        values = list(chunk.data)
        index = self._world.launch(self._rank, "all_gather", values, len(values))
        return _Handle(lambda: type(chunk)([v for part in self._world.gather(index)
                                            for v in part], dtype=chunk.dtype))


class OneRank:
    """A world of one process, for any framework's tensors: every collective gives back what
    it was given (a sum, a chunk or a gather over one rank)."""

    def world_size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def allreduce_async(self, flat: Any) -> _Handle:
        return _Handle(lambda: flat)

    reduce_scatter_async = all_gather_async = allreduce_async

    def broadcast(self, flat: Any, src: int) -> Any:
        return flat


def run_ranks(world: int, fn: Callable[[int, ThreadWorld], Any], timeout: float = 60.0) -> list:
    """``fn(rank, world)`` in ``world`` threads with the fake backend's default transport set
    to that rank's; returns each rank's result, or raises the first error with its traceback."""
    from fake_backend import FakeBackend

    group = ThreadWorld(world, timeout)
    results: List[Any] = [None] * world
    errors: List[str] = []

    def main(rank: int) -> None:
        FakeBackend.default_transport.value = group.transport(rank)
        try:
            results[rank] = fn(rank, group)
        except BaseException:
            errors.append(f"rank {rank}:\n{traceback.format_exc()}")
        finally:
            FakeBackend.default_transport.value = None

    threads = [threading.Thread(target=main, args=(r,), name=f"rank {r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a rank did not finish within {timeout} s")
    if errors:
        raise AssertionError("\n".join(errors))
    return results


def _float16(value: float) -> float:
    return struct.unpack("e", struct.pack("e", value))[0]


class FakeOps(TensorOps):
    """The fake framework's tensors are lists of floats; a frozen one has
    ``requires_grad=False``."""

    def key(self, tensor: Any) -> Tuple[str, str]:
        return tensor.dtype, "cpu"

    def shape(self, tensor: Any) -> Tuple[int, ...]:
        return tuple(tensor.shape)

    def nbytes(self, tensor: Any) -> int:
        return 4 * len(tensor.data)

    def trainable(self, tensor: Any) -> bool:
        return tensor.requires_grad

    def new_buffer(self, bucket: Any, like: Any, factor: Optional[float] = None) -> FakeBuffer:
        return FakeBuffer(bucket, type(like), factor)

    def unpack(self, flat: Any, bucket: Any) -> Tuple[List[Any], Any]:
        kind = type(flat)
        parts: List[Any] = [None] * len(bucket.sizes)
        for slot in bucket.layout:
            start = bucket.offsets[slot]
            values = flat.data[start:start + bucket.sizes[slot]]
            parts[slot] = kind(values if bucket.shapes[slot] else values[0])
        return parts, flat.data[bucket.numel:]

    def flag(self, flags: Any, i: int) -> float:
        return float(flags[i])

    def scale(self, flat: Any, factor: float) -> Any:
        flat.data[:] = [v * factor for v in flat.data]
        return flat

    def cast(self, flat: Any, dtype: str) -> Any:
        cast = _float16 if dtype in ("float16", "bfloat16") else float
        return type(flat)([cast(v) for v in flat.data], dtype=dtype)

    def vector(self, values: Sequence[float], like: Any) -> Any:
        return type(like)([float(v) for v in values])

    def values(self, vector: Any) -> List[float]:
        return list(vector.data)

    def flatten(self, tensors: Sequence[Any]) -> Any:
        return type(tensors[0])([v for t in tensors for v in t.data])

    def assign(self, tensors: Sequence[Any], flat: Any) -> None:
        start = 0
        for t in tensors:
            t.data[:] = flat.data[start:start + len(t.data)]
            start += len(t.data)

    # sharding: fake tensors are lists of floats; segments are copies
    def is_tensor(self, value: Any) -> bool:
        return hasattr(value, "data") and hasattr(value, "shape")

    def numel(self, tensor: Any) -> int:
        return len(tensor.data)

    def flat(self, tensor: Any) -> Any:
        return type(tensor)(list(tensor.data), dtype=tensor.dtype)

    def part(self, flat: Any, start: int, stop: Any) -> Any:
        return type(flat)(flat.data[start:stop], dtype=flat.dtype)

    def reshape(self, tensor: Any, shape: Sequence[int]) -> Any:
        return type(tensor)(list(tensor.data) if shape else tensor.data[0], dtype=tensor.dtype)

    def copy(self, tensor: Any) -> Any:
        return type(tensor)(list(tensor.data) if tensor.shape else tensor.data[0],
                            dtype=tensor.dtype)

    def zeros(self, numel: int, like: Any, dtype: Any = None) -> Any:
        return type(like)([0.0] * numel, dtype=dtype or like.dtype)

    def add(self, total: Any, more: Any) -> Any:
        return type(total)([a + b for a, b in zip(total.data, more.data)], dtype=total.dtype)

    def write(self, flat: Any, start: int, values: Any) -> None:
        flat.data[start:start + len(values.data)] = values.data

    def item(self, value: Any) -> float:
        return value.data[0] if self.is_tensor(value) else float(value)

    def sum_squares(self, tensors: Sequence[Any]) -> float:
        return sum(v * v for t in tensors for v in t.data)

    def segment(self, param: Any, start: int, stop: int, master_dtype: Any) -> Any:
        return type(param)(param.data[start:stop], dtype=master_dtype or param.dtype)

    def refresh_segment(self, segment: Any, param: Any, start: int, stop: int) -> None:
        current = param.data[start:stop]
        if segment.dtype == param.dtype:
            segment.data[:] = current
        else:  # a master copy (the fake's half precision is rounded by cast() only)
            cast = _float16 if param.dtype in ("float16", "bfloat16") else float
            segment.data[:] = [v if cast(v) == p else p for v, p in zip(segment.data, current)]

    def set_segment_grad(self, segment: Any, grad: Any) -> None:
        segment.grad = grad

    def optimizer_state(self, optimizer: Any, param: Any) -> dict:
        return dict(optimizer.state.get(id(param), {}))

    def set_optimizer_state(self, optimizer: Any, param: Any, state: dict) -> None:
        optimizer.state[id(param)] = dict(state)


class FakeSGD:
    """SGD over fake tensors, shaped as the frameworks' optimizers are (``param_groups`` with
    their options, ``state`` by parameter, ``state_dict()`` by index): what a
    ShardedOptimizer wraps on the fake backend. With ``momentum``, a buffer per parameter is
    made at its first gradient (lazily, as PyTorch's); a parameter without a gradient is
    skipped."""

    def __init__(self, params: Any, lr: float, momentum: float = 0.0) -> None:
        listed = list(params)
        groups = listed if listed and isinstance(listed[0], dict) else [{"params": listed}]
        self.param_groups = [{"lr": lr, "momentum": momentum, **g, "params": list(g["params"])}
                             for g in groups]
        self.state: Dict[int, Dict[str, Any]] = {}

    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = list(p.grad.data)
                if group["momentum"]:
                    state = self.state.setdefault(id(p), {})
                    if "momentum_buffer" in state:
                        old = state["momentum_buffer"].data
                        update = [group["momentum"] * b + g for b, g in zip(old, update)]
                    state["momentum_buffer"] = type(p)(update, dtype=p.dtype)
                p.data[:] = [v - group["lr"] * u for v, u in zip(p.data, update)]

    def state_dict(self) -> Dict[str, Any]:
        params = [p for g in self.param_groups for p in g["params"]]
        return {"state": {i: dict(self.state[id(p)]) for i, p in enumerate(params)
                          if id(p) in self.state},
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups]}


class FakeBuffer:
    """A bucket's parts (values), concatenated by ``finish``."""

    def __init__(self, bucket: Any, kind: type, factor: Optional[float] = None) -> None:
        self.bucket, self.kind, self.factor = bucket, kind, factor
        self.parts: List[Any] = [None] * len(bucket.sizes)

    def put(self, slot: int, grad: Any, local: Any) -> None:
        if grad is None or local is None:
            self.parts[slot] = grad if local is None else local
        else:
            self.parts[slot] = [a + b for a, b in zip(grad.data, local.data)]

    def finish(self, unused: Sequence[int], failed: bool = False) -> Any:
        bucket = self.bucket
        values: List[float] = []
        for slot in bucket.layout:
            part = self.parts[slot]
            if part is None:
                values.extend([0.0] * bucket.sizes[slot])
            else:
                values.extend(part if isinstance(part, list) else part.data)
        flags = [0.0 if slot in unused else 1.0 for slot in range(len(bucket.sizes))]
        self.parts = []
        values += flags + [1.0 if failed else 0.0]
        if self.factor is not None:  # as FakeOps.scale scales
            values = [v * self.factor for v in values]
        return self.kind(values)


FAKE_OPS = FakeOps()
