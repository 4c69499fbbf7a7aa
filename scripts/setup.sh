#!/usr/bin/env bash
# Sets up gradmgr's development environments; safe to run again (it then only checks).
#   scripts/setup.sh demo     .venv only: what `make demo` (and `make bench`) runs in
#   scripts/setup.sh latest   .venv-latest only (`make docs`, `make lint`)
#   scripts/setup.sh [all]    all three, and Chromium for the docs' browser test (`make test`, CI)
#   scripts/setup.sh system   only the changes outside the checkout, asked for (`make setup-system`)
#   .venv         CPython 3.8-3.10 with torch 2.8.0 + megengine 1.13.0 (MegEngine has no newer wheels)
#   .venv-paddle  .venv's Python and packages (lent) plus PaddlePaddle 3.3.1 (setup_paddle)
#   .venv-latest  the machine's python3 with the newest cheap PyTorch (torch 2.13.0, CPU build)
#                 and the docs tools (mkdocs)
# Everything it writes is inside the checkout (the environments, pip's cache in .cache/pip),
# except two things it may need where the machine lacks them, each announced before it happens
# with how to avoid it (README.md's requirements list them): Debian's bullseye python3.9 (for
# .venv, when no CPython 3.8-3.10 is found) and Debian's chromium (`all` only).
# Environment: GRADMGR_PYTHON names a CPython 3.8-3.10 to use for .venv;
#              GRADMGR_LATEST_PYTHON the interpreter for .venv-latest (default python3);
#              GRADMGR_SYSTEM=no: never change the machine (stop, or warn, instead);
#              GRADMGR_SYSTEM=yes: change it without the pause given on a terminal.
# Bash, not uv or nox (uv 0.13.9, nox 2026.10.20; measured 2026-11-28, issue 37): `uv python
# install 3.10` downloads CPython from GitHub, unreachable on the project's machine, so finding
# or installing a CPython 3.8-3.10 stays here. `uv venv -p PYTHON` + `uv pip install` built
# .venv-latest (29 s) and resolve .venv's set (torch 2.8.0, megengine 1.13.0: a dry run), but
# uv reads no pip.conf (find-links, extra indexes: pass them) and needs --index-strategy
# unsafe-best-match with more than one index; Chromium and the pinned-wheel fallback stay here
# either way. nox runs sessions in venvs (it would replace Makefile targets, none of this);
# asked for python 3.10 with the uv backend it tried the same download and skipped the session.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
LEGACY_TORCH="torch==2.8.0"
LATEST_TORCH="${GRADMGR_LATEST_TORCH:-torch==2.13.0}"
APT_ETC=/etc/apt  # (tests point these elsewhere)
SYSTEM_LOG=$ROOT/.setup-system-changes  # what was changed outside the checkout, for distclean
ANNOUNCE_WAIT_S=15
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$ROOT/.cache/pip}"  # pip's cache inside the checkout
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }

is_legacy_python() {  # true if "$1" runs and is CPython 3.8-3.10
  "$1" -c 'import sys, platform; sys.exit(not (platform.python_implementation() == "CPython" and (3, 8) <= sys.version_info[:2] <= (3, 10)))' >/dev/null 2>&1
}

legacy_candidates() {  # interpreters that may exist but are not on PATH (pyenv installs, Debian's /usr/bin)
  local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  printf '%s\n' "$pyenv_root"/versions/3.10*/bin/python3.10 "$pyenv_root"/versions/3.9*/bin/python3.9 \
    "$pyenv_root"/versions/3.8*/bin/python3.8 /usr/bin/python3.10 /usr/bin/python3.9 /usr/bin/python3.8
}

find_legacy_python() {
  local c
  if [ -n "${GRADMGR_PYTHON:-}" ]; then
    is_legacy_python "$GRADMGR_PYTHON" || die "GRADMGR_PYTHON=$GRADMGR_PYTHON is not a working CPython 3.8-3.10"
    echo "$GRADMGR_PYTHON"; return
  fi
  for c in python3.10 python3.9 python3.8; do
    if command -v "$c" >/dev/null 2>&1 && is_legacy_python "$c"; then command -v "$c"; return; fi
  done
  while IFS= read -r c; do
    if [ -x "$c" ] && is_legacy_python "$c"; then echo "$c"; return; fi
  done < <(legacy_candidates)
  return 1
}

can_apt() {  # Debian, run as root, with apt-get: the only place this script installs system packages
  [ -r /etc/debian_version ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1
}

announce_system_change() {  # announce_system_change WHAT HOW-TO-AVOID: said before, never after
  # GRADMGR_SYSTEM=no refuses (returns 1); on a terminal, a pause to press Ctrl-C first.
  say "ABOUT TO CHANGE THIS MACHINE (outside this checkout): $1"
  say "To avoid it: $2"
  if [ "${GRADMGR_SYSTEM:-}" = no ]; then
    say "GRADMGR_SYSTEM=no: not changing it"; return 1
  fi
  if [ "${GRADMGR_SYSTEM:-}" != yes ] && [ -t 0 ]; then
    say "Nothing is changed yet: press Ctrl-C within $ANNOUNCE_WAIT_S s to stop here."
    sleep "$ANNOUNCE_WAIT_S"
  fi
}

note_system_change() {  # note_system_change LINE: kept in the checkout for `make distclean` to show
  echo "$*" >>"$SYSTEM_LOG"
}

install_bullseye_python39() {
  # Debian bookworm has no python3.8-3.10; bullseye's python3.9 installs cleanly beside it.
  local sources=$APT_ETC/sources.list.d/gradmgr-bullseye.sources
  local pin=$APT_ETC/preferences.d/gradmgr-bullseye
  local uri keyring
  uri=$(awk '/^URIs:/{print $2; exit}' "$APT_ETC/sources.list.d/debian.sources" 2>/dev/null || true)
  keyring=$(awk '/^Signed-By:/{print $2; exit}' "$APT_ETC/sources.list.d/debian.sources" 2>/dev/null || true)
  uri=${uri:-http://deb.debian.org/debian}
  keyring=${keyring:-/usr/share/keyrings/debian-archive-keyring.gpg}
  say "Adding Debian's bullseye suite ($sources), pinned at priority 100 ($pin) so it never"
  say "wins for other packages, to install python3.9."
  printf 'Types: deb\nURIs: %s\nSuites: bullseye\nComponents: main\nSigned-By: %s\n' "$uri" "$keyring" >"$sources"
  printf 'Package: *\nPin: release n=bullseye\nPin-Priority: 100\n' >"$pin"
  note_system_change "file $sources" && note_system_change "file $pin"
  apt_install -t bullseye python3.9
  note_system_change "apt package python3.9 (bullseye; with libssl1.1, libffi7, libmpdec3)"
  # bullseye's python3-distutils would replace bookworm's package of the same name; unpack its files only.
  local tmp; tmp=$(mktemp -d)
  (cd "$tmp" && with_retries 3 "apt-get download python3-distutils" apt-get download -q python3-distutils/bullseye \
     && dpkg-deb -x python3-distutils_*.deb /)
  rm -rf "$tmp"
  note_system_change "files of bullseye's python3-distutils under /usr/lib/python3.9/distutils (not tracked by dpkg)"
  say "Installed /usr/bin/python3.9 from bullseye (plus its libssl1.1, libffi7, libmpdec3); nothing removed."
}

LEGACY_AVOID="install a CPython 3.9 or 3.10 yourself (e.g. 'pyenv install 3.10') and run again, or name one with GRADMGR_PYTHON=/path/to/python3.10; GRADMGR_SYSTEM=no stops instead of installing"

ensure_legacy_python() {
  local py
  if py=$(find_legacy_python); then echo "$py"; return; fi
  if can_apt; then
    if announce_system_change "no CPython 3.8-3.10 found (MegEngine needs one): installing Debian bullseye's python3.9 with apt-get (an apt source and a pin file under $APT_ETC, python3.9 and its libraries, python3-distutils' files unpacked into /usr/lib/python3.9)" \
         "$LEGACY_AVOID" >&2; then
      install_bullseye_python39 >&2
      py=$(find_legacy_python) || die "python3.9 from bullseye did not install as expected"
      echo "$py"; return
    fi
  fi
  die "MegEngine needs CPython 3.8, 3.9 or 3.10 and none was found: $LEGACY_AVOID."
}

make_venv() {  # make_venv DIR PYTHON
  local dir=$1 py=$2
  if [ -x "$dir/bin/python" ] && "$dir/bin/python" -m pip --version >/dev/null 2>&1; then return; fi
  rm -rf "$dir"
  say "creating $dir with $py ($("$py" --version 2>&1))"
  if "$py" -c 'import ensurepip, venv' >/dev/null 2>&1 && "$py" -m venv "$dir"; then return; fi
  rm -rf "$dir"
  # Debian's python3.9 from bullseye has no ensurepip; virtualenv seeds pip itself.
  if python3 -m virtualenv --version >/dev/null 2>&1; then
    python3 -m virtualenv -q -p "$py" "$dir"; return
  fi
  # Into a scratch directory: --target also works where python3 is "externally managed" (PEP 668).
  local tools; tools=$(mktemp -d)
  python3 -m pip install -q --target "$tools" virtualenv
  PYTHONPATH="$tools" python3 -m virtualenv -q -p "$py" "$dir"
  rm -rf "$tools"
}

stamp_of() {  # what the environment was built from: a change re-runs the install
  cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16
}

with_retries() {  # with_retries ATTEMPTS WHAT COMMAND...: COMMAND until it succeeds, ATTEMPTS times at most
  # Every download here (pip's wheels, Debian's packages) crosses the network on a fresh machine,
  # and a dropped connection must not end the set-up.
  local attempts=$1 what=$2 attempt
  shift 2
  for attempt in $(seq "$attempts"); do
    "$@" && return 0
    [ "$attempt" -lt "$attempts" ] || break
    say "$what failed (attempt $attempt of $attempts, usually the network): trying again in $((attempt * 20)) s"
    sleep $((attempt * 20))
  done
  return 1
}

pip_install() {  # pip_install VENV-PYTHON PIP-ARGS...; tries ${PIP_ATTEMPTS:-4} times, returns pip's status
  # torch 2.8 for Python <= 3.10 exists on the index only as a CUDA build: several GB of nvidia-*
  # wheels come over the network on every fresh machine. pip keeps finished wheels in its
  # cache, so a retry fetches only what failed.
  local py=$1 resume=()
  shift
  if "$py" -m pip install --help 2>/dev/null | grep -q -- '--resume-retries'; then resume=(--resume-retries 5); fi
  with_retries "${PIP_ATTEMPTS:-4}" "pip install" \
    "$py" -m pip install -q --retries 10 ${resume[@]+"${resume[@]}"} "$@"
}

apt_install() {  # apt_install APT-GET-INSTALL-ARGS...: Debian's packages, the index updated first
  with_retries 3 "apt-get update" apt-get update -q || die "apt-get update failed three times"
  with_retries 3 "apt-get install $*" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" \
    || die "apt-get install $* failed three times (apt's message is above); run 'make setup' again"
}

pip_failed() {  # pip_failed PIP-ARGS...
  die "pip install $* failed (pip's message is above). When the network is back, run 'make setup' again: it goes on from what is installed."
}

pip_install_or_die() {  # pip_install_or_die VENV-PYTHON PIP-ARGS...
  pip_install "$@" && return 0
  shift
  pip_failed "$@"
}

torch_requirements() {  # torch_requirements VENV-PYTHON: installed torch's needs on this machine, one per line
  "$1" - <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for line in requires("torch") or []:
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        print(str(req).split(";")[0])
PY
}

neighbour_releases() {  # neighbour_releases VENV-PYTHON NAME PINNED: up to 3 other releases, nearest first
  # Only releases in the pinned one's series (same first number; same first two for 0.x), which
  # ship the same shared-library major (libcudnn.so.9, libnccl.so.2...): torch links by that name.
  local py=$1 name=$2 pinned=$3 available
  available=$("$py" -m pip index versions "$name" 2>/dev/null | sed -n 's/^Available versions: //p')
  "$py" - "$pinned" "$available" <<'PY'
import sys
from pip._vendor.packaging.version import InvalidVersion, Version

def series(v):
    return v.release[:2] if v.release[0] == 0 else v.release[:1]

pinned = Version(sys.argv[1])
found = []
for text in sys.argv[2].split(", "):
    try:
        v = Version(text)
    except InvalidVersion:
        continue
    if v != pinned and not v.is_prerelease and series(v) == series(pinned):
        found.append(v)
ordered = sorted(found + [pinned])
at = ordered.index(pinned)
nearest = sorted(found, key=lambda v: (abs(ordered.index(v) - at), v < pinned))  # newer first
print(" ".join(str(v) for v in nearest[:3]))
PY
}

install_pinned_wheel() {  # install_pinned_wheel VENV-PYTHON NAME==PINNED: the pinned wheel, else a neighbour
  local py=$1 req=$2 name pinned v
  name=${req%%==*} pinned=${req#*==}
  PIP_ATTEMPTS=2 pip_install "$py" --no-deps "$req" && return 0
  for v in $(neighbour_releases "$py" "$name" "$pinned"); do
    if PIP_ATTEMPTS=1 pip_install "$py" --no-deps "$name==$v"; then
      say "FALLBACK used: $name $v instead of the $pinned torch pins ('pip check' will say so)"
      return 0
    fi
  done
  die "neither $req nor a neighbouring release of it could be downloaded; when the network is back, run 'make setup' again"
}

install_legacy_torch_piecewise() {  # VENV-PYTHON TORCH-SPEC PIP-ARGS...
  # Three times a CI download of one of torch 2.8's pinned nvidia-* wheels stopped at the same
  # byte on every retry and every resume (nccl 2.27.3 at 269.0 of 322.4 MB, twice; cudnn
  # 9.10.2.21 at 490.2 of 706.8 MB) while every other wheel arrived: a truncated copy on the way,
  # not a flaky link, so retrying the same file cannot help. This CPU-only environment never calls
  # CUDA or triton; torch only needs each CUDA library's file, by its major version, to import.
  # So install torch alone, then its unpinned needs with the project, then each pinned wheel
  # (nvidia-*, triton) on its own, taking a neighbouring release of the same series where the
  # pinned one cannot be had (said loudly).
  local py=$1 torch=$2; shift 2
  local req reqs others=() pinned=()
  say "FALLBACK: installing $torch, then its other needs, then each wheel it pins on its own"
  PIP_ATTEMPTS=2 pip_install_or_die "$py" --no-deps "$torch"
  mapfile -t reqs < <(torch_requirements "$py")
  for req in "${reqs[@]}"; do
    case "$req" in *==*) pinned+=("$req") ;; *) others+=("$req") ;; esac
  done
  PIP_ATTEMPTS=2 pip_install_or_die "$py" "${others[@]}" "$@"
  for req in "${pinned[@]}"; do install_pinned_wheel "$py" "$req"; done
}

setup_env() {  # setup_env DIR PYTHON CHECK-IMPORTS PIP-ARGS...
  local dir=$1 py=$2 check=$3; shift 3
  local stamp; stamp="$(stamp_of) $*"
  if [ -f "$dir/.gradmgr-stamp" ] && [ "$(cat "$dir/.gradmgr-stamp")" = "$stamp" ] \
     && "$dir/bin/python" -c "import $check" >/dev/null 2>&1; then
    say "$dir is up to date"; return
  fi
  make_venv "$dir" "$py"
  say "installing into $dir: $*"
  pip_install_or_die "$dir/bin/python" --upgrade pip
  if ! PIP_ATTEMPTS=${GRADMGR_PIP_ATTEMPTS:-2} pip_install "$dir/bin/python" "$@"; then
    [ "$1" = "$LEGACY_TORCH" ] || pip_failed "$@"
    install_legacy_torch_piecewise "$dir/bin/python" "$@"
  fi
  "$dir/bin/python" -c "import $check"
  echo "$stamp" >"$dir/.gradmgr-stamp"
  say "$dir ready"
}

find_chromium() {
  local c
  for c in chromium chromium-browser google-chrome; do
    if command -v "$c" >/dev/null 2>&1; then command -v "$c"; return; fi
  done
  return 1
}

ensure_chromium() {  # the docs' browser test (tests/docs/test_docs_site.py) drives Chromium
  local found
  if found=$(find_chromium); then say "Chromium for the docs' browser test: $found"; return; fi
  if can_apt && announce_system_change "no Chromium found, and the docs' browser test needs one: installing Debian's chromium package with apt-get" \
       "put a Chromium on PATH as 'chromium' and run again; GRADMGR_SYSTEM=no skips it (the browser test then fails, saying so)"; then
    apt_install chromium
    note_system_change "apt package chromium"
    say "Installed $(command -v chromium) ($(chromium --version 2>/dev/null | head -1))"
    return
  fi
  say "WARNING: no Chromium on PATH: install Chromium (as 'chromium'), or the docs' browser test fails."
}

setup_legacy() {  # .venv: torch 2.8 + MegEngine, what the demo, the benchmarks and most tests run in
  LEGACY_PY=$(ensure_legacy_python)
  setup_env .venv "$LEGACY_PY" "torch, megengine, gradmgr, lightning_fabric" \
    "$LEGACY_TORCH" -e ".[megengine,lightning,parity,test,demo]"
}

setup_paddle() {  # .venv-paddle: PaddlePaddle beside .venv's torch and MegEngine (issue 40)
  # Its own environment, lent .venv's packages by a .pth line, rather than Paddle in .venv:
  # `make demo` keeps not downloading Paddle's 195 MB wheel, and Paddle's wheel, which pulls
  # numpy 2 (MegEngine then fails to import), cannot change what .venv's tests run on; numpy
  # stays .venv's 1.x (the `paddle` extra pins it below 2). Measured 2026-11-28: 39 s of pip
  # (8 packages added: paddlepaddle 3.3.1, protobuf, safetensors, opt_einsum, httpx and its
  # three), and torch, MegEngine and Paddle import together in one process.
  local dir=.venv-paddle stamp
  stamp="$(stamp_of) paddle"
  if [ -f "$dir/.gradmgr-stamp" ] && [ "$(cat "$dir/.gradmgr-stamp")" = "$stamp" ] \
     && "$dir/bin/python" -c "import paddle, megengine, torch, gradmgr" >/dev/null 2>&1; then
    say "$dir is up to date"; return
  fi
  make_venv "$dir" "$LEGACY_PY"
  "$dir/bin/python" - "$ROOT/.venv/bin/python" <<'PY'
import subprocess, sys, sysconfig
lent = subprocess.run([sys.argv[1], "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                      capture_output=True, text=True, check=True).stdout.strip()
with open(sysconfig.get_paths()["purelib"] + "/gradmgr-lend-venv.pth", "w") as f:
    f.write(lent + "\n")  # a path line only: .venv's own .pth files (its editable gradmgr) stay off
PY
  say "installing into $dir: -e .[paddle] (torch, MegEngine and the rest lent by .venv)"
  pip_install_or_die "$dir/bin/python" -e ".[paddle]"
  "$dir/bin/python" -c "import paddle, megengine, torch, gradmgr"
  echo "$stamp" >"$dir/.gradmgr-stamp"
  say "$dir ready"
}

setup_latest() {  # .venv-latest: the newest torch, the docs tools and ruff
  setup_env .venv-latest "${GRADMGR_LATEST_PYTHON:-python3}" "torch, gradmgr, mkdocs, mkdocstrings, lightning_fabric" \
    "$LATEST_TORCH" -e ".[lightning,parity,test,docs]"
}

summary() {  # one line per environment there is
  local v
  for v in .venv .venv-paddle .venv-latest; do
    [ -x "$v/bin/python" ] || continue
    say "$v: $("$v/bin/python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)' 2>/dev/null | tail -1)"
  done
}

main() {  # main [demo|latest|all|system]
  local what=${1:-all}
  case "$what" in
    demo) setup_legacy ;;
    latest) setup_latest ;;
    all) setup_legacy; setup_paddle; setup_latest; ensure_chromium ;;
    system)  # asked for: make both system changes now, where they are missing
      export GRADMGR_SYSTEM=${GRADMGR_SYSTEM:-yes}
      local py; py=$(ensure_legacy_python)
      say "old Python for .venv: $py"
      ensure_chromium
      return ;;
    *) die "unknown set-up '$what': demo, latest, all or system" ;;
  esac
  summary
  say "done ($what)"
}

# Sourced (tests/test_setup_script.py), it only defines the functions.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
