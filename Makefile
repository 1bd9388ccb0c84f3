# Two commands, both safe to repeat: `make demo` and `make test`.
# The first run creates .venv and installs; later runs reuse it (the stamp file is newer than
# pyproject.toml and the lock), so nothing is reinstalled unless the dependencies change.
# requirements/dev.lock pins every package at one version; `python -m tools.lock` writes it
# from pyproject.toml's pins (and the GPU image's and runtime env's installs from it).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sdtrain-installed

.PHONY: demo test test-fast test-gpu lint setup bytecode clean-runs

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/dev.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, at the lock's version: this takes the CPU build from the local wheel store,
	# where an unpinned torch (or one pulled in by another package) would be a multi-GB CUDA build.
	$(PY) -m pip install --quiet --disable-pip-version-check $$(grep '^torch==' requirements/dev.lock)
	# Then every other package at the lock's version, and this package with its extras on top.
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/dev.lock -e '.[test,trackers,preprocess]'
	touch $(STAMP)

# This package's modules compiled to bytecode, for every process that imports them. Where Python writes none itself
# (PYTHONDONTWRITEBYTECODE=1, as on this project's machines), each process compiled sdtrain's modules from source at
# each import: ~0.6 s of CPU a process, in every Ray worker, task and subprocess a run or the suite starts. Only files
# changed since the last run are compiled again.
bytecode: $(STAMP)
	$(PY) -m compileall -q src tests bench tools

demo: $(STAMP) bytecode
	$(PY) entrypoints/train.py

# Two lanes (pytest-xdist): every Ray run one after another in one, the other tests beside them, a file at a time
# (tests/conftest.py groups them). In one process the suite left 27% of two cores idle
# (bench/results/2026-11-30-suite.md).
LANES := -n 2 --dist loadgroup --no-loadscope-reorder

test: $(STAMP) bytecode
	$(PY) -m pytest $(LANES)

# The unit tier: everything but the tests marked slow (Ray runs, servers, compilation).
test-fast: $(STAMP) bytecode
	$(PY) -m pytest $(LANES) -m "not slow and not gpu"

# ruff's lint and format check and mypy's type check of src/ (settings for both in
# pyproject.toml); CI runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench entrypoints tools
	$(VENV)/bin/ruff format --check src tests bench entrypoints tools
	$(VENV)/bin/mypy

# On a machine with a CUDA GPU (docs/gpu.md): the training checks of tests/test_gpu.py.
test-gpu: $(STAMP) bytecode
	$(PY) -m pytest -m gpu

clean-runs:
	rm -rf runs .sdtrain-data
