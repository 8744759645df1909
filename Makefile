# Developer entry points. Every target that runs code first makes sure .venv is set up.

PYTHON ?= python3
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
VENV_PIP := $(VENV)/bin/pip
# Stamp file: the venv is (re)provisioned only when it is missing or pyproject.toml changed.
VENV_STAMP := $(VENV)/.installed
# Installed on its own, before the package: a bare `torch` requirement resolved by
# pip on Linux would otherwise pull the multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help venv .venv demo test test-all bench clean distclean

help:
	@echo "make demo      train, save and generate with a small Trellis model"
	@echo "make test      run the test suite without slow checks (the CI command)"
	@echo "make test-all  run the whole test suite, slow checks included"
	@echo "make bench     run the CPU benchmark"
	@echo "make clean     remove build artefacts and caches (distclean also removes .venv)"

$(VENV_STAMP): pyproject.toml
	test -x $(VENV_PYTHON) || $(PYTHON) -m venv $(VENV)
	$(VENV_PIP) install '$(TORCH_SPEC)' $(TORCH_PIP_ARGS)
	$(VENV_PIP) install -e '.[test]'
	touch $@

venv .venv: $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(VENV_PYTHON) examples/demo.py

test: $(VENV_STAMP)
	$(VENV_PYTHON) -m pytest -m "not slow" -q

test-all: $(VENV_STAMP)
	$(VENV_PYTHON) -m pytest -q

bench: $(VENV_STAMP)
	$(VENV_PYTHON) benchmarks/bench_cpu.py

clean:
	rm -rf build dist .pytest_cache src/*.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
