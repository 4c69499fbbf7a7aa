"""What the parity adapters of every framework share: a model seen through its named modules,
parameters and buffers (both frameworks name them alike and hook a module's forward alike).

A backend's adapter derives from :class:`NamedModules` and adds what differs: how a module's
kind and configuration read, and how tensors are made, copied and written.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np

from .contract import MODAL, Layer, Post, Pre, Slot, family


def hooked_too(remove_first: Callable[[], None],
               install: Callable[[], Callable[[], None]]) -> Callable[[], None]:
    """Install a second set of hooks beside a first (whose remover is ``remove_first``): if
    installing fails, the first is removed too, so no hook outlives the error; the remover
    returned removes both, the second first."""
    try:
        remove_second = install()
    except BaseException:
        remove_first()
        raise

    def remove() -> None:
        try:
            remove_second()
        finally:
            remove_first()
    return remove


def as_tuple(value: Any, n: int) -> tuple:
    """``value`` as an ``n``-tuple (a kernel size given as one int)."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def nearest_kind(module: Any, package: str) -> str:
    """The lower-cased name of the nearest class of ``module`` defined under ``package``
    (``"torch.nn."``): a port's subclass of a Linear with its own forward is still a
    ``linear``."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith(package) and cls.__name__ != "Module":
            return cls.__name__.lower()
    return type(module).__name__.lower()


def tied_names(unique: Mapping[str, Any], every: Iterable[Tuple[str, Any]]) -> Dict[str, str]:
    """The other names of tied parameters, ``{other name: its name in unique}``: ``every`` is
    the model's ``(name, parameter)`` list with the duplicates kept, ``unique`` without
    (each framework keeps one name: torch and Paddle the first registered, MegEngine the
    first in sorted order)."""
    first = {id(p): name for name, p in unique.items()}
    return {name: first[id(p)] for name, p in every if name not in unique and id(p) in first}


def second_names(aliases: Mapping[str, str], hooked: Iterable[str]) -> Dict[str, str]:
    """A layer shared under two names (``self.b = self.a``): ``{its other name: the name it is
    hooked under}``, from its parameters' aliases (``b.weight -> a.weight``). Each framework
    lists a module once, so the other name is no leaf, never hooked and never called: the
    one layer's calls are all under its first name."""
    hooked = set(hooked)
    found = {}
    for alias, name in aliases.items():
        (other, _, role), (first, _, own) = alias.rpartition("."), name.rpartition(".")
        if role == own and other != first and other not in hooked and first in hooked:
            found[other] = first
    return found


# Configuration a port's own module keeps under another name (a BERT port's LayerNorm keeps
# its eps as ``variance_epsilon``): read where the framework's config reader knows no class.
ALIASES = {"eps": ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")}


def attribute_config(module: Any) -> Dict[str, Any]:
    """The configuration of a module of no framework class, from its plain number
    attributes (:data:`ALIASES`)."""
    found = {}
    for key, names in ALIASES.items():
        value = next((getattr(module, n) for n in names
                      if isinstance(getattr(module, n, None), (int, float))
                      and not isinstance(getattr(module, n), bool)), None)
        if value is not None:
            found[key] = value
    return found


class NamedModules:
    """The tables of a model, and what reads only them.

    ``leaves``: the leaf modules, and every module that owns a tensor itself (an attention's
    ``in_proj_weight``, a model's position embedding), so that no tensor belongs to no layer;
    ``params`` and ``buffers``: the model's named parameters and buffers.
    """

    framework = ""

    def __init__(self, model: Any, leaves: Dict[str, Any], params: Dict[str, Any],
                 buffers: Dict[str, Any], aliases: Optional[Dict[str, str]] = None) -> None:
        self.model, self.leaves, self.params, self.buffers = model, leaves, params, buffers
        # Tied weights: {another name of a parameter: its name in params} (head.weight ->
        # emb.weight). A slot of its own, so that its layer pairs with the other model's and
        # the mapping sees the tie (mapping.tie_findings); one parameter all the same.
        self.aliases = dict(aliases or {})
        # a whole layer shared: its other name a layer of its own in the map, like a tie's
        self.second = second_names(self.aliases, leaves)
        # the tied names the framework's state dict leaves out (gradmgr.parity.checkpoint)
        self.unlisted: List[str] = []
        self.device = next(iter(params.values())).device

    def kind(self, module: Any) -> str:
        raise NotImplementedError

    def config(self, module: Any) -> Dict[str, Any]:
        raise NotImplementedError

    def numpy(self, tensor: Any) -> np.ndarray:
        raise NotImplementedError

    def layers(self) -> List[Layer]:
        found = []
        for name, m in self.leaves.items():
            kind, config = self.kind(m), dict(self.config(m) or attribute_config(m))
            if family(kind).startswith(MODAL):  # a port's own BatchNorm too
                config["training"] = bool(m.training)
            found.append(Layer(name, kind, config))
        first = {layer.name: layer for layer in found}
        found += [Layer(other, first[name].kind, first[name].config)
                  for other, name in self.second.items()]
        return found

    def slots(self) -> List[Slot]:
        found = []
        for table, trainable in ((self.params, True), (self.buffers, False)):
            for name, t in table.items():
                layer, _, role = name.rpartition(".")
                found.append(Slot(name, layer, role, tuple(t.shape), trainable))
        for alias, name in self.aliases.items():
            layer, _, role = alias.rpartition(".")
            found.append(Slot(alias, layer, role, tuple(self.params[name].shape), True))
        return found

    def slot(self, name: str) -> Any:
        """The parameter or buffer named ``name`` (or another name of a tied parameter)."""
        name = self.aliases.get(name, name)
        return self.params[name] if name in self.params else self.buffers[name]

    def read(self, name: str) -> np.ndarray:
        return self.numpy(self.slot(name))

    def parameters(self) -> List[Any]:
        return list(self.params.values())

    def grad(self, name: str) -> Optional[np.ndarray]:
        g = self.params[self.aliases.get(name, name)].grad
        return None if g is None else self.numpy(g)

    def clear_grads(self) -> None:
        for p in self.params.values():
            p.grad = None

    def hook(self, pre: Pre, post: Post) -> Callable[[], None]:
        handles = []
        for name, m in self.leaves.items():
            handles.append(m.register_forward_pre_hook(
                lambda mod, inputs, name=name: pre(name, inputs)))
            handles.append(m.register_forward_hook(
                lambda mod, inputs, out, name=name: post(name, out)))

        def remove() -> None:
            for handle in handles:
                handle.remove()
        return remove
