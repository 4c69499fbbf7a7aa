"""The errors of the parity tool: every one carries the report that explains it."""

from __future__ import annotations

from typing import Any


class ParityError(Exception):
    """Base of the parity tool's errors; ``report`` is the report that explains it (or None).

    Example:
        >>> from gradmgr.parity import ParityError
        >>> str(ParityError("two models differ", report=None))
        'two models differ'
    """

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class MappingError(ParityError, ValueError):
    """``transfer_weights(..., strict=True)`` could not map every tensor, or a mapped pair
    differs in shape beyond a layout-only reshape (a transposed weight among them); the
    message is the mapping report.

    Example:
        >>> from gradmgr.parity import MappingError, ParityError
        >>> issubclass(MappingError, ParityError)
        True
    """


class ModelTypeError(ParityError, TypeError):
    """The object given as a model is no module of a framework gradmgr knows, or its backend
    has no parity adapter.

    Example:
        >>> from gradmgr.parity import ModelTypeError, compare_step
        >>> try:
        ...     compare_step(object(), object(), batch=())
        ... except ModelTypeError as error:
        ...     print(str(error).split(":")[0])
        cannot compare a object
    """
