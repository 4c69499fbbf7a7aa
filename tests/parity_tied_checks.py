"""What the parity tool's tests of tied weights (an LM head on its embedding's weight, two
Linears on one weight) assert alike on MegEngine (tests/test_parity_tool.py) and Paddle
(tests/test_parity_paddle.py) against PyTorch: each file builds its framework's models and
passes its own tolerance between two frameworks' float32 kernels; and what checkpoint files of
tied models converted between frameworks must be (tests/test_parity_checkpoint_ties.py on
PyTorch and MegEngine, tests/test_parity_paddle.py on Paddle)."""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest

from gradmgr.parity import compare_step, convert_checkpoint, save_map, transfer_weights
from gradmgr.parity.contract import adapter_for
from gradmgr.parity.errors import MappingError
from gradmgr.parity.mapping import TIED as TIE


def grads_by_name(model: Any) -> Dict[str, Any]:
    """Each name's gradient as the tool's adapter reads it ([out, in] for Paddle's Linear)."""
    adapter = adapter_for(model)
    return {s.name: adapter.grad(s.name) for s in adapter.slots() if s.trainable}


def check_tied_on_both_sides(a: Any, b: Any, x: Any, ported: Any, alias: str, first: str,
                             rel: float) -> None:
    """``a`` and ``b`` both tie ``alias`` to ``first``; ``ported`` is the one of them that is
    not torch's. The adapter finds the tie, the map pairs both names, the step is parity, and
    each name's gradient (the sum of both uses) is the other side's within ``rel`` of its
    largest."""
    other = b if ported is a else a
    assert adapter_for(ported).aliases == {alias: first}
    mapping = transfer_weights(a, b, probe=x)
    assert mapping.ok and not mapping.findings
    assert {(alias, alias), (first, first)} <= {(p.src, p.dst) for p in mapping.pairs}
    report = compare_step(a, b, x)
    assert report.ok, report.text()
    assert {alias, first} <= {e.name.split(" / ")[0] for e in report.entries if e.what == "grad"}
    mine, theirs = grads_by_name(ported), grads_by_name(other)
    for name in (first, alias):
        np.testing.assert_allclose(mine[name], theirs[name], rtol=0,
                                   atol=rel * np.abs(theirs[name]).max(), err_msg=name)


def check_tied_on_one_side(a: Any, b: Any, x: Any, alias: str, first: str,
                           rel: float) -> None:
    """``a`` ties ``alias`` to ``first``, ``b`` does not: the tied side is the reference, its
    values copied to both of the other's tensors, every forward agrees, and the verdict names
    the tie and the gradients; the tied gradient is the sum of the untied side's two (within
    ``rel`` of its largest)."""
    with pytest.raises(MappingError, match="tied to"):
        transfer_weights(a, b, probe=x)
    mapping = transfer_weights(a, b, probe=x, strict=False)
    assert not mapping.unmapped and [f.key for f in mapping.findings] == [TIE]
    report = compare_step(a, b, x)
    assert not report.ok and report.first_forward is None
    assert all(e.ok for e in report.entries if e.what in ("forward", "loss"))
    assert f"{alias} / {alias}: tied to is '{first}'" in str(report)
    assert report.first_grad is not None and report.first_grad.what == "grad"
    ga, gb = grads_by_name(a), grads_by_name(b)
    np.testing.assert_allclose(ga[first], gb[first] + gb[alias], rtol=0,
                               atol=rel * np.abs(ga[first]).max())


# A layer under two names: {each tensor's other name: its first}. One Linear (``self.b =
# self.a``, tests/parity_small_*.py's SharedLayer), and one block of three layers, its two
# Linears' tensors (``self.second = self.first``, SharedBlock).
SHARED = {"b.weight": "a.weight", "b.bias": "a.bias"}
BLOCK = {f"second.{i}.{role}": f"first.{i}.{role}" for i in (0, 2) for role in ("weight", "bias")}


def torch_reference(model: Any, x: Any, rel: float) -> None:
    """A torch ``model``'s gradients after compare_step (gradmgr's GradManager) are what
    plain ``torch.autograd.grad`` of the output's mean gives (within ``rel`` of the largest);
    a model of another framework is left alone."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return
    params = dict(model.named_parameters())
    want = torch.autograd.grad(model(torch.as_tensor(x)).mean(), list(params.values()))
    for (name, p), g in zip(params.items(), want):
        np.testing.assert_allclose(p.grad.numpy(), g.numpy(), rtol=0,
                                   atol=rel * float(g.abs().max()), err_msg=name)


def check_shared_layer_on_both_sides(a: Any, b: Any, x: Any, rel: float,
                                     forwards: int = 2) -> None:
    """Both models share one layer (or block: under two names, or called twice under one):
    every tensor pairs with its namesake (strict), the step is parity with all ``forwards``
    calls compared, each with its namesake's, and each name's gradient (the sum of both uses)
    is the other side's within ``rel`` of its largest, torch's plain autograd's."""
    names = {s.name for s in adapter_for(a).slots()}
    mapping = transfer_weights(a, b, probe=x)
    assert mapping.ok and not mapping.unmapped, mapping.text()
    assert {(p.src, p.dst) for p in mapping.pairs} == {(n, n) for n in names}
    report = compare_step(a, b, x)
    assert report.ok, report.text()
    assert not report.unmatched and not report.unmapped
    calls = [e.name.split(" / ") for e in report.entries if e.what == "forward"]
    assert len(calls) == forwards and all(la == lb for la, lb in calls), calls
    ga, gb = grads_by_name(a), grads_by_name(b)
    assert ga.keys() == gb.keys()
    for name in ga:
        np.testing.assert_allclose(ga[name], gb[name], rtol=0,
                                   atol=rel * np.abs(gb[name]).max(), err_msg=name)
    for model in (a, b):
        torch_reference(model, x, 1e-6)


def check_shared_layer_on_one_side(a: Any, b: Any, x: Any, rel: float,
                                   tied: Dict[str, str] = SHARED, forwards: int = 2) -> None:
    """``a`` shares a layer (or block) under two names (``tied``: its tensors'), ``b`` has
    two: a tie finding for each tensor (not an unmapped one), all ``forwards`` calls and the
    loss agree, and each shared gradient is the sum of the other side's two (within ``rel``
    of its largest)."""
    with pytest.raises(MappingError, match="tied to"):
        transfer_weights(a, b, probe=x)
    mapping = transfer_weights(a, b, probe=x, strict=False)
    assert not mapping.unmapped, mapping.text()
    assert [f.key for f in mapping.findings] == [TIE] * len(tied)
    report = compare_step(a, b, x)
    assert not report.ok and report.first_forward is None and not report.unmatched
    agreed = [e for e in report.entries if e.what in ("forward", "loss")]
    assert len(agreed) == forwards + 1 and all(e.ok for e in agreed)
    for other, first in tied.items():
        assert f"{other} / {other}: tied to is '{first}'" in str(report)
    assert report.first_grad is not None and report.first_grad.what == "grad"
    ga, gb = grads_by_name(a), grads_by_name(b)
    for other, first in tied.items():
        np.testing.assert_allclose(ga[first], gb[first] + gb[other], rtol=0,
                                   atol=rel * np.abs(ga[first]).max(), err_msg=first)


def check_block_called_twice_on_one_side(a: Any, b: Any, x: Any) -> None:
    """One model calls its block twice under its one name, the other has a block for each
    call: no name carries the sharing, so no tie to find; strict transfer refuses (a block's
    tensors unmapped, never copied on a guess) and the step is not parity."""
    with pytest.raises(MappingError, match="unmapped"):
        transfer_weights(a, b, probe=x)
    transfer_weights(a, b, probe=x, strict=False)
    report = compare_step(a, b, x)
    assert not report.ok and report.unmapped, report.text()


# Checkpoint files (gradmgr.parity.convert_checkpoint) of tied models: a converted tensor
# moves no bits, so values are compared for equality; the forwards within ``rel``.

def save_state(model: Any, path: str, state: Any = None) -> None:
    """``model.state_dict()`` (or ``state``) saved its framework's way."""
    framework = adapter_for(model).framework
    state = model.state_dict() if state is None else state
    engine = importlib.import_module(framework)
    engine.save(state, path)


def load_strictly(model: Any, path: str) -> None:
    """The file at ``path`` loaded into ``model``: every key, none extra."""
    framework = adapter_for(model).framework
    engine = importlib.import_module(framework)
    if framework == "paddle":
        missing, unexpected = model.set_state_dict(engine.load(path))
        assert not missing and not unexpected, (missing, unexpected)
    else:
        model.load_state_dict(engine.load(path), strict=True)


def forward(model: Any, x: np.ndarray) -> np.ndarray:
    adapter = adapter_for(model)
    return adapter.numpy(model(adapter.tensor(x)))


def _converted(make_src: Callable[[int], Any], make_dst: Callable[[int], Any],
               seeds: Tuple[int, int], folder: str, reverse: bool) -> Tuple[Any, Any]:
    """A ``make_src`` model's checkpoint converted into a ``make_dst`` model, loaded
    strictly (``reverse``: through the map backwards); both models."""
    source, target = make_src(seeds[0]), make_dst(seeds[1])
    save_state(source, f"{folder}/in")
    convert_checkpoint(f"{folder}/in", f"{folder}/out", f"{folder}/map.json", reverse=reverse)
    load_strictly(target, f"{folder}/out")
    return source, target


def _assert_copied(source: Any, target: Any, pairs: List[Tuple[str, str]], x: np.ndarray,
                   rel: float) -> None:
    """Every pair's value bit for bit (as the adapters read them, [out, in]), and the
    forwards within ``rel`` of the largest."""
    ad_s, ad_t = adapter_for(source), adapter_for(target)
    for s, t in pairs:
        np.testing.assert_array_equal(ad_t.read(t), ad_s.read(s), err_msg=f"{s} -> {t}")
    y_s, y_t = forward(source, x), forward(target, x)
    assert np.abs(y_s - y_t).max() <= rel * np.abs(y_s).max()


def check_tied_checkpoint(make_a: Callable[[int], Any], make_b: Callable[[int], Any],
                          x: np.ndarray, folder: str, rel: float) -> Dict[str, Any]:
    """Both sides tied: ``save_map``, then an ``a`` checkpoint converted into ``b``'s format
    and one of ``b`` back (``reverse``), each loaded strictly into a fresh model of other
    values: every value the source's bit for bit, the tie kept (the loaded model's
    parameters still one object under both names), the forwards within ``rel``. Returns the
    map."""
    written = save_map(make_a(0), make_b(1), f"{folder}/map.json", probe=x)
    ties = {"src": adapter_for(make_a(0)).aliases, "dst": adapter_for(make_b(1)).aliases}
    assert written["tied"] == ties and ties["src"] and ties["dst"]
    pairs = [(p["src"], p["dst"]) for p in written["pairs"]]
    assert set(ties["src"]) <= {s for s, _ in pairs} and set(ties["dst"]) <= {d for _, d in pairs}
    for reverse, makers, seeds in ((False, (make_a, make_b), (2, 3)),
                                   (True, (make_b, make_a), (4, 5))):
        source, target = _converted(*makers, seeds, folder, reverse)
        assert adapter_for(target).aliases == ties["src" if reverse else "dst"]
        _assert_copied(source, target, [(d, s) if reverse else (s, d) for s, d in pairs],
                       x, rel)
    return written


def check_untied_into_tied(make_tied: Callable[[int], Any],
                           make_untied: Callable[[int], Any], x: np.ndarray, folder: str,
                           alias: str, first: str, rel: float) -> None:
    """Tied on one side only. Untied -> tied: the two tensors differ, so the conversion is
    refused naming both and nothing is written; made equal, they convert into the one
    parameter. Tied -> untied (``reverse``): the one value is written to both names."""
    written = save_map(make_untied(0), make_tied(1), f"{folder}/map.json", probe=x)
    ties = adapter_for(make_tied(1)).aliases  # a shared layer ties its bias too
    assert written["tied"] == {"src": {}, "dst": ties} and ties[alias] == first
    untied = make_untied(2)
    save_state(untied, f"{folder}/in")
    with pytest.raises(MappingError, match=rf"{first}, {alias}: one parameter in the "
                                           rf"{adapter_for(make_tied(0)).framework} model "
                                           rf"\(tied\), but the checkpoint's {first} and "
                                           rf"{alias}, converted into them, differ"):
        convert_checkpoint(f"{folder}/in", f"{folder}/out", f"{folder}/map.json")
    assert not os.path.exists(f"{folder}/out")
    adapter = adapter_for(untied)
    for other, name in ties.items():  # an untied model that holds each value twice
        adapter.write(other, adapter.read(name))
    save_state(untied, f"{folder}/in")
    convert_checkpoint(f"{folder}/in", f"{folder}/out", f"{folder}/map.json")
    tied = make_tied(3)
    load_strictly(tied, f"{folder}/out")
    assert adapter_for(tied).aliases == ties
    pairs = [(p["src"], p["dst"]) for p in written["pairs"]]
    _assert_copied(untied, tied, pairs, x, rel)
    tied, untied = _converted(make_tied, make_untied, (4, 5), folder, reverse=True)
    _assert_copied(tied, untied, [(d, s) for s, d in pairs], x, rel)
    assert adapter_for(untied).aliases == {}


def check_edited_tied_checkpoint(make_a: Callable[[int], Any], make_b: Callable[[int], Any],
                                 x: np.ndarray, folder: str, alias: str, first: str) -> None:
    """A checkpoint of the tied ``a`` whose two names were given different values (edited,
    or saved after untying) converted through a map of tied models: refused, naming both
    names, nothing written."""
    save_map(make_a(0), make_b(1), f"{folder}/map.json", probe=x)
    model = make_a(2)
    state = model.state_dict()
    state[alias] = state[alias] * 2
    save_state(model, f"{folder}/in", state)
    with pytest.raises(MappingError, match=rf"{first}, {alias}: one parameter in the map's "
                                           rf"\w+ model \(tied\), but the checkpoint holds "
                                           rf"different values under the two names"):
        convert_checkpoint(f"{folder}/in", f"{folder}/out", f"{folder}/map.json")
    assert not os.path.exists(f"{folder}/out")
