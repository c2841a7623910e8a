# The two quick-start commands: `make demo` and `make test`. Both install what they need first.
# Torch: the CPU build torch==2.13.0 by default (pip takes it from this machine's disk here, and never a
# multi-GB CUDA build). For a GPU: make install TORCH_SPEC="torch==2.13.0" TORCH_INDEX_URL=<a CUDA wheel index>
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stepscope-installed

.PHONY: install demo test lint bench

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/stepscope demo

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q -p no:cacheprovider

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
