"""When a ``ShardedOptimizer``'s updated parameters arrive: before ``step()`` returns
(``gather="eager"``, the default), or behind the next forward (``gather="deferred"``).

Deferred, the step starts the broadcasts of the buckets cut into few large segments and
returns; each module's forward waits, in a pre-hook, for the broadcasts into its own
parameters only, so the rest arrive while the earlier layers compute. The model's
``state_dict()`` and ``load_state_dict()`` wait for all of them, and so does every method of
the optimizer but ``zero_grad`` (the next ``step``, ``clip_grad_norm_``, its checkpoints), its
:meth:`Gathering.finish` (``opt.finish_gather()``), its garbage collection and the end of the
process. A read the framework cannot see (``p`` itself, ``p.data``, between the step and the
next forward) can see a parameter half written: why it is an option and not the default
(docs/sharded.md, "The gather behind the next forward"). Buckets of many small segments are
all-gathered through a buffer before ``step()`` returns either way: deferring them would keep
every such bucket's buffer alive until its forward.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

from .gather import ParameterGather, PendingGather

GATHERS = ("eager", "deferred")

_NO_MODULE = (
    "ShardedOptimizer(gather='deferred') waits for the gathered parameters in the forward "
    "pre-hooks of the model's modules, so it needs the manager of data_parallel(model, "
    "shard=True){why}; use gather='eager' (the default)"
)

class Gathering:
    """One ``ShardedOptimizer``'s gather and, deferred, the broadcasts still in flight."""

    def __init__(self, gather: ParameterGather, how: str, gm: Any, ops: Any) -> None:
        if how not in GATHERS:
            raise ValueError(f"ShardedOptimizer: gather={how!r}; expected one of {GATHERS}: "
                             "'eager' (the default) or 'deferred'")
        self.gather = gather
        self.pending: Optional[PendingGather] = None
        self.hooks: Any = None
        if how == "deferred":
            module = _module_of(gm)
            positions = {id(t): i for i, t in enumerate(gather.plan.tensors())}
            me = weakref.ref(self)  # the model's hooks must not keep the optimizer's gather

            def wait_for(params: Sequence[Any]) -> None:
                gathering = me()
                if gathering is None or gathering.pending is None:
                    return
                pending = gathering.pending
                pending.wait_for([positions[id(p)] for p in params if id(p) in positions])
                if not pending.pending:  # all arrived: later forwards skip the look-up
                    gathering.pending = None

            def wait_all() -> None:
                gathering = me()
                if gathering is not None:
                    gathering.finish()

            self.hooks = ops.hook_parameter_reads(module, wait_for, wait_all)
            if self.hooks is None:
                raise ValueError(_NO_MODULE.format(
                    why=f" over a module with hooks ({type(module).__name__} has none here)"))

    @property
    def deferred(self) -> bool:
        return self.hooks is not None

    def after_step(self) -> None:
        """The step wrote this rank's segments: every rank takes every segment's values."""
        self.finish()  # (the step waited already: nothing is pending here)
        if self.hooks is None:
            self.gather()
        else:
            self.pending = self.gather.start()

    def finish(self) -> None:
        """Wait for every broadcast still in flight (none: returns at once)."""
        pending = self.pending
        if pending is not None:
            pending.wait_all()
            self.pending = None

    def close(self) -> None:
        """The optimizer is gone, or the process ends: the last gather arrives, the hooks go."""
        try:
            self.finish()
        finally:
            if self.hooks is not None:
                self.hooks.remove()
                self.hooks = None

def _module_of(gm: Any) -> Any:
    ref: Optional[Callable[[], Any]] = getattr(gm, "module_ref", None)
    module = ref() if ref is not None else None
    if module is None:
        raise ValueError(_NO_MODULE.format(why=" (this manager has no model)"))
    return module

def close_with(owner: Any, gathering: Gathering) -> None:
    """Close ``gathering`` when ``owner`` is collected, or at the latest at interpreter exit
    (``weakref.finalize`` runs then), so that the last step's gather is never left half
    written."""
    weakref.finalize(owner, gathering.close)


__all__ = ["GATHERS", "Gathering", "close_with"]
