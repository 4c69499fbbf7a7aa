"""The in-place habits of DDP scripts on ``.grad`` after a sharded backward, on 2 gloo ranks
(dist_workers/shard_grad_in_place.py, next to DDP in the same ranks): manual averaging
(``p.grad.div_(n)``, ``p.grad /= n``), ``clip_grad_value_`` (its per-tensor ``clamp_`` and its
``foreach=True`` kernels), ``clamp_min_``/``clamp_max_``/``clip_``, DP-SGD's noise
(``add_``/``sub_`` of the same full-shape noise on every rank, ``torch._foreach_add_``),
``torch._foreach_div_``, a full-shape mask through ``mul_``, ``nan_to_num_``, ``*=``,
``+=``, ``-=``, ``torch._foreach_mul_``/``_sub_``/``_clamp_max_``/``_zero_``. Each rank applies
the call to its slices of the stand-in ``.grad``; on old code each raised ``RuntimeError``.

Tolerance: none. Each of these is elementwise, so each slice holds DDP's values and the
parameters after two steps of SGD with momentum are DDP's bit for bit (a float32 model with a
layer laid out transposed and a float64 one, split over the ranks by 300-byte buckets).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from dist_workers.shard_grad_in_place import HABITS  # noqa: E402
from ranks import spawn  # noqa: E402


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    return spawn("shard_grad_in_place", tmp_path_factory.mktemp("ranks"), 2, timeout=300)


@pytest.mark.parametrize("habit", sorted(HABITS))
def test_the_habit_on_the_slices_gives_ddps_parameters(outs, habit):
    for rank, out in enumerate(outs):
        got = out[habit]
        assert "error" not in got, (rank, got.get("error"))
        for i, (ours, ddp) in enumerate(zip(*got["params"])):
            assert torch.equal(ours, ddp), (rank, i)
        assert ours.dtype == torch.float64  # the float64 layer is among them
    first, second = (out[habit]["params"][0] for out in outs)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "the ranks differ"


def test_the_clipping_habits_clip(outs):
    """Clipping at 0.02 changes part of DDP's gradients at each step: the clipping rows
    above check something."""
    for out in outs:
        assert all(n > 0 for n in out["clip_grad_value_"]["clipped"])


def test_noise_that_differs_between_ranks_gives_each_slice_its_ranks_noise(outs):
    """Each rank adds noise from its own seed: DDP's ranks drift apart; here every rank ends
    with the same parameters (each slice stepped with the noise of the rank that holds it)."""
    ours, ddp = zip(*(out["own noise"]["params"] for out in outs))
    assert "error" not in outs[0]["own noise"]
    assert all(torch.equal(a, b) for a, b in zip(*ours))
    assert not all(torch.equal(a, b) for a, b in zip(*ddp))


@pytest.mark.parametrize("what", ["another .grad", "into a plain tensor", "abs_()", "copy_()"])
def test_what_a_slice_cannot_do_still_raises_saying_where_the_gradient_is(outs, what):
    """An operand that is another stand-in (its slices need not line up), a stand-in added
    into a plain tensor, an in-place op not known to be elementwise."""
    for out in outs:
        kind, message = out["refused"][what]
        assert kind == "RuntimeError" and "p.grad.to_local() is this rank's slice" in message


@pytest.mark.parametrize("what", ["wrong shape", "foreach wrong shape"])
def test_an_operand_of_another_shape_is_a_clear_error(outs, what):
    for out in outs:
        kind, message = out["refused"][what]
        assert kind == "RuntimeError", (what, kind, message)
        assert "shape [5], which does not broadcast to it" in message, message


@pytest.mark.parametrize("habit", ["div_(3)", "/= 0-dim tensor", "clip_grad_value_",
                                   "add_ noise", "mul_ mask", "nan_to_num_", "_foreach_div_",
                                   "_foreach_add_ noise"])
def test_on_bfloat16_gradients_each_slice_holds_ddps_values(outs, habit):
    """The same habits on a bfloat16 model: each rank's slice after the call equals DDP's
    ``.grad`` there, bit for bit (compared as gradients: SGD's own step over bf16 slices is not
    DDP's bit for bit, docs/sharded.md)."""
    for rank, out in enumerate(outs):
        got = out["16-bit"][habit]
        assert isinstance(got, list), (rank, got)
        for i, (ours, ddp) in enumerate(got):
            assert ours.dtype == torch.bfloat16, (rank, i)
            assert torch.equal(ours, ddp), (rank, i)


@pytest.mark.parametrize("what", ["alpha", "foreach alpha"])
def test_alpha_on_16_bit_gradients_is_a_clear_error(outs, what):
    """``add_(other, alpha=a)`` on a bfloat16 slice: torch's CPU kernel rounds a 16-bit
    tensor's last elements otherwise than the rest (in a probe cutting bf16 tensors of 100,
    1,000 and 4,931 elements in two at 5 places each, 47 elements differed from the whole
    tensor's with alpha=0.37, none without alpha), so it raises, saying to scale the operand
    first."""
    for out in outs:
        kind, message = out["16-bit"][what]
        assert kind == "RuntimeError" and "alpha=0.5" in message
        assert "p.grad.add_(other * alpha)" in message
