"""GradManagerGroup: managers that record together and do not see each other's backward."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, List

from . import _state
from .registry import imported_backends


class GradManagerGroup:
    """Managers that record together and do not see each other's backward.

    Example:
        >>> from gradmgr import GradManager
        >>> gm1, gm2 = GradManager(), GradManager()
        >>> group = gm1 | gm2
        >>> with group:
        ...     pass  # both record; gm1.backward(...) is not recorded by gm2, nor vice versa
    """

    def __init__(self, gms: Iterable[Any]) -> None:
        self._gms = list(gms)
        for gm in self._gms:
            if not (callable(getattr(gm, "record", None)) and hasattr(gm, "backend")):
                raise TypeError(f"a group holds GradManagers, not {type(gm).__name__}")

    def merge_with(self, other: Any) -> GradManagerGroup:
        """A group of these managers and ``other`` (a manager or a group): ``group | gm``."""
        if isinstance(other, GradManagerGroup):
            return GradManagerGroup([*self._gms, *other._gms])
        if callable(getattr(other, "record", None)) and hasattr(other, "backend"):
            return GradManagerGroup([*self._gms, other])
        return NotImplemented

    __or__ = merge_with
    __ror__ = merge_with

    def record(self) -> None:
        """Every member starts recording, together (none records another's backward). A
        member with nothing attached takes the framework of the members that have something
        attached."""
        backends = {gm.backend for gm in self._gms if gm.backend is not None}
        if len(backends) > 1:
            names = sorted(b.name for b in backends)
            raise TypeError(f"a group cannot mix frameworks: its managers use {names}")
        backend = next(iter(backends), None)
        # Members that know no framework yet start a tape in each imported one (see
        # GradManager._start_without_backend): each one's group forms.
        candidates = [backend] if backend is not None else imported_backends()
        started: List[Any] = []
        state = _state.state
        try:
            with contextlib.ExitStack() as contexts:
                for candidate in candidates:
                    contexts.enter_context(candidate.recording_group())
                # A token, not the group: members must not keep each other alive through
                # it (a member dropped while recording is freed, see GradManager._ref).
                state.starting_group = _state.StartingGroup(object(), backend)
                for gm in self._gms:
                    gm.record()
                    started.append(gm)
        except BaseException:
            for gm in reversed(started):
                gm.release()
            raise
        finally:
            state.starting_group = None

    def release(self) -> None:
        """Every member stops recording (also when one raises: the first error propagates)."""
        first_error = None
        for gm in reversed(self._gms):
            try:
                gm.release()
            except BaseException as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def __enter__(self) -> GradManagerGroup:
        self.record()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.release()
