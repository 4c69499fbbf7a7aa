"""Split backward on Paddle: ``paddle.grad`` over the ``first`` tensors now, keeping the graph,
and over the others when the rest runs.

``paddle.grad`` cannot hand the rest what the first part computed, so the rest runs the graph
from the outputs again: the part both share is computed twice (docs/paddle.md).

:func:`engine_run` is the one ``paddle.grad`` call of every backward, split or not.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import paddle

from gradmgr.errors import UnsupportedGraphError

from . import written

REPEATED_OUTPUT = (
    "backward() got one output twice ({which}): Paddle's engine refuses that (paddle.grad "
    "and paddle.autograd.backward raise), where PyTorch adds the two seeds and MegEngine "
    "keeps the last one. Pass the output once, with its seeds added: gm.backward([y], "
    "[dy1 + dy2]); with the default seeds, gm.backward(y * 2)"
)

# How Paddle 3.3.1's paddle.grad says it: it compares the outputs' autograd records, which
# a slice that takes all of y (y[:]) shares with y, a new tensor object over the same record
_DUPLICATE = "outputs contain duplicate tensor"

# (outputs, entries, tensors, their gradients): the tape's delivery after an engine run
Deliver = Callable[[List[Any], List[Any], List[Any], Sequence[Optional[Any]]], None]


def engine_run(outs: List[Any], seeds: List[Any], tensors: List[Any],
               retain_graph: bool) -> Sequence[Optional[Any]]:
    """The gradients of ``tensors`` (None where unreached) from ``outs`` seeded with ``seeds``;
    UnsupportedGraphError if another backward wrote one's ``.grad`` meanwhile (written.py), or
    if Paddle refused an output given twice (before it computed anything)."""
    with written.watching(tensors):
        try:
            return paddle.grad(outs, tensors, grad_outputs=seeds, retain_graph=retain_graph,
                               create_graph=False, allow_unused=True)
        except RuntimeError as error:
            if _DUPLICATE not in str(error):
                raise
            raise UnsupportedGraphError(REPEATED_OUTPUT.format(which=_repeated(outs))) from error


def _repeated(outs: List[Any]) -> str:
    """What Paddle found twice, as the user can tell it."""
    if len({id(y) for y in outs}) < len(outs):
        return "the same tensor twice"
    return "two tensors over one autograd record, as y and y[:] are"


class Rest:
    """The second part of a split backward, run once by :meth:`run`. It holds the tensors it
    differentiates and the outputs until then (the recording has ended)."""

    def __init__(self, outs: List[Any], seeds: List[Any], entries: List[Any], tensors: List[Any],
                 deliver: Deliver, retain_graph: bool) -> None:
        self._outs, self._seeds, self._entries = outs, seeds, entries
        self._tensors, self._deliver = tensors, deliver
        self._retain = retain_graph

    def run(self, may_accumulate: bool, retain_graph: bool = False) -> None:
        """Run the rest (every gradient goes through its sink: ``may_accumulate`` is unused);
        ``retain_graph``: keep the graph for another backward."""
        grads = engine_run(self._outs, self._seeds, self._tensors,
                           retain_graph or self._retain)
        outs, entries, tensors, deliver = self._outs, self._entries, self._tensors, self._deliver
        self.release()
        deliver(outs, entries, tensors, grads)

    def release(self) -> None:
        """Let go of the outputs, the seeds and the tensors."""
        self._outs, self._seeds, self._entries, self._tensors = [], [], [], []
