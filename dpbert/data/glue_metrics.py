"""GLUE metrics through `evaluate`, offline: dpbert's GLUE metric is a local `evaluate` module.

`evaluate.load("glue", ...)` fetches its script from the Hub. dpbert ships the same metric as a local
module (package data, `dpbert/data/glue_metric/glue.py`): same config names and outputs as the Hub's
`glue` metric, computed with scikit-learn and scipy. `load_glue_metric(config)` loads it with
`evaluate.load(path, config)`, which never touches the network; `compute_metrics` (what fine-tuning
reports) goes through it.

cola: matthews_correlation; stsb: pearson, spearmanr (of float32 scores, as on the Hub); mrpc, qqp:
accuracy, f1 (binary, positive class 1); the others: accuracy. All values are Python floats in the
metric's natural range (accuracy and f1 in [0, 1], correlations in [-1, 1]), not percentages.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
from pathlib import Path
from typing import Any

import numpy as np

from dpbert.data.glue import GlueTask

# The `evaluate` config names of the Hub's GLUE metric (dpbert's nine tasks use their own names;
# mnli_matched / mnli_mismatched / hans are accepted as on the Hub).
CONFIG_NAMES = (
    "sst2", "mnli", "mnli_mismatched", "mnli_matched", "cola", "stsb", "mrpc", "qqp", "qnli", "rte", "wnli",
    "hans",
)  # fmt: skip
_METRIC_DIR = "glue_metric"
_METRIC_FILE = "glue.py"
# Keeps a copy of the module alive when dpbert is imported from a zip (a no-op on a filesystem).
_STACK = contextlib.ExitStack()


def metric_script() -> Path:
    """Path of the local `evaluate` module (package data of `dpbert.data`), from a checkout or a wheel."""
    resource = importlib.resources.files("dpbert.data").joinpath(_METRIC_DIR, _METRIC_FILE)
    if not resource.is_file():
        raise FileNotFoundError(f"{resource}: dpbert's GLUE metric module is missing from the installed package")
    # A package imported from a zip gives a non-filesystem path: copy it out once for `evaluate.load`.
    return Path(_STACK.enter_context(importlib.resources.as_file(resource)))


@functools.cache
def load_glue_metric(config_name: str) -> Any:
    """`evaluate.load(metric_script(), config_name)`: the GLUE metric of one config, loaded offline
    (kept in memory: no cache files are written when it computes). KeyError for an unknown config."""
    if config_name not in CONFIG_NAMES:
        raise KeyError(f"glue metric: unknown config name {config_name!r}; expected one of {list(CONFIG_NAMES)}")
    import evaluate  # deferred: 5-10 s at import (it imports datasets and more)

    return evaluate.load(str(metric_script()), config_name, keep_in_memory=True)


def compute_metrics(task: GlueTask, predictions: np.ndarray, references: np.ndarray) -> dict[str, float]:
    """Task metrics of `predictions` (class ids, or scores for STS-B) against `references`, computed by
    the local `evaluate` GLUE module under the task's config name."""
    preds = np.asarray(predictions)
    refs = np.asarray(references)
    if preds.shape != refs.shape or preds.ndim != 1 or len(preds) == 0:
        raise ValueError(
            f"predictions: expected a non-empty 1-D array shaped like references {refs.shape}, got {preds.shape}"
        )
    if not task.is_regression and not np.array_equal(preds, np.round(preds)):
        raise ValueError(f"predictions: expected class ids (integers) for {task.name}, got {preds[:5]!r}...")
    dtype = np.float32 if task.is_regression else np.int64
    result = load_glue_metric(task.name).compute(predictions=preds.astype(dtype), references=refs.astype(dtype))
    if set(result) != set(task.metric_names):
        raise ValueError(
            f"task {task.name}: the GLUE metric returned {sorted(result)}, expected {list(task.metric_names)}"
        )
    return {name: float(result[name]) for name in task.metric_names}


def predictions_from_logits(task: GlueTask, logits: np.ndarray) -> np.ndarray:
    """Class ids (argmax) for classification; the single output column for STS-B regression."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] != task.num_labels:
        raise ValueError(f"logits: expected [N, {task.num_labels}] for {task.name}, got {logits.shape}")
    return logits[:, 0] if task.is_regression else np.argmax(logits, axis=-1)
