"""One side's step kept in a file (:func:`dump`) and read back as a model the tool compares
(:func:`load`): the reference runs where its framework installs (MegEngine needs Python
3.10 or older), the port where its own does, or on another device or framework version.

The file is a numpy ``.npz`` (no pickle) whose ``header`` member is UTF-8 JSON: ``format``
(:data:`FORMAT`), ``version`` (:data:`VERSION`), ``framework`` and ``framework_version``,
``device``, ``gradmgr``, ``python``, then what :func:`compare_step` reads of a side: the
layers (kind, configuration), the tensors (role, shape, trainable, ``transposed`` and
``note``: :class:`~gradmgr.parity.contract.Slot`), their values before the step (the
buffers', BatchNorm's running statistics, after it too), the batch, every watched call (its
output; its input for a piecewise layer; a functional call, ``F.relu``, its ``kind`` and
``config`` too), the loss and the gradients. Each array is a member ``a<n>`` the header
names.
"""

from __future__ import annotations

import json
import platform
import zipfile
from importlib import metadata
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .contract import Layer, Slot, adapter_for
from .errors import ParityError
from .modules import second_names
from .trace import Call, Loss, Trace, as_batch, run_step

FORMAT = "gradmgr.parity.dump"
VERSION = 3
"""The dump format this gradmgr writes and the only one it reads (docs/porting.md). Version
2 keeps each tensor's ``transposed`` and ``note`` (Paddle's Linear weight, its running
variance): a version 1 dump lacks them, and read as untransposed a square Linear weight would
be mapped, and its checkpoint converted, without its transpose. Version 3 keeps the buffers'
values after the step (``after``): without them a port that updates a buffer wrong (a
momentum, an EMA) could not be compared offline, and read OK."""

_DISTRIBUTIONS = {"torch": "torch", "megengine": "MegEngine", "paddle": "paddlepaddle"}


def dump(model: Any, batch: Any, path: str, *, loss: Optional[Loss] = None,
         inputs: int = 1) -> Dump:
    """Run one step of ``model`` on ``batch`` (as :func:`compare_step` runs a side) and write
    it to ``path`` (an ``.npz``); returns what :func:`load` would read back.

    Args:
        model: a PyTorch or MegEngine module (left as one training step leaves it).
        batch: a numpy array or a tuple of them, as :func:`compare_step` takes.
        path: the file to write.
        loss: ``loss(output, *targets) -> scalar tensor``; default the output's mean.
        inputs: how many leading batch items the model takes.

    Example:
        >>> import os, tempfile, numpy as np, torch
        >>> from gradmgr.parity import dump, load
        >>> path = os.path.join(tempfile.mkdtemp(), "run.npz")
        >>> _ = dump(torch.nn.Linear(4, 2), np.ones((3, 4), np.float32), path)
        >>> load(path).header["framework"], load(path).header["version"]
        ('torch', 3)
    """
    adapter = adapter_for(model)
    arrays = as_batch(batch)
    values = {s.name: adapter.read(s.name) for s in adapter.slots()}
    layers, slots = adapter.layers(), adapter.slots()
    trace = run_step(adapter, arrays, inputs, loss, {})
    after = {s.name: adapter.read(s.name) for s in slots if not s.trainable}
    store: List[np.ndarray] = []

    def key(array: Optional[np.ndarray]) -> Optional[str]:
        if array is None:
            return None
        store.append(np.ascontiguousarray(array))
        return f"a{len(store) - 1}"

    header = {
        "format": FORMAT, "version": VERSION, "framework": adapter.framework,
        "framework_version": _version(_DISTRIBUTIONS.get(adapter.framework,
                                                         adapter.framework)),
        "device": str(getattr(adapter, "device", "unknown")), "gradmgr": _version("gradmgr"),
        "python": platform.python_version(), "inputs": inputs,
        "loss": "mean" if loss is None else "custom", "loss_value": trace.loss,
        "dtype": np.dtype(trace.dtype).str, "order": trace.order,
        "layers": [{"name": y.name, "kind": y.kind, "config": _plain(y.config)}
                   for y in layers],
        "slots": [{"name": s.name, "layer": s.layer, "role": s.role, "shape": list(s.shape),
                   "trainable": s.trainable, "transposed": s.transposed, "note": s.note}
                  for s in slots],
        "aliases": dict(adapter.aliases),
        "unlisted": list(adapter.unlisted),
        "batch": [key(a) for a in arrays],
        "values": {name: key(v) for name, v in values.items()},
        "grads": {name: key(g) for name, g in trace.grads.items()},
        "after": {name: key(v) for name, v in after.items()},
        "calls": [dict({"layer": c.layer, "in_shape": list(c.in_shape), "done": c.done,
                        "output": key(c.output), "input": key(c.input)},
                       # a functional call (F.relu) is no layer: it keeps its kind with it
                       **({"kind": c.kind, "config": _plain(c.config)} if c.functional
                          else {})) for c in trace.calls],
    }
    members = {f"a{i}": a for i, a in enumerate(store)}
    members["header"] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    with open(path, "wb") as file:
        np.savez(file, **members)  # type: ignore[arg-type]  # (numpy's stubs: one kwarg type)
    return load(path)


def load(path: str) -> Dump:
    """A file :func:`dump` wrote, as a model :func:`compare_step` and
    :func:`transfer_weights` take (as the reference ``a``, or the port ``b``), or
    :class:`ParityError` if it is no dump or a version this gradmgr cannot read.

    Example:
        >>> import os, tempfile, numpy as np
        >>> from gradmgr.parity import ParityError, load
        >>> path = os.path.join(tempfile.mkdtemp(), "other.npz")
        >>> np.savez(path, x=np.zeros(2))
        >>> try:
        ...     load(path)
        ... except ParityError as error:
        ...     print(str(error).split(":")[0])
        not a gradmgr parity dump
    """
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:  # (cut short, edited)
        raise ParityError(f"cannot read {path} as a gradmgr parity dump (an .npz written by "
                          f"gradmgr.parity.dump): {error}") from error
    if "header" not in arrays:
        raise ParityError(f"not a gradmgr parity dump: {path} has no header member (write "
                          f"one with gradmgr.parity.dump)")
    header = json.loads(arrays.pop("header").tobytes().decode("utf-8"))
    if header.get("format") != FORMAT:
        raise ParityError(f"not a gradmgr parity dump: {path}'s header names format "
                          f"{header.get('format')!r}, not {FORMAT!r}")
    if header.get("version") != VERSION:
        raise ParityError(
            f"{path} is a parity dump of format version {header.get('version')!r} (written "
            f"by gradmgr {header.get('gradmgr')}); this gradmgr ({_version('gradmgr')}) reads "
            f"version {VERSION} only: compare it with the gradmgr that wrote it, or dump the "
            f"run again with this one")
    _check_complete(path, header, arrays)
    return Dump(header, arrays)


def _check_complete(path: str, header: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
    """Every tensor the header names is in the file, and every tensor's value, gradient (a
    trainable one's) and value after the step (a buffer's) is named: a gradient left out
    would be no row of the report, not a difference."""
    aliases = header["aliases"]
    tables = {"values": [s["name"] for s in header["slots"]],
              "grads": [s["name"] for s in header["slots"] if s["trainable"]],
              "after": [s["name"] for s in header["slots"] if not s["trainable"]]}
    named = {table: header.get(table, {}) for table in tables}
    missing = [f"{table}[{name!r}]" for table, names in tables.items() for name in names
               if name not in named[table] and aliases.get(name) not in named[table]]
    keys = (list(header["batch"]) + [c[k] for c in header["calls"] for k in ("output", "input")]
            + [k for table in named.values() for k in table.values()])
    missing += [f"member {k}" for k in keys if k is not None and k not in arrays]
    if missing:
        raise ParityError(f"{path} is an incomplete parity dump: {', '.join(missing[:5])}"
                          f"{' ...' if len(missing) > 5 else ''} missing (the file was edited "
                          f"or cut short): dump the run again")


class Dump:
    """A recorded step of one model, read back (:func:`load`): the tool's view of a model
    (:class:`~gradmgr.parity.contract.ModelAdapter`) that replays instead of running.
    ``header`` is the file's header, ``batch`` the batch it was recorded on."""

    def __init__(self, header: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
        self.header, self._arrays = header, arrays
        self.framework = header["framework"]
        self.model = self
        self.device = header["device"]
        self.aliases = dict(header["aliases"])
        self.unlisted = list(header.get("unlisted", []))  # (a dump from before it was kept)
        # the recorded calls stand for the hooked layers: a layer shared under two names is
        # called under its first only
        self.second = second_names(self.aliases, {c["layer"] for c in header["calls"]})
        self.batch: Tuple[np.ndarray, ...] = tuple(arrays[k] for k in header["batch"])
        self._layers = [Layer(y["name"], y["kind"], _tuples(y["config"]))
                        for y in header["layers"]]
        self._slots = [Slot(s["name"], s["layer"], s["role"], tuple(s["shape"]),
                            s["trainable"], s["transposed"], s["note"])
                       for s in header["slots"]]

    def __repr__(self) -> str:
        h = self.header
        return (f"<parity dump: {h['framework']} {h['framework_version']} on {h['device']}, "
                f"{len(h['calls'])} calls, gradmgr {h['gradmgr']}>")

    def parity_adapter(self) -> Dump:
        """Itself: a dump is its own adapter (gradmgr.parity.contract.adapter_for)."""
        return self

    def _own(self, table: Dict[str, Any], name: str) -> str:
        """The name ``name`` is recorded under in ``table``: its own where it is (a Paddle
        Linear's weight tied to an Embedding's is that tensor in another layout), else that
        of the parameter it is tied to."""
        return name if name in table else self.aliases.get(name, name)

    def _array(self, key: Optional[str]) -> Optional[np.ndarray]:
        return None if key is None else self._arrays[key].copy()

    def layers(self) -> List[Layer]:
        return list(self._layers)

    def slots(self) -> List[Slot]:
        return list(self._slots)

    def read(self, name: str) -> np.ndarray:
        return self._required("values", name, "value before its step")

    def write(self, name: str, value: np.ndarray) -> None:
        # restoring the values it was recorded with is fine; anything else would be a guess
        if not np.array_equal(np.asarray(value), self.read(name).reshape(np.shape(value))):
            raise ParityError(f"a parity dump is read-only: cannot write {name} into it; "
                              f"transfer the weights from the dump into the live model")

    def read_after(self, name: str) -> np.ndarray:
        """A buffer's value as the recorded step left it (:meth:`read`: before the step)."""
        return self._required("after", name, "value after its step")

    def _required(self, table: str, name: str, what: str) -> np.ndarray:
        entries = self.header[table]
        value = self._array(entries[self._own(entries, name)])
        if value is None:  # (load() checked that every tensor's is there)
            raise ParityError(f"the parity dump holds no {what} of {name}: dump the run again")
        return value

    def grad(self, name: str) -> Optional[np.ndarray]:
        grads = self.header["grads"]
        return self._array(grads.get(self._own(grads, name)))

    def clear_grads(self) -> None:
        pass

    def recorded_order(self) -> List[str]:
        """The layers in the order the recorded forward first called them."""
        return list(self.header["order"])

    def replay(self, batch: Sequence[np.ndarray], inputs: int, loss: Optional[Loss],
               pins: Dict[int, Any]) -> Trace:
        """The recorded step, as :func:`~gradmgr.parity.trace.run_step` returns a live one;
        :class:`ParityError` if asked for another batch or another run."""
        if loss is not None:
            raise ParityError("a parity dump's loss was recorded with it: pass no loss for "
                              "the dump's side")
        if pins:
            raise ParityError("a parity dump cannot run again with a pinned branch")
        same = (len(batch) == len(self.batch) and inputs == self.header["inputs"]
                and all(np.array_equal(x, y) for x, y in zip(batch, self.batch)))
        if not same:
            raise ParityError("the batch is not the one the dump was recorded on: pass "
                              "dump.batch (and the inputs= it was dumped with, "
                              f"{self.header['inputs']})")
        by_name = {y.name: y for y in self._layers}
        own = {c["layer"]: Layer(c["layer"], c["kind"], _tuples(c["config"]))
               for c in self.header["calls"] if "kind" in c}
        by_name.update(own)
        calls = [Call(c["layer"], by_name[c["layer"]].kind, by_name[c["layer"]].config,
                      tuple(c["in_shape"]), self._array(c["output"]), self._array(c["input"]),
                      c["done"], functional=c["layer"] in own) for c in self.header["calls"]]
        grads = {name: self._array(key) for name, key in self.header["grads"].items()}
        return Trace(calls, float(self.header["loss_value"]), grads,
                     np.dtype(self.header["dtype"]), list(self.header["order"]))

    def __getattr__(self, name: str) -> Any:
        if name in ("parameters", "tensor", "numpy", "is_tensor", "hook", "clone", "offset",
                    "mask", "mean", "step"):
            raise ParityError(f"a parity dump holds one recorded step and cannot run ({name}): "
                              f"compare_step and transfer_weights take it, train_drift needs "
                              f"live models")
        raise AttributeError(name)


def after_step(adapter: Any, name: str) -> np.ndarray:
    """A tensor's value as the compared step left it: a live model's now, a dump's as
    recorded after its step."""
    return adapter.read_after(name) if isinstance(adapter, Dump) else adapter.read(name)


def recorded_loss(adapter: Any) -> Optional[str]:
    """``"mean"`` or ``"custom"``: the loss a dump was recorded with; None for a live model."""
    return adapter.header["loss"] if isinstance(adapter, Dump) else None


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def _plain(value: Any) -> Any:
    """A configuration as JSON holds it (a tuple as a list; anything else as its repr)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _tuples(value: Any) -> Any:
    """A configuration read back: lists as the tuples they were."""
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value
