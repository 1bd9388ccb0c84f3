# Two commands, both safe to repeat: `make demo` and `make test`.
# The first run creates .venv and installs; later runs reuse it (the stamp file is newer
# than pyproject.toml), so nothing is reinstalled unless the dependencies change.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sdtrain-installed

.PHONY: demo test test-fast test-gpu lint setup clean-runs

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: this takes the CPU build from the local wheel store, where
	# an unpinned torch (or one pulled in by another package) would be a multi-GB CUDA build.
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,trackers,preprocess]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) entrypoints/train.py

test: $(STAMP)
	$(PY) -m pytest

# The unit tier: everything but the tests marked slow (Ray runs, servers, compilation).
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu"

# ruff's lint and format check and mypy's type check of src/ (settings for both in
# pyproject.toml); CI runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench entrypoints tools
	$(VENV)/bin/ruff format --check src tests bench entrypoints tools
	$(VENV)/bin/mypy

# On a machine with a CUDA GPU (docs/gpu.md): the training checks of tests/test_gpu.py.
test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu

clean-runs:
	rm -rf runs .sdtrain-data
