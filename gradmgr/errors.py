"""Exceptions and warnings raised by gradmgr."""


class GradMgrWarning(UserWarning):
    """A framework cannot reproduce GradManager semantics exactly in this situation; the base
    of gradmgr's warnings.

    Example:
        >>> import warnings
        >>> warnings.simplefilter("error", GradMgrWarning)  # make every gradmgr warning fatal
        >>> warnings.resetwarnings()
    """


class BackendNotFoundError(LookupError):
    """No backend knows the given tensor type, or the named backend does not exist (or cannot
    be imported here).

    Example:
        >>> from gradmgr import get_backend
        >>> try:
        ...     get_backend("no-such-framework")
        ... except BackendNotFoundError as error:
        ...     print("no such backend")
        no such backend
    """


class AttachError(TypeError, AssertionError):
    """``attach()`` was given something that cannot get a gradient (not a tensor, or not a
    floating-point dtype). A ``TypeError``, and also an ``AssertionError`` because
    ``megengine.autodiff.GradManager.attach`` raises that, and code written for it catches it.

    Example:
        >>> from gradmgr import GradManager
        >>> try:
        ...     GradManager().attach([1.0, 2.0])
        ... except AttachError as error:
        ...     print("not a tensor")
        not a tensor
    """


class CallbackResultError(ValueError):
    """A gradient callback returned something that cannot be a gradient of its tensor: not a
    tensor, a Future or None, or a tensor whose shape, dtype or device differ from the
    tensor's.

    Example:
        >>> import torch
        >>> from gradmgr import GradManager
        >>> w = torch.ones(3, requires_grad=True)
        >>> gm = GradManager().attach(w, callbacks=lambda t, g: g.sum())   # a scalar: wrong
        >>> try:
        ...     with gm:
        ...         gm.backward((w * 2).sum())
        ... except CallbackResultError:
        ...     print("refused")
        refused
    """


class UnsupportedGraphError(RuntimeError):
    """The recorded computation uses something the backend cannot differentiate with
    GradManager semantics (for example reentrant activation checkpointing on PyTorch); the
    message says what to use instead.

    Example:
        >>> import torch
        >>> import torch.utils.checkpoint
        >>> from gradmgr import GradManager
        >>> block = torch.nn.Linear(2, 2)
        >>> gm = GradManager().attach(block.parameters())
        >>> x = torch.ones(1, 2, requires_grad=True)
        >>> try:
        ...     with gm:
        ...         h = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        ...         gm.backward(h.sum())
        ... except UnsupportedGraphError as error:
        ...     print("use_reentrant=False" in str(error))  # what to write instead
        True
    """


class UnsupportedBackendError(TypeError):
    """The tensors' backend does not implement what was asked (data parallelism needs
    ``Backend.tensor_ops()`` and ``Backend.transport()``).

    Example:
        >>> from gradmgr import Backend
        >>> class Minimal(Backend):                   # a backend without data parallelism
        ...     name = "minimal"
        ...     is_tensor = check_attachable = shape = ones_like = accumulate = new_tape = None
        >>> try:
        ...     Minimal().tensor_ops()
        ... except UnsupportedBackendError:
        ...     print("no data parallelism")
        no data parallelism
    """


class CallbackReturnedNoneWarning(GradMgrWarning):
    """A gradient callback returned None: its tensor gets no gradient from that backward
    (MegEngine's rule). Warned once per callback: a callback that forgot its ``return``
    (``clip(g)`` instead of ``return clip(g)``) drops the gradient.

    Example:
        >>> import warnings
        >>> def observe(tensor, grad):      # only looks: None on purpose, so not warned about
        ...     print(grad.shape)
        >>> warnings.filterwarnings("ignore", category=CallbackReturnedNoneWarning,
        ...                         message=".*observe")
        >>> warnings.resetwarnings()
    """


# What torch's Join asks every joinable first: a GradManager built by hand answers NOT_JOINABLE.
JOIN_HOOK_NAMES = frozenset({"join_hook", "join_device", "join_process_group"})
NOT_JOINABLE = (
    "this GradManager is not a joinable of torch's Join (uneven inputs): only the manager "
    "gradmgr.distributed.data_parallel(model) returns takes part in it, as a DDP model does "
    "(a manager built by hand with make_allreduce_cb() has no join hook). Make it with "
    "gm = data_parallel(model), or give every rank the same number of batches"
)
