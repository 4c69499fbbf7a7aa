"""Tied weights in checkpoint files (:func:`~gradmgr.parity.checkpoint.convert_checkpoint`):
one parameter under two names (an LM head on its embedding's weight, one layer under two
attribute names). The map file records per side ``tied`` (``{other name: first name}``, the
adapter's ``aliases``) and ``unlisted`` (the tied names that side's state dict leaves out:
MegEngine lists a layer shared under two names once). A file never gives one parameter two
values: two names of one parameter that hold different values are refused, never picked.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Set, Tuple

import numpy as np

from .contract import ModelAdapter


def recorded(a: ModelAdapter, b: ModelAdapter) -> Dict[str, Any]:
    """The map file's ``tied`` and ``unlisted`` of the adapters ``a`` (src) and ``b`` (dst)."""
    return {"tied": {"src": dict(a.aliases), "dst": dict(b.aliases)},
            "unlisted": {"src": sorted(a.unlisted), "dst": sorted(b.unlisted)}}


def _groups(written: Mapping[str, Any], side: str) -> List[List[str]]:
    """The names of each tied parameter of ``side``, its first name first."""
    found: Dict[str, List[str]] = {}
    for other, first in written["tied"][side].items():
        found.setdefault(first, [first]).append(other)
    return list(found.values())


def _unlisted(written: Mapping[str, Any], side: str) -> List[str]:
    return list(written["unlisted"][side])


def _same(x: np.ndarray, y: np.ndarray) -> bool:
    """Bit for bit: one parameter's value read under two names."""
    return (x.shape == y.shape and x.dtype == y.dtype
            and np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes())


def _difference(x: np.ndarray, y: np.ndarray) -> str:
    if x.shape != y.shape:
        return f"shapes {x.shape} and {y.shape}"
    return f"largest difference {np.abs(x.astype(np.float64) - y.astype(np.float64)).max():.3g}"


def _apart(values: Mapping[str, np.ndarray], written: Mapping[str, Any],
           side: str) -> List[Tuple[str, str]]:
    """The pairs of names of one tied parameter of ``side`` (its first name present, another)
    whose values in ``values`` are not bit for bit the same."""
    found = []
    for names in _groups(written, side):
        present = [n for n in names if n in values]
        found += [(present[0], name) for name in present[1:]
                  if not _same(values[present[0]], values[name])]
    return found


def read_tied(source: Dict[str, np.ndarray], written: Mapping[str, Any],
              side: str) -> List[str]:
    """Check the checkpoint ``source`` of the map's ``side``: every tied parameter must hold
    one value under all the names the file has; a name its framework leaves out is filled
    in (in place) from another. Returns the refusals."""
    refused = [
        f"  {a}, {b}: one parameter in the map's {written[side]} model (tied), but the "
        f"checkpoint holds different values under the two names "
        f"({_difference(source[a], source[b])}): nothing is picked; write the map again from "
        f"models that do not tie them, or make the two equal in the checkpoint"
        for a, b in _apart(source, written, side)]
    unlisted = _unlisted(written, side)
    for names in _groups(written, side):
        present = [n for n in names if n in source]
        source.update({n: source[present[0]] for n in names
                       if present and n not in source and n in unlisted})
    return refused


def write_tied(values: Mapping[str, np.ndarray], origin: Mapping[str, str],
               written: Mapping[str, Any], side: str) -> List[str]:
    """Check the converted ``values`` of the map's ``side`` (``origin``: each one's name in
    the checkpoint): a tied parameter must receive one value from all its names. Returns
    the refusals."""
    return [
        f"  {a}, {b}: one parameter in the {written[side]} model (tied), but the checkpoint's "
        f"{origin[a]} and {origin[b]}, converted into them, differ "
        f"({_difference(values[a], values[b])}): nothing is picked; convert into a model that "
        f"does not tie them, or make {origin[a]} and {origin[b]} equal in the checkpoint"
        for a, b in _apart(values, written, side)]


def also_named(written: Mapping[str, Any], side: str, mapped: Set[str]) -> Dict[str, str]:
    """The tied names of ``side`` the map pairs with nothing, ``{name: first name}``, where
    the first name is ``mapped``: names a state dict lists for a parameter it lists under
    its first name too (Paddle's RNN cells: ``rnn.0.cell.weight_ih`` for
    ``rnn.weight_ih_l0``). Read, they are checked like any tie (:func:`read_tied`) and
    converted under the first name; written, each gets the first name's value."""
    return {other: first for other, first in written["tied"][side].items()
            if first in mapped and other not in mapped}


def listed(values: Dict[str, np.ndarray], written: Mapping[str, Any],
           side: str) -> Dict[str, np.ndarray]:
    """``values`` without the names ``side``'s state dict leaves out (its strict load
    refuses them)."""
    unlisted = set(_unlisted(written, side))
    return {name: value for name, value in values.items() if name not in unlisted}
