"""scripts/setup.sh's fallback for a wheel that torch 2.8 pins (nvidia-*, triton) and that cannot
be downloaded, run with pip replaced by stubs: no network, no install. CI once failed when one
such wheel stopped at the same byte on every retry; the fallback must then take a neighbouring
release of the same series, nearest first, and stop with a clear message when none arrives."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "scripts", "setup.sh")

AVAILABLE = {
    "nvidia-cudnn-cu12": "9.28.0.42, 9.12.0rc1, 9.11.0.98, 9.10.2.21, 9.10.1.4, 9.10.0.56, "
    "8.9.7.29",
    "nvidia-cusparselt-cu12": "0.8.0, 0.7.2, 0.7.1, 0.7.0, 0.6.3",
}


@pytest.fixture
def fake_python(tmp_path):
    """A 'python' that answers `-m pip index versions NAME` from AVAILABLE and runs the real
    interpreter (which has pip's vendored packaging) for everything else."""
    lines = [f'  {name}) echo "Available versions: {found}";;' for name, found in AVAILABLE.items()]
    script = tmp_path / "python"
    script.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1 $2 $3 $4" = "-m pip index versions" ]; then\n'
        '  case "$5" in\n' + "\n".join(lines) + "\n  esac\n  exit 0\nfi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def run_setup_functions(body: str, tmp_path) -> subprocess.CompletedProcess:
    """Sources setup.sh (which then only defines its functions) and runs `body` after it."""
    program = f"source {SETUP}\n" + textwrap.dedent(body)
    return subprocess.run(
        ["bash", "-c", program], capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
        env={**os.environ, "PIP_LOG": str(tmp_path / "pip.log")},
    )


def test_neighbours_are_the_same_series_nearest_first(fake_python, tmp_path):
    out = run_setup_functions(
        f"""
        neighbour_releases {fake_python} nvidia-cudnn-cu12 9.10.2.21
        neighbour_releases {fake_python} nvidia-cusparselt-cu12 0.7.1
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    # 9.x only (8.9 ships libcudnn.so.8), no pre-release; 0.7.x only for a 0.x series.
    assert out.stdout.splitlines() == ["9.11.0.98 9.10.1.4 9.28.0.42", "0.7.2 0.7.0"]


STUBS = """
torch_requirements() {
  printf '%s\\n' filelock 'sympy>=1.13.3' nvidia-cublas-cu12==12.8.4.1 \\
    nvidia-cudnn-cu12==9.10.2.21 triton==3.4.0
}
pip_install() {  # records each call; the listed wheels "stop at the same byte"
  shift
  echo "$*" >>"$PIP_LOG"
  case " $* " in FAILING) return 1;; esac
}
sleep() { :; }
"""


def pip_calls(tmp_path) -> list[str]:
    return (tmp_path / "pip.log").read_text().splitlines()


def run_fallback(fake_python, tmp_path, failing: str, project: str):
    """install_legacy_torch_piecewise with pip calls matching the case pattern `failing` failing."""
    return run_setup_functions(
        STUBS.replace("FAILING", failing)
        + f"install_legacy_torch_piecewise {fake_python} torch==2.8.0 -e '{project}'\n",
        tmp_path,
    )


def test_a_pinned_wheel_that_never_arrives_is_replaced_by_its_nearest(fake_python, tmp_path):
    failing = '*" nvidia-cudnn-cu12==9.10.2.21 "*|*" nvidia-cudnn-cu12==9.11.0.98 "*'
    out = run_fallback(fake_python, tmp_path, failing, ".[megengine]")
    assert out.returncode == 0, out.stderr
    assert pip_calls(tmp_path) == [
        "--no-deps torch==2.8.0",
        "filelock sympy>=1.13.3 -e .[megengine]",
        "--no-deps nvidia-cublas-cu12==12.8.4.1",
        "--no-deps nvidia-cudnn-cu12==9.10.2.21",
        "--no-deps nvidia-cudnn-cu12==9.11.0.98",
        "--no-deps nvidia-cudnn-cu12==9.10.1.4",
        "--no-deps triton==3.4.0",
    ]
    said = "FALLBACK used: nvidia-cudnn-cu12 9.10.1.4 instead of the 9.10.2.21 torch pins"
    assert said in out.stdout


def test_no_neighbour_arriving_stops_with_what_to_do(fake_python, tmp_path):
    out = run_fallback(fake_python, tmp_path, '*" nvidia-cudnn-cu12=="*', ".")
    assert out.returncode == 1
    assert "neither nvidia-cudnn-cu12==9.10.2.21 nor a neighbouring release" in out.stderr
    assert "run 'make setup' again" in out.stderr
    tried = [f"--no-deps nvidia-cudnn-cu12=={v}" for v in ("9.11.0.98", "9.10.1.4", "9.28.0.42")]
    assert pip_calls(tmp_path)[-3:] == tried


def test_a_download_is_tried_again_then_given_up_with_a_status(tmp_path):
    """with_retries (pip's and apt's downloads): a command that fails twice and then succeeds
    passes with three attempts; one that always fails gives up after them with its status."""
    flaky = tmp_path / "flaky"
    flaky.write_text(
        "#!/usr/bin/env bash\n"
        f'n=$(cat "{tmp_path}/count" 2>/dev/null || echo 0); echo $((n + 1)) >"{tmp_path}/count"\n'
        '[ "$n" -ge 2 ]\n'
    )
    flaky.chmod(flaky.stat().st_mode | stat.S_IEXEC)
    out = run_setup_functions(
        f"""
        sleep() {{ echo "slept $1"; }}
        with_retries 3 "the flaky download" {flaky} && echo "passed"
        rm "{tmp_path}/count"
        with_retries 2 "the flaky download" {flaky} || echo "gave up"
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    said = [line.split("\x1b[0m ", 1)[-1] for line in out.stdout.splitlines()]  # after [setup]
    assert said == [
        "the flaky download failed (attempt 1 of 3, usually the network): trying again in 20 s",
        "slept 20",
        "the flaky download failed (attempt 2 of 3, usually the network): trying again in 40 s",
        "slept 40",
        "passed",
        "the flaky download failed (attempt 1 of 2, usually the network): trying again in 20 s",
        "slept 20",
        "gave up",
    ]


# ------------------------------------------------ what the set-up changes, on a faked machine
# scripts/setup.sh run from a copy of the checkout with PATH holding only fakes and the few
# tools it uses: fake interpreters (a CPython of a given version; `-m venv` makes a fake venv,
# `-m pip` only records), a fake apt-get and dpkg-deb that record, HOME and TMPDIR empty. No
# network, nothing installed; the tests read what it would have done, and in which order.
TOOLS = ["bash", "cat", "sha256sum", "cut", "mkdir", "cp", "rm", "mktemp", "awk", "sed", "seq",
         "id", "head", "tail", "env", "grep", "dirname", "basename", "chmod", "tee", "ls"]

FAKE_PYTHON = """#!/usr/bin/env bash
# a fake CPython {version}
echo "[fake] $0 $*" >>"$FAKE_LOG"
case "$1" in
  --version) echo "Python {version}";;
  -c) case "$2" in *python_implementation*) exit {not_legacy};; esac;;
  -m) case "$2" in
        venv) mkdir -p "$3/bin" && cp "$0" "$3/bin/python";;
        pip) echo "[fake] pip ${{*:3}} (cache $PIP_CACHE_DIR)" >>"$FAKE_LOG";;
      esac;;
  -) cat >/dev/null;;
esac
exit 0
"""

FAKE_APT = """#!/usr/bin/env bash
echo "[fake] apt-get $*" >>"$FAKE_LOG"; echo "[fake] apt-get $*" >&2
case "$*" in
  *" python3.9") printf '%s' "$FAKE_PY39" >"$FAKE_BIN/python3.9"; chmod +x "$FAKE_BIN/python3.9";;
  *"download -q python3-distutils/bullseye") : >python3-distutils_3.9.2-1_all.deb;;
esac
"""


class Machine:
    """A faked machine: ``python(version)`` puts a fake interpreter on PATH, ``run(what)`` runs
    ``main what`` of a copy of setup.sh with apt usable (Debian as root) unless told not."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.checkout, self.bin = tmp_path / "checkout", tmp_path / "bin"
        self.home = tmp_path / "home"
        self.etc_apt, self.tmpdir = tmp_path / "etc" / "apt", tmp_path / "tmp"
        for d in (self.checkout / "scripts", self.bin, self.home, self.tmpdir,
                  self.etc_apt / "sources.list.d", self.etc_apt / "preferences.d"):
            d.mkdir(parents=True)
        script = read(SETUP)
        # A set-up that cannot be pointed away from /etc/apt would write there: do not run it.
        assert "\nAPT_ETC=" in script and "\ncan_apt()" in script, "setup.sh cannot be faked"
        (self.checkout / "scripts" / "setup.sh").write_text(script)
        (self.checkout / "pyproject.toml").write_text(read(os.path.join(ROOT, "pyproject.toml")))
        for tool in TOOLS:
            (self.bin / tool).symlink_to(shutil.which(tool))
        self.log = tmp_path / "log"
        self.log.write_text("")
        self._executable("apt-get", FAKE_APT)
        self._executable("dpkg-deb",
                         '#!/usr/bin/env bash\necho "[fake] dpkg-deb $*" >>"$FAKE_LOG"\n')

    def _executable(self, name: str, text: str) -> None:
        (self.bin / name).write_text(text)
        (self.bin / name).chmod(0o755)

    def python(self, name: str, version: str) -> None:
        self._executable(name, fake_interpreter(version))

    def run(self, what: str, apt: bool = True, **env: str) -> subprocess.CompletedProcess:
        program = (f"source {self.checkout}/scripts/setup.sh\n"
                   f"APT_ETC={self.etc_apt}\n"
                   "legacy_candidates() { :; }\n"  # none outside PATH on this faked machine
                   f"can_apt() {{ {'true' if apt else 'false'}; }}\n"
                   f"main {what}\n")
        return subprocess.run(
            [shutil.which("bash"), "-c", program], capture_output=True, text=True, timeout=60,
            cwd=str(self.tmp), env={"PATH": str(self.bin), "HOME": str(self.home),
                                    "TMPDIR": str(self.tmpdir), "FAKE_LOG": str(self.log),
                                    "FAKE_BIN": str(self.bin),
                                    "FAKE_PY39": fake_interpreter("3.9.2"), **env})

    def calls(self, prefix: str) -> list:
        return [line[len("[fake] "):] for line in self.log.read_text().splitlines()
                if line.startswith(f"[fake] {prefix}")]

    def outside_checkout(self) -> list:
        """What exists outside the checkout that the faked machine did not start with."""
        found = [str(p.relative_to(self.tmp)) for p in self.tmp.rglob("*")
                 if self.checkout not in p.parents and p != self.checkout]
        return sorted(set(found) - set(self.at_start))

    def snapshot(self) -> None:
        self.at_start = [str(p.relative_to(self.tmp)) for p in self.tmp.rglob("*")
                         if self.checkout not in p.parents and p != self.checkout]


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def fake_interpreter(version: str) -> str:
    legacy = (3, 8) <= tuple(int(v) for v in version.split(".")[:2]) <= (3, 10)
    return FAKE_PYTHON.format(version=version, not_legacy=0 if legacy else 1)


@pytest.fixture
def machine(tmp_path) -> Machine:
    m = Machine(tmp_path)
    m.python("python3", "3.11.7")
    return m


def test_demo_with_python310_and_no_chromium_changes_nothing_outside(machine):
    """`make demo` on a machine that has a Python 3.10 but no Chromium, where apt could run:
    .venv only (from python3.10, pip's cache in the checkout), no apt, nothing new outside."""
    machine.python("python3.10", "3.10.12")
    machine.snapshot()
    out = machine.run("demo")
    assert out.returncode == 0, out.stderr
    assert machine.outside_checkout() == []
    assert machine.calls("apt-get") == [] and machine.calls("dpkg-deb") == []
    assert "CHANGING" not in out.stdout + out.stderr and "Chromium" not in out.stdout
    assert (machine.checkout / ".venv" / "bin" / "python").exists()
    assert not (machine.checkout / ".venv-latest").exists()
    made = [c for c in machine.calls(str(machine.bin)) if " -m venv " in c]
    assert made == [f"{machine.bin}/python3.10 -m venv .venv"]
    pip = machine.calls("pip install")
    assert pip and all(c.endswith(f"(cache {machine.checkout}/.cache/pip)") for c in pip), pip
    installs = [c for c in pip if "torch==2.8.0 -e .[" in c]  # the project's extras may grow
    assert installs and all(x in installs[0] for x in ("megengine", "demo")), pip
    assert not (machine.checkout / ".setup-system-changes").exists()


def test_test_setup_builds_both_and_announces_chromium_before_installing_it(machine):
    """`make test` (CI): both environments, then Chromium from apt, announced first."""
    machine.python("python3.10", "3.10.12")
    out = machine.run("all")
    assert out.returncode == 0, out.stderr
    assert (machine.checkout / ".venv-latest" / "bin" / "python").exists()
    assert machine.calls("apt-get") == ["apt-get update -q", "apt-get install -y -q chromium"]
    said = out.stdout
    assert said.index("ABOUT TO CHANGE THIS MACHINE") < said.index("Installed")
    assert "GRADMGR_SYSTEM=no skips it" in said
    assert (machine.checkout / ".setup-system-changes").read_text() == "apt package chromium\n"


def test_test_setup_gives_paddle_its_own_environment_after_venv(machine):
    """`make test` builds .venv-paddle from the same Python 3.10 after .venv, lends it .venv's
    packages (a .pth line written by its Python) and installs only the project with the paddle
    extra there; `make demo` never does (test above)."""
    machine.python("python3.10", "3.10.12")
    out = machine.run("all")
    assert out.returncode == 0, out.stderr
    made = [c for c in machine.calls(str(machine.bin)) if " -m venv " in c]
    assert made[:2] == [f"{machine.bin}/python3.10 -m venv .venv",
                        f"{machine.bin}/python3.10 -m venv .venv-paddle"], made
    paddle_pip = [c for c in machine.calls("pip install") if ".[paddle]" in c]
    assert len(paddle_pip) == 1 and "torch" not in paddle_pip[0], paddle_pip
    lends = [c for c in machine.calls(".venv-paddle/bin/python - ")]
    assert lends == [f".venv-paddle/bin/python - {machine.checkout}/.venv/bin/python"], lends
    assert ".venv-paddle ready" in out.stdout


def test_test_setup_with_chromium_present_installs_nothing(machine):
    machine.python("python3.10", "3.10.12")
    machine._executable("chromium", "#!/usr/bin/env bash\n")
    out = machine.run("all")
    assert out.returncode == 0, out.stderr
    assert machine.calls("apt-get") == []
    assert f"Chromium for the docs' browser test: {machine.bin}/chromium" in out.stdout


def test_without_an_old_python_the_apt_install_is_announced_first(machine):
    """No CPython 3.8-3.10: bullseye's python3.9, every change announced before the first
    apt-get, with how to avoid it, and noted for `make distclean`; then .venv from it."""
    out = machine.run("demo")
    assert out.returncode == 0, out.stderr
    err = out.stderr
    assert err.index("ABOUT TO CHANGE THIS MACHINE") < err.index("[fake] apt-get")
    assert "GRADMGR_PYTHON=/path/to/python3.10" in err and "GRADMGR_SYSTEM=no" in err
    assert machine.calls("apt-get") == [
        "apt-get update -q", "apt-get install -y -q -t bullseye python3.9",
        "apt-get download -q python3-distutils/bullseye"]
    assert machine.calls("dpkg-deb") == ["dpkg-deb -x python3-distutils_3.9.2-1_all.deb /"]
    sources = machine.etc_apt / "sources.list.d" / "gradmgr-bullseye.sources"
    assert "Suites: bullseye" in sources.read_text()
    pin = machine.etc_apt / "preferences.d" / "gradmgr-bullseye"
    assert "Pin-Priority: 100" in pin.read_text()
    made = [c for c in machine.calls(str(machine.bin)) if " -m venv " in c]
    assert made == [f"{machine.bin}/python3.9 -m venv .venv"]
    noted = (machine.checkout / ".setup-system-changes").read_text()
    assert "apt package python3.9" in noted and "python3-distutils" in noted


def test_system_changes_refused_stop_with_what_to_do(machine):
    machine.snapshot()
    out = machine.run("demo", GRADMGR_SYSTEM="no")
    assert out.returncode == 1
    assert machine.calls("apt-get") == [] and machine.outside_checkout() == []
    assert "none was found: install a CPython 3.9 or 3.10 yourself" in out.stderr


def test_not_debian_root_never_tries_apt(machine):
    out = machine.run("all", apt=False)
    assert out.returncode == 1
    assert machine.calls("apt-get") == []
    assert "ABOUT TO CHANGE" not in out.stderr
    assert "GRADMGR_PYTHON" in out.stderr


def test_the_readme_lists_every_change_outside_the_checkout() -> None:
    """What the set-up may change outside the checkout, and how to avoid it, is in README.md's
    "Two commands" section (the requirements), where a user reads before running them."""
    readme = read(os.path.join(ROOT, "README.md"))
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    for named in ("/etc/apt/sources.list.d/gradmgr-bullseye.sources",
                  "/etc/apt/preferences.d/gradmgr-bullseye", "python3.9", "python3-distutils",
                  "chromium", "GRADMGR_SYSTEM=no", "GRADMGR_PYTHON", "make setup-system",
                  ".cache/pip"):
        assert named in section, named
