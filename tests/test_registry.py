"""Backend registry: detection from the tensor type, forcing by name, unknown names, and
third-party backends through the ``gradmgr.backends`` entry-point group."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest
from fake_backend import FakeBackend, FakeTensor, register

import gradmgr
from gradmgr import BackendNotFoundError, GradManager, backend_for, get_backend, registry


@pytest.fixture
def isolated_registry(monkeypatch):
    """Let a test register backends without leaking them into other tests."""
    for name in ("_specs", "_owners", "_instances", "_by_type"):
        monkeypatch.setattr(registry, name, dict(getattr(registry, name)))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    return registry


def _tensor_module(monkeypatch, name: str) -> type:
    """A new top-level module ``name`` defining a FakeTensor subclass, as a plugin would."""
    module = types.ModuleType(name)
    module.Tensor = type("Tensor", (FakeTensor,), {"__module__": name, "__slots__": ()})
    monkeypatch.setitem(sys.modules, name, module)
    return module.Tensor


def _plugin_backend(name: str, tensor_type: type) -> type:
    return type(f"{name}Backend", (FakeBackend,),
                {"name": name, "tensor_type": tensor_type, "tensor_modules": (name,)})


# ----------------------------------------------------------------------------- detection
@pytest.mark.parametrize("obj", [1.0, 3, [1.0, 2.0], "tensor", None, object()])
def test_non_tensors_have_no_backend(obj):
    assert backend_for(obj) is None


def test_fake_tensor_detected_and_cached():
    fk = register()
    x = fk.tensor([1.0, 2.0])
    assert backend_for(x) is fk.backend
    assert backend_for(fk.tensor(3.0)) is fk.backend  # same instance every time
    assert get_backend("fake") is fk.backend


def test_detection_keys_on_top_level_module(isolated_registry, monkeypatch):
    tensor_type = _tensor_module(monkeypatch, "yl_plugin_mod")
    x = tensor_type(1.0)
    assert backend_for(x) is None  # nobody owns the module yet
    gradmgr.register_backend("yl_mod", _plugin_backend("yl_mod", tensor_type),
                             tensor_modules=["yl_plugin_mod"])
    assert backend_for(x).name == "yl_mod"  # registering cleared the cached miss


def test_register_backend_accepts_a_lazy_module_path(isolated_registry, monkeypatch):
    tensor_type = _tensor_module(monkeypatch, "yl_lazy_mod")
    plugin = types.ModuleType("yl_lazy_impl")
    plugin.Backend = _plugin_backend("yl_lazy", tensor_type)
    monkeypatch.setitem(sys.modules, "yl_lazy_impl", plugin)
    gradmgr.register_backend("yl_lazy", "yl_lazy_impl:Backend", tensor_modules=["yl_lazy_mod"])
    gm = GradManager().attach(tensor_type(2.0))
    assert isinstance(gm.backend, plugin.Backend)


@pytest.mark.torch
def test_torch_tensors_and_subclasses_detected():
    torch = pytest.importorskip("torch")

    class MyTensor(torch.Tensor):  # defined outside torch: found through its base class
        pass

    backend = get_backend("torch")
    assert backend.name == "torch"
    assert backend_for(torch.zeros(2)) is backend
    assert backend_for(torch.nn.Parameter(torch.zeros(2))) is backend
    assert backend_for(torch.zeros(2).as_subclass(MyTensor)) is backend
    assert backend_for(torch.zeros(2).numpy()) is None


@pytest.mark.megengine
def test_megengine_tensors_detected():
    mge = pytest.importorskip("megengine")
    backend = get_backend("megengine")
    assert backend.name == "megengine"
    assert backend_for(mge.tensor([1.0])) is backend
    assert backend_for(mge.Parameter([1.0])) is backend


# ----------------------------------------------------------------------------- forcing
@pytest.mark.torch
def test_force_torch_backend_by_name():
    torch = pytest.importorskip("torch")
    gm = GradManager(backend="torch")
    assert gm.backend is get_backend("torch")
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    gm.attach(w)
    with gm:
        gm.backward((w * w).sum())
    torch.testing.assert_close(w.grad, torch.tensor([2.0, 4.0]), rtol=0, atol=0)


@pytest.mark.torch
def test_forced_torch_manager_rejects_another_framework():
    pytest.importorskip("torch")
    fk = register()
    with pytest.raises(TypeError, match=r"(?=.*torch)(?=.*fake)"):
        GradManager(backend="torch").attach(fk.tensor(1.0))


def test_force_with_a_backend_instance():
    fk = register()
    backend = fk.backend
    assert GradManager(backend=backend).backend is backend


@pytest.mark.parametrize("name", ["tensorflow", "Torch", ""])
def test_unknown_backend_name_raises(name):
    with pytest.raises(BackendNotFoundError, match="no gradmgr backend named") as info:
        GradManager(backend=name)
    assert "torch" in str(info.value) and "megengine" in str(info.value)  # lists known names
    assert isinstance(info.value, LookupError)


def test_backend_of_wrong_type_raises():
    with pytest.raises(TypeError, match="int"):
        GradManager(backend=3)


# ----------------------------------------------------------------------------- entry points
def _group_entry_points(group: str) -> list:
    eps = importlib.metadata.entry_points()
    if hasattr(eps, "select"):
        return list(eps.select(group=group))
    return list(eps.get(group, []))  # Python 3.9


def test_entry_point_group_is_declared():
    eps = {ep.name: ep.value for ep in _group_entry_points(registry.ENTRY_POINT_GROUP)}
    assert registry.ENTRY_POINT_GROUP == "gradmgr.backends"
    assert eps["torch"] == "gradmgr.backends.torch:TorchBackend"
    assert eps["megengine"] == "gradmgr.backends.megengine:MegEngineBackend"


class _EntryPoint:
    def __init__(self, name: str, load) -> None:
        self.name, self.load = name, load


class _EntryPoints(list):
    def select(self, group: str) -> list:
        return list(self) if group == registry.ENTRY_POINT_GROUP else []


def test_third_party_backend_from_entry_point(isolated_registry, monkeypatch):
    tensor_type = _tensor_module(monkeypatch, "yl_ep_mod")
    backend_cls = _plugin_backend("yl_ep_mod", tensor_type)

    def broken():
        raise ImportError("plugin is broken")

    fake_eps = _EntryPoints([_EntryPoint("yl_broken", broken),
                             _EntryPoint("yl_ep_mod", lambda: backend_cls)])
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda: fake_eps)
    with pytest.warns(UserWarning, match=r"yl_broken.*plugin is broken"):
        found = backend_for(tensor_type(1.0))
    assert isinstance(found, backend_cls)
    assert get_backend("yl_ep_mod") is found
    with pytest.raises(BackendNotFoundError):
        get_backend("yl_broken")
