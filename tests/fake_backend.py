"""A tiny pure-Python framework and its gradmgr backend, for testing the core without torch or
MegEngine.

Tensors hold a list of floats and have shape ``()`` (scalar) or ``(n,)``; the ops are add, sub,
mul, neg, sin, cos, exp, sum and broadcast (Python numbers act as constants). Each tape records
only ops with an input it already tracks, so ops done before ``record()`` / ``attach()`` are
ignored (snapshots, S8/S9). Backward walks the recorded ops in reverse and calls each eager sink
the moment that tensor's gradient is final, logging every op it differentiates to ``EVENTS`` so
that tests can check that callbacks interleave with the engine (S7). Vector-Jacobian products
are built from the same ops, so an earlier-started tape records a later one's backward when the
core asks for ``create_graph`` (S10).

Example:
    >>> from gradmgr import GradManager
    >>> from fake_backend import register
    >>> fk = register()                 # the backend "fake", owner of fake_backend.FakeTensor
    >>> x = fk.tensor(3.0)
    >>> gm = GradManager().attach(x)
    >>> with gm:
    ...     gm.backward(x * x)
    >>> x.grad.data
    [6.0]
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import threading
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import gradmgr
from gradmgr import Backend, Capabilities, Tape

EVENTS: List[str] = []
"""``"vjp:<op>"`` for every op a backward differentiates; tests clear and append to it."""

_start_counter = itertools.count()


class _ThreadState(threading.local):
    """Like a framework's grad mode, recording is per thread (S12)."""

    def __init__(self) -> None:
        self.active: List[FakeTape] = []  # started tapes, in start order
        self.scopes: List[Tuple[FakeTape, bool, int]] = []  # backwards: tape, create_graph, mark
        self.group: Optional[object] = None  # set while a GradManagerGroup starts recording


_local = _ThreadState()


class FakeTensor:
    """An immutable vector (or scalar) of floats with a ``.grad`` slot. ``requires_grad=False``
    freezes it, as a frozen PyTorch parameter: no tape tracks it, so it gets no gradient."""

    __slots__ = ("data", "shape", "dtype", "grad", "requires_grad", "__weakref__")

    def __init__(self, data: Any, dtype: str = "float32") -> None:
        if isinstance(data, (list, tuple)):
            self.data, self.shape = [float(v) for v in data], (len(data),)
        else:
            self.data, self.shape = [float(data)], ()
        self.dtype = dtype
        self.grad: Optional[FakeTensor] = None
        self.requires_grad = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.data if self.shape else self.data[0]})"

    def __add__(self, other: Any) -> FakeTensor:
        return add(self, other)

    __radd__ = __add__

    def __sub__(self, other: Any) -> FakeTensor:
        return add(self, neg(_const(other, self)))

    def __mul__(self, other: Any) -> FakeTensor:
        return mul(self, other)

    __rmul__ = __mul__

    def __neg__(self) -> FakeTensor:
        return neg(self)


# ------------------------------------------------------------------ ops
VJP = Callable[[FakeTensor], FakeTensor]


def _const(value: Any, like: FakeTensor) -> FakeTensor:
    return value if isinstance(value, FakeTensor) else type(like)(float(value))


def _zip(a: FakeTensor, b: FakeTensor) -> Tuple[List[float], List[float], tuple]:
    if a.shape == b.shape:
        return a.data, b.data, a.shape
    if a.shape == ():
        return a.data * len(b.data), b.data, b.shape
    if b.shape == ():
        return a.data, b.data * len(a.data), a.shape
    raise ValueError(f"shapes {a.shape} and {b.shape} do not broadcast")


def _make(kind: type, data: List[float], shape: tuple, op: str,
          parents: Sequence[Tuple[FakeTensor, VJP]]) -> FakeTensor:
    out = kind(data if shape else data[0])
    for tape in _local.active:
        if tape._may_record():
            tape._record(out, op, parents)
    return out


def _unbroadcast(g: FakeTensor, shape: tuple) -> FakeTensor:
    return g if g.shape == shape else sum_(g)


def add(a: FakeTensor, b: Any) -> FakeTensor:
    b = _const(b, a)
    x, y, shape = _zip(a, b)
    return _make(type(a), [u + v for u, v in zip(x, y)], shape, "add",
                 [(a, lambda g: _unbroadcast(g, a.shape)), (b, lambda g: _unbroadcast(g, b.shape))])


def mul(a: FakeTensor, b: Any) -> FakeTensor:
    b = _const(b, a)
    x, y, shape = _zip(a, b)
    return _make(type(a), [u * v for u, v in zip(x, y)], shape, "mul",
                 [(a, lambda g: _unbroadcast(mul(g, b), a.shape)),
                  (b, lambda g: _unbroadcast(mul(g, a), b.shape))])


def neg(a: FakeTensor) -> FakeTensor:
    return _make(type(a), [-u for u in a.data], a.shape, "neg", [(a, neg)])


def sin(a: FakeTensor) -> FakeTensor:
    return _make(type(a), [math.sin(u) for u in a.data], a.shape, "sin",
                 [(a, lambda g: mul(g, cos(a)))])


def cos(a: FakeTensor) -> FakeTensor:
    return _make(type(a), [math.cos(u) for u in a.data], a.shape, "cos",
                 [(a, lambda g: neg(mul(g, sin(a))))])


def exp(a: FakeTensor) -> FakeTensor:
    data = [math.exp(u) for u in a.data]
    return _make(type(a), data, a.shape, "exp", [(a, lambda g: mul(g, exp(a)))])


def sum_(a: FakeTensor) -> FakeTensor:
    return _make(type(a), [math.fsum(a.data)], (), "sum",
                 [(a, lambda g: broadcast(g, a.shape))])


def broadcast(a: FakeTensor, shape: tuple) -> FakeTensor:
    if a.shape == shape:
        return a
    return _make(type(a), a.data * shape[0], shape, "broadcast", [(a, sum_)])


# ------------------------------------------------------------------ tape
class _Node:
    __slots__ = ("out", "op", "parents")

    def __init__(self, out: FakeTensor, op: str, parents: List[Tuple[FakeTensor, VJP]]):
        self.out, self.op, self.parents = out, op, parents


class _Watch:
    __slots__ = ("tensor", "sink", "eager")

    def __init__(self, tensor: FakeTensor, sink: Callable[[Any], None], eager: bool):
        self.tensor, self.sink, self.eager = tensor, sink, eager


class FakeTape(Tape):
    """One manager's recording. Holds tensors strongly only between ``start()`` and ``stop()``."""

    def __init__(self) -> None:
        self.order = -1
        self.group: Optional[object] = None
        self.nodes: List[_Node] = []
        self.known: Dict[int, FakeTensor] = {}  # tracked tensors: watched ones and op outputs
        self.watched: Dict[int, _Watch] = {}

    def start(self) -> None:
        self.order = next(_start_counter)
        self.group = _local.group
        _local.active.append(self)

    def watch(self, tensor: Any, sink: Callable[[Any], None], eager: bool) -> None:
        entry = self.watched.get(id(tensor))
        if entry is not None and entry.tensor is tensor:
            entry.sink, entry.eager = sink, eager
            return
        self.watched[id(tensor)] = _Watch(tensor, sink, eager)
        self.known[id(tensor)] = tensor

    def _tracks(self, t: FakeTensor) -> bool:
        return self.known.get(id(t)) is t and t.requires_grad

    def _may_record(self) -> bool:
        """Inside a backward only earlier-started tapes outside its group record, and only
        when that backward was asked to create a graph; tapes started by callbacks during
        that backward record as usual."""
        return all(
            self.order > mark
            or (create_graph and self.order < tape.order
                and (self.group is None or self.group is not tape.group))
            for tape, create_graph, mark in _local.scopes
        )

    def _record(self, out: FakeTensor, op: str, parents: Sequence[Tuple[FakeTensor, VJP]]):
        tracked = [(p, vjp) for p, vjp in parents if self._tracks(p)]
        if tracked:
            self.nodes.append(_Node(out, op, tracked))
            self.known[id(out)] = out

    def backward(self, ys: Sequence[Any], dys: Sequence[Any], *, create_graph: bool,
                 retain_graph: bool, may_accumulate: bool = False) -> None:
        grads: Dict[int, FakeTensor] = {}

        def deliver(t: FakeTensor, g: FakeTensor) -> None:
            old = grads.get(id(t))
            grads[id(t)] = g if old is None else add(old, g)

        for y, dy in zip(ys, dys):
            if self._tracks(y):
                deliver(y, dy)
        # A watched tensor's gradient is final once its first consumer has been differentiated.
        first_use: Dict[int, int] = {}
        for i, node in enumerate(self.nodes):
            for p, _ in node.parents:
                first_use.setdefault(id(p), i)
        ready: Dict[int, List[_Watch]] = {}
        for key, entry in self.watched.items():
            ready.setdefault(first_use.get(key, len(self.nodes)), []).append(entry)
        deferred: List[_Watch] = []

        def fire(index: int) -> None:
            for entry in ready.get(index, ()):
                if id(entry.tensor) in grads:
                    if entry.eager:
                        entry.sink(grads[id(entry.tensor)])
                    else:
                        deferred.append(entry)

        _local.scopes.append((self, create_graph, next(_start_counter)))
        try:
            fire(len(self.nodes))
            for i in reversed(range(len(self.nodes))):
                node = self.nodes[i]
                g = grads.get(id(node.out))
                if g is not None:
                    EVENTS.append(f"vjp:{node.op}")
                    for p, vjp in node.parents:
                        deliver(p, vjp(g))
                fire(i)
            for entry in deferred:
                entry.sink(grads[id(entry.tensor)])
        finally:
            _local.scopes.pop()
            if not retain_graph:
                self.nodes = []

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            _local.active.remove(self)
        self.nodes, self.known, self.watched = [], {}, {}


# ------------------------------------------------------------------ backend
class FakeBackend(Backend):
    """The backend of :class:`FakeTensor` (subclasses own other tensor types)."""

    name = "fake"
    tensor_type: type = FakeTensor
    tensor_modules = (__name__.partition(".")[0],)
    capabilities = Capabilities(
        higher_order=True, exact_pre_record_semantics=True, threads=True, backward_in_callback=True
    )

    default_transport = threading.local()
    """Each rank thread's transport (``value``), set by ``fake_distributed.run_ranks``."""

    def __init__(self) -> None:
        self.tapes: List[FakeTape] = []  # every tape made, so tests can inspect them

    def is_tensor(self, obj: Any) -> bool:
        return type(obj) is self.tensor_type

    def check_attachable(self, tensor: Any) -> None:
        if not tensor.dtype.startswith("float"):
            raise TypeError(
                f"only floating-point tensors can be attached; got dtype {tensor.dtype} "
                f"and shape {tensor.shape}"
            )

    def shape(self, tensor: Any) -> tuple:
        return tensor.shape

    def ones_like(self, tensor: Any) -> Any:
        return type(tensor)([1.0] * len(tensor.data) if tensor.shape else 1.0)

    def accumulate(self, tensor: Any, grad: Any) -> None:
        if tensor.grad is None:
            tensor.grad = grad
        else:  # not recorded, like an in-place add under no_grad
            x, y, shape = _zip(tensor.grad, grad)
            tensor.grad = type(tensor)([u + v for u, v in zip(x, y)] if shape else x[0] + y[0])

    def new_tape(self) -> Tape:
        tape = FakeTape()
        self.tapes.append(tape)
        return tape

    def tensor_ops(self) -> Any:
        from fake_distributed import FAKE_OPS

        return FAKE_OPS

    def transport(self, group: Any = None, name: Optional[str] = None) -> Any:
        if name is not None:
            raise self.unknown_transport(name)
        transport = group if group is not None else getattr(self.default_transport, "value",
                                                             None)
        if transport is None:
            raise RuntimeError("no fake ranks are running: use fake_distributed.run_ranks")
        return transport

    @contextlib.contextmanager
    def recording_group(self) -> Iterator[None]:
        previous, _local.group = _local.group, object()
        try:
            yield
        finally:
            _local.group = previous


class FakeFramework:
    """What a test holds: the registered backend's name and a tensor factory."""

    def __init__(self, name: str, backend_cls: type) -> None:
        self.name = name
        self.backend_cls = backend_cls

    def tensor(self, data: Any, dtype: str = "float32") -> FakeTensor:
        return self.backend_cls.tensor_type(data, dtype)

    @property
    def backend(self) -> FakeBackend:
        return gradmgr.get_backend(self.name)


def register(name: str = "fake") -> FakeFramework:
    """Register a fake framework under ``name`` and return its tensor factory.

    ``"fake"`` owns :class:`FakeTensor`; any other name gets its own tensor type, defined in a
    new top-level module of that name, so that the two frameworks are told apart by the
    registry exactly as torch and megengine are.
    """
    cls = _registered.get(name)
    if cls is None:  # registering again would replace the backend instance managers hold
        if name == FakeBackend.name:
            cls = FakeBackend
        else:
            module = sys.modules[name] = types.ModuleType(name)
            tensor_type = type("Tensor", (FakeTensor,), {"__module__": name, "__slots__": ()})
            module.Tensor = tensor_type
            cls = type(f"{name}Backend", (FakeBackend,),
                       {"name": name, "tensor_type": tensor_type, "tensor_modules": (name,)})
        gradmgr.register_backend(name, cls, tensor_modules=list(cls.tensor_modules))
        _registered[name] = cls
    return FakeFramework(name, cls)


_registered: Dict[str, type] = {}


def live_state() -> Tuple[int, int]:
    """(started tapes, running backwards) in this thread; both 0 when nothing leaked."""
    return len(_local.active), len(_local.scopes)
