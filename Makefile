# Two commands on a fresh machine: `make bench` (the main job) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: bench test list patterns lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch is pinned: 2.13.0 is the local CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/attnzoo bench

list: $(STAMP)
	$(VENV)/bin/attnzoo list

patterns: $(STAMP)
	$(VENV)/bin/attnzoo patterns

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) bench-results patterns
