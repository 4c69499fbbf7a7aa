#!/usr/bin/env bash
# Runs lint (ruff), the type check (mypy on gradmgr/) and the whole test suite in both
# environments made by scripts/setup.sh:
#   .venv         torch 2.8 + megengine 1.13: every test
#   .venv-paddle  PaddlePaddle 3.3.1 (.venv's packages lent): the Paddle suite (PADDLE_TESTS)
#   .venv-latest  torch 2.13: core and torch tests, and the docs site's; MegEngine tests are
#                 deselected there (and the docs site's in .venv, which has no docs tools)
# In each environment a test skipped for a reason not starting with "CUDA" counts as a failure
# (GRADMGR_STRICT_SKIPS, see tests/conftest.py). Exits non-zero if lint or either run failed.
# Extra arguments go to both pytest runs, e.g. scripts/run_tests.sh -k backward -x
# Each run lists its 25 slowest tests (--durations=25); the summary ends with the total time.
# scripts/run_tests.sh --fast (make test-fast): lint, then FAST_TESTS below in .venv-latest
# only: the core and one distributed smoke, for the inner loop (CONTRIBUTING.md, "Test map").
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
# The Paddle suite (.venv-paddle): its contract leg, its backend's tests, its data parallel
# (the data-parallel contract's Paddle leg too),
# the parity tool against torch and MegEngine (which .venv-paddle imports too), its example
# training loop and demo, and its doc blocks.
PADDLE_TESTS=(tests/test_contract.py tests/test_edges.py tests/test_paddle_backend.py
              tests/test_paddle_distributed.py tests/test_dp_contract.py
              tests/differential/test_paddle_differential.py tests/test_env_command.py tests/test_parity_paddle.py
              tests/test_parity_paddle_functional.py tests/test_docstrings.py
              tests/docs/test_doc_blocks.py tests/test_examples.py tests/test_paddle_ports.py
              tests/test_paddle_bucket_fill.py
              -k paddle)
FAST_TESTS=(tests/test_core.py tests/test_edges.py tests/test_dp_contract.py
            tests/test_logging.py -m "not slow")

bold() { printf '\n\033[1m%s\033[0m\n' "$*"; }
status=0
summaries=()

bold "== lint: ruff check ."
if .venv-latest/bin/ruff check .; then
  summaries+=("lint: ruff check passed")
else
  status=1; summaries+=("lint: ruff check FAILED")
fi

bold "== types: mypy (the library, [tool.mypy] in pyproject.toml)"
if .venv-latest/bin/python -m mypy; then
  summaries+=("types: mypy passed")
else
  status=1; summaries+=("types: mypy FAILED")
fi

run_env() {  # run_env VENV FRAMEWORKS DOCS(0|1) [PYTEST-ARGS...]
  local venv=$1 frameworks=$2 docs=$3 log rc line; shift 3
  if [ ! -x "$venv/bin/python" ]; then
    status=1; summaries+=("$venv: MISSING (run make setup)"); return
  fi
  bold "== $venv (frameworks expected: $frameworks)"
  "$venv/bin/python" - <<'PY' 2>/dev/null
import importlib, sys
print("python   ", sys.version.split()[0], sys.executable)
for name in ("torch", "megengine", "paddle", "mkdocs"):
    try:
        print(f"{name:<9}", importlib.import_module(name).__version__)
    except ImportError:
        print(f"{name:<9}", "not installed")
PY
  log=$(mktemp)
  GRADMGR_FRAMEWORKS=$frameworks GRADMGR_DOCS=$docs GRADMGR_STRICT_SKIPS=1 PYTHONDONTWRITEBYTECODE=1 \
    "$venv/bin/python" -m pytest -p no:cacheprovider -q -ra --durations=25 "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  line=$(grep -E '^(=+ )?(no tests ran|[0-9]+ [a-z]+).* in [0-9.]+s' "$log" | tail -1)
  summaries+=("$venv ($frameworks): ${line:-no pytest summary line} [exit $rc]")
  rm -f "$log"
  [ "$rc" = 0 ] || status=1
}

if [ "${1:-}" = "--fast" ]; then
  shift
  run_env .venv-latest torch 0 "${FAST_TESTS[@]}" "$@"
else
  run_env .venv torch,megengine 0 tests "$@"
  run_env .venv-paddle paddle,torch,megengine 0 "${PADDLE_TESTS[@]}" "$@"
  run_env .venv-latest torch 1 tests "$@"
fi

bold "== summary"
printf '%s\n' "${summaries[@]}"
elapsed=$((SECONDS - started))
printf 'total time: %dm %02ds\n' $((elapsed / 60)) $((elapsed % 60))
if [ "$status" = 0 ]; then bold "ALL PASSED"; else bold "FAILED"; fi
exit "$status"
