"""What a rank program records of a call that may raise, for the parent test to assert on."""

from __future__ import annotations

from typing import Callable, Optional, Tuple


def raised(fn: Callable[[], object]) -> Optional[Tuple[str, str]]:
    """``(type name, message)`` of what ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - what was raised is the result
        return type(error).__name__, str(error)
    return None
