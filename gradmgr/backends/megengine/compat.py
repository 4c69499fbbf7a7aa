"""What MegEngine's own code sees of gradmgr managers: its backwarding manager (so that
``megengine.distributed.make_allreduce_cb`` works with a gradmgr manager), and groups of Grads."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import megengine.autodiff.grad_manager as native_grad_manager
from megengine.core.autodiff.grad import Grad


class _NativeView(native_grad_manager.GradManager):
    """What ``megengine.autodiff.grad_manager.get_backwarding_grad_manager()`` returns while a
    gradmgr manager backwards, so that MegEngine's own helpers work with gradmgr managers:
    ``megengine.distributed.make_allreduce_cb`` checks ``isinstance`` against MegEngine's class
    and registers its flush with ``_register_after_backward_callback``."""

    def __init__(self, manager: Any) -> None:  # not MegEngine's __init__: it holds no state
        self._gradmgr = weakref.ref(manager)

    def _manager(self) -> Any:
        manager = self._gradmgr()
        if manager is None:  # MegEngine's helper kept this view past its backward
            raise RuntimeError("gradmgr: the GradManager this MegEngine view stands for is "
                               "gone (a view is valid only during its manager's backward)")
        return manager

    def _register_after_backward_callback(self, callback: Any) -> _NativeView:
        self._manager().register_after_backward_callback(callback)
        return self


def _forward_to_gradmgr(name: str) -> Any:
    def method(self: _NativeView, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._manager(), name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in ("attached_tensors", "attach", "backward", "record", "release", "__enter__",
              "__exit__", "__or__"):  # the rest of the native API: the gradmgr manager's
    setattr(_NativeView, _name, _forward_to_gradmgr(_name))


_native_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()




def enter_backward(manager: Any) -> Any:
    """Make MegEngine's ``get_backwarding_grad_manager()`` return ``manager``'s view; returns
    what it returned before."""
    # One view per manager: MegEngine's helpers remember the managers they registered with.
    view = _native_views.get(manager)
    if view is None:
        view = _native_views[manager] = _NativeView(manager)
    previous = native_grad_manager.backwarding_grad_manager
    native_grad_manager.backwarding_grad_manager = view
    return previous


def exit_backward(previous: Any) -> None:
    native_grad_manager.backwarding_grad_manager = previous


@contextlib.contextmanager
def recording_group() -> Iterator[None]:
    """Grad objects started inside join one group, as ``GradManagerGroup.__enter__`` does.

    If a member fails to start, the group is closed and, when nobody joined it, removed
    from ``Grad.stack``, so MegEngine's global state is as before.
    """
    if Grad.grouping:
        raise RuntimeError("a MegEngine GradManager group is already being formed")
    group: list = []
    Grad.stack.append(group)
    Grad.begin_group()
    try:
        yield
    finally:
        Grad.grouping = False  # Grad.end_group(), minus its bare asserts
        if not group:  # nobody joined: remove exactly this list (Grad uses ==)
            for i in range(len(Grad.stack) - 1, -1, -1):
                if Grad.stack[i] is group:
                    del Grad.stack[i]
                    break
