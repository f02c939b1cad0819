# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first;
# setup is skipped when pyproject.toml and constraints.txt have not changed.
PYTHON ?= python3
VENV   ?= .venv
PIP_FLAGS ?= -q
# Extra pip arguments, e.g. TORCH_INDEX=--extra-index-url=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
BIN := $(VENV)/bin

.PHONY: setup setup-test demo test lint clean gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install $(PIP_FLAGS) $(TORCH_INDEX) -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install $(PIP_FLAGS) $(TORCH_INDEX) -c constraints.txt -e '.[test]'
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

demo: setup
	$(BIN)/stalwart demo

# Lint first: style (ruff check + format) and the layered-import contracts (import-linter, pyproject.toml).
lint: setup-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports

# Two test processes (pytest-xdist), one module each at a time: most e2e time is waiting on real
# processes (restarts, heartbeats, keepers), so two modules share the 2 cores CI has. PYTEST_JOBS=0: serial.
PYTEST_JOBS ?= 2
test: lint
	$(BIN)/python -m pytest $(if $(filter 0,$(PYTEST_JOBS)),,-n $(PYTEST_JOBS) --dist loadfile) $(PYTEST_ARGS)

# On a CUDA machine: tests/gpu + benchmarks/gpu_step.py, one summary (docs/gpu.md). Where stalwart's
# dependencies are already installed (the lent GPU machines), skip the venv: make gpu-check GPU_PY=python3
GPU_PY ?= $(BIN)/python
gpu-check:
	PYTHONPATH=src:.:$$PYTHONPATH $(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs data/prepared .pytest_cache
