"""PaddleTape: one manager's recording on Paddle's dygraph engine.

Paddle records every operation on a tensor with ``stop_gradient=False`` whether a manager
records or not, so the tape keeps only the attached tensors (weakly), which of them are the
manager's inputs, and the flags it lifted; its backward is one ``paddle.grad`` call over the
live attached tensors.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gradmgr.backend import GradSink, Tape
from gradmgr.errors import UnsupportedGraphError
from gradmgr.weak_keys import forgetting_ref

from . import flags
from .leaf_hooks import HookProbe, run_hooks
from .order import ready_order
from .split import Rest, engine_run

_MAIN_THREAD_ID = threading.main_thread().ident

HIGHER_ORDER_MESSAGE = (
    "a manager that started recording earlier records this backward (higher-order "
    "derivatives), which gradmgr does not support on Paddle yet: Paddle copies what is "
    "assigned to .grad, so a gradient kept in .grad cannot be differentiated again. "
    "Use paddle.grad(..., create_graph=True) for higher-order derivatives"
)


def check_main_thread(action: str) -> None:
    """Refuse Paddle recordings outside the main thread (not tested with gradmgr yet)."""
    if threading.get_ident() != _MAIN_THREAD_ID:
        raise RuntimeError(
            f"cannot {action} in thread {threading.current_thread().name!r}: gradmgr's Paddle "
            f"backend works only in the main thread; run Paddle GradManagers in the main "
            f"thread or in separate processes"
        )


class _Watched:
    """One attached tensor of the manager: held weakly, its current sink, whether it is an
    input of the manager (an attach found its flag off: :func:`flags.is_input`), and whether
    the running recording lifted its ``stop_gradient`` flag; whether its sink runs callbacks
    (``eager``); for a leaf, whether it may have hooks of its own (leaf_hooks.py)."""

    __slots__ = ("tensor", "sink", "eager", "input", "lifted", "hooks")

    def __init__(self, tensor: weakref.ref, sink: GradSink) -> None:
        self.tensor = tensor
        self.sink = sink
        self.eager = False
        self.input = False
        self.lifted = False
        self.hooks = HookProbe()

    def has_hooks(self, tensor: Any) -> bool:
        """Whether ``tensor`` is a leaf that may have hooks of its own (leaf_hooks.py: one
        probe), which ``paddle.grad`` did not run."""
        return tensor.is_leaf and self.hooks.may_have_hooks(tensor)


class PaddleTape(Tape):
    """The attached tensors of one manager, differentiated by ``paddle.grad``.

    Watches persist across recordings (``persistent_watch``): each attach is seen when it
    happens, so that a tensor frozen after its attach stays frozen (the contract's point 15).
    """

    persistent_watch = True

    def __init__(self) -> None:
        self._watched: Dict[int, _Watched] = {}
        self._recording = False

    def start(self) -> None:
        check_main_thread("start recording a Paddle GradManager")
        self._recording = True
        for entry in list(self._watched.values()):
            tensor = entry.tensor()
            if tensor is not None and entry.input:
                entry.lifted = flags.lift(tensor)

    def watch(self, tensor: Any, sink: GradSink, eager: bool) -> None:
        # ``eager`` cannot be honoured: paddle.grad runs no hooks on leaves (_deliver runs a
        # leaf's own afterwards), so every sink is called after the engine, in the order it
        # finished the gradients (order.py) where that order can be seen (_deliver).
        key = id(tensor)
        entry = self._watched.get(key)
        if entry is None or entry.tensor() is not tensor:  # new, or a dead tensor's id reused
            entry = _Watched(forgetting_ref(tensor, self, PaddleTape._forget), sink)
            self._watched[key] = entry
        entry.sink, entry.eager = sink, eager
        if not entry.input and flags.is_input(tensor):
            entry.input = True  # from this attach on, as on PyTorch
        if self._recording and entry.input and not entry.lifted:
            entry.lifted = flags.lift(tensor)

    def _forget(self, key: int, dead: weakref.ref) -> None:
        """A dead tensor's entry goes (not a tensor's that reused the id)."""
        entry = self._watched.get(key)
        if entry is not None and entry.tensor is dead:
            del self._watched[key]

    def backward(
        self, ys: Sequence[Any], dys: Sequence[Any], *, create_graph: bool, retain_graph: bool,
        may_accumulate: bool = False,
    ) -> None:
        if not self._recording:
            raise RuntimeError("PaddleTape.backward() called while the tape is not started")
        if create_graph:
            raise UnsupportedGraphError(HIGHER_ORDER_MESSAGE)
        pairs = [(y, dy) for y, dy in zip(ys, dys) if not y.stop_gradient]
        live = self._live()
        entries, tensors = [e for e, _ in live], [t for _, t in live]
        if not pairs or not tensors:
            return  # constants only, or nothing attached alive: no gradient reaches anything
        outs = [y for y, _ in pairs]
        grads = engine_run(outs, [dy for _, dy in pairs], tensors, retain_graph)
        self._deliver(outs, entries, tensors, grads)

    def backward_split(self, ys: Sequence[Any], dys: Sequence[Any], first: Sequence[Any], *,
                       retain_graph: bool) -> Any:
        if not self._recording:
            raise RuntimeError("PaddleTape.backward_split() called while the tape is not started")
        pairs = [(y, dy) for y, dy in zip(ys, dys) if not y.stop_gradient]
        live = self._live()
        if not pairs or not live:
            return None
        outs, seeds = [y for y, _ in pairs], [dy for _, dy in pairs]
        wanted = {id(t) for t in first}
        now = [(e, t) for e, t in live if id(t) in wanted]
        later = [(e, t) for e, t in live if id(t) not in wanted]
        if now:
            tensors = [t for _, t in now]
            grads = engine_run(outs, seeds, tensors, retain_graph=bool(later) or retain_graph)
            self._deliver(outs, [e for e, _ in now], tensors, grads)
        if not later:
            return None
        return Rest(outs, seeds, [e for e, _ in later], [t for _, t in later], self._deliver,
                    retain_graph)

    def _live(self) -> List[Tuple[_Watched, Any]]:
        """Each watched tensor still alive, with its entry (held strongly from here on), but
        those that are not this manager's inputs and have their flag lifted by another
        manager's recording: the user froze them, so this manager gives them no gradient.
        The others all go to ``paddle.grad``, which gives a tensor frozen before the forward
        none and one frozen after it its gradient, as ``loss.backward()`` does."""
        pairs = [(entry, entry.tensor()) for entry in list(self._watched.values())]
        return [(entry, tensor) for entry, tensor in pairs
                if tensor is not None and (entry.input or not flags.lifted(tensor))]

    @staticmethod
    def _deliver(outs: List[Any], entries: List[_Watched], tensors: List[Any],
                 grads: Sequence[Optional[Any]]) -> None:
        """Each gradient to its sink, through the leaf's own hooks if it may have some, in
        the engine's order (order.py) where a callback or a hook could see it; else in the
        given one, which spares reading the graph in Python (about half of what gradmgr adds
        in Python at 1,000 tensors, bench/RESULTS.md): sinks without callbacks only keep the
        gradient, and ``.grad`` comes out the same in any order.

        The engine has run, and its graph's nodes and edges are still there to read: so one
        probe of each leaf, made now, tells both whether the order can be seen and which
        leaves run hooks, a hook registered while the engine ran included. Where a callback or
        a hook has run since, a leaf is probed when its turn comes instead (they may have
        registered a hook on it, which ``loss.backward()`` would run)."""
        got = [i for i, grad in enumerate(grads) if grad is not None]
        eager = any(entries[i].eager for i in got)
        hooks = {} if eager else {i: entries[i].has_hooks(tensors[i]) for i in got}
        order = ready_order(outs, tensors) if eager or any(hooks.values()) else got
        stale = eager  # user code ran since the probe (callbacks do, in the sinks)
        for i in order:
            grad = grads[i]
            if grad is None:
                continue
            hooked = entries[i].has_hooks(tensors[i]) if stale else hooks[i]
            entries[i].sink(run_hooks(tensors[i], grad) if hooked else grad)
            stale = stale or hooked

    def stop(self) -> None:
        self._recording = False
        for entry in list(self._watched.values()):
            tensor = entry.tensor()
            if entry.lifted and tensor is not None:
                flags.restore(tensor)
            entry.lifted = False
