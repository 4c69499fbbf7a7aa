"""The weight map between two models: which tensor of one is which tensor of the other, with
the layout changes allowed (size-1 dims; a grouped convolution's weight split by group), and
the copy itself (:func:`transfer_weights`).

The automatic map pairs layers that own tensors in the order a forward calls them (MegEngine
lists parameters by name, so registration order is not enough), aligning their kinds as a
``diff`` aligns lines; inside a layer pair, tensors pair by role (``weight``, ``bias``,
``running_mean``...). Nothing is transposed silently: a ``(N, M)`` against ``(M, N)`` pair is
reported as "looks transposed" unless ``transforms`` declares what to do.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import numpy as np

from .contract import Layer, ModelAdapter, Slot, adapter_for, family, squeezed
from .errors import MappingError
from .report import ConfigFinding, Unmapped
from .trace import as_batch, forward_order

Transform = Union[str, Callable[[np.ndarray], np.ndarray]]
# Tensors one framework keeps and the other has no use for: skipped, and said so.
_IGNORED = {"num_batches_tracked": "PyTorch's BatchNorm step counter (used only with "
                                   "momentum=None); MegEngine has none"}


@dataclass(frozen=True)
class Pair:
    """``src`` is copied to ``dst``; ``how`` is ``copy``, ``reshape (1, C, 1, 1) -> (C,)`` or
    ``transform``."""

    src: str
    dst: str
    src_shape: Tuple[int, ...]
    dst_shape: Tuple[int, ...]
    how: str
    transform: Optional[Transform] = None


@dataclass
class MappingReport:
    """What :func:`transfer_weights` mapped to what, what it could not map and why, the
    tensors it skipped by design, and the configuration findings of the mapped layers.

    Example:
        >>> import torch
        >>> from gradmgr.parity import transfer_weights
        >>> report = transfer_weights(torch.nn.Linear(2, 3), torch.nn.Linear(2, 3))
        >>> report.ok, [(p.src, p.dst, p.how) for p in report.pairs]
        (True, [('weight', 'weight', 'copy'), ('bias', 'bias', 'copy')])
    """

    src: str
    dst: str
    pairs: List[Pair] = field(default_factory=list)
    unmapped: List[Unmapped] = field(default_factory=list)
    ignored: List[Tuple[str, str]] = field(default_factory=list)
    findings: List[ConfigFinding] = field(default_factory=list)
    layers: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every tensor mapped and every mapped layer configured alike."""
        return not self.unmapped and not self.findings

    def text(self) -> str:
        """The report as a human reads it."""
        lines = [f"weights {self.src} -> {self.dst}: {len(self.pairs)} mapped, "
                 f"{len(self.unmapped)} unmapped, {len(self.findings)} config finding(s)"]
        lines += [f"  unmapped ({u.side}) {u.name}: {u.reason}" for u in self.unmapped]
        lines += [f"  config: {finding}" for finding in self.findings]
        lines += [f"  {p.src} -> {p.dst}: {p.how}" for p in self.pairs]
        lines += [f"  skipped {name}: {why}" for name, why in self.ignored]
        return "\n".join(lines)

    __str__ = text


def transfer_weights(src: Any, dst: Any, name_map: Optional[Mapping[str, str]] = None, *,
                     strict: bool = True, probe: Any = None,
                     transforms: Optional[Mapping[str, Transform]] = None,
                     inputs: int = 1) -> MappingReport:
    """Copy every parameter and buffer of ``src`` into ``dst`` (PyTorch or MegEngine modules,
    either direction or the same framework), and report what went where.

    Args:
        src: the model whose values are copied.
        dst: the model that receives them (in place).
        name_map: ``{src_name: dst_name}`` for every tensor; None maps automatically (layer
            kinds in execution order, then roles and shapes).
        strict: raise :class:`MappingError` (its message the report) if a tensor is left
            unmapped or a mapped layer is configured differently; False copies what it could
            map and returns the report.
        probe: a batch (a numpy array or a tuple of them) to run one forward on each model
            for the execution order; without it the registration order is used (MegEngine
            registers by name: pass a probe when porting to or from MegEngine).
        transforms: ``{src_name: "transpose" or f(array) -> array}``: declared layout
            changes (never guessed).
        inputs: how many leading batch items the model takes.

    Example:
        >>> import torch
        >>> from gradmgr.parity import transfer_weights
        >>> a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
        >>> report = transfer_weights(a, b)
        >>> bool(torch.equal(a.weight, b.weight)), report.ok
        (True, True)
    """
    a, b = adapter_for(src), adapter_for(dst)
    report = build_map(a, b, name_map, probe=probe, transforms=transforms, inputs=inputs)
    if strict and not report.ok:
        raise MappingError(f"cannot transfer the weights:\n{report.text()}", report)
    for pair in report.pairs:
        b.write(pair.dst, convert(pair, a.read(pair.src)))
    return report


def transformed(transform: Transform, value: np.ndarray) -> np.ndarray:
    """``value`` through ``transform``: ``"transpose"``, or a function of the array."""
    if callable(transform):
        return transform(value)
    if transform != "transpose":
        raise ValueError(f"unknown transform {transform!r}: give 'transpose' or a function "
                         f"of the array")
    return np.transpose(value)


def convert(pair: Pair, value: np.ndarray) -> np.ndarray:
    """``value`` of ``pair.src`` in the layout of ``pair.dst``."""
    if pair.transform is not None:
        value = transformed(pair.transform, value)
    return np.ascontiguousarray(value).reshape(pair.dst_shape)


def build_map(a: ModelAdapter, b: ModelAdapter, name_map: Optional[Mapping[str, str]] = None,
              *, probe: Any = None, transforms: Optional[Mapping[str, Transform]] = None,
              inputs: int = 1, order_a: Optional[Sequence[str]] = None,
              order_b: Optional[Sequence[str]] = None) -> MappingReport:
    """The map from ``a``'s tensors to ``b``'s, without copying anything: ``name_map``'s
    pairs, then the layers it does not name, automatically."""
    if probe is not None and order_a is None:
        batch = as_batch(probe)
        order_a, order_b = forward_order(a, batch, inputs), forward_order(b, batch, inputs)
    report = MappingReport(a.framework, b.framework)
    slots_a, slots_b = {s.name: s for s in a.slots()}, {s.name: s for s in b.slots()}
    pairs = _given_pairs(name_map or {}, slots_a, slots_b, report)
    named_a = {slots_a[n].layer if n in slots_a else n.rpartition(".")[0] for n in name_map or {}}
    named_b = {slots_b[n].layer if n in slots_b else n.rpartition(".")[0]
               for n in (name_map or {}).values()}
    for sa, sb in pairs:
        if (sa.layer, sb.layer) not in report.layers:
            report.layers.append((sa.layer, sb.layer))
    pairs += _auto_pairs(a, b, order_a, order_b, report, named_a, named_b)
    conv_a, conv_b = ({y.name for y in side.layers() if family(y.kind).startswith("conv")}
                      for side in (a, b))
    for sa, sb in pairs:
        _pair(sa, sb, dict(transforms or {}), report,
              grouped_convs=sa.layer in conv_a and sb.layer in conv_b)
    report.findings.extend(tie_findings(report.pairs, a.aliases, b.aliases))
    used_a, used_b = {p[0].name for p in pairs}, {p[1].name for p in pairs}
    for side, slots, used, named in (("src", slots_a, used_a, named_a),
                                     ("dst", slots_b, used_b, named_b)):
        for name, slot in slots.items():
            if name in used or any(u.name == name and u.side == side for u in report.unmapped):
                continue
            if slot.role in _IGNORED and not slot.trainable:
                report.ignored.append((name, _IGNORED[slot.role]))
            else:  # a tensor no paired layer owns is said, never skipped silently
                report.unmapped.append(Unmapped(side, name, "not in name_map (name_map names "
                                                            "other tensors of its layer)"
                                                if slot.layer in named
                                                else "no paired layer owns it"))
    return report


TIED = "tied to"  # the key of a tie finding


def tie_findings(pairs: Sequence[Pair], aliases_a: Mapping[str, str],
                 aliases_b: Mapping[str, str]) -> List[ConfigFinding]:
    """Tied weights on one side only: one parameter paired with two of the other model's.
    The forwards can agree (the values are copied to both), but the tied parameter's
    gradient sums both uses' where the untied ones get one each."""
    found, seen = [], set()
    for tied, other, side in ((aliases_a, aliases_b, 0), (aliases_b, aliases_a, 1)):
        for pair in pairs:
            mine, theirs = (pair.src, pair.dst) if side == 0 else (pair.dst, pair.src)
            if mine not in tied or (mine, side) in seen:
                continue
            partner = next((p.dst if side == 0 else p.src for p in pairs
                            if (p.src if side == 0 else p.dst) == tied[mine]), None)
            if partner is None or other.get(theirs, theirs) == other.get(partner, partner):
                continue  # tied on both sides too
            seen.add((mine, side))
            values = (tied[mine], "none") if side == 0 else ("none", tied[mine])
            found.append(ConfigFinding(pair.src, pair.dst, TIED, *values))
    return found


def _given_pairs(name_map: Mapping[str, str], slots_a: Dict[str, Slot],
                 slots_b: Dict[str, Slot], report: MappingReport) -> List[Tuple[Slot, Slot]]:
    pairs = []
    for src, dst in name_map.items():
        missing = [(side, n) for side, n, slots in (("src", src, slots_a), ("dst", dst, slots_b))
                   if n not in slots]
        for side, name in missing:
            close = _closest(name, slots_a if side == "src" else slots_b)
            report.unmapped.append(Unmapped(side, name, "name_map names a tensor the model "
                                                        "does not have" + (
                                                            f" (did you mean {close!r}?)"
                                                            if close else "")))
        if not missing:
            pairs.append((slots_a[src], slots_b[dst]))
    return pairs


def _closest(name: str, slots: Mapping[str, Slot]) -> Optional[str]:
    """The tensor ``name`` most likely meant: its layer first (the closest layer name), then
    the closest role in that layer, so that a typo in a role is never answered with another
    layer's tensor of the same role."""
    layer, _, role = name.rpartition(".")
    layers = sorted({s.layer for s in slots.values()})
    near = [layer] if layer in layers else difflib.get_close_matches(layer, layers, 1, 0.6)
    if not near:
        close = difflib.get_close_matches(name, list(slots), 1)
        return close[0] if close else None
    roles = [s.role for s in slots.values() if s.layer == near[0]]
    close = difflib.get_close_matches(role, roles, 1, 0.5)
    if not close:
        return None
    return f"{near[0]}.{close[0]}" if near[0] else close[0]


def _ordered(adapter: ModelAdapter, order: Sequence[str], skip: Set[str]) -> List[Layer]:
    """Layers that own tensors (but those in ``skip``), in execution order, then the
    never-called ones as registered."""
    owners = {s.layer for s in adapter.slots()} - skip
    layers = {layer.name: layer for layer in adapter.layers() if layer.name in owners}
    rank = {name: i for i, name in enumerate(order)}
    return sorted(layers.values(), key=lambda layer: rank.get(layer.name, len(rank)))


def _auto_pairs(a: ModelAdapter, b: ModelAdapter, order_a: Optional[Sequence[str]],
                order_b: Optional[Sequence[str]], report: MappingReport, skip_a: Set[str],
                skip_b: Set[str]) -> List[Tuple[Slot, Slot]]:
    la, lb = _ordered(a, order_a or [], skip_a), _ordered(b, order_b or [], skip_b)
    by_layer_a, by_layer_b = _by_layer(a.slots()), _by_layer(b.slots())
    matched, ambiguous = match_layers(la, lb, by_layer_a, by_layer_b,
                                      executed=order_a is not None)
    pairs: List[Tuple[Slot, Slot]] = []
    for ya, yb in matched:
        report.layers.append((ya.name, yb.name))
        report.findings.extend(config_findings(ya, yb))
        pairs.extend(_pair_roles(by_layer_a[ya.name], by_layer_b[yb.name], report))
    for side, by_layer, names in (("src", by_layer_a, ambiguous), ("dst", by_layer_b,
                                                                   ambiguous.values())):
        for name in names:  # no tensor is copied on a guess
            why = (_crossing(ambiguous, name, side) if order_a is not None
                   else _ambiguous(len(ambiguous)))
            report.unmapped.extend(Unmapped(side, s.name, why)
                                   for s in by_layer[name] if s.role not in _IGNORED)
    matched_a = {x for x, _ in report.layers} | set(ambiguous)
    matched_b = {y for _, y in report.layers} | set(ambiguous.values())
    for side, layers, done, by_layer, other in (("src", la, matched_a, by_layer_a, lb),
                                                ("dst", lb, matched_b, by_layer_b, la)):
        for layer in layers:
            if layer.name not in done:
                reason = (f"no {layer.kind} layer at this place in the other model (its "
                          f"layers with tensors, in execution order: "
                          f"{', '.join(x.kind for x in other)})")
                report.unmapped.extend(Unmapped(side, s.name, reason)
                                       for s in by_layer[layer.name] if s.role not in _IGNORED)
    return pairs


def match_layers(la: List[Layer], lb: List[Layer], slots_a: Dict[str, List[Slot]],
                 slots_b: Dict[str, List[Slot]],
                 executed: bool = True
                 ) -> Tuple[List[Tuple[Layer, Layer]], Dict[str, str]]:
    """Pair the layers of two models: first as ``diff`` aligns lines, a line being a layer's
    kind and its tensors' shapes (size-1 dims dropped); then what is left, by the same kind
    and shapes in order (a port that calls its downsample before the block's convolutions,
    not after); then by kind alone in order (so that a shape mismatch is reported as one).

    Without ``executed`` (no probe: registration order, which MegEngine sorts by name) the
    order proves nothing: layers of the same name and line pair first, and a pair whose line
    another layer of either model shares is ambiguous: returned apart, ``{a_name: b_name}``,
    so that no tensor is copied on a guess."""
    def key(layer: Layer, slots: Dict[str, List[Slot]]) -> tuple:
        return (family(layer.kind),) + tuple(sorted((s.role, squeezed(s.shape))
                                                    for s in slots.get(layer.name, ())
                                                    if s.role not in _IGNORED))
    ka, kb = [key(x, slots_a) for x in la], [key(x, slots_b) for x in lb]
    found: Dict[int, int] = {}
    if not executed:  # the same name and the same line: the port kept the reference's names
        index_b = {y.name: j for j, y in enumerate(lb)}
        found = {i: index_b[x.name] for i, x in enumerate(la)
                 if x.name in index_b and ka[i] == kb[index_b[x.name]]}
    rest_a = [i for i in range(len(la)) if i not in found]
    rest_b = [j for j in range(len(lb)) if j not in found.values()]
    matcher = difflib.SequenceMatcher(None, [ka[i] for i in rest_a], [kb[j] for j in rest_b],
                                      autojunk=False)
    found.update({rest_a[blk.a + k]: rest_b[blk.b + k] for blk in matcher.get_matching_blocks()
                  for k in range(blk.size)})
    for same in (lambda i, j: ka[i] == kb[j],
                 lambda i, j: family(la[i].kind) == family(lb[j].kind)):
        free_b = [j for j in range(len(lb)) if j not in found.values()]
        for i in range(len(la)):
            j = next((j for j in free_b if i not in found and same(i, j)), None)
            if j is not None:
                found[i] = j
                free_b.remove(j)
    result, ambiguous = [], {}
    crossed = _crossed(la, lb, ka, kb, found) if executed else set()
    for i, j in sorted(found.items()):
        twins_a = sum(ka[k] == ka[i] for k in rest_a)
        twins_b = sum(kb[k] == kb[j] for k in rest_b)
        if i in crossed:
            ambiguous[la[i].name] = lb[j].name
        elif executed or la[i].name == lb[j].name or (twins_a <= 1 and twins_b <= 1):
            result.append((la[i], lb[j]))
        else:
            ambiguous[la[i].name] = lb[j].name
    return result, ambiguous


def _crossed(la: List[Layer], lb: List[Layer], ka: List[tuple], kb: List[tuple],
             found: Dict[int, int]) -> Set[int]:
    """The pairs (``a``'s indices) the call order makes against the names: layers of one kind
    and shapes that both models name alike, the order pairing them round a cycle (``fc1``
    with ``fc2`` and ``fc2`` with ``fc1``). Either the port calls them in another order (the
    names are right) or uses one where the other model uses another (the order is right and
    a checkpoint loaded by name is wrong): which, only the user knows. A chain that does not
    close (a port's names shifted by one) leaves the order the only evidence: not crossed."""
    index_a = {x.name: i for i, x in enumerate(la)}
    crossed: Set[int] = set()
    for start in found:
        cycle, i = [start], start
        while lb[found[i]].name != la[start].name:
            i = index_a.get(lb[found[i]].name, -1)
            if i not in found or i in cycle or ka[i] != ka[start]:
                break
            cycle.append(i)
        else:
            if len(cycle) > 1 and all(kb[found[k]] == ka[k] for k in cycle):
                crossed.update(cycle)
    return crossed


def _crossing(ambiguous: Dict[str, str], name: str, side: str) -> str:
    other = (ambiguous[name] if side == "src"
             else next(a for a, b in ambiguous.items() if b == name))
    return (f"the call order pairs layer {name} with the other model's {other}, but both "
            f"models have layers named {name} and {other} of this kind and shapes: the port "
            f"calls them in another order, or uses one where the reference uses the other "
            f"(then a checkpoint loaded by name is wrong); say which with name_map (e.g. "
            f"{{'{name}.weight': '{name}.weight'}}, each tensor of these layers)")


def _ambiguous(count: int) -> str:
    return (f"ambiguous without a probe: its layer has the kind and shapes of other layers, "
            f"and registration order (MegEngine's is by name) does not say which is which "
            f"({count} layer pair(s) like it); pass probe=batch (one forward gives the "
            f"execution order) or name_map")


def _by_layer(slots: Sequence[Slot]) -> Dict[str, List[Slot]]:
    found: Dict[str, List[Slot]] = {}
    for slot in slots:
        found.setdefault(slot.layer, []).append(slot)
    return found


def _pair_roles(sa: List[Slot], sb: List[Slot], report: MappingReport) -> List[Tuple[Slot, Slot]]:
    roles_b = {s.role: s for s in sb}
    pairs = []
    for slot in sa:
        other = roles_b.pop(slot.role, None)
        if other is not None:
            pairs.append((slot, other))
        elif slot.role not in _IGNORED:
            report.unmapped.append(Unmapped("src", slot.name, f"the matching layer has no "
                                                              f"{slot.role}"))
    for slot in roles_b.values():
        if slot.role not in _IGNORED:
            report.unmapped.append(Unmapped("dst", slot.name, f"the matching layer has no "
                                                              f"{slot.role}"))
    return pairs


def grouped(shape: Sequence[int], other: Sequence[int]) -> bool:
    """``shape`` is ``other`` with its first dim split in two: a grouped convolution's weight
    as MegEngine stores it, ``(groups, out/groups, in/groups, *kernel)``, against PyTorch's
    and Paddle's ``(out, in/groups, *kernel)`` (a transposed convolution's: ``in`` first),
    the same elements in the same order. tests/test_parity_grouped.py checks the reshape
    against MegEngine's own Conv2d, ConvTranspose2d and Conv3d."""
    shape, other = tuple(shape), tuple(other)
    return (len(shape) == len(other) + 1 and len(other) >= 3
            and shape[0] * shape[1] == other[0] and shape[2:] == other[1:])


def _pair(sa: Slot, sb: Slot, transforms: Dict[str, Transform], report: MappingReport,
          grouped_convs: bool = False) -> None:
    """``grouped_convs``: both tensors belong to convolutions, whose weights may differ by a
    grouped layout (:func:`grouped`); elsewhere that reshape would be a guess."""
    transform = transforms.get(sa.name)
    shape = sa.shape
    if transform is not None:
        probe = np.zeros(sa.shape, dtype=np.float32)
        shape = transformed(transform, probe).shape
    if shape == sb.shape:
        how = "transform" if transform is not None else "copy"
    elif squeezed(shape) == squeezed(sb.shape):
        how = f"reshape {shape} -> {sb.shape}"
    elif grouped_convs and (grouped(shape, sb.shape) or grouped(sb.shape, shape)):
        how = (f"reshape {shape} -> {sb.shape} (a grouped convolution's weight: (groups, "
               f"C/groups, ...) holds (C, ...) in the same order)")
    else:
        report.unmapped.append(Unmapped("src", sa.name, _shape_reason(sa, sb)))
        report.unmapped.append(Unmapped("dst", sb.name, f"{sa.name} does not fit it (above)"))
        return
    if sa.transposed != sb.transposed:  # translated by the adapter, said here
        side = "src" if sa.transposed else "dst"
        how += f" ({side} stores it transposed, [in, out]: read and written as [out, in])"
    if sa.note != sb.note:
        how += "".join(f" ({side}: {note})" for side, note in (("src", sa.note),
                                                              ("dst", sb.note)) if note)
    report.pairs.append(Pair(sa.name, sb.name, sa.shape, sb.shape, how, transform))


def _shape_reason(sa: Slot, sb: Slot) -> str:
    if squeezed(sa.shape) == tuple(reversed(squeezed(sb.shape))) and len(squeezed(sa.shape)) == 2:
        return (f"looks transposed: {sa.shape} against {sb.name} {sb.shape}; if the port "
                f"stores it transposed, declare transforms={{{sa.name!r}: 'transpose'}}")
    return f"shape {sa.shape} cannot hold {sb.name}'s {sb.shape} (not a layout-only change)"


def config_findings(la: Layer, lb: Layer) -> List[ConfigFinding]:
    """The configuration keys both layers have and set differently."""
    found = []
    for key in sorted(set(la.config) & set(lb.config) - {"training"}):  # a mode (contract.py)
        va, vb = la.config[key], lb.config[key]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
        # momentum 0.9 in MegEngine arrives as 1 - 0.9 = 0.09999999999999998
        same = math.isclose(va, vb, rel_tol=1e-6, abs_tol=0.0) if numbers else va == vb
        if not same:
            found.append(ConfigFinding(la.name, lb.name, key, va, vb))
    return found
