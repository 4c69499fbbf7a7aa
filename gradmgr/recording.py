"""One manager's recording bookkeeping: its framework (known, or guessed until a tensor settles
it), its tape, and the recording in progress (``record()`` to ``release()``): the thread's list
of recording managers it joined, its group, the started tape, its number, whether a backward
ran in it.

A :class:`Recording` holds no reference to its manager, so a manager dropped while recording is
freed (as MegEngine's is) and :meth:`Recording.collected` ends the recording it leaves behind.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, List, NoReturn, Optional

from . import _state
from .attachments import Attachments
from .backend import Backend, Tape
from .errors import GradMgrWarning
from .provisional import ProvisionalTape
from .registry import imported_backends


class Recording:
    """The fields are read and written by the manager directly (the usual step reads several:
    a method per field would cost it); the methods are the changes that touch several."""

    __slots__ = ("backend", "guessed", "tape", "started", "provisional", "managers", "group",
                 "step", "backward_ran")

    def __init__(self, backend: Optional[Backend]) -> None:
        self.backend = backend
        # The backend was only guessed (a recording or a backward with nothing attached took
        # the only imported framework, or its group's): the first attached tensor decides.
        self.guessed = False
        self.tape: Optional[Tape] = None  # the backend's, for the manager's whole life
        # While recording: the started tape (``tape``, or ``provisional`` until the backend is
        # known), and the thread's list of recording managers the manager joined (a backward
        # may run in another thread). None: not recording.
        self.started: Optional[Tape] = None
        self.provisional: Optional[Tape] = None  # the latest recording's, if it needed one
        self.managers: Optional[List[weakref.ref]] = None
        self.group: Optional[object] = None  # the token of the group it started with
        self.step = -1  # the latest recording's number
        self.backward_ran = False  # in the latest recording

    def begin(self, ref: weakref.ref, group: Optional[object]) -> None:
        """Join this thread's recording managers (``ref``: the manager's weak reference)."""
        self.step = next(_state.record_counter)
        self.backward_ran = False
        self.group = group
        self.managers = _state.state.recording
        self.managers.append(ref)

    def leave(self, ref: weakref.ref) -> bool:
        """Leave the thread's list; False if not recording."""
        managers, self.managers = self.managers, None
        if managers is None:
            return False
        if managers and managers[-1] is ref:
            managers.pop()
        elif ref in managers:
            managers.remove(ref)
        return True

    def refuse(self, call: str) -> NoReturn:
        """``call`` (a backward) outside a recording: why, and what to do."""
        if self.managers is None and self.backward_ran:
            raise RuntimeError(
                f"not recording: the first backward() ended the recording, as every backward "
                f"does (MegEngine's rule), so {call} has nothing to differentiate. For another "
                f"backward, compute y again in a new recording (`with gm:` or record()); for "
                f"several outputs at once, pass them together: backward([y1, y2])"
            )
        raise RuntimeError(
            f"no computation history to differentiate: call record() (or use `with gm:`) "
            f"before computing y, then {call} inside the recording"
        )

    def warn_if_started_late(self, others: List[Recording]) -> None:
        """The tape starts only now (the framework became known): say so if a manager that
        started recording later (``others``: the thread's other ones) records already."""
        if any(r.step > self.step and r.taping for r in others):
            warnings.warn(
                "gradmgr: this manager started recording before its framework was known "
                "(nothing was attached before record(), and it recorded as part of a group or "
                "its framework was imported only after record()), and a manager that started "
                "later is already recording: it may not record that manager's backward. Pass "
                "GradManager(backend=...) to fix the order.",
                GradMgrWarning,
                stacklevel=6,
            )

    @property
    def taping(self) -> bool:
        return self.managers is not None and self.started is not None

    def own_tape(self) -> Tape:
        if self.tape is None:
            if self.backend is None:  # callers come with a tensor, or from settle()
                raise RuntimeError("gradmgr: a tape was asked for before the manager's "
                                   "framework is known (an internal error: please report it "
                                   "with the output of `python -m gradmgr env`)")
            self.tape = self.backend.new_tape()
        return self.tape

    def start_tape(self, attached: Attachments) -> None:
        if self.started is not None:
            return
        tape = self.own_tape()
        tape.start()
        self.started = tape
        if not tape.persistent_watch:
            tape.watch_all([(t, spec.sink, bool(spec.callbacks)) for t, spec in attached.live()])

    def start_without_backend(self, group_backend: Optional[Backend]) -> None:
        """Nothing attached tells the framework yet. A group's member takes the group's (a
        group cannot mix frameworks); otherwise the only one imported, or with several, a
        provisional tape in each until a tensor settles it (for a group's members inside
        each framework's group context, so whichever it turns out to be, its tape started
        with the group's: on MegEngine, one started later would not join the native group)."""
        candidates = [group_backend] if group_backend is not None else imported_backends()
        if len(candidates) == 1:
            self.backend, self.guessed = candidates[0], True
        else:
            provisional = ProvisionalTape(candidates)
            provisional.start()
            self.started = self.provisional = provisional

    def replace_guess(self, backend: Backend, still_guessed: bool) -> bool:
        """A tensor of ``backend`` is given while the backend was only guessed (or is
        unknown): keep the guess if it is the tensor's framework; otherwise forget it and its
        tape. An attached tensor settles the backend; a ``y`` (``still_guessed``) is only the
        next guess. True: the tape was forgotten while recording (restart one)."""
        self.guessed = still_guessed
        if backend is self.backend or self.backend is None:
            return False
        recording = self.managers is not None
        if recording and self.started is not None:
            tape, self.started = self.started, None
            tape.stop()
        self.backend, self.tape = backend, None
        return recording

    def settle(self, backend: Optional[Backend]) -> None:
        """The backend just became known (from a tensor): settle a provisional tape."""
        if backend is None or backend is self.backend:
            return
        self.backend = backend
        provisional = self.started
        if self.managers is not None and isinstance(provisional, ProvisionalTape):
            tape = provisional.settle(backend)
            self.started = None
            if tape is not None:
                self.tape = self.started = tape

    def collected(self, ref: weakref.ref) -> None:
        """The manager died: if it was recording, end the recording (a tape's stop() undoes
        what it changed: PyTorch inputs' ``requires_grad``, grad mode, MegEngine's ``Grad``),
        so that it no longer records (higher order) later backwards of its thread."""
        managers = self.managers
        if managers is None or ref not in managers:
            return  # not recording
        managers.remove(ref)
        for tape in (self.provisional, self.tape):
            if tape is not None:
                tape.stop()


def live(refs: Optional[List[weakref.ref]]) -> List[Any]:
    """The live managers of a thread's list of recording ones; none for a manager that is not
    recording."""
    return [] if refs is None else [m for m in (ref() for ref in refs) if m is not None]
