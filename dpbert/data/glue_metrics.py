"""GLUE metrics with scikit-learn and scipy, under the names `evaluate`'s GLUE metric reports.

cola: matthews_correlation; stsb: pearson, spearmanr; mrpc, qqp: accuracy, f1 (binary, positive
class 1); the others: accuracy. All values are Python floats in the metric's natural range
(accuracy and f1 in [0, 1], correlations in [-1, 1]), not percentages.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

from dpbert.data.glue import GlueTask


def compute_metrics(task: GlueTask, predictions: np.ndarray, references: np.ndarray) -> dict[str, float]:
    """Task metrics of `predictions` (class ids, or scores for STS-B) against `references`."""
    preds = np.asarray(predictions)
    refs = np.asarray(references)
    if preds.shape != refs.shape or preds.ndim != 1 or len(preds) == 0:
        raise ValueError(f"predictions: expected a non-empty 1-D array shaped like references {refs.shape}, got {preds.shape}")
    out: dict[str, float] = {}
    for name in task.metric_names:
        if name == "accuracy":
            out[name] = float(np.mean(preds == refs))
        elif name == "f1":
            out[name] = float(f1_score(refs, preds))
        elif name == "matthews_correlation":
            out[name] = float(matthews_corrcoef(refs, preds))
        elif name == "pearson":
            out[name] = float(pearsonr(preds, refs)[0])
        elif name == "spearmanr":
            out[name] = float(spearmanr(preds, refs)[0])
        else:
            raise ValueError(f"task {task.name}: unknown metric {name!r}")
    return out


def predictions_from_logits(task: GlueTask, logits: np.ndarray) -> np.ndarray:
    """Class ids (argmax) for classification; the single output column for STS-B regression."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] != task.num_labels:
        raise ValueError(f"logits: expected [N, {task.num_labels}] for {task.name}, got {logits.shape}")
    return logits[:, 0] if task.is_regression else np.argmax(logits, axis=-1)
