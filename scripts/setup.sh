#!/usr/bin/env bash
# Sets up gradmgr's two development environments; safe to run again (it then only checks).
#   .venv         CPython 3.8-3.10 with torch 2.8.0 + megengine 1.13.0 (MegEngine has no newer wheels)
#   .venv-latest  the machine's python3 with the newest cheap PyTorch (torch 2.13.0, CPU build)
#                 and the docs tools (mkdocs); Chromium for the docs' browser test (apt, as root)
# Environment: GRADMGR_PYTHON names a CPython 3.8-3.10 to use for .venv;
#              GRADMGR_LATEST_PYTHON the interpreter for .venv-latest (default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
LEGACY_TORCH="torch==2.8.0"
LATEST_TORCH="${GRADMGR_LATEST_TORCH:-torch==2.13.0}"
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }

is_legacy_python() {  # true if "$1" runs and is CPython 3.8-3.10
  "$1" -c 'import sys, platform; sys.exit(not (platform.python_implementation() == "CPython" and (3, 8) <= sys.version_info[:2] <= (3, 10)))' >/dev/null 2>&1
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
  # Interpreters that exist but are not on PATH (pyenv installs, Debian's /usr/bin).
  local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  for c in "$pyenv_root"/versions/3.10*/bin/python3.10 "$pyenv_root"/versions/3.9*/bin/python3.9 \
           "$pyenv_root"/versions/3.8*/bin/python3.8 /usr/bin/python3.10 /usr/bin/python3.9 /usr/bin/python3.8; do
    if [ -x "$c" ] && is_legacy_python "$c"; then echo "$c"; return; fi
  done
  return 1
}

install_bullseye_python39() {
  # Debian bookworm has no python3.8-3.10; bullseye's python3.9 installs cleanly beside it.
  local sources=/etc/apt/sources.list.d/gradmgr-bullseye.sources
  local pin=/etc/apt/preferences.d/gradmgr-bullseye
  local uri keyring
  uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  keyring=$(awk '/^Signed-By:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  uri=${uri:-http://deb.debian.org/debian}
  keyring=${keyring:-/usr/share/keyrings/debian-archive-keyring.gpg}
  say "No CPython 3.8-3.10 found. CHANGING THIS MACHINE: adding Debian's bullseye suite ($sources),"
  say "pinned at priority 100 ($pin) so it never wins for other packages, to install python3.9."
  printf 'Types: deb\nURIs: %s\nSuites: bullseye\nComponents: main\nSigned-By: %s\n' "$uri" "$keyring" >"$sources"
  printf 'Package: *\nPin: release n=bullseye\nPin-Priority: 100\n' >"$pin"
  apt_install -t bullseye python3.9
  # bullseye's python3-distutils would replace bookworm's package of the same name; unpack its files only.
  local tmp; tmp=$(mktemp -d)
  (cd "$tmp" && with_retries 3 "apt-get download python3-distutils" apt-get download -q python3-distutils/bullseye \
     && dpkg-deb -x python3-distutils_*.deb /)
  rm -rf "$tmp"
  say "Installed /usr/bin/python3.9 from bullseye (plus its libssl1.1, libffi7, libmpdec3); nothing removed."
}

ensure_legacy_python() {
  local py
  if py=$(find_legacy_python); then echo "$py"; return; fi
  if [ -r /etc/debian_version ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    install_bullseye_python39 >&2
    py=$(find_legacy_python) || die "python3.9 from bullseye did not install as expected"
    echo "$py"; return
  fi
  die "MegEngine needs CPython 3.8, 3.9 or 3.10 and none was found. Install one (e.g. 'pyenv install 3.9'), then run again, or set GRADMGR_PYTHON=/path/to/python3.9."
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

ensure_chromium() {  # the docs' browser test (tests/docs/test_docs_site.py) drives Chromium
  local c
  for c in chromium chromium-browser google-chrome; do
    if command -v "$c" >/dev/null 2>&1; then say "Chromium for the docs' browser test: $(command -v "$c")"; return; fi
  done
  if [ -r /etc/debian_version ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "No Chromium found; the docs' browser test needs one. CHANGING THIS MACHINE: installing Debian's chromium package with apt-get."
    apt_install chromium
    say "Installed $(command -v chromium) ($(chromium --version 2>/dev/null | head -1))"
    return
  fi
  say "WARNING: no Chromium on PATH, and this is not Debian run as root: install Chromium (as 'chromium'), or the docs' browser test fails."
}

main() {
  LEGACY_PY=$(ensure_legacy_python)
  setup_env .venv "$LEGACY_PY" "torch, megengine, gradmgr" \
    "$LEGACY_TORCH" -e ".[megengine,test,demo]"
  setup_env .venv-latest "${GRADMGR_LATEST_PYTHON:-python3}" "torch, gradmgr, mkdocs, mkdocstrings" \
    "$LATEST_TORCH" -e ".[test,docs]"
  ensure_chromium
  say "done: .venv ($(.venv/bin/python -c 'import sys,torch,megengine;print("python",sys.version.split()[0],"torch",torch.__version__,"megengine",megengine.__version__)' 2>/dev/null | tail -1)), .venv-latest ($(.venv-latest/bin/python -c 'import sys,torch;print("python",sys.version.split()[0],"torch",torch.__version__)'))"
}

# Sourced (tests/test_setup_script.py), it only defines the functions.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
