"""A parameter's ``.grad`` after a synced sharded backward: a stand-in that holds no memory,
through which ``torch.nn.utils.clip_grad_norm_`` clips the gradient slices the ranks hold
(see :mod:`gradmgr.distributed.sharded.shard_grads`), and which refuses, with an error saying where
the gradient is, anything else.

Torch's clipping asks each gradient for its 2-norm (``torch.linalg.vector_norm``, or
``torch._foreach_norm``), takes the norm of those norms, and multiplies each gradient in place
by the clipped factor (``Tensor.mul_``, or ``torch._foreach_mul_``): the stand-in answers the
norm of the whole gradient and multiplies this rank's slices by the same factor, so the result
is DDP's + ``clip_grad_norm_``'s. ``torch.amp.GradScaler.unscale_``'s kernel
(``torch._amp_foreach_non_finite_check_and_unscale_``) unscales the slices and finds a
non-finite value in any rank's slices, on every rank. ``Tensor.zero_``
(``model.zero_grad(set_to_none=False)``) zeroes the slices.

Metadata is the whole gradient's, as DDP's ``.grad`` and FSDP2's DTensor ``.grad`` (whose
metadata is the global tensor's) answer it: shape, dtype, device, layout, strides (the
parameter's, as DDP lays out its gradients), ``numel()``, ``element_size()``, ``nbytes``
(what the whole gradient would take: memory-accounting code sums these as under DDP; this
rank holds ``to_local().nbytes`` of it). ``to_local()`` is this rank's slice, as DTensor's
``to_local()``; it is not a DTensor, since a rank's slice is a flat range of the gradient
where the bucket's chunk falls, not a placement DTensor has. Every other operation, from
Python or from C++ (autograd, an optimizer's kernels), raises.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

_REFUSED = (
    "{what} on the .grad of a parameter that data_parallel(model, shard=True) reduced: after "
    "a synced backward each rank holds only its slice of the reduced gradient, in the "
    "ShardedOptimizer, and .grad is a stand-in that answers the whole gradient's metadata "
    "(shape, dtype, device, numel(), element_size(), nbytes) but holds no values. "
    "p.grad.to_local() is this rank's slice (a 1-D view of the flattened gradient's elements "
    "p.grad.local_range()); "
    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) (2-norm, on every rank) "
    "works on it, or opt.clip_grad_norm_(max_norm); opt.step() steps the slices and "
    "opt.zero_grad() drops them, and the stand-ins. Inside no_sync(gm), .grad holds this "
    "rank's own whole gradient"
)

_GONE = (
    "to_local() on a stand-in .grad whose gradient slices are gone (opt.zero_grad() dropped "
    "them): read p.grad.to_local() after a synced backward, before opt.zero_grad()"
)


class ShardedGradient(torch.Tensor):
    """The stand-in ``.grad`` of one parameter (``member``: a ``MemberGrad``)."""

    _member: Any

    @staticmethod
    def __new__(cls, like: torch.Tensor, member: Any) -> ShardedGradient:
        # The parameter's strides: DDP's .grad has them (its gradient layout contract).
        grad = torch.Tensor._make_wrapper_subclass(cls, like.shape, like.stride(),
                                                   dtype=like.dtype, device=like.device)
        grad._member = member
        return grad

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]  # (1)
        return (f"ShardedGradient(shape={list(self.shape)}, dtype={self.dtype}: this rank's "
                f"slice of it is in the ShardedOptimizer, p.grad.to_local())")

    def __format__(self, spec: str) -> str:
        if spec:  # a number's format: there are no values to format
            raise RuntimeError(_REFUSED.format(what=f"format(p.grad, {spec!r})"))
        return repr(self)

    def to_local(self) -> torch.Tensor:
        """This rank's slice of the reduced gradient, as DTensor's ``to_local()``: a 1-D view
        of the elements :meth:`local_range` of the flattened gradient (empty where this rank
        holds none of it). A view, as DTensor's: writing it changes what ``opt.step()``
        steps. Write it before torch's ``clip_grad_norm_``, not between two of them in one
        step: the second would reuse the norms the first asked (``opt.clip_grad_norm_``
        always sums the slices afresh)."""
        part = self._member.local()
        if part is None:
            raise RuntimeError(_GONE)
        return part

    def local_range(self) -> Tuple[int, int]:
        """``(start, stop)``: :meth:`to_local` holds the elements ``start`` to ``stop`` of the
        flattened gradient (``p.grad.to_local()`` is DDP's ``p.grad.flatten()[start:stop]``);
        ``start == stop`` where this rank holds none of it."""
        return self._member.span()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__" or func in _PASSED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise RuntimeError(_REFUSED.format(what=_name(func)))

    # (1) torch declares these as wrapped or bound C functions, which mypy cannot match
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # (1)
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(_REFUSED.format(what=str(func)))


def stand_in_grad(tensor: torch.Tensor, member: Any) -> ShardedGradient:
    return ShardedGradient(tensor, member)


def is_stand_in(grad: Any) -> bool:
    return type(grad) is ShardedGradient


def _name(func: Any) -> str:
    owner = getattr(func, "__objclass__", None) or getattr(func, "__module__", None)
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
               or repr(func))
    return name if owner is None or "." in name else f"{getattr(owner, '__name__', owner)}.{name}"


def _norm_of(grad: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,
             dtype: Any = None, out: Any = None) -> torch.Tensor:
    if not is_stand_in(grad):
        return torch.linalg.vector_norm(grad, ord, dim, keepdim, dtype=dtype, out=out)
    if float(ord) != 2.0 or dim is not None or out is not None:
        raise RuntimeError(_REFUSED.format(
            what=f"a norm other than the whole 2-norm (ord={ord}, dim={dim})"))
    return torch.tensor(grad._member.norm(), dtype=dtype or grad.dtype, device=grad.device)


def _foreach_norm(grads: Any, ord: Any = 2, dtype: Any = None) -> list:
    return [_norm_of(g, ord, dtype=dtype) for g in grads]


def _in_place(grad: Any, change: Callable[[torch.Tensor], Any]) -> Any:
    """``change`` each of this rank's slices of the stand-in's gradient, in place."""
    with torch.no_grad():
        for part in grad._member.parts():
            change(part)
    grad._member.changed()
    return grad


def _mul_(grad: Any, factor: Any) -> Any:
    return _in_place(grad, lambda part: part.mul_(factor))


def _foreach_mul_(grads: Any, factors: Any) -> None:
    many = isinstance(factors, (list, tuple))
    for i, grad in enumerate(grads):
        factor = factors[i] if many else factors
        if is_stand_in(grad):
            _mul_(grad, factor)
        else:
            grad.mul_(factor)


def _zero_(grad: Any) -> Any:
    return _in_place(grad, torch.Tensor.zero_)


def _unscale_(grads: Any, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``torch.amp.GradScaler.unscale_``'s kernel: unscales this rank's slices of the stand-ins
    in place, and sets ``found_inf`` where any rank's slices hold a non-finite value (one small
    allreduce), so that every rank skips the step, or steps, and scales alike."""
    plain = [g for g in grads if not is_stand_in(g)]
    members = [g._member for g in grads if is_stand_in(g)]
    unscale = torch._amp_foreach_non_finite_check_and_unscale_
    with torch._C.DisableTorchFunctionSubclass():
        if plain:
            unscale(plain, found_inf, inv_scale)
        if members:
            parts = [p for member in members for p in member.parts()]
            here = torch.zeros_like(found_inf)
            if parts:
                unscale(parts, here, inv_scale)
            for member in members:
                member.changed()
            if members[0].on_some_rank(bool(here.item())):
                found_inf.fill_(1.0)


def _type(grad: Any, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``p.grad.type()``, the type's name (metadata); a conversion (``type(dtype)``) refused."""
    if dtype is not None or args or kwargs:
        raise RuntimeError(_REFUSED.format(what="Tensor.type(dtype), a conversion,"))
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.type(grad)


_HANDLERS: Dict[Any, Callable[..., Any]] = {
    torch.Tensor.type: _type,
    torch._amp_foreach_non_finite_check_and_unscale_: _unscale_,
    torch.linalg.vector_norm: _norm_of,
    torch._foreach_norm: _foreach_norm,
    torch.Tensor.mul_: _mul_,
    torch._foreach_mul_: _foreach_mul_,
    torch.Tensor.zero_: _zero_,
}
# Metadata that needs no values, the whole gradient's (model.zero_grad(set_to_none=False) asks
# requires_grad_(False)); attributes (.shape, .dtype, .nbytes...) pass as __get__.
_PASSED = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.requires_grad_,
           torch.Tensor.__repr__, torch.Tensor.element_size, torch.Tensor.is_floating_point,
           torch.Tensor.is_complex, torch.Tensor.is_signed, torch.Tensor.get_device,
           torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.__len__,
           torch.Tensor.ndimension, torch.Tensor.nelement}
