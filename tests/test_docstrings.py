"""Every example in gradmgr's docstrings runs (doctest): the API reference shows them, so they
must not drift from the code. Modules of a framework this environment lacks are not collected
(their examples need it)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import sys

import pytest

import gradmgr
import gradmgr.backends
import gradmgr.distributed

FRAMEWORK_MODULES = {"gradmgr.backends.torch": "torch", "gradmgr.backends.megengine": "megengine",
                     "gradmgr.backends.paddle": "paddle"}


def modules() -> list:
    names = []
    for package in (gradmgr, gradmgr.distributed, gradmgr.backends):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            names.append(info.name)
    return sorted(set(names))


def _needs(name: str) -> str:
    for prefix, framework in FRAMEWORK_MODULES.items():
        if name == prefix or name.startswith(prefix + "."):
            return framework
    return "torch"  # the core's examples use PyTorch tensors


@pytest.mark.parametrize("name", [pytest.param(n, marks=getattr(pytest.mark, _needs(n)))
                                  for n in modules()])
def test_docstring_examples_run(name):
    pytest.importorskip(_needs(name), reason=f"{_needs(name)} is not installed")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_a_backend_whose_framework_is_missing_names_the_python_version(monkeypatch):
    from gradmgr import BackendNotFoundError, GradManager, registry

    monkeypatch.setitem(registry._specs, "absent", "no_such_framework_module:Backend")
    monkeypatch.setitem(registry._INSTALL_HINTS, "absent", "its wheels need CPython 3.8-3.10")
    with pytest.raises(BackendNotFoundError) as info:
        GradManager(backend="absent")
    message = str(info.value)
    assert "'absent' backend cannot be used here" in message
    assert "no_such_framework_module" in message and "CPython 3.8-3.10" in message
    assert f"Python {sys.version_info[0]}.{sys.version_info[1]}" in message


@pytest.mark.parametrize("python, says, never", [
    ((3, 10, 12), "install MegEngine 1.13 (pip install 'gradmgr[megengine]'), which supports it",
     "only"),
    ((3, 11, 4), "no wheels for Python 3.11 or newer", "which supports it"),
])
def test_the_megengine_hint_reads_right_for_the_python(monkeypatch, python, says, never):
    """On Python 3.10 (supported) the hint is to install MegEngine; it read "wheels for CPython
    3.8-3.10 only ... This is Python 3.10", as if 3.10 were not supported. On 3.11 there is
    nothing to install."""
    from gradmgr import BackendNotFoundError, GradManager, registry

    monkeypatch.setattr(registry, "_python", lambda: python, raising=False)
    monkeypatch.setitem(registry._specs, "megengine", "no_such_framework_module:Backend")
    monkeypatch.delitem(registry._instances, "megengine", raising=False)
    with pytest.raises(BackendNotFoundError) as info:
        GradManager(backend="megengine")
    message = str(info.value)
    assert says in message and never not in message, message
    assert "This is Python " + ".".join(map(str, python)) in message


def test_help_shows_the_public_methods_only():
    """``help(GradManager)`` lists what a user calls (every ``register_*`` among them), not
    what only the data-parallel library needs (now functions of gradmgr.hooks and
    gradmgr.manager)."""
    import pydoc

    from gradmgr import GradManager

    shown = pydoc.render_doc(GradManager, renderer=pydoc.plaintext)
    for internal in ("set_backward_delegate", "attach_epoch", "callback_chains",
                     "after_backward_callbacks"):
        assert internal not in shown, internal
    for public in ("attach", "attached_tensors", "backward", "backward_split", "record",
                   "release", "add_gradient", "reachable", "register_record_callback",
                   "register_after_backward_callback", "register_backward_error_callback",
                   "register_release_callback"):
        assert f"{public}(" in shown, public
