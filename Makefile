# gradmgr: `make demo` sets everything up and runs the main example; `make test` sets up if
# needed and runs every test. Set-up is idempotent: when done it only checks (seconds).
.PHONY: help setup test lint demo docs bench clean distclean

help:
	@echo "make demo       set up, then run examples/demo.py"
	@echo "make test       set up, then lint and run every test in both environments"
	@echo "make setup      create .venv (torch 2.8 + megengine 1.13) and .venv-latest (torch 2.13, docs tools)"
	@echo "make docs       set up, then build the documentation site into site/ (strict)"
	@echo "make lint       ruff check ."
	@echo "make bench      set up, then run bench/run_all.py"
	@echo "make clean      remove caches and generated output (keeps the environments)"
	@echo "make distclean  clean, and remove both environments"

setup:
	bash scripts/setup.sh

test: setup
	bash scripts/run_tests.sh

lint: setup
	.venv-latest/bin/ruff check .

demo: setup
	.venv/bin/python examples/demo.py

docs: setup
	.venv-latest/bin/python -m mkdocs build --strict --site-dir site

bench: setup
	.venv/bin/python bench/run_all.py

clean:
	find . -path ./.venv -prune -o -path ./.venv-latest -prune -o \
		-name __pycache__ -type d -exec rm -rf {} +
	rm -rf .pytest_cache .ruff_cache build dist demo_out site

distclean: clean
	rm -rf .venv .venv-latest
