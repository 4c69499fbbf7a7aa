"""Checkpoint files converted between frameworks (:func:`convert_checkpoint`) through a map
file (:func:`save_map`): the weight map :func:`transfer_weights` builds, written as JSON a
user can read and edit, then applied to a saved state dict without building either model.

The map file: ``format`` (:data:`FORMAT`), ``version`` (:data:`VERSION`), ``src`` and ``dst``
(the frameworks), ``pairs`` (``src``, ``dst``, their shapes and dtypes, ``how``, and
``transform``: ``"transpose"`` or null), and ``ignored`` per side: the tensors one framework
keeps and the other has no use for (PyTorch's ``num_batches_tracked``), with the value written
where the converted file needs one; per side, ``tied`` and ``unlisted``: the names of tied
parameters, and those its state dict leaves out (:mod:`~gradmgr.parity.checkpoint_ties`).
Each framework's backend reads and writes its own files
(``load_state`` and ``save_state`` in ``gradmgr/backends/<name>/parity.py``).
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from ..errors import BackendNotFoundError
from ..registry import get_backend
from .checkpoint_ties import also_named, listed, read_tied, recorded, write_tied
from .contract import adapter_for, squeezed
from .errors import MappingError, ParityError
from .mapping import Pair, Transform, build_map, convert

FORMAT = "gradmgr.parity.map"
VERSION = 2
"""The map file format this gradmgr writes and the only one it reads. Version 1 recorded no
tied weights, so a conversion through it could give one tied parameter two values unseen."""
REQUIRED = ("src", "dst", "pairs", "ignored", "tied", "unlisted")
"""The keys every map file has (a hand-edited one that lost one is refused)."""


def save_map(src: Any, dst: Any, path: str, name_map: Optional[Mapping[str, str]] = None, *,
             probe: Any = None, transforms: Optional[Mapping[str, Transform]] = None,
             inputs: int = 1) -> Dict[str, Any]:
    """Build the weight map from ``src`` to ``dst`` as :func:`transfer_weights` does (the
    same arguments; nothing is copied) and write it to ``path`` as JSON; returns what was
    written. :class:`MappingError` (its message the report) if a tensor is left unmapped or
    ambiguous: a map file is never written on a guess. Layers configured differently (an
    ``eps``) do not stop it: a checkpoint holds tensors only (``compare_step`` reports them).

    Example:
        >>> import os, tempfile, torch
        >>> from gradmgr.parity import save_map
        >>> path = os.path.join(tempfile.mkdtemp(), "map.json")
        >>> written = save_map(torch.nn.Linear(2, 3), torch.nn.Linear(2, 3), path)
        >>> [(p["src"], p["dst"], p["how"]) for p in written["pairs"]]
        [('weight', 'weight', 'copy'), ('bias', 'bias', 'copy')]
    """
    a, b = adapter_for(src), adapter_for(dst)
    report = build_map(a, b, name_map, probe=probe, transforms=transforms, inputs=inputs)
    if report.unmapped:
        raise MappingError(f"cannot write the map:\n{report.text()}", report)
    for p in report.pairs:
        if p.transform is not None and p.transform != "transpose":
            raise ParityError(f"the transform of {p.src} is a function: a map file holds "
                              f"only 'transpose'; convert that tensor yourself after "
                              f"convert_checkpoint")
    stored_a = {s.name for s in a.slots() if s.transposed}
    stored_b = {s.name for s in b.slots() if s.transposed}
    written: Dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "src": a.framework, "dst": b.framework,
        "pairs": [_stored(p, p.src in stored_a, p.dst in stored_b,
                          src_dtype=a.read(p.src).dtype.str, dst_dtype=b.read(p.dst).dtype.str)
                  for p in report.pairs],
    }
    _split_ignored(written, a, b, report.ignored)
    written.update(recorded(a, b))
    with open(path, "w", encoding="utf-8") as file:
        json.dump(written, file, indent=1)
    return written


def _stored(pair: Pair, src_transposed: bool, dst_transposed: bool,
            **dtypes: str) -> Dict[str, Any]:
    """A pair as the files hold it: a tensor its framework stores transposed (Paddle's
    Linear weight, ``[in, out]``) with its stored shape, and one more transpose where one side
    only stores it so."""
    transform = pair.transform
    if src_transposed != dst_transposed:
        transform = None if transform == "transpose" else "transpose"
    src_shape = list(reversed(pair.src_shape)) if src_transposed else list(pair.src_shape)
    dst_shape = list(reversed(pair.dst_shape)) if dst_transposed else list(pair.dst_shape)
    return {"src": pair.src, "dst": pair.dst, "src_shape": src_shape, "dst_shape": dst_shape,
            **dtypes, "how": pair.how, "transform": transform}


def _split_ignored(written: Dict[str, Any], a: Any, b: Any, ignored: List[Any]) -> None:
    """The skipped tensors by side (a name may be in both models)."""
    names_a, names_b = {s.name for s in a.slots()}, {s.name for s in b.slots()}
    paired_a = {p["src"] for p in written["pairs"]}
    paired_b = {p["dst"] for p in written["pairs"]}
    skipped = {n for n, _ in ignored}
    written["ignored"] = {
        "src": {n: _value(a.read(n)) for n in sorted(skipped & names_a - paired_a)},
        "dst": {n: _value(b.read(n)) for n in sorted(skipped & names_b - paired_b)}}


def _value(array: np.ndarray) -> Dict[str, Any]:
    """A skipped tensor's dtype, shape and value (a step counter: one number)."""
    return {"dtype": array.dtype.str, "shape": list(array.shape),
            "value": array.reshape(-1)[0].item() if array.size else 0}


def read_map(path: str) -> Dict[str, Any]:
    """A map file :func:`save_map` wrote (perhaps edited since), or :class:`ParityError`."""
    try:
        with open(path, encoding="utf-8") as file:
            written = json.load(file)
    except (OSError, ValueError) as error:
        raise ParityError(f"cannot read the map file {path}: {error}") from error
    if not isinstance(written, dict) or written.get("format") != FORMAT:
        raise ParityError(f"{path} is not a gradmgr weight map (write one with "
                          f"gradmgr.parity.save_map)")
    if written.get("version") != VERSION:
        raise ParityError(f"{path} is a weight map of format version "
                          f"{written.get('version')!r}; this gradmgr reads version {VERSION} "
                          f"only: write the map again with save_map")
    lost = [key for key in REQUIRED if key not in written]
    if lost:
        raise ParityError(f"{path} lacks {', '.join(lost)}: write the map again with save_map")
    return written


def convert_checkpoint(src_path: str, dst_path: str, map_path: str, *,
                       reverse: bool = False) -> List[str]:
    """Convert the state dict file ``src_path`` (``megengine.save`` or ``torch.save`` of a
    ``state_dict()``) into ``dst_path`` in the other framework's format, through the map file
    ``map_path`` (:func:`save_map`): each tensor renamed, reshaped where only size-1 dims
    differ, transposed where the map says so, cast to the dtype the map records. With
    ``reverse`` the map is read backwards (its ``dst`` file into its ``src`` format).

    Every tensor of the file must be in the map (or skipped by it), and every tensor the map
    names must be in the file (but a tied name the file's framework does not list), with the
    shape it records: otherwise :class:`MappingError` names it, and nothing is written. So
    too where one tied parameter would hold two values: two names of one parameter whose
    values in the file differ, or two tensors of the file that differ and are converted into
    one tied parameter. Returns the names written.

    Example:
        >>> import os, tempfile, torch
        >>> from gradmgr.parity import convert_checkpoint, save_map
        >>> folder = tempfile.mkdtemp()
        >>> a, b = torch.nn.Linear(2, 3), torch.nn.Linear(2, 3)
        >>> _ = save_map(a, b, os.path.join(folder, "map.json"))
        >>> torch.save(a.state_dict(), os.path.join(folder, "a.pth"))
        >>> convert_checkpoint(os.path.join(folder, "a.pth"), os.path.join(folder, "b.pth"),
        ...                    os.path.join(folder, "map.json"))
        ['weight', 'bias']
    """
    written = read_map(map_path)
    sides = ("dst", "src") if reverse else ("src", "dst")
    pairs = [Pair(p[sides[0]], p[sides[1]], tuple(p[f"{sides[0]}_shape"]),
                  tuple(p[f"{sides[1]}_shape"]), p["how"], p.get("transform"))
             for p in written["pairs"]]
    dtypes = {p[sides[1]]: p[f"{sides[1]}_dtype"] for p in written["pairs"]}
    try:
        source = _io(written[sides[0]]).load_state(src_path)
    except (OSError, ValueError, RuntimeError) as error:
        raise ParityError(f"cannot read {src_path} as a {written[sides[0]]} state dict "
                          f"file: {error}") from error
    skipped = written["ignored"][sides[0]]
    tied = read_tied(source, written, sides[0])
    extra = sorted(set(source) - {p.src for p in pairs} - set(skipped)
                   - set(also_named(written, sides[0], {p.src for p in pairs})))
    missing = [p.src for p in pairs if p.src not in source]
    wrong = [f"{p.src} {source[p.src].shape} (the map says {p.src_shape})" for p in pairs
             if p.src in source and squeezed(source[p.src].shape) != squeezed(p.src_shape)]
    if extra or missing or wrong or tied:
        raise MappingError(_refusal(src_path, map_path, extra, missing, wrong, tied))
    # "transpose" is its own inverse: a reversed map applies it as is (a framework may save
    # a tensor without its size-1 dims: MegEngine's BatchNorm)
    values = {p.dst: convert(p, source[p.src].reshape(p.src_shape)) for p in pairs}
    for other, first in also_named(written, sides[1], set(values)).items():
        values[other], dtypes[other] = values[first], dtypes[first]
    tied = write_tied(values, {p.dst: p.src for p in pairs}, written, sides[1])
    if tied:
        raise MappingError(_refusal(src_path, map_path, [], [], [], tied))
    values = {n: v.astype(np.dtype(dtypes[n])) for n, v in listed(values, written,
                                                                   sides[1]).items()}
    for name, kept in written["ignored"][sides[1]].items():
        values[name] = np.full(kept["shape"], kept["value"], dtype=np.dtype(kept["dtype"]))
    _io(written[sides[1]]).save_state(values, dst_path)
    return list(values)


def _refusal(src_path: str, map_path: str, extra: List[str], missing: List[str],
             wrong: List[str], tied: List[str]) -> str:
    lines = [f"cannot convert {src_path} through {map_path}; nothing written:"]
    lines += [f"  {n}: in the checkpoint, not in the map (add its pair to the map file, or "
              f"write the map again from the models this checkpoint belongs to)" for n in extra]
    lines += [f"  {n}: in the map, not in the checkpoint" for n in missing]
    lines += [f"  {w}: the checkpoint's shape is not the map's" for w in wrong]
    return "\n".join(lines + tied)


def _io(framework: str) -> Any:
    """The module of ``framework``'s backend that reads and writes its checkpoint files."""
    try:
        backend = get_backend(framework)
    except BackendNotFoundError as error:
        raise ParityError(f"a {framework} checkpoint cannot be read or written in this "
                          f"environment: {error}") from error
    package = type(backend).__module__.rpartition(".")[0]
    module = importlib.import_module(f"{package}.parity")
    if not hasattr(module, "load_state"):
        raise ParityError(f"the {framework!r} backend cannot read or write checkpoint files "
                          f"(its parity module has no load_state/save_state)")
    return module
