"""Checkpoint conversion (gradmgr.parity.save_map / convert_checkpoint, docs/porting.md
"Converting checkpoints"): a state dict file of one framework converted into the other's
through the map file transfer_weights' map is written to, each direction, and loaded into
the other model, which then computes what the original computes. The values are copied (a
reshape or transpose moves no bits), so the converted tensors are compared bit for bit and
the outputs within 1e-5 relative (two frameworks' float32 kernels on the same weights)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

import parity_small_torch as T  # noqa: E402
import torch  # noqa: E402

from gradmgr.parity import (  # noqa: E402
    MappingError,
    ParityError,
    compare_step,
    convert_checkpoint,
    save_map,
)

RNG = np.random.RandomState(0)
IMAGES = RNG.randn(4, 3, 8, 8).astype(np.float32)
ROWS = RNG.randn(6, 16).astype(np.float32)
RTOL = 1e-5


def _close(x: np.ndarray, y: np.ndarray) -> None:
    assert np.abs(x - y).max() <= RTOL * np.abs(x).max(), (np.abs(x - y).max())


def _mlp(seed: int, **kwargs) -> T.MLP:
    torch.manual_seed(seed)
    return T.MLP(**kwargs)


def test_a_torch_checkpoint_converts_to_a_transposed_port_and_back(tmp_path):
    a, b = _mlp(0), _mlp(1, transposed=True)  # b multiplies by fc2's weight as stored
    paths = {n: str(tmp_path / n) for n in ("map.json", "a.pth", "b.pth", "back.pth")}
    save_map(a, b, paths["map.json"], probe=ROWS, transforms={"fc2.weight": "transpose"})
    torch.save(a.state_dict(), paths["a.pth"])
    convert_checkpoint(paths["a.pth"], paths["b.pth"], paths["map.json"])
    b.load_state_dict(torch.load(paths["b.pth"]))  # strict: every key, no extra
    np.testing.assert_array_equal(b.fc2.weight.detach().numpy(),
                                  a.fc2.weight.detach().numpy().T)
    with torch.no_grad():
        _close(a(torch.from_numpy(ROWS)).numpy(), b(torch.from_numpy(ROWS)).numpy())
    c = _mlp(2, transposed=True)  # the other direction: b's format into a's, the same map
    torch.save(c.state_dict(), paths["b.pth"])
    convert_checkpoint(paths["b.pth"], paths["back.pth"], paths["map.json"], reverse=True)
    a.load_state_dict(torch.load(paths["back.pth"]))
    np.testing.assert_array_equal(a.fc2.weight.detach().numpy(),
                                  c.fc2.weight.detach().numpy().T)
    with torch.no_grad():
        _close(c(torch.from_numpy(ROWS)).numpy(), a(torch.from_numpy(ROWS)).numpy())


def test_a_tensor_the_map_does_not_name_is_refused_never_guessed(tmp_path):
    a, b = _mlp(0), _mlp(1)
    paths = {n: str(tmp_path / n) for n in ("map.json", "a.pth", "b.pth")}
    save_map(a, b, paths["map.json"], probe=ROWS)
    written = json.loads((tmp_path / "map.json").read_text())
    written["pairs"] = [p for p in written["pairs"] if p["src"] != "fc3.bias"]  # edited out
    with open(paths["map.json"], "w") as file:
        json.dump(written, file)
    torch.save(a.state_dict(), paths["a.pth"])
    with pytest.raises(MappingError, match="fc3.bias: in the checkpoint, not in the map"):
        convert_checkpoint(paths["a.pth"], paths["b.pth"], paths["map.json"])
    state = a.state_dict()
    state["fc1.weight"] = state["fc1.weight"][:, :8]  # a checkpoint of another model
    del state["fc3.bias"]
    torch.save(state, paths["a.pth"])
    with pytest.raises(MappingError, match=r"fc1.weight \(32, 8\) \(the map says \(32, 16\)"):
        convert_checkpoint(paths["a.pth"], paths["b.pth"], paths["map.json"])
    assert not (tmp_path / "b.pth").exists()
    written["version"] = 3
    with open(paths["map.json"], "w") as file:
        json.dump(written, file)
    with pytest.raises(ParityError, match="format version 3; this gradmgr reads version 2"):
        convert_checkpoint(paths["a.pth"], paths["b.pth"], paths["map.json"])


def test_a_map_that_would_guess_is_not_written(tmp_path):
    # two Linear(32, 32) twins in another order with no probe: which is which is a guess
    a = torch.nn.Sequential()
    for name in ("x", "y"):
        a.add_module(name, torch.nn.Linear(32, 32))
    b = torch.nn.Sequential()
    for name in ("p", "q"):
        b.add_module(name, torch.nn.Linear(32, 32))
    with pytest.raises(MappingError, match="ambiguous without a probe"):
        save_map(a, b, str(tmp_path / "map.json"))
    assert not (tmp_path / "map.json").exists()
    with pytest.raises(ParityError, match="a map file holds only 'transpose'"):
        save_map(_mlp(0), _mlp(1, transposed=True), str(tmp_path / "map.json"), probe=ROWS,
                 transforms={"fc2.weight": lambda w: w.T})


@pytest.mark.megengine
def test_megengine_checkpoint_to_torch_and_back_through_one_map(tmp_path):
    import megengine
    import parity_small_mge as G

    megengine.random.seed(5)
    reference, port = G.CNN(), T.CNN()
    for m in (reference.bn1, reference.bn2):  # running statistics not the defaults
        m.running_mean[...] = megengine.tensor(RNG.randn(*m.running_mean.shape) * 0.1)
        m.running_var[...] = megengine.tensor(1 + RNG.rand(*m.running_var.shape))
    assert np.abs(reference.bn1.running_mean.numpy()).max() > 0.01
    paths = {n: str(tmp_path / n) for n in ("map.json", "ref.mge", "port.pth", "back.mge")}
    megengine.save(reference.state_dict(), paths["ref.mge"])
    written = save_map(G.CNN(), T.CNN(), paths["map.json"], probe=IMAGES)
    assert written["ignored"]["dst"] == {
        f"bn{i}.num_batches_tracked": {"dtype": "<i8", "shape": [], "value": 0} for i in (1, 2)}
    convert_checkpoint(paths["ref.mge"], paths["port.pth"], paths["map.json"])
    port.load_state_dict(torch.load(paths["port.pth"]))  # strict
    for name, value in reference.state_dict().items():
        np.testing.assert_array_equal(port.state_dict()[name].numpy().reshape(-1),
                                      value.reshape(-1))  # (1, C, 1, 1) against (C,)
    reference.eval(), port.eval()  # the running statistics are used, so compared too
    with torch.no_grad():
        _close(reference(megengine.tensor(IMAGES)).numpy(),
               port(torch.from_numpy(IMAGES)).numpy())
    report = compare_step(reference, port, IMAGES)
    assert report.ok, report.text()
    # back: a torch checkpoint into MegEngine's format through the same map
    port.train()
    with torch.no_grad():
        port.fc.bias.add_(0.5)
        port.bn2.running_mean.add_(0.25)
    torch.save(port.state_dict(), paths["port.pth"])
    convert_checkpoint(paths["port.pth"], paths["back.mge"], paths["map.json"], reverse=True)
    back = G.CNN()
    back.load_state_dict(megengine.load(paths["back.mge"]))
    for name, value in port.state_dict().items():
        if "num_batches_tracked" not in name:
            np.testing.assert_array_equal(back.state_dict()[name].reshape(-1),
                                          value.numpy().reshape(-1))
    back.eval(), port.eval()
    with torch.no_grad():
        _close(port(torch.from_numpy(IMAGES)).numpy(), back(megengine.tensor(IMAGES)).numpy())


@pytest.mark.megengine
def test_a_megengine_checkpoint_with_a_tensor_outside_the_map_is_refused(tmp_path):
    import megengine
    import parity_small_mge as G

    paths = {n: str(tmp_path / n) for n in ("map.json", "ref.mge", "port.pth")}
    save_map(G.CNN(), T.CNN(), paths["map.json"], probe=IMAGES)
    state = G.CNN().state_dict()
    state["head.weight"] = np.zeros((10, 16), np.float32)  # the reference grew a layer
    megengine.save(state, paths["ref.mge"])
    with pytest.raises(MappingError, match="head.weight: in the checkpoint, not in the map"):
        convert_checkpoint(paths["ref.mge"], paths["port.pth"], paths["map.json"])
