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
non-finite value in any rank's slices, on every rank.

Elementwise in-place calls (``zero_`` of ``model.zero_grad(set_to_none=False)``, ``div_`` and
``/=`` of manual averaging, the clamps of ``clip_grad_value_``, ``add_`` of DP-SGD's noise,
``nan_to_num_``, and torch's ``_foreach_`` forms) act on this rank's slices: each element of a
slice is what it is in DDP's ``.grad`` after the same call. A number or a 0-dim tensor applies
as it is; a tensor of the gradient's shape (or one that broadcasts to it) is flattened as the
shards flatten the gradient, and each slice takes its own elements of it.

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
    "works on it, or opt.clip_grad_norm_(max_norm); so do in-place elementwise calls with a "
    "number or a tensor of the gradient's shape (mul_, div_, /=, add_, sub_, clamp_, "
    "clip_grad_value_, nan_to_num_, zero_), each rank on its slice; opt.step() steps the "
    "slices and opt.zero_grad() drops them, and the stand-ins. Inside no_sync(gm), .grad "
    "holds this rank's own whole gradient"
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


class _Flat:
    """A tensor operand of the gradient's shape (or broadcast to it), flattened as the
    shards flatten the gradient: each slice takes its own elements of it."""

    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values


def _operand(grad: Any, value: Any, what: str) -> Any:
    """``value`` ready to apply to ``grad``'s slices; checked on every rank, those holding
    none of the gradient too, so that every rank raises alike."""
    if is_stand_in(value):  # another gradient's slices need not line up with this one's
        raise RuntimeError(_REFUSED.format(what=f"{what} with a stand-in .grad as its operand"))
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value  # a number, or a 0-dim tensor: the same for every element
    try:
        whole = value.broadcast_to(grad.shape)
    except RuntimeError:
        raise RuntimeError(
            f"{what} on a stand-in .grad of shape {list(grad.shape)} with a tensor of shape "
            f"{list(value.shape)}, which does not broadcast to it: give a number, a 0-dim "
            f"tensor or a tensor of the gradient's shape (each rank applies its slice of it)"
        ) from None
    return _Flat(whole.reshape(-1))


def _cut(value: Any, start: int, stop: int) -> Any:
    return value.values[start:stop] if isinstance(value, _Flat) else value


def _check_alpha(grad: Any, alpha: Any, what: str) -> None:
    # torch's CPU kernel of a + alpha * b rounds a 16-bit tensor's last elements (past its
    # last full vector) otherwise than the rest: a slice's last ones would not be DDP's
    if alpha != 1 and grad.dtype in (torch.bfloat16, torch.float16):
        raise RuntimeError(
            f"{what} with alpha={alpha} on a stand-in .grad of dtype {grad.dtype}: each rank "
            f"would round its slice's last elements otherwise than DDP's whole .grad. Scale "
            f"the operand first (p.grad.add_(other * alpha)): each slice then holds what "
            f"DDP's .grad holds after that same call")


def _slices(grad: Any, args: tuple, kwargs: dict, what: str) -> list:
    """``(slice, args, kwargs)`` for each of this rank's slices of the stand-in's gradient,
    each tensor operand of the gradient's shape cut to the slice's elements."""
    _check_alpha(grad, kwargs.get("alpha", 1), what)
    args = tuple(_operand(grad, a, what) for a in args)
    kwargs = {k: _operand(grad, v, what) for k, v in kwargs.items()}
    return [(part, tuple(_cut(a, start, stop) for a in args),
             {k: _cut(v, start, stop) for k, v in kwargs.items()})
            for start, stop, part in grad._member.pieces()]


def _elementwise(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, an in-place elementwise ``Tensor`` method, applied to each of this rank's
    slices of the stand-in's gradient: DDP's ``.grad`` after the same call, slice by slice."""
    what = f"Tensor.{method.__name__}"

    def apply(grad: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_stand_in(grad):  # a plain tensor, with a stand-in as its operand
            raise RuntimeError(_REFUSED.format(what=f"{what} with a stand-in .grad as its operand"))
        with torch.no_grad():
            for part, part_args, part_kwargs in _slices(grad, args, kwargs, what):
                method(part, *part_args, **part_kwargs)
        grad._member.changed()
        return grad
    return apply


def _foreach(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._foreach_*_(tensors, *operands)``: one call of torch's kernel on the plain
    tensors and this rank's slices of the stand-ins (an operand given per tensor cut to each
    slice's elements)."""
    what = f"torch.{kernel.__name__}"

    def apply(tensors: Any, *operands: Any, **kwargs: Any) -> None:
        targets, given, stand_ins = [], [], []
        for i, tensor in enumerate(tensors):
            mine = tuple(o[i] if isinstance(o, (list, tuple)) else o for o in operands)
            if is_stand_in(tensor):
                stand_ins.append(tensor)
                for part, part_args, _ in _slices(tensor, mine, kwargs, what):
                    targets.append(part)
                    given.append(part_args)
            else:
                targets.append(tensor)
                given.append(mine)
        args = [[g[j] for g in given] if isinstance(o, (list, tuple)) else o
                for j, o in enumerate(operands)]
        if targets:
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                kernel(targets, *args, **kwargs)
        for grad in stand_ins:
            grad._member.changed()
    return apply


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
}
# In place and elementwise: each rank applies them to its slices, which then hold DDP's values
# there (clipping's mul_, zero_grad(set_to_none=False)'s zero_, clip_grad_value_'s clamps,
# averaging's div_ and /=, noise's add_, nan_to_num_).
_HANDLERS.update({method: _elementwise(method) for method in (
    torch.Tensor.mul_, torch.Tensor.div_, torch.Tensor.add_, torch.Tensor.sub_,
    torch.Tensor.clamp_, torch.Tensor.clip_, torch.Tensor.clamp_min_, torch.Tensor.clamp_max_,
    torch.Tensor.nan_to_num_, torch.Tensor.zero_)})
_HANDLERS.update({kernel: _foreach(kernel) for kernel in (
    torch._foreach_mul_, torch._foreach_div_, torch._foreach_add_, torch._foreach_sub_,
    torch._foreach_clamp_min_, torch._foreach_clamp_max_, torch._foreach_zero_)})
# Metadata that needs no values, the whole gradient's (model.zero_grad(set_to_none=False) asks
# requires_grad_(False)); attributes (.shape, .dtype, .nbytes...) pass as __get__.
_PASSED = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.requires_grad_,
           torch.Tensor.__repr__, torch.Tensor.element_size, torch.Tensor.is_floating_point,
           torch.Tensor.is_complex, torch.Tensor.is_signed, torch.Tensor.get_device,
           torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.__len__,
           torch.Tensor.ndimension, torch.Tensor.nelement}
