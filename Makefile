# gradmgr: `make demo` sets up what the demo needs and runs it; `make test` sets up if needed
# and runs every test. Set-up is idempotent: when done it only checks (seconds). Nothing outside
# the checkout changes unless the machine lacks a CPython 3.8-3.10 (or, for `make test`,
# Chromium): scripts/setup.sh then says what it is about to install before it does, and how to
# avoid it (README.md, "Two commands").
.PHONY: help setup setup-demo setup-latest setup-system test test-fast lint demo docs bench clean distclean

help:
	@echo "make demo          set up .venv, then run examples/demo.py (in .venv-paddle, on three frameworks, where make setup built it)"
	@echo "make test          set up both environments (and Chromium), then lint and run every test"
	@echo "make test-fast     set up .venv-latest, then lint and run the core tests and one distributed smoke"
	@echo "make setup         create .venv (torch 2.8 + megengine 1.13) and .venv-latest (torch 2.13, docs tools)"
	@echo "make setup-system  only install what the set-up needs outside the checkout (python3.9, chromium)"
	@echo "make docs          set up .venv-latest, then build the documentation site into site/ (strict)"
	@echo "make lint          ruff check . and mypy (the library)"
	@echo "make bench         set up .venv, then run bench/run_all.py"
	@echo "make clean         remove caches and generated output (keeps the environments)"
	@echo "make distclean     clean, and remove the environments and pip's cache"

setup:
	bash scripts/setup.sh all

setup-demo:
	bash scripts/setup.sh demo

setup-latest:
	bash scripts/setup.sh latest

setup-system:
	bash scripts/setup.sh system

test: setup
	bash scripts/run_tests.sh

test-fast: setup-latest
	bash scripts/run_tests.sh --fast

lint: setup-latest
	.venv-latest/bin/ruff check .
	.venv-latest/bin/python -m mypy

# The demo trains on PaddlePaddle too where `make setup` built .venv-paddle (`make demo` alone
# does not download Paddle's 195 MB wheel).
demo: setup-demo
	@if [ -x .venv-paddle/bin/python ] && .venv-paddle/bin/python -c "import paddle, gradmgr" >/dev/null 2>&1; \
	then echo ".venv-paddle/bin/python examples/demo.py"; .venv-paddle/bin/python examples/demo.py; \
	else echo ".venv/bin/python examples/demo.py"; .venv/bin/python examples/demo.py; fi

docs: setup-latest
	.venv-latest/bin/python -m mkdocs build --strict --site-dir site

bench: setup-demo
	.venv/bin/python bench/run_all.py

clean:
	find . -path ./.venv -prune -o -path ./.venv-latest -prune -o -path ./.venv-paddle -prune -o -path ./.cache -prune -o \
		-name __pycache__ -type d -exec rm -rf {} +
	rm -rf .pytest_cache .ruff_cache .mypy_cache build dist demo_out site

distclean: clean
	rm -rf .venv .venv-latest .venv-paddle .cache
	@if [ -f .setup-system-changes ]; then \
		echo "make setup changed these outside the checkout (distclean leaves them; README.md says how to undo them):"; \
		sed 's/^/  /' .setup-system-changes; fi
