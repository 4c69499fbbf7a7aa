"""The tape of a manager that starts recording before its framework is known.

A manager with nothing attached does not know its backend at ``record()``. Where several
frameworks are imported, it starts a tape on each, so that whichever it turns out to be has its
place in the recording order (an earlier-started manager records a later one's backward); the
first tensor it is given settles it: that backend's tape goes on, the others stop.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .backend import Backend, GradSink, Tape


class ProvisionalTape(Tape):
    """Started tapes of several candidate backends, until :meth:`settle` picks one."""

    def __init__(self, candidates: List[Backend]) -> None:
        self._candidates = candidates
        self._tapes: Dict[Backend, Tape] = {}

    def start(self) -> None:
        for backend in self._candidates:
            tape = backend.new_tape()
            try:
                tape.start()
            except Exception:
                # This framework cannot record here (MegEngine outside the main thread). If the
                # manager turns out to be of it, starting its own tape raises the real error.
                continue
            self._tapes[backend] = tape

    def settle(self, backend: Backend) -> Optional[Tape]:
        """The started tape of ``backend`` (None if it could not start); the others stop."""
        tapes, self._tapes = self._tapes, {}
        tape = tapes.pop(backend, None)
        for other in tapes.values():
            other.stop()
        return tape

    def watch(self, tensor: Any, sink: GradSink, eager: bool) -> None:
        raise RuntimeError("a tensor was attached before the manager's backend was settled")

    def backward(self, ys: Sequence[Any], dys: Sequence[Any], *, create_graph: bool,
                 retain_graph: bool, may_accumulate: bool = False) -> None:
        pass  # nothing is attached yet, so nothing gets a gradient

    def stop(self) -> None:
        self.settle(None)  # type: ignore[arg-type]  # no backend: every tape stops
