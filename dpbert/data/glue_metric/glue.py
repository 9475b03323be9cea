"""GLUE metric as a local `evaluate` module: the Hub's `glue` metric, offline.

Load it with `evaluate.load(path_to_this_file, config_name)` (dpbert: `dpbert.data.glue_metrics.
load_glue_metric(config_name)`): no network access. Config names and outputs are those of the Hub's
`evaluate-metric/glue` module:

    cola                                        -> {"matthews_correlation": float}
    stsb                                        -> {"pearson": float, "spearmanr": float}
    mrpc, qqp                                   -> {"accuracy": float, "f1": float}
    sst2, mnli, mnli_matched, mnli_mismatched,
    qnli, rte, wnli, hans                       -> {"accuracy": float}

As on the Hub, predictions and references are int64 class ids, except for stsb where they are
float32 scores (so the correlations are those of the float32 values); f1 is binary with positive
class 1; every value is a Python float in the metric's own range (accuracy and f1 in [0, 1],
correlations in [-1, 1]), not a percentage. Computed with scikit-learn and scipy.

This file is package data of dpbert (`dpbert/data/glue_metric/glue.py`); it imports only
`evaluate`, `datasets`, scikit-learn and scipy, so `evaluate` can copy it into its module cache.
"""

import datasets
import evaluate
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

_CITATION = """\
@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  note={In the Proceedings of ICLR.},
  year={2019}
}
"""

_DESCRIPTION = """\
GLUE, the General Language Understanding Evaluation benchmark (https://gluebenchmark.com/), is a
collection of resources for training, evaluating and analyzing natural language understanding
systems. This module computes the official metric of each GLUE task (dpbert's offline copy of the
Hub's `glue` metric: same config names, same outputs).
"""

_KWARGS_DESCRIPTION = """
Compute the GLUE metric of a task (the config name).
Args:
    predictions: predicted class ids (int), or scores (float) for stsb.
    references: gold class ids (int), or gold scores (float) for stsb.
Returns: depending on the config name,
    "accuracy": fraction of correct predictions;
    "f1": binary F1 of class 1;
    "pearson": Pearson correlation;
    "spearmanr": Spearman rank correlation;
    "matthews_correlation": Matthews correlation coefficient.
Examples:

    >>> glue_metric = evaluate.load("dpbert/data/glue_metric/glue.py", "mrpc")
    >>> results = glue_metric.compute(predictions=[0, 1], references=[0, 1])
    >>> print(results)
    {'accuracy': 1.0, 'f1': 1.0}
"""

CONFIG_NAMES = (
    "sst2", "mnli", "mnli_mismatched", "mnli_matched", "cola", "stsb", "mrpc", "qqp", "qnli", "rte", "wnli",
    "hans",
)  # fmt: skip
ACCURACY_ONLY = ("sst2", "mnli", "mnli_mismatched", "mnli_matched", "qnli", "rte", "wnli", "hans")


def simple_accuracy(preds, labels):
    return float((preds == labels).mean())


def acc_and_f1(preds, labels):
    return {"accuracy": simple_accuracy(preds, labels), "f1": float(f1_score(y_true=labels, y_pred=preds))}


def pearson_and_spearman(preds, labels):
    return {"pearson": float(pearsonr(preds, labels)[0]), "spearmanr": float(spearmanr(preds, labels)[0])}


def _unknown(config_name):
    return KeyError(
        f"glue metric: unknown config name {config_name!r}; expected one of "
        f'["sst2", "mnli", "mnli_mismatched", "mnli_matched", "cola", "stsb", "mrpc", "qqp", "qnli", "rte", '
        f'"wnli", "hans"]'
    )


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name not in CONFIG_NAMES:
            raise _unknown(self.config_name)
        dtype = "float32" if self.config_name == "stsb" else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value(dtype), "references": datasets.Value(dtype)}),
            codebase_urls=[],
            reference_urls=[],
            format="numpy",
        )

    def _compute(self, predictions, references):
        if self.config_name == "cola":
            return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
        if self.config_name == "stsb":
            return pearson_and_spearman(predictions, references)
        if self.config_name in ("mrpc", "qqp"):
            return acc_and_f1(predictions, references)
        if self.config_name in ACCURACY_ONLY:
            return {"accuracy": simple_accuracy(predictions, references)}
        raise _unknown(self.config_name)
