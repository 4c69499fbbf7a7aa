"""Entering PyTorch's autograd engine."""

from __future__ import annotations

import operator
from typing import Any, List, Optional, Sequence

import torch

from .grads import storage_users, unshare_seeds

# The seed gradmgr made last (dy left out: ones), until the engine takes it: no user holds it,
# so a .grad on its storage is what the engine leaves after loss.backward() too, and needs no
# check. Told by identity, which costs a step less than an attribute set on the tensor
# (bench/bench_torch.py times the plain step; bench/ab_plain_step.py compares two versions)
# (another thread's seed made in between only sends this one through the check). The tape
# forgets one the engine did not take when its recording stops, which every backward ends
# with (y needed no gradient, an error before the engine), so that no seed outlives its
# backward.
OWN_SEED: List[Optional[torch.Tensor]] = [None]

_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)  # torch>=2.3
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _public_engine(outputs, seeds, retain, create_graph, inputs, accumulate):
    if accumulate:
        torch.autograd.backward(outputs, seeds, retain_graph=retain, inputs=inputs)
        return ()
    return torch.autograd.grad(outputs, inputs, grad_outputs=seeds, retain_graph=retain,
                               create_graph=create_graph, allow_unused=True)


def run_engine(
    outputs: Sequence[Any], seeds: Sequence[torch.Tensor], retain: bool, create_graph: bool,
    inputs: Sequence[Any], accumulate: bool,
) -> Sequence[Optional[torch.Tensor]]:
    """Run the autograd engine: accumulate into ``.grad`` of ``inputs``, or return their grads.

    ``torch.autograd.backward``/``grad`` spend most of their Python time normalizing arguments
    and re-checking seeds, which the manager has already done (every seed is a tensor of its
    output's shape), and that is measurable on small models. So this goes straight to the
    function both of them end in, ``torch.autograd.graph._engine_run_backward``, which keeps
    PyTorch's own per-call set-up (debug-logging hooks, compiled-autograd context). Where that
    private function is missing, or inside a functorch transform (where the public functions
    raise their own error), the public functions are used. When it accumulates, no ``.grad``
    is left on a seed the user passed (:func:`.grads.unshare_seeds`).
    """
    own = _takes_own_seed(seeds)  # (also where it does not accumulate: see there)
    if not accumulate or own:
        return _run(outputs, seeds, retain, create_graph, inputs, accumulate)
    # A seed whose storage has more users after the engine accumulated went into a .grad.
    users = [storage_users(dy) for dy in seeds]
    result = _run(outputs, seeds, retain, create_graph, inputs, True)
    if any(storage_users(dy) > n for dy, n in zip(seeds, users)):
        unshare_seeds(inputs, seeds)
    return result


def run_engine_plain(output: torch.Tensor, seed: torch.Tensor, retain: bool,
                     inputs: List[torch.Tensor]) -> None:
    """``run_engine([output], [seed], retain, False, inputs, accumulate=True)`` for the usual
    step (one output, gradmgr's own seed), without the lists and calls around the engine."""
    if seed is OWN_SEED[0] and _engine_run_backward is not None and not _functorch_active():
        OWN_SEED[0] = None  # (taken, as _takes_own_seed does)
        _engine_run_backward((output,), (seed,), retain, False, tuple(inputs),
                             allow_unreachable=True, accumulate_grad=True)
    else:
        run_engine([output], [seed], retain, False, inputs, accumulate=True)


def _takes_own_seed(seeds: Sequence[torch.Tensor]) -> bool:
    """Whether ``seeds`` is the one seed :func:`own_seed` made last. Called as seeds go into
    the engine, which is when that seed is forgotten, also among others: from then on it may
    be some ``.grad`` (the engine stores a seed itself where the output is a leaf), which the
    user may pass as ``dy`` later."""
    own = OWN_SEED[0]
    if own is None:
        return False
    if len(seeds) == 1 and seeds[0] is own:
        OWN_SEED[0] = None
        return True
    if any(dy is own for dy in seeds):
        OWN_SEED[0] = None
    return False


def own_seed(like: torch.Tensor) -> torch.Tensor:
    """``ones_like(like)``, remembered as a seed no user holds (see ``OWN_SEED``)."""
    seed = OWN_SEED[0] = torch.ones_like(like)
    return seed


def _run(outputs, seeds, retain, create_graph, inputs, accumulate):
    if _engine_run_backward is None or _functorch_active():
        return _public_engine(outputs, seeds, retain, create_graph, inputs, accumulate)
    return _engine_run_backward(
        tuple(outputs), tuple(seeds), retain, create_graph, tuple(inputs),
        allow_unreachable=True, accumulate_grad=accumulate,
    )


_POST_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


class EngineAccumulates:
    """Whether a backward can leave the attached tensors' gradients to the engine, accumulated
    into ``.grad`` as a plain ``loss.backward()`` does, for a reducer to reduce the planned
    ones afterwards (torch's C++ reducer, or gradmgr's buckets after the backward): every
    attached tensor a leaf (or, where ``delivers_others``, every planned one: the tape
    delivers the others, see ``TorchTape.backward_accumulating``); the planned ones dense and
    trainable; and none with a post-accumulate-grad hook (it would run before the reduction,
    and see the local gradient instead of the reduced one)."""

    delivers_others = False

    def accepts(self, attached: Sequence[Any], planned: Sequence[Any]) -> bool:
        return (all(t.is_leaf for t in (planned if self.delivers_others else attached))
                and all(t.requires_grad and t.layout == torch.strided for t in planned)
                and self.still_accepts(planned))

    def still_accepts(self, planned: Sequence[Any]) -> bool:
        return not any(map(_POST_HOOKS, planned))
