"""The parameters that full sharding's wrapping replaced, and the refusal of callbacks attached
to them.

FSDP2's ``fully_shard`` puts new parameters (the shards) on the model. A list of parameters
taken before ``data_parallel(model, shard="full")`` still holds the old ones, which no forward
uses: callbacks attached to them with ``gm.attach(old, callbacks=...)`` would never run, and
training would go on without them, silently. The manager's recording refuses them instead;
so does an optimizer made before the wrapping, at its first step, where the framework can see
it (torch: ``gradmgr/backends/torch/stale_optimizers.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, List, Sequence

from ...manager import attach_epoch, callback_chains

_STALE = (
    "gm.attach(..., callbacks=...) under full sharding (shard='full') was given {count} "
    "parameter(s) the model no longer has{names}: data_parallel(model, shard='full') "
    "replaced the model's parameters with their shards (FSDP2's fully_shard), so the ones "
    "taken before it are used by no forward, and their callbacks would never run. Drop what "
    "holds the old ones (they leave the manager when freed) and attach the model's own "
    "after data_parallel: gm.attach(list(model.parameters()), callbacks=...) (or a "
    "submodule's, e.g. model.head.parameters())"
)


class ReplacedParameters:
    """The parameters ``module`` held before wrapping (weakly: the user may drop them), less
    those it still holds after; :meth:`check` raises where callbacks are attached to them."""

    def __init__(self, before: Sequence[Any], names: Dict[int, str]) -> None:
        self._refs: Dict[int, Any] = {}
        self._names = names
        for param in before:
            with contextlib.suppress(TypeError):  # no weak reference taken: never refused
                self._refs[id(param)] = weakref.ref(param)
        self._epoch = -1  # the manager's attach_epoch last checked

    def keep_only_replaced(self, after: Sequence[Any]) -> None:
        """Forget the parameters ``after`` (the module's after wrapping) still holds."""
        for param in after:
            ref = self._refs.get(id(param))
            if ref is not None and ref() is param:
                del self._refs[id(param)]

    def check(self, gm: Any) -> None:
        """Raise where a callback chain of ``gm`` hangs on a replaced parameter (checked again
        only after an attach)."""
        epoch = attach_epoch(gm)
        if epoch == self._epoch or not self._refs:
            return
        stale = [t for t, chain in callback_chains(gm) if chain and self.holds(t)]
        if stale:
            raise TypeError(_STALE.format(count=len(stale), names=self.named(stale)))
        self._epoch = epoch

    def holds(self, tensor: Any) -> bool:
        """``tensor`` is one of the parameters wrapping replaced."""
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def named(self, stale: List[Any]) -> str:
        """`` (fc.weight, ...)``: the names the ``stale`` parameters had, or ``""``."""
        names = [self._names[id(t)] for t in stale if id(t) in self._names]
        return f" ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else ""


__all__: List[str] = ["ReplacedParameters"]
