"""One side of a compared step: the model's forward with every leaf layer watched, the loss,
and the backward under a gradmgr GradManager; all of it kept as numpy arrays."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..manager import GradManager
from .contract import PIECEWISE, Layer, ModelAdapter
from .errors import ParityError

Loss = Callable[..., Any]


@dataclass
class Call:
    """One call of a leaf layer during the forward (a layer called twice gives two calls)."""

    layer: str
    kind: str
    config: Dict[str, Any]
    in_shape: Tuple[int, ...]
    output: Optional[np.ndarray]
    input: Optional[np.ndarray] = None  # kept for piecewise layers only (kinks.py)
    done: int = -1  # the order in which calls return (a module's after its children's)
    functional: bool = False  # a function the model called (F.relu), not a module
    # the gradient the call's backward sends to its input (piecewise calls, where the adapter
    # can tap it: ModelAdapter.tap): what a backward-only bug in the call itself changes
    grad_in: Optional[np.ndarray] = None


@dataclass
class Trace:
    """What one side computed for one batch."""

    calls: List[Call]
    loss: float
    grads: Dict[str, Optional[np.ndarray]]
    dtype: Any = np.float32
    order: List[str] = field(default_factory=list)  # layers by first call


def as_batch(batch: Any) -> Tuple[np.ndarray, ...]:
    """The batch as a tuple of numpy arrays (one array alone is a batch of one tensor)."""
    # Only a tuple or list is a batch of several items: anything else (a numpy array, or a
    # framework's tensor, which iterates over its rows) is one item.
    items = batch if isinstance(batch, (tuple, list)) else (batch,)
    arrays = tuple(_as_array(i, item) for i, item in enumerate(items))
    for i, a in enumerate(arrays):
        if a.dtype.kind not in "fiub":
            raise ParityError(f"batch item {i} has dtype {a.dtype}: the batch must hold "
                              f"numeric numpy arrays, converted for each framework")
    if not arrays:
        raise ParityError("the batch is empty: give the model's input (and the loss's "
                          "targets) as numpy arrays")
    return arrays


def _as_array(index: int, item: Any) -> np.ndarray:
    if isinstance(item, (tuple, list)):
        raise ParityError(
            f"batch item {index} is a {type(item).__name__}: the batch is a flat tuple of "
            f"arrays; give the model's inputs as the first items and say how many with "
            f"inputs= (a model taking a tuple: wrap it in a module taking them one by one)")
    try:
        array = np.asarray(item)
    except (TypeError, ValueError, RuntimeError) as error:  # a tensor numpy cannot read
        raise ParityError(
            f"batch item {index} ({type(item).__name__}) cannot be read as a numpy array "
            f"({error}): give numpy arrays (a torch tensor: x.detach().cpu().numpy()), "
            f"converted for each framework") from None
    # a framework's tensor may lend a read-only view: torch warns on one
    return array if array.flags.writeable else array.copy()


def forward_order(adapter: ModelAdapter, batch: Sequence[np.ndarray], inputs: int) -> List[str]:
    """The leaf layers in the order one forward calls them first; buffers (BatchNorm's
    running statistics) are put back as they were."""
    recorded = getattr(adapter, "recorded_order", None)  # a dump (dump.py) replays
    if recorded is not None:
        return recorded()
    calls = _watch(adapter, batch, inputs, loss=None, pins={}, backward=False)[0]
    return _first_calls(calls, adapter.second)


def run_step(adapter: ModelAdapter, batch: Sequence[np.ndarray], inputs: int,
             loss: Optional[Loss], pins: Dict[int, tuple]) -> Trace:
    """One forward and backward; ``pins`` maps a call's index to its pin (kinks.py):
    ``("mask", keep[, where])``: the output is ``x * keep`` (only where ``where`` is set, if
    given, ``("offset", delta)``: the input is ``x + delta``. A dump (dump.py) replays."""
    replay = getattr(adapter, "replay", None)
    if replay is not None:
        return replay(batch, inputs, loss, pins)
    calls, value, grads = _watch(adapter, batch, inputs, loss, pins, backward=True)
    dtype = calls[0].output.dtype if calls and calls[0].output is not None else np.float32
    return Trace(calls, value, grads, dtype, _first_calls(calls, adapter.second))


def train_step(adapter: ModelAdapter, batch: Sequence[np.ndarray], inputs: int,
               loss: Optional[Loss]) -> float:
    """One forward and backward, nothing watched (a training step of :mod:`.drift`);
    returns the loss."""
    return _forward_backward(adapter, batch, inputs, loss, backward=True)[0]


def _first_calls(calls: List[Call], second: Mapping[str, str]) -> List[str]:
    """The layers by first call; a layer shared under two names (``second``: {other name:
    first name}) is called under its first name only, so its other names take the places of
    its second, third... calls, where the other model calls its counterparts."""
    others: Dict[str, List[str]] = {}
    for other, first in second.items():
        others.setdefault(first, []).append(other)
    found: Dict[str, None] = {}
    for c in calls:
        if c.layer in found and others.get(c.layer):
            found[others[c.layer].pop(0)] = None
        found.setdefault(c.layer, None)
    return list(found)


def _watch(adapter: ModelAdapter, batch: Sequence[np.ndarray], inputs: int,
           loss: Optional[Loss], pins: Dict[int, tuple],
           backward: bool) -> tuple:
    layers = {layer.name: layer for layer in adapter.layers()}
    calls: List[Call] = []
    finished = [0]
    running: Dict[str, List[int]] = {}  # a layer's calls whose forward has not returned
    saved: Dict[int, Any] = {}
    kept = None if backward else snapshot(adapter)

    def pre(name: str, args: Tuple[Any, ...],
            function: Optional[Layer] = None) -> Optional[Tuple[Any, ...]]:
        # a functional call (F.relu) comes with its own Layer: it is no module of the model
        layer, x = function or layers[name], args[0] if args else None
        index = len(calls)
        shape = tuple(x.shape) if x is not None and adapter.is_tensor(x) else ()
        piecewise = layer.kind in PIECEWISE and adapter.is_tensor(x)
        calls.append(Call(name, layer.kind, layer.config, shape, None,
                          adapter.numpy(x) if piecewise else None,
                          functional=function is not None))
        running.setdefault(name, []).append(index)
        tapped = _tap(adapter, x, calls[index]) if piecewise and backward else None
        x = x if tapped is None else tapped
        if index in pins and pins[index][0] == "offset":
            return (adapter.offset(x, pins[index][1]),) + tuple(args[1:])
        if index in pins:  # an in-place ReLU must not overwrite the input the pin needs
            saved[index] = x
            return (adapter.clone(x),) + tuple(args[1:])
        return None if tapped is None else (x,) + tuple(args[1:])

    def post(name: str, out: Any) -> Any:
        index = running[name].pop()
        calls[index].done, finished[0] = finished[0], finished[0] + 1
        if index in saved:
            out = _pinned(adapter, out, saved.pop(index), pins[index])
        shown = out  # a layer returning a tuple (an LSTM, an attention) by its first tensor
        if isinstance(out, (tuple, list)):
            shown = next((o for o in out if adapter.is_tensor(o)), None)
        if adapter.is_tensor(shown):
            calls[index].output = adapter.numpy(shown)
        return out if index in pins and pins[index][0] == "mask" else None

    remove = adapter.hook(pre, post)
    try:
        return (calls,) + _forward_backward(adapter, batch, inputs, loss, backward)
    finally:
        remove()
        if kept is not None:
            restore(adapter, kept)


def _tap(adapter: ModelAdapter, x: Any, call: Call) -> Optional[Any]:
    """``x`` as the adapter passes it on with ``call.grad_in`` set in the backward, or None
    where the adapter cannot tap a gradient (MegEngine) or ``x`` takes none."""
    tap = getattr(adapter, "tap", None)
    if tap is None:
        return None

    def keep(grad: Any) -> None:
        call.grad_in = adapter.numpy(grad)
    tapped = tap(x, keep)
    if tapped is not None and call.input is not None:  # no gradient reaching it is a zero
        call.grad_in = np.zeros_like(call.input)
    return tapped


def _pinned(adapter: ModelAdapter, out: Any, x: Any, pin: tuple) -> Any:
    """A pinned layer's output: ``x * keep`` where the pin holds (its third item, if any;
    everywhere without one); elsewhere the layer's own output, so that its own backward
    (a port's hand-written one among them) is still what is compared."""
    if len(pin) < 3:
        return adapter.mask(x, pin[1])
    where = pin[2].astype(pin[1].dtype)
    return adapter.mask(out, 1 - where) + adapter.mask(x, pin[1] * where)


def _forward_backward(adapter: ModelAdapter, batch: Sequence[np.ndarray], inputs: int,
                      loss: Optional[Loss], backward: bool) -> tuple:
    tensors = [adapter.tensor(a) for a in batch]
    if not backward:
        _call(adapter, tensors[:inputs])
        return (None, {})
    adapter.clear_grads()
    gm = GradManager().attach(adapter.parameters())
    with gm:
        output = _call(adapter, tensors[:inputs])
        value = _loss(adapter, loss, output, tensors[inputs:])
        gm.backward(value)
    grads = {slot.name: adapter.grad(slot.name) for slot in adapter.slots() if slot.trainable}
    return (float(adapter.numpy(value).reshape(-1)[0]), grads)


def _call(adapter: ModelAdapter, inputs: Sequence[Any]) -> Any:
    try:
        return adapter.model(*inputs)
    except Exception as error:  # a batch that does not fit: say which model and which shapes
        shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
        raise ParityError(
            f"the {adapter.framework} model ({type(adapter.model).__name__}) failed on the "
            f"batch's input(s) of shape {shapes}: {type(error).__name__}: {error}") from error


def _loss(adapter: ModelAdapter, loss: Optional[Loss], output: Any,
          targets: Sequence[Any]) -> Any:
    if loss is None:
        return _mean(adapter, output)
    try:
        return loss(output, *targets)
    except Exception as error:  # say which side, and the dtypes a port most often gets wrong
        dtypes = [str(t.dtype) for t in targets]
        hint = ("; each framework gets the batch's items in their numpy dtype: give class "
                "targets as int64 (PyTorch's losses need it, MegEngine reads it as int32)"
                if any("int" in d and "int64" not in d for d in dtypes) else "")
        raise ParityError(
            f"the {adapter.framework} loss failed (targets' dtypes: "
            f"{', '.join(dtypes) or 'none'}): {type(error).__name__}: {error}{hint}") from error


def _mean(adapter: ModelAdapter, output: Any) -> Any:
    if not adapter.is_tensor(output):
        raise ParityError(
            f"the {adapter.framework} model returned a {type(output).__name__}, not a tensor: "
            f"pass loss_a= and loss_b= (loss(output, *targets) -> scalar tensor)")
    return adapter.mean(output)


def snapshot(adapter: ModelAdapter) -> Dict[str, np.ndarray]:
    """The buffers' values, to run a step again from the same state (:func:`restore`)."""
    return {s.name: adapter.read(s.name) for s in adapter.slots() if not s.trainable}


def restore(adapter: ModelAdapter, values: Dict[str, np.ndarray]) -> None:
    """Put back the buffers' values :func:`snapshot` took."""
    for name, value in values.items():
        adapter.write(name, value)
