"""Keeping ``torch.compile`` out of gradmgr's own code.

A compiled function that records or backwards a manager (``with gm: ...`` inside it) would
have Dynamo trace gradmgr: thread-local state, weak references, thread identities, reference
counts and autograd nodes, which it cannot trace (it warns, breaks the graph, and once rewrote
the tape's weak references into the tensors themselves). So gradmgr's directories go on
Dynamo's skip list: Dynamo then runs gradmgr's frames as they are, at no cost outside
compilation (``torch.compiler.disable`` would cost every call a frame switch).

Under compiled autograd (``torch._dynamo.compiled_autograd``: torch.compile capturing the
backward), data parallel runs its steps without a hook in the backward:
:class:`CompiledAutogradPath` says when.

Dynamo is not imported with ``torch`` (importing it takes about a second), so where it is not
imported yet, the skip list is filled the moment it is.
"""

from __future__ import annotations

import sys

from gradmgr._imports import call_after_import

from .engine import EngineAccumulates


def keep_dynamo_out() -> None:
    """Put gradmgr on Dynamo's skip list now, or as soon as Dynamo is imported."""
    call_after_import("torch._dynamo", _skip_gradmgr)


def _skip_gradmgr() -> None:
    try:
        from torch._dynamo import trace_rules
    except ImportError:  # a torch without Dynamo: nothing traces gradmgr
        return
    add = getattr(trace_rules, "add", None)  # torch >= 2.2
    if add is None:
        return
    add("gradmgr")  # the backends too: they are gradmgr.backends


_COMPILED_AUTOGRAD = "torch._dynamo.compiled_autograd"


def compiled_autograd_on() -> bool:
    """Whether backwards run now are compiled autograd's: torch's own flag, which its
    ``_enable`` context sets (``torch._dynamo.config.compiled_autograd = True`` enters it
    around each compiled function's call), the same on torch 2.8 and 2.13. Nothing is
    imported: where the module is not imported yet, compiled autograd cannot be on."""
    module = sys.modules.get(_COMPILED_AUTOGRAD)
    return module is not None and getattr(module, "compiled_autograd_enabled", False)


class CompiledAutogradPath(EngineAccumulates):
    """Data parallel's steps under compiled autograd: the engine accumulates into ``.grad``
    and gradmgr reduces after the backward (see
    :class:`gradmgr.distributed.contract.PostBackwardPath`), so the compiled backward holds no
    gradmgr hook, which would break its graph at every tensor (and torch's C++ reducer refuses
    compiled autograd)."""

    def wanted(self) -> bool:
        return compiled_autograd_on()


COMPILED_AUTOGRAD_PATH = CompiledAutogradPath()
