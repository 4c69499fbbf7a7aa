"""Writing ``.grad``: what PyTorch's AccumulateGrad guarantees, for gradients gradmgr delivers.

Gradients that pass through the manager (callbacks, nesting, after-backward callbacks) are the
engine's or a callback's tensor objects: the same object may be the gradient of two tensors
(``a + b``), an expanded view (``w.sum()``), or something user code keeps. So the first
gradient stored into an empty ``.grad`` is copied into storage of its own, laid out like its
tensor (PyTorch's gradient layout contract), later ones are added in place, and the tensor's
post-accumulate-grad hooks run, all as AccumulateGrad does for ``loss.backward()``.
"""

from __future__ import annotations

import operator
import sys
import threading
import warnings
from itertools import repeat
from typing import Any, Optional, Sequence

import torch

# Managers in different threads may accumulate into one shared tensor; AccumulateGrad holds a
# lock for the same reason.
_LOCK = threading.Lock()


def any_present(grads: Sequence[Any]) -> bool:
    """Whether some item of ``grads`` is not None. One C-level pass (no generator frame
    resumed per item): the snapshots of ``.grad`` around every step call it on every attached
    tensor (bench/RESULTS.md, wt/pertensor)."""
    return not all(map(operator.is_, grads, repeat(None)))


def any_missing(grads: Sequence[Any]) -> bool:
    """Whether some item of ``grads`` is None (one C-level pass, as :func:`any_present`)."""
    return any(map(operator.is_, grads, repeat(None)))


def zeros_like_cheaply(grad: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``grad`` in one element of memory (a stand-in the engine accepts where
    it wants a gradient of that shape)."""
    key = (grad.dtype, grad.device)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = torch.zeros((), dtype=grad.dtype, device=grad.device)
    return zero.expand(grad.shape)


_ZEROS: dict = {}


def owned_copy(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A copy of ``grad`` in new storage with ``like``'s strides where ``like`` is dense
    (contiguous otherwise). Differentiable, so a higher-order ``.grad`` keeps its graph."""
    if grad.layout != torch.strided:
        return grad.clone()
    if like.is_contiguous():
        return grad.clone(memory_format=torch.contiguous_format)
    if like.is_contiguous(memory_format=torch.channels_last):
        return grad.clone(memory_format=torch.channels_last)
    if _dense(like):
        out = torch.empty_strided(like.size(), like.stride(), dtype=grad.dtype,
                                  device=grad.device)
        return out.copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _references_of(tensor: Any, grad: Any) -> int:
    return sys.getrefcount(grad)


def _unshared_references() -> int:
    """What ``sys.getrefcount`` says inside :func:`accumulate` of an object that only its
    caller's variable holds (the manager drops every other reference first, see
    GradManager._accumulate_gradients); measured, since the interpreter's calling convention
    decides it. Tests pin both directions: a gradient user code still holds is copied, one
    nobody holds is stored as it is."""
    held_only_here = object()
    return _references_of(None, held_only_here)


_OWN_REFS = _unshared_references()


def _storage(t: torch.Tensor) -> tuple:
    """``(users of t's storage, its size in bytes)``, counted as stealable() counts."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata), storage.nbytes()


def _use_count(tensor: torch.Tensor) -> int:
    """C++ tensors sharing ``tensor``'s TensorImpl (its Python object among them)."""
    return tensor._use_count()  # type: ignore[attr-defined]  # private: not in torch's stubs


def _base_users(view: torch.Tensor) -> tuple:
    """Python references to a view's base, and C++ tensors on it (the view itself is one)."""
    base = view._base
    if base is None:
        raise ValueError("_base_users: not a view")  # (callers ask for views only)
    return sys.getrefcount(base), _use_count(base)


def _calibrate() -> tuple:
    """Use counts of tensors nobody else holds, as this torch reports them: a tensor alone
    (its Python object; its storage, plus what counting adds on some versions), and a view
    whose base only the view holds (the engine often returns those: the transpose of a
    product)."""
    alone = torch.empty(1)
    view = torch.empty(2, 2).t()
    return (_use_count(alone), _storage(alone)[0]) + _base_users(view)


_OWN_TENSOR_USES, _OWN_STORAGE_USES, _OWN_BASE_REFS, _OWN_BASE_USES = _calibrate()


def storage_unshared(t: torch.Tensor) -> bool:
    """No tensor but ``t`` uses its storage (no view, no ``.grad`` kept somewhere)."""
    return _storage(t)[0] <= _OWN_STORAGE_USES


def storage_users(t: torch.Tensor) -> int:
    """Tensors on ``t``'s storage, or 0 where it has no storage to count (a sparse tensor, a
    functorch wrapper)."""
    if t.layout != torch.strided:
        return 0
    try:
        return _storage(t)[0]
    except (RuntimeError, NotImplementedError):
        return 0


def unshare_seeds(tensors: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor]) -> None:
    """Give each ``.grad`` of ``tensors`` that uses a seed's storage a copy of its own.

    The engine's AccumulateGrad stores an incoming gradient as an empty ``.grad`` when no
    other tensor object holds it, which a view of the seed passes (``y = x.reshape(6)`` hands
    ``x`` a view of ``dy``): a later backward would then add into the user's ``dy``
    (contract point 6). The value is the same, so hooks that already saw it saw it right."""
    shared = {s.untyped_storage().data_ptr() for s in seeds if storage_users(s)} - {0}
    for t in tensors:
        grad = t.grad
        if (grad is not None and grad.layout == torch.strided
                and grad.untyped_storage().data_ptr() in shared):
            t.grad = owned_copy(grad, t)


def stealable(grad: torch.Tensor, like: torch.Tensor, refs: int) -> bool:
    """AccumulateGrad's rule for storing ``grad`` itself as ``like.grad``: nobody else holds
    it (Python references, other C++ tensors on it), it is laid out like ``like`` with storage
    of its own size, and it needs no graph; and, stricter than AccumulateGrad, no other tensor
    uses its storage but its own base, if it is a view (so two views of one buffer, which
    ``cat``'s backward hands out, are never two ``.grad`` tensors on one storage)."""
    if (refs > _OWN_REFS or _use_count(grad) > _OWN_TENSOR_USES or grad.requires_grad
            or grad.is_sparse or grad.storage_offset()):
        return False
    if not (grad.is_contiguous() and like.is_contiguous()) and grad.stride() != like.stride():
        return False
    if not grad._is_view():
        users, nbytes = _storage(grad)
        return users <= _OWN_STORAGE_USES and nbytes == grad.nbytes
    # A view: its base (every view holds it) must be held by nobody but this view, not by the
    # user (their dy) nor by another view (cat's backward), and be no larger than the view.
    base_refs, base_uses = _base_users(grad)
    if base_refs > _OWN_BASE_REFS or base_uses > _OWN_BASE_USES:
        return False
    base = grad._base
    return (base is not None and base._base is None and base.nbytes == grad.nbytes
            and not base._is_view())


def accumulate(tensor: torch.Tensor, grad: torch.Tensor) -> None:
    """``tensor.grad = grad`` (the gradient itself where nobody else holds it, else a copy of
    its own) or ``tensor.grad += grad``."""
    refs = sys.getrefcount(grad)
    with _LOCK:
        if tensor.is_leaf:
            existing = tensor.grad
        else:
            with warnings.catch_warnings():  # reading .grad of a non-leaf warns
                warnings.simplefilter("ignore")
                existing = tensor.grad
        if existing is None:
            tensor.grad = grad if stealable(grad, tensor, refs) else owned_copy(grad, tensor)
        elif existing.is_sparse and not grad.is_sparse:
            tensor.grad = grad + existing  # as AccumulateGrad: sparse + dense is not defined
        elif grad.requires_grad or existing.requires_grad or existing.is_sparse:
            tensor.grad = existing + grad  # keeps the graph of a higher-order gradient
        else:
            existing.add_(grad)
    if tensor.is_leaf and tensor._post_accumulate_grad_hooks:
        _post_accumulate(tensor)


def set_grad(tensor: torch.Tensor, grad: torch.Tensor) -> None:
    """``tensor.grad = grad`` for a gradient nobody else holds (``Future.replaces_grad``),
    copied only where its layout differs from a non-contiguous tensor's (channels_last)."""
    if not tensor.is_contiguous() and grad.stride() != tensor.stride():
        grad = owned_copy(grad, tensor)
    tensor.grad = grad  # one assignment: no lock needed
    _post_accumulate(tensor)


def _post_accumulate(tensor: torch.Tensor) -> None:
    if tensor.is_leaf:
        hooks = tensor._post_accumulate_grad_hooks
        if hooks:
            for hook in tuple(hooks.values()):
                if hook(tensor) is not None:  # as PyTorch's AccumulateGrad refuses it
                    raise RuntimeError("Tensor post accumulate grad hooks should return None.")


def grad_problem(tensor: torch.Tensor, grad: torch.Tensor) -> Optional[str]:
    """Why ``grad`` cannot be ``tensor``'s gradient, or None."""
    if grad.shape == tensor.shape and grad.dtype == tensor.dtype and grad.device == tensor.device:
        return None
    return f"got {describe(grad)}, but the tensor has {describe(tensor)}"


def describe(t: Any) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"
