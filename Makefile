# The two commands a fresh machine needs: `make demo` and `make test`.
# Each creates .venv under the repo and installs what it needs (idempotent, stamp-based).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.optserve-dev-installed
# torch first, pinned: 2.13.0 is a CPU build that lies on disk; an open range downloads CUDA.
TORCH  := torch==2.13.0

.PHONY: demo test bench protos clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/optserve demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m bench

protos: $(STAMP)
	$(PY) scripts/generate_protos.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
