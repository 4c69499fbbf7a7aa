"""Which call of one forward is the counterpart of which call of the other
(:func:`align_calls`): the mapped layers' calls anchor, the rest pair by kind between them."""

from __future__ import annotations

import difflib
from typing import List, Mapping, Optional, Set, Tuple

from .contract import family
from .report import StepReport
from .trace import Call


def align_calls(ca: List[Call], cb: List[Call], layers: List[Tuple[str, str]],
                report: StepReport, second: Tuple[Mapping[str, str], Mapping[str, str]] = ({}, {})
                ) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """Pair the two forwards' calls: the k-th call of a mapped layer with the k-th call of its
    counterpart; between those anchors, the calls of layers without tensors (activations,
    pooling) by kind, as ``diff`` pairs lines, and as many calls of other kinds at the same
    place on both sides (an average pool where the original has a max pool) as a
    substitution, compared like any pair. The rest are listed as without counterpart.
    ``second``: each side's layers shared under two names (modules.second_names), whose
    calls are all under the first name. Returns every pair, and those of the same kind."""
    anchors: List[Tuple[int, int]] = []
    for names_a, names_b in _shared_groups(layers, second):
        anchors += zip([i for i, c in enumerate(ca) if c.layer in names_a],
                       [j for j, c in enumerate(cb) if c.layer in names_b])
    anchors.sort()
    chain, last = [], -1  # the anchors in the same order on both sides bound the segments
    for i, j in anchors:
        if j > last:
            chain.append((i, j))
            last = j
    used_a, used_b = {i for i, _ in anchors}, {j for _, j in anchors}
    pairs, swapped = set(anchors), set()
    bounds = [(-1, -1)] + chain + [(len(ca), len(cb))]
    for (i0, j0), (i1, j1) in zip(bounds, bounds[1:]):
        seg_a = [i for i in range(i0 + 1, i1) if i not in used_a]
        seg_b = [j for j in range(j0 + 1, j1) if j not in used_b]
        matcher = difflib.SequenceMatcher(None, [family(ca[i].kind) for i in seg_a],
                                          [family(cb[j].kind) for j in seg_b], autojunk=False)
        for tag, a0, a1, b0, b1 in matcher.get_opcodes():
            if tag == "equal":
                pairs |= _unambiguous(ca, cb, seg_a, seg_b,
                                      set(zip(seg_a[a0:a1], seg_b[b0:b1])))
            elif tag == "replace":
                found = _substitutions(ca, cb, seg_a[a0:a1], seg_b[b0:b1])
                pairs |= found
                swapped |= found
    left_a = sorted(set(range(len(ca))) - {i for i, _ in pairs})
    left_b = sorted(set(range(len(cb))) - {j for _, j in pairs})
    report.unmatched += [f"a {ca[i].layer} ({ca[i].kind}), call {i}" for i in left_a]
    report.unmatched += [f"b {cb[j].layer} ({cb[j].kind}), call {j}" for j in left_b]
    return sorted(pairs), sorted(pairs - swapped)


def _shared_groups(layers: List[Tuple[str, str]],
                   second: Tuple[Mapping[str, str], Mapping[str, str]]
                   ) -> List[Tuple[Set[str], Set[str]]]:
    """The mapped layer pairs, those of one shared layer merged: a layer called under one
    name on one side (``a`` twice) against two layers on the other (``a``, then ``b``) pairs
    its calls in order with theirs together. Without sharing, each pair alone."""
    groups: List[Tuple[Set[str], Set[str]]] = []
    for la, lb in sorted(layers, key=lambda p: p[0] in second[0] or p[1] in second[1]):
        na, nb = second[0].get(la, la), second[1].get(lb, lb)
        joined = [g for g in groups if na in g[0] or nb in g[1]]
        if not (la in second[0] or lb in second[1]) or not joined:
            groups.append(({na}, {nb}))
            continue
        joined[0][0].add(na)
        joined[0][1].add(nb)
    return groups


def _unambiguous(ca: List[Call], cb: List[Call], seg_a: List[int], seg_b: List[int],
                 found: Set[Tuple[int, int]]) -> Set[Tuple[int, int]]:
    """``found`` without the pairs of a functional call (F.relu) of a kind the segment calls
    a different number of times on each side: which of them is whose counterpart is a guess,
    so they stay unpaired (each a place on one side only: its flips unverified)."""
    def count(calls: List[Call], seg: List[int], kind: str) -> int:
        return sum(family(calls[k].kind) == kind for k in seg)
    return {(i, j) for i, j in found
            if not (ca[i].functional or cb[j].functional)
            or count(ca, seg_a, family(ca[i].kind)) == count(cb, seg_b, family(cb[j].kind))}


def _substitutions(ca: List[Call], cb: List[Call], seg_a: List[int],
                   seg_b: List[int]) -> Set[Tuple[int, int]]:
    """Calls of other kinds at the same place on both sides that reshape their input alike
    (an average pool where the original has a max pool, past a ReLU the other side calls as
    a function), paired in order. Only reshaping calls: an elementwise one (an ``Identity``
    downsample, a ReLU) has the shape of anything near it, and pairing it on that alone would
    blame a correct port."""
    def shapes(call: Call) -> Optional[tuple]:
        out = None if call.output is None else tuple(call.output.shape)
        return (tuple(call.in_shape), out) if out and out != tuple(call.in_shape) else None
    found, start = set(), 0
    for i in seg_a:
        j = next((k for k in range(start, len(seg_b)) if shapes(ca[i]) is not None
                  and shapes(cb[seg_b[k]]) == shapes(ca[i])), None)
        if j is not None:
            found.add((i, seg_b[j]))
            start = j + 1
    return found
