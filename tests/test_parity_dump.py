"""The parity tool's offline side (gradmgr.parity.dump, docs/porting.md "Offline, across
environments"): one side's step written to a file and compared in another process, another
environment, against a live model. A replayed dump must give the verdicts the live model
gives: the same values (bit for bit: the arrays are stored as computed), so a correct port is
OK, a broken one DIFFERS at its layer, and a dump the tool cannot read is an error."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

pytest.importorskip("torch")

import parity_small_torch as T  # noqa: E402
import torch  # noqa: E402

from gradmgr.parity import (  # noqa: E402
    ParityError,
    compare_step,
    dump,
    load,
    transfer_weights,
)
from gradmgr.parity.dump import VERSION  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
RNG = np.random.RandomState(0)
IMAGES = (RNG.randn(4, 3, 8, 8).astype(np.float32), np.array([1, 0, 3, 9]))
ROWS = RNG.randn(6, 16).astype(np.float32)
CROSS_ENV_S = 600  # two interpreters start (one imports MegEngine) on a loaded 2-core machine


def _cnn(seed: int = 0, **kwargs) -> T.CNN:
    torch.manual_seed(seed)
    return T.CNN(**kwargs)


def test_a_dump_replays_the_step_its_model_ran_bit_for_bit(tmp_path):
    model = _cnn()
    twin = _cnn()
    recorded = dump(model, IMAGES, str(tmp_path / "run.npz"), loss=T.cross_entropy)
    report = compare_step(twin, recorded, IMAGES, loss_a=T.cross_entropy)
    assert report.ok, report.text()
    # the same weights, the same kernels: every compared value equal, not only within tol
    assert [e.max_abs for e in report.entries] == [0.0] * len(report.entries)
    assert len([e for e in report.entries if e.what == "grad"]) == 9
    # a dump holds its buffers before and after its step: compared after it, as live
    assert len([e for e in report.entries if e.what == "buffer"]) == 6
    for name, param in model.named_parameters():
        np.testing.assert_array_equal(recorded.grad(name), param.grad.numpy())
    header = recorded.header
    assert (header["format"], header["version"], header["framework"]) == (
        "gradmgr.parity.dump", VERSION, "torch")
    assert header["framework_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert header["device"] == "cpu" and header["loss"] == "custom"


def test_a_broken_port_is_named_at_its_layer_through_a_dump(tmp_path):
    recorded = dump(_cnn(), IMAGES, str(tmp_path / "run.npz"), loss=T.cross_entropy)
    port = _cnn(seed=1, bn_eps=1e-3)  # other random weights: transfer_weights replaces them
    transfer_weights(recorded, port, probe=recorded.batch, strict=False)
    report = compare_step(recorded, port, recorded.batch, loss_b=T.cross_entropy)
    assert not report.ok and report.text().startswith("PARITY BROKEN")
    assert report.first_forward.layer == "bn2" and report.first_forward.verdict == "DIFFERS"
    assert [(f.layer_src, f.key) for f in report.findings] == [("bn2", "eps")]
    # a backward-only bug: the forward agrees, bias gradients of the last layer doubled
    port = _cnn(seed=1)
    transfer_weights(recorded, port, probe=recorded.batch)
    port.fc.bias.register_hook(lambda g: g * 2)
    report = compare_step(recorded, port, recorded.batch, loss_b=T.cross_entropy)
    bad = [e.name for e in report.entries if e.verdict != "ok"]
    assert bad == ["fc.bias / fc.bias"] and report.first_forward is None
    assert report.first_grad.layer == "fc" and not report.ok


def test_a_dump_of_another_version_or_no_dump_is_a_clear_error(tmp_path):
    path = str(tmp_path / "run.npz")
    dump(torch.nn.Linear(16, 2), ROWS, path)
    with np.load(path) as npz:
        members = {k: npz[k] for k in npz.files}
    header = json.loads(members["header"].tobytes())
    header["version"] = VERSION + 1
    members["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(str(tmp_path / "future.npz"), **members)
    with pytest.raises(ParityError, match=rf"format version {VERSION + 1} .*reads version "
                                          rf"{VERSION} only"):
        load(str(tmp_path / "future.npz"))
    np.savez(str(tmp_path / "plain.npz"), x=np.zeros(3))
    with pytest.raises(ParityError, match="not a gradmgr parity dump"):
        load(str(tmp_path / "plain.npz"))
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(ParityError, match="cannot read .* as a gradmgr parity dump"):
        load(str(tmp_path / "text.npz"))


def test_a_dump_is_compared_only_as_recorded(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    recorded = dump(model, ROWS, str(tmp_path / "run.npz"))
    live = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    transfer_weights(recorded, live)
    assert compare_step(recorded, live, ROWS).ok
    with pytest.raises(ParityError, match="not the one the dump was recorded on"):
        compare_step(recorded, live, ROWS + 1)
    with pytest.raises(ParityError, match="a parity dump is read-only"):
        transfer_weights(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(),
                                             torch.nn.Linear(8, 2)), recorded)
    with pytest.raises(ParityError, match="loss_a given for a parity dump"):
        compare_step(recorded, live, ROWS, loss_a=lambda out: out.mean(),
                     loss_b=lambda out: out.mean())
    custom = dump(_cnn(), IMAGES, str(tmp_path / "cnn.npz"), loss=T.cross_entropy)
    with pytest.raises(ParityError, match="recorded with its own loss: give loss_b"):
        compare_step(custom, _cnn(), IMAGES)
    from gradmgr.parity import train_drift
    with pytest.raises(ParityError, match="cannot run"):
        train_drift(recorded, live, None, None, [ROWS])


class _Average(torch.nn.Module):
    """A Linear that keeps a running average of its output in a buffer, updated at
    ``rate`` (an EMA a port can get wrong with every output and gradient right)."""

    def __init__(self, rate: float = 0.1) -> None:
        super().__init__()
        self.fc, self.rate = torch.nn.Linear(16, 4), rate
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        with torch.no_grad():
            self.avg.mul_(1 - self.rate).add_(self.rate * y.mean(0))
        return y


def test_a_buffer_the_port_updates_wrong_differs_through_a_dump_as_live(tmp_path):
    """A dump keeps its buffers after its step: a port whose update of one is wrong (no
    configuration tells it) is no OK offline, as it is none live."""
    def model(seed: int, rate: float = 0.1) -> _Average:
        torch.manual_seed(seed)
        return _Average(rate)

    live = compare_step(model(0), model(0, rate=0.2), ROWS)
    recorded = dump(model(0), ROWS, str(tmp_path / "run.npz"))
    for port, ok in ((model(1), True), (model(1, rate=0.2), False)):
        transfer_weights(recorded, port, probe=recorded.batch)
        report = compare_step(recorded, port, recorded.batch)
        rows = [(e.name, e.verdict) for e in report.entries if e.what == "buffer"]
        assert report.ok == ok, report.text()
        assert rows == [("avg / avg", "ok" if ok else "DIFFERS")], report.text()
    assert report.text().splitlines()[:2] == live.text().splitlines()[:2]
    assert report.text().startswith("PARITY BROKEN") and "buffers after the step: 1" in (
        report.text())
    # the step moved the live port's buffer and not the dump's: compared again, it starts
    # from another state, and is told so; transferred again, it is parity again
    port = model(1)
    transfer_weights(recorded, port, probe=recorded.batch)
    assert compare_step(recorded, port, ROWS).ok
    again = compare_step(recorded, port, ROWS)
    assert [e.note for e in again.entries if not e.ok] == [
        "it differed before the step too: transfer the weights first"]
    transfer_weights(recorded, port, probe=recorded.batch)
    assert compare_step(recorded, port, ROWS).ok
    # a port dumped too (each side in its own environment): the same verdicts
    for rate, ok in ((0.1, True), (0.2, False)):
        port = dump(model(0, rate), ROWS, str(tmp_path / f"port{rate}.npz"))
        assert compare_step(recorded, port, ROWS).ok == ok
    # exactly the live buffer: 0.1 * (mean output) against 0.2 * it
    np.testing.assert_array_equal(recorded.read_after("avg"), model(0)(
        torch.from_numpy(ROWS)).mean(0).detach().numpy() * np.float32(0.1))


def test_a_dump_cut_short_or_with_a_tensor_left_out_is_a_clear_error(tmp_path):
    path = tmp_path / "run.npz"
    dump(_cnn(), IMAGES, str(path), loss=T.cross_entropy)
    data = path.read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.npz").write_bytes(b"")
    flipped = bytearray(data)  # one bit of a stored tensor: the zip's checksum tells it
    flipped[data.find(b"a0.npy") + 1000] ^= 1  # (a0: the images, 3072 bytes)
    (tmp_path / "flipped.npz").write_bytes(bytes(flipped))
    for name, why in (("cut", "File is not a zip file"), ("empty", "No data left"),
                      ("flipped", "Bad CRC-32 for file 'a0.npy'")):
        with pytest.raises(ParityError, match=f"cannot read .*{name}.npz as a gradmgr parity "
                                              f"dump .*: {why}"):
            load(str(tmp_path / f"{name}.npz"))
    with np.load(path) as npz:
        members = {k: npz[k] for k in npz.files}
    header = json.loads(members["header"].tobytes())
    grads = dict(header["grads"])
    # a gradient left out would be no row of the report, and the step read OK
    del header["grads"]["fc.weight"]
    members["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(str(tmp_path / "no_grad.npz"), **members)
    with pytest.raises(ParityError, match=r"incomplete parity dump: grads\['fc.weight'\] "
                                          r"missing .*dump the run again"):
        load(str(tmp_path / "no_grad.npz"))
    header["grads"] = grads
    members["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    del members[grads["fc.bias"]]
    np.savez(str(tmp_path / "no_member.npz"), **members)
    with pytest.raises(ParityError, match=rf"incomplete parity dump: member {grads['fc.bias']} "
                                          rf"missing"):
        load(str(tmp_path / "no_member.npz"))


def test_a_bfloat16_model_is_a_clear_error_live_and_dumped(tmp_path):
    """numpy has no bfloat16: torch's .numpy() raised a bare TypeError ("Got unsupported
    ScalarType BFloat16"), from compare_step and from dump alike."""
    message = r"numpy has no bfloat16 .*compare the models in float32 \(model.float\(\)"
    with pytest.raises(ParityError, match=message):
        dump(torch.nn.Linear(16, 2).bfloat16(), ROWS, str(tmp_path / "run.npz"))
    with pytest.raises(ParityError, match=message):
        compare_step(_cnn().bfloat16(), _cnn().bfloat16(), IMAGES, loss_a=T.cross_entropy,
                     loss_b=T.cross_entropy)
    assert not (tmp_path / "run.npz").exists()


def _python(env: str) -> str:
    """The python of the project environment ``env`` (``.venv``, ``.venv-latest``): in this
    checkout, or in the main checkout of a git worktree (its environments are shared)."""
    roots = [ROOT]
    common = subprocess.run(["git", "rev-parse", "--git-common-dir"], cwd=ROOT, text=True,
                            capture_output=True)
    if common.returncode == 0:
        roots.append((ROOT / common.stdout.strip()).resolve().parent)
    for root in roots:
        python = root / env / "bin" / "python"
        if python.exists():
            return str(python)
    pytest.fail(f"the cross-environment dump test needs both project environments; {env} "
                f"is in none of {[str(r) for r in roots]}: run make setup (scripts/setup.sh "
                f"all)")


def _worker(env: str, mode: str, path: pathlib.Path) -> dict:
    python = _python(env)
    run = subprocess.run([python, str(ROOT / "tests" / "parity_dump_worker.py"), mode,
                          str(path)], cwd=str(path.parent), text=True, capture_output=True,
                         timeout=CROSS_ENV_S,
                         env=dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}"))
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and lines, f"{env} {mode}:\n{run.stdout}\n{run.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def test_megengine_dumped_in_python_3_10_compares_against_torch_2_13_in_the_other_env(
        tmp_path):
    path = tmp_path / "megengine_cnn.npz"
    dumped = _worker(".venv", "dump", path)
    found = _worker(".venv-latest", "compare", path)
    assert dumped["python"].startswith("3.10") and not found["python"].startswith("3.10")
    header = found["header"]
    assert (header["framework"], header["framework_version"]) == ("megengine", "1.13.0")
    assert header["python"] == dumped["python"] and header["loss_value"] == dumped["loss"]
    good = found["good"]
    assert good["ok"], good["text"]
    assert good["mapped"] == 13  # 9 trained tensors + 4 BatchNorm running statistics
    # the layers' outputs, the loss, the grads, the running statistics after the step
    assert len(good["verdicts"]) == 9 + 1 + 9 + 4
    assert set(good["verdicts"].values()) == {"ok"}
    # two kernels' float32 rounding, each compared value: far below the 1e-3 of a real bug
    assert good["max_rel"] < 1e-5, good["text"]
    eps = found["eps"]
    assert not eps["ok"] and eps["text"].startswith("PARITY BROKEN")
    assert eps["first_forward"] == "bn2" and eps["verdicts"]["bn2 / bn2"] == "DIFFERS"
    assert eps["findings"] == [["bn2", "eps"]]
    # MegEngine's momentum 0.9 copied as PyTorch's: the running statistics after the step
    # differ, compared from the file (the dump keeps them after its step)
    moved = found["momentum"]["verdicts"]
    assert [k for k, v in moved.items() if v != "ok"] == [
        "bn1.running_mean / bn1.running_mean", "bn1.running_var / bn1.running_var"]
