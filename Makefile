# The two commands a fresh machine needs: `make demo` and `make test`.
# Each creates .venv under the repo and installs what it needs (idempotent, stamp-based).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.optserve-dev-installed
# torch first, pinned: 2.13.0 is a CPU build that lies on disk; an open range downloads CUDA.
TORCH  := torch==2.13.0

.PHONY: demo test bench protos clean gpu-wheels gpu-check gpu-check-dry

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/optserve demo

# Two passes (tests/conftest.py): the modules that can share the machine on two workers (a module
# with module-scoped fixtures whole, every other test alone, longest first: tests/_scheduling.py),
# then the serial ones alone; the exit status fails if either failed.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadscope -m "not serial" --durations=20; parallel=$$?; \
	$(PY) -m pytest -q -m serial --durations=10; serial=$$?; \
	test $$parallel -eq 0 && test $$serial -eq 0

bench: $(STAMP)
	$(PY) -m bench

protos: $(STAMP)
	$(PY) scripts/generate_protos.py

# The GPU kit (docs/gpu.md). Here, with PyPI: the wheels a lent device lacks (.gpu-wheels, < 60 MiB).
gpu-wheels: $(STAMP)
	$(PY) scripts/gpu_wheels.py --python-version 3.12 --out .gpu-wheels

# On the lent device (its own python3, no venv; carry .gpu-wheels): install, GPU tests, bench, docs/gpu.md.
gpu-check:
	python3 -m bench.gpu_check

# Here: the same end to end with the GPU rehearsed (JAX on the CPU), the wheels built for this Python.
gpu-check-dry: $(STAMP)
	$(PY) scripts/gpu_wheels.py --python-version $$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])') --out .gpu-wheels-here
	$(PY) -m bench.gpu_check --cpu --small --wheels .gpu-wheels-here --out /tmp/optserve-gpu-dry-run.md

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
