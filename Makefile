# The two quick-start commands: `make demo` and `make test`. Both install what they need first.
# Torch: torch==2.13.0 from PyTorch's CPU wheel index when it answers (a few seconds' probe), so that pip never
# pulls a multi-GB CUDA build; otherwise from pip's default index, and the line `torch: installed ...` says which
# build that gave. For a GPU: make install TORCH_INDEX_URL=<a CUDA wheel index>
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stepscope-installed

# Does the wheel index answer within a few seconds (a thread bounds the DNS lookup too)?
define PROBE
import sys, threading, urllib.request
ok = []
url = sys.argv[1].rstrip("/") + "/torch/"
t = threading.Thread(target=lambda: ok.append(urllib.request.urlopen(url, timeout=5).status), daemon=True)
t.start()
t.join(8)
sys.exit(0 if ok == [200] else 1)
endef
define SAY_TORCH
import warnings
warnings.filterwarnings("ignore")  # numpy arrives with the project, after torch
import torch
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
print(f"torch: installed {torch.__version__} ({build})")
endef
export PROBE SAY_TORCH

.PHONY: install browser demo test lint bench

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c "$$PROBE" "$(TORCH_INDEX_URL)" 2>/dev/null; then \
	  echo "torch: $(TORCH_SPEC) from $(TORCH_INDEX_URL)"; \
	  $(PY) -m pip install -q "$(TORCH_SPEC)" --index-url "$(TORCH_INDEX_URL)"; \
	else \
	  echo "torch: $(TORCH_INDEX_URL) does not answer; $(TORCH_SPEC) from pip's default index instead"; \
	  $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	fi
	@$(PY) -c "$$SAY_TORCH"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/stepscope demo

# The dashboard's browser test drives Debian's chromium; installed here where apt-get runs as root,
# otherwise that one test skips and says why.
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "browser: installing chromium with apt-get for the dashboard's browser test"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q chromium >/dev/null 2>&1 \
	    || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
	    || echo "browser: apt-get could not install chromium; the browser test will skip"; \
	else \
	  echo "browser: no chromium, and no apt-get as root to install it; the browser test will skip"; \
	fi

test: install browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q -p no:cacheprovider

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
