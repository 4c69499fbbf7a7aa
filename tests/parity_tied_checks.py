"""What the parity tool's tests of tied weights (an LM head on its embedding's weight, two
Linears on one weight) assert alike on MegEngine (tests/test_parity_tool.py) and Paddle
(tests/test_parity_paddle.py) against PyTorch: each file builds its framework's models and
passes its own tolerance between two frameworks' float32 kernels."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest

from gradmgr.parity import compare_step, transfer_weights
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


# One Linear under two names (``self.b = self.a``, tests/parity_small_*.py's SharedLayer)
SHARED = ("a.weight", "a.bias", "b.weight", "b.bias")


def check_shared_layer_on_both_sides(a: Any, b: Any, x: Any, rel: float) -> None:
    """Both models call one Linear under the names ``a`` and ``b``: every name pairs (strict),
    the step is parity with both calls compared, and each name's gradient (the sum of both
    uses) is the other side's within ``rel`` of its largest."""
    mapping = transfer_weights(a, b, probe=x)
    assert mapping.ok and not mapping.unmapped, mapping.text()
    assert {(n, n) for n in SHARED} <= {(p.src, p.dst) for p in mapping.pairs}
    report = compare_step(a, b, x)
    assert report.ok, report.text()
    assert not report.unmatched and not report.unmapped
    assert sum(e.what == "forward" for e in report.entries) == 2  # both calls compared
    ga, gb = grads_by_name(a), grads_by_name(b)
    for name in SHARED:
        np.testing.assert_allclose(ga[name], gb[name], rtol=0,
                                   atol=rel * np.abs(gb[name]).max(), err_msg=name)


def check_shared_layer_on_one_side(a: Any, b: Any, x: Any, rel: float) -> None:
    """``a`` shares its Linear under two names, ``b`` has two: a tie finding for each of the
    Linear's tensors (not an unmapped one), every forward agrees, and the shared gradient is
    the sum of the other side's two (within ``rel`` of its largest)."""
    with pytest.raises(MappingError, match="tied to"):
        transfer_weights(a, b, probe=x)
    mapping = transfer_weights(a, b, probe=x, strict=False)
    assert not mapping.unmapped, mapping.text()
    assert [f.key for f in mapping.findings] == [TIE, TIE]
    report = compare_step(a, b, x)
    assert not report.ok and report.first_forward is None and not report.unmatched
    forwards = [e for e in report.entries if e.what in ("forward", "loss")]
    assert len(forwards) == 3 and all(e.ok for e in forwards)
    assert "b.weight / b.weight: tied to is 'a.weight'" in str(report)
    assert report.first_grad is not None and report.first_grad.what == "grad"
    ga, gb = grads_by_name(a), grads_by_name(b)
    for role in ("weight", "bias"):
        np.testing.assert_allclose(ga[f"a.{role}"], gb[f"a.{role}"] + gb[f"b.{role}"], rtol=0,
                                   atol=rel * np.abs(ga[f"a.{role}"]).max())
