"""What the parity tool needs from a framework, and how it finds the adapter for a model.

The core never touches a framework's module: each backend hands out a :class:`ModelAdapter`
(``Backend.parity_adapter(model)``, found from the backend of the model's first parameter, as
data parallelism finds a backend's ``TensorOps``). Everything crosses this line as numpy arrays
or as opaque tensors the adapter made itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import numpy as np

from ..errors import UnsupportedBackendError
from ..registry import backend_for
from .errors import ModelTypeError

# Layer kinds that compute differently in training and in eval mode: their config carries
# ``training`` (a state, not a setting: compare_step notes it, transfer_weights ignores it).
MODAL = ("batchnorm", "syncbatchnorm", "dropout", "instancenorm")
# Layer kinds whose output is piecewise in the input and whose flips kinks.py can find: two
# frameworks may take different branches for an input within rounding of the kink. Their
# inputs are kept (a copy per call): only for the kinds kinks.py reads.
PIECEWISE = ("relu", "leakyrelu", "maxpool2d")


@dataclass(frozen=True)
class Layer:
    """A leaf module: its qualified name, its kind (the lower-cased class name, the same in
    both frameworks: ``conv2d``, ``linear``, ``batchnorm2d``, ``relu``...) and its
    configuration in framework-neutral terms (BatchNorm momentum in PyTorch's convention:
    the weight of the new batch statistic)."""

    name: str
    kind: str
    config: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Slot:
    """A parameter or buffer of a model: qualified name, its layer, its role in the layer
    (``weight``, ``bias``, ``running_mean``...), shape, and whether it is trained.
    ``transposed``: the framework stores it transposed (Paddle's Linear weight, ``[in, out]``);
    ``shape``, ``read``, ``write`` and ``grad`` are in the contract's layout all the same
    (PyTorch's ``[out, in]``), and a checkpoint file holds it as stored. ``note``: what the
    framework does with it differently that no translation undoes (Paddle's running
    variance), said in the weight map's ``how``."""

    name: str
    layer: str
    role: str
    shape: Tuple[int, ...]
    trainable: bool
    transposed: bool = False
    note: str = ""


# pre(name, inputs[, layer]): a functional call (F.relu) gives its own Layer (a backend that
# watches functions: gradmgr/backends/torch/parity_functions.py)
Pre = Callable[..., Optional[Tuple[Any, ...]]]
Post = Callable[[str, Any], Any]


class ModelAdapter(Protocol):
    """One model of one framework, as the parity tool sees it.

    ``aliases``: a tied parameter's other names, ``{other name: its name}`` (``head.weight ->
    emb.weight``), each a slot of its own (:meth:`slots`) so that the weight map sees the tie;
    empty without ties. ``second``: a layer shared under two names (``self.b = self.a``),
    ``{its other name: the name its calls are under}``, each a layer of its own
    (:meth:`layers`); gradmgr.parity.modules.second_names finds them from ``aliases``.
    ``unlisted``: the tied names the framework's state dict leaves out (MegEngine lists a
    layer shared under two names once: gradmgr.parity.checkpoint_ties)."""

    framework: str
    model: Any
    aliases: Mapping[str, str]
    second: Mapping[str, str]
    unlisted: Sequence[str]

    def layers(self) -> List[Layer]:
        """The leaf modules, and the modules that own a parameter or buffer themselves, in
        registration order."""

    def slots(self) -> List[Slot]:
        """Parameters (trainable) and buffers."""

    def read(self, name: str) -> np.ndarray:
        """A slot's value as a new numpy array."""

    def write(self, name: str, value: np.ndarray) -> None:
        """Set a slot's value in place (``value`` has the slot's shape)."""

    def parameters(self) -> List[Any]:
        """The framework's trainable parameter objects, in :meth:`slots` order."""

    def grad(self, name: str) -> Optional[np.ndarray]:
        """A parameter's ``.grad`` as numpy, or None."""

    def clear_grads(self) -> None:
        """Set every parameter's ``.grad`` to None."""

    def tensor(self, array: np.ndarray) -> Any:
        """A framework tensor holding ``array`` (on the model's device)."""

    def numpy(self, tensor: Any) -> np.ndarray:
        """A tensor's value as a new numpy array."""

    def is_tensor(self, obj: Any) -> bool:
        """True for a tensor of this framework."""

    def hook(self, pre: Pre, post: Post) -> Callable[[], None]:
        """Call ``pre(layer, inputs)`` before and ``post(layer, output)`` after every leaf
        module's forward (each may return a replacement: inputs, output); returns the
        remover. A backend that watches functional calls too (torch) calls
        ``pre(place, inputs, Layer)`` and ``post(place, output)`` around each. An adapter
        may also have ``tap(x, keep) -> copy of x or None``: ``keep(grad)`` gets the
        gradient the call given the copy sends back (gradmgr/parity/trace.py)."""

    def clone(self, tensor: Any) -> Any:
        """A differentiable copy (what an in-place layer may overwrite, kept intact)."""

    def offset(self, x: Any, delta: np.ndarray) -> Any:
        """``x + delta``, ``delta`` a constant (a pinned max-pool's input)."""

    def mask(self, x: Any, keep: np.ndarray) -> Any:
        """``x * keep`` (a pinned ReLU: the elements the other side zeroed, zeroed here)."""

    def mean(self, tensor: Any) -> Any:
        """The mean of a tensor (the default loss)."""

    def step(self, optimizer: Any) -> None:
        """One optimizer step from the current ``.grad``, then clear the gradients."""


def adapter_for(model: Any) -> ModelAdapter:
    """The adapter of ``model``'s framework, or :class:`ModelTypeError` naming what it is.
    An object that is its own view (a recorded step, :mod:`.dump`) says so with a
    ``parity_adapter()`` method."""
    own = getattr(model, "parity_adapter", None)
    if callable(own):
        return own()
    try:
        first = next(iter(model.parameters()), None)
    except (AttributeError, TypeError):
        first = None
    backend = backend_for(first) if first is not None else None
    if backend is None:
        raise ModelTypeError(
            f"cannot compare a {type(model).__name__}: the parity tool takes a module of a "
            f"framework gradmgr knows (a torch.nn.Module, megengine.module.Module or "
            f"paddle.nn.Layer) with at least one parameter")
    try:
        return backend.parity_adapter(model)
    except UnsupportedBackendError as error:
        raise ModelTypeError(str(error)) from error


# The kinds a port's own class is matched as when its name ends with one (a BERT port's
# ``BertLayerNorm`` is a ``layernorm``): the kind shown stays the class's own.
FAMILIES = ("layernorm", "batchnorm1d", "batchnorm2d", "groupnorm", "linear", "conv1d",
            "conv2d", "embedding", "relu", "gelu", "dropout", "maxpool2d", "avgpool2d")


def family(kind: str) -> str:
    """``kind``, or the known kind its name ends with (``bertlayernorm`` -> ``layernorm``).

    Example:
        >>> from gradmgr.parity.contract import family
        >>> family("bertlayernorm"), family("conv2d")
        ('layernorm', 'conv2d')
    """
    return next((f for f in FAMILIES if kind.endswith(f)), kind)


def squeezed(shape: Sequence[int]) -> Tuple[int, ...]:
    """``shape`` without its size-1 dims: two layouts of the same elements in the same order
    (MegEngine's ``(1, C, 1, 1)`` BatchNorm weight, PyTorch's ``(C,)``) compare equal."""
    return tuple(int(d) for d in shape if d != 1)
