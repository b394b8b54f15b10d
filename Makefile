# The two commands of the README. Each works in a virtualenv: the one $(PY) already runs in (an active venv),
# else .venv in the repository, made with `$(PY) -m venv --system-site-packages` (so packages the machine already
# has, torch included, are used as they are). Where that environment has no torch, the CPU build of torch is
# installed (a console line says so): from pip's own sources (its find-links or a local index, `pip config list`) when
# they hold torch's CPU wheel, else from PyTorch's CPU index, which is first probed for $(PROBE_TIMEOUT) s: without an
# answer, one line says to install torch first and make stops (pip would retry every file for minutes). Then archer,
# editable, with its dependencies.
PY ?= python3
TORCH = torch==2.13.0
TORCH_INDEX = https://download.pytorch.org/whl/cpu
# seconds the torch step waits for pip's sources and PyTorch's CPU index to answer
PROBE_TIMEOUT = 5
# pytest processes side by side in `make test` (CI's machine has 2 cores)
TEST_WORKERS ?= 2
# the environment $(PY) runs in when it is a virtualenv (sys.prefix differs from the base interpreter's), else .venv
ACTIVE := $(shell $(PY) -c "import sys; print(sys.prefix if sys.prefix != sys.base_prefix else '')" 2>/dev/null)
VENV := $(if $(ACTIVE),$(ACTIVE),$(CURDIR)/.venv)
BIN := $(VENV)/bin

.PHONY: venv torch install quickstart test

venv:
	@test -x $(BIN)/python || { echo "make: creating the virtualenv $(VENV) (packages of $(PY) stay visible)"; \
	  $(PY) -m venv --system-site-packages $(VENV) 2>/dev/null \
	  || { rm -rf $(VENV) && $(PY) -m venv --system-site-packages --without-pip $(VENV) \
	       && $(BIN)/python -m pip --version >/dev/null 2>&1; } \
	  || { echo "make: $(PY) cannot make a virtualenv with pip (Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }; }
	@echo "make: using the virtualenv $(VENV) (run '. $(BIN)/activate' to have archer on your PATH)"

torch: venv
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
	  echo "make: torch is in $(VENV) already: not installing it"; \
	elif $(BIN)/python -m pip install -q --dry-run --no-deps --ignore-installed --retries 0 --timeout $(PROBE_TIMEOUT) \
	     --report - $(TORCH) 2>/dev/null | grep -q '"version": "[^"]*+cpu"'; then \
	  echo "make: no torch in $(VENV): installing the CPU build of $(TORCH) that pip's own sources hold (pip config list)"; \
	  $(BIN)/python -m pip install -q $(TORCH); \
	elif $(BIN)/python -c "import urllib.request; urllib.request.urlopen('$(TORCH_INDEX)/torch/', timeout=$(PROBE_TIMEOUT))" 2>/dev/null; then \
	  echo "make: no torch in $(VENV): installing the CPU build of $(TORCH) from $(TORCH_INDEX) (about 650 MB installed)"; \
	  $(BIN)/python -m pip install -q --index-url $(TORCH_INDEX) $(TORCH); \
	else \
	  echo "make: no torch in $(VENV), and $(TORCH_INDEX) does not answer: install torch first ($(BIN)/python -m pip install $(TORCH) from a wheel or an index you can reach), then run make again"; \
	  exit 1; \
	fi

install: torch
	$(BIN)/python -m pip install -q -e .

quickstart: install
	$(BIN)/archer quickstart

test: torch
	$(BIN)/python -m pip install -q -e ".[test]"
	test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)
	$(BIN)/python -m ruff check archer tests bench
	# the documentation site (mkdocs.yml), into build/site: a broken link or a missing page fails
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet
	# two workers (pytest-xdist), then the tests that time wall-clock bounds alone (marked serial); the slowest
	# tests are listed at the end, to keep the suite in CI's budget as it grows
	PATH="$(BIN):$$PATH" $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not serial" --durations=15
	PATH="$(BIN):$$PATH" $(BIN)/python -m pytest -q -m serial
