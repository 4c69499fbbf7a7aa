"""Exceptions and warnings raised by gradmgr."""


class GradMgrWarning(UserWarning):
    """A framework cannot reproduce GradManager semantics exactly in this situation."""


class BackendNotFoundError(LookupError):
    """No backend knows the given tensor type, or the named backend does not exist."""
