"""Keeping ``torch.compile`` out of gradmgr's own code.

A compiled function that records or backwards a manager (``with gm: ...`` inside it) would
have Dynamo trace gradmgr: thread-local state, weak references, thread identities, reference
counts and autograd nodes, which it cannot trace (it warns, breaks the graph, and once rewrote
the tape's weak references into the tensors themselves). So gradmgr's directories go on
Dynamo's skip list: Dynamo then runs gradmgr's frames as they are, at no cost outside
compilation (``torch.compiler.disable`` would cost every call a frame switch).

Dynamo is not imported with ``torch`` (importing it takes about a second), so where it is not
imported yet, the skip list is filled the moment it is.
"""

from __future__ import annotations

from gradmgr._imports import call_after_import


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
    for package in ("gradmgr", "gradmgr.backends"):  # backends/ may live outside gradmgr/
        add(package)
