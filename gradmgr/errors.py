"""Exceptions and warnings raised by gradmgr."""


class GradMgrWarning(UserWarning):
    """A framework cannot reproduce GradManager semantics exactly in this situation."""


class BackendNotFoundError(LookupError):
    """No backend knows the given tensor type, or the named backend does not exist."""


class AttachError(TypeError, AssertionError):
    """``attach()`` was given something that cannot get a gradient (not a tensor, or not a
    floating-point dtype). A ``TypeError``, and also an ``AssertionError`` because
    ``megengine.autodiff.GradManager.attach`` raises that, and code written for it catches it."""


class CallbackResultError(ValueError):
    """A gradient callback returned something that cannot be a gradient of its tensor: not a
    tensor or Future, or a tensor whose shape, dtype or device differ from the tensor's."""


class UnsupportedGraphError(RuntimeError):
    """The recorded computation uses something the backend cannot differentiate with
    GradManager semantics (for example reentrant activation checkpointing on PyTorch); the
    message says what to use instead."""


class UnsupportedBackendError(TypeError):
    """The tensors' backend does not implement what was asked (data parallelism needs
    ``Backend.tensor_ops()`` and ``Backend.transport()``)."""


class CallbackReturnedNoneWarning(GradMgrWarning):
    """A gradient callback returned None: its tensor gets no gradient from that backward
    (MegEngine's rule). Warned once per callback: a callback that forgot its ``return``
    (``clip(g)`` instead of ``return clip(g)``) drops the gradient."""
