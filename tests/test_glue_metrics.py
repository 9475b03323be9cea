"""dpbert's GLUE metric as a local `evaluate` module: loaded offline, checked against scikit-learn
and scipy on fixtures for every config name of the Hub's `glue` metric."""

from __future__ import annotations

import socket
import warnings

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from dpbert.data import glue
from dpbert.data.glue_metrics import CONFIG_NAMES, compute_metrics, load_glue_metric, metric_script

# The Hub's `glue` metric: config name -> the keys it returns.
HUB_OUTPUTS = {
    "cola": ("matthews_correlation",),
    "stsb": ("pearson", "spearmanr"),
    "mrpc": ("accuracy", "f1"),
    "qqp": ("accuracy", "f1"),
    **{name: ("accuracy",) for name in
       ("sst2", "mnli", "mnli_mismatched", "mnli_matched", "qnli", "rte", "wnli", "hans")},
}  # fmt: skip
NUM_CLASSES = {"mnli": 3, "mnli_matched": 3, "mnli_mismatched": 3}


def _reference(config: str, preds: np.ndarray, refs: np.ndarray) -> dict[str, float]:
    """The metric computed directly with scikit-learn / scipy (STS-B on float32 values, as the
    module's features declare, like the Hub's)."""
    if config == "stsb":
        p, r = preds.astype(np.float32), refs.astype(np.float32)
        return {"pearson": float(pearsonr(p, r)[0]), "spearmanr": float(spearmanr(p, r)[0])}
    out = {"accuracy": float(accuracy_score(refs, preds))}
    if config in ("mrpc", "qqp"):
        out["f1"] = float(f1_score(refs, preds))
    if config == "cola":
        return {"matthews_correlation": float(matthews_corrcoef(refs, preds))}
    return out


def _fixtures(config: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(sum(map(ord, config)))
    if config == "stsb":
        refs = rng.uniform(0, 5, 200)
        return [
            ("random", rng.uniform(0, 5, 200), refs),
            ("correlated", np.clip(refs + rng.normal(0, 0.7, 200), 0, 5), refs),
            ("anti-correlated", 5 - refs, refs),
            ("ties", np.round(refs), refs),
        ]
    k = NUM_CLASSES.get(config, 2)
    refs = rng.integers(0, k, 300)
    noisy = np.where(rng.random(300) < 0.7, refs, rng.integers(0, k, 300))
    return [
        ("random", rng.integers(0, k, 300), refs),
        ("mostly right", noisy, refs),
        ("perfect", refs.copy(), refs),
        ("all wrong", (refs + 1) % k, refs),
        ("tiny", np.array([1, 0, 1, 1]), np.array([1, 0, 0, 1])),
    ]


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_every_config_matches_sklearn_and_scipy(config):
    metric = load_glue_metric(config)
    for label, preds, refs in _fixtures(config):
        got = metric.compute(predictions=preds, references=refs)
        assert tuple(sorted(got)) == tuple(sorted(HUB_OUTPUTS[config])), (config, label)
        assert all(type(v) is float for v in got.values()), (config, label, got)
        assert got == pytest.approx(_reference(config, preds, refs), rel=1e-12, abs=1e-12), (config, label)
        if config == "stsb":  # float32 inputs, as on the Hub: within float32 rounding of the float64 values
            exact = {"pearson": pearsonr(preds, refs)[0], "spearmanr": spearmanr(preds, refs)[0]}
            assert got == pytest.approx(exact, rel=1e-5), label


def test_hand_computed_values():
    preds, refs = [1, 0, 1, 1], [1, 0, 0, 1]
    # TP=2 TN=1 FP=1 FN=0: accuracy 3/4, F1 = 2PR/(P+R) with P=2/3, R=1 -> 0.8, MCC = 2/sqrt(12).
    assert load_glue_metric("mrpc").compute(predictions=preds, references=refs) == pytest.approx(
        {"accuracy": 0.75, "f1": 0.8}
    )
    assert load_glue_metric("cola").compute(predictions=preds, references=refs) == pytest.approx(
        {"matthews_correlation": 2 / np.sqrt(12)}
    )
    got = load_glue_metric("stsb").compute(predictions=[1.0, 2.0, 3.0, 4.0], references=[2.0, 1.0, 4.0, 3.0])
    assert got["spearmanr"] == pytest.approx(0.6)  # 1 - 6 * 4 / (4 * 15)


def test_degenerate_inputs_behave_like_sklearn_and_scipy():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # A constant prediction: MCC 0 (sklearn's convention), F1 0 when class 1 is never predicted.
        got = load_glue_metric("cola").compute(predictions=[0, 0, 0, 0], references=[0, 1, 0, 1])
        assert got == {"matthews_correlation": 0.0}
        got = load_glue_metric("qqp").compute(predictions=[0, 0, 0, 0], references=[0, 1, 0, 1])
        assert got == {"accuracy": 0.5, "f1": 0.0}
        # A constant score has no correlation: NaN, as scipy says.
        got = load_glue_metric("stsb").compute(predictions=[2.0, 2.0, 2.0], references=[1.0, 2.0, 3.0])
        assert np.isnan(got["pearson"]) and np.isnan(got["spearmanr"])


def test_loads_offline_from_the_package(monkeypatch):
    import evaluate

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access while loading the GLUE metric: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)
    script = metric_script()
    assert script.is_file() and script.parts[-3:] == ("data", "glue_metric", "glue.py")
    for config in CONFIG_NAMES:  # a fresh load, not the cached object
        metric = evaluate.load(str(script), config, keep_in_memory=True)
        assert metric.config_name == config and metric.name == "glue"
    with pytest.raises(KeyError, match="unknown config name"):
        evaluate.load(str(script), "squad", keep_in_memory=True)
    with pytest.raises(KeyError, match="unknown config name"):
        load_glue_metric("squad")


@pytest.mark.parametrize("name", sorted(glue.GLUE_TASKS))
def test_finetuning_reports_the_modules_figures(name):
    """`compute_metrics` (what fine-tuning reports) is the module's output under the task's names."""
    task = glue.get_task(name)
    assert task.name in CONFIG_NAMES and set(HUB_OUTPUTS[task.name]) == set(task.metric_names)
    for _, preds, refs in _fixtures(task.name):
        got = compute_metrics(task, preds, refs)
        assert list(got) == list(task.metric_names)
        assert got == pytest.approx(_reference(task.name, preds, refs), rel=1e-12, abs=1e-12)
    if not task.is_regression:
        with pytest.raises(ValueError, match="class ids"):
            compute_metrics(task, np.array([0.5, 1.0]), np.array([0, 1]))
    with pytest.raises(ValueError, match="predictions"):
        compute_metrics(task, np.array([1, 0]), np.array([1]))
