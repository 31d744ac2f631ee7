# Two commands on a fresh machine: `make bench` (the main job) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: bench test list patterns lint clean peers peers-ft performance

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch is pinned: 2.13.0 is the local CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[cli,dev,hf]"
	touch $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/attnzoo bench

list: $(STAMP)
	$(VENV)/bin/attnzoo list

patterns: $(STAMP)
	$(VENV)/bin/attnzoo patterns

# The suite with the CPU backend, then the mechanisms' tests with every override off
# (ATTNZOO_FAST=0: the portable code, as a GPU runs it); the files that run both paths themselves
# (NaN containment, precision, compile) or test no mechanism's code, once.
PORTABLE_TESTS = tests/test_differential.py tests/test_nn.py $(filter-out tests/test_cli.py tests/test_readme.py \
	tests/test_layers.py tests/test_differential.py tests/test_nn.py tests/test_swap.py tests/test_hf.py \
	tests/test_nan_containment.py tests/test_precision.py tests/test_compile.py tests/test_progress.py \
	tests/test_edge_inputs.py tests/test_machine.py,$(wildcard tests/test_*.py))

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest
	ATTNZOO_FAST=0 $(PY) -m pytest $(PORTABLE_TESTS)

# Peers for benchmarks/peers.py: the `peers` group of pyproject.toml, each with --no-deps
# (their small dependencies are listed in the group by name), so torch 2.13.0 never moves.
GROUP = $(PY) -c "import sys, tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'][sys.argv[1]]))"

$(VENV)/.peers: $(STAMP)
	$(PY) -m pip install --quiet --no-deps $$($(GROUP) peers)
	touch $@

peers: $(VENV)/.peers

# fast-transformers' setup.py imports torch (no build isolation) and adds CUDA extensions when an
# nvcc is on PATH; with no CUDA torch here, nvcc's folder is left off PATH so only the CPU ones build.
$(VENV)/.peers-ft: $(VENV)/.peers
	$(PY) -m pip install --quiet wheel ninja
	env PATH="$$(printf '%s' "$$PATH" | tr ':' '\n' | grep -vxF "$$(dirname "$$(command -v nvcc || echo /none/nvcc)")" | paste -sd: -)" \
	  MAX_JOBS=2 $(PY) -m pip install --quiet --no-deps --no-build-isolation $$($(GROUP) peers-ft)
	touch $@

peers-ft: $(VENV)/.peers-ft

performance: $(VENV)/.peers
	$(PY) benchmarks/peers.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) bench-results patterns
