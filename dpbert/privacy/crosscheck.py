"""A second opinion from jax-privacy (the optional extra `crosscheck`): its accountant recomputes a
ledger's epsilon, and its canary auditor scores an audit's canaries.

`jax_privacy_epsilon(ledger)` maps a ledger's stages to jax-privacy's `DpParams` and
`DpsgdTrainingAccountant`; `jax_privacy_user_level_epsilon` uses its user-level accountant for a
document-level ledger or a group of sequences; `jax_privacy_audit_figures` gives its AUROC, TPR at
low FPR and one-run bounds. dpbert never needs it: tests compare the two where it is installed,
and every figure of the auditor is empirical, never a guarantee. How the schedules are mapped
(and why batch sizes are passed as integers): docs/INTERNALS.md ("dpbert.privacy.crosscheck").
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

from dpbert.privacy.accounting import PLD_DISCRETIZATION, PrivacyLedger

EXTRA = "crosscheck"
MISSING = f"jax-privacy is not installed (pip install 'dpbert[{EXTRA}]' for the second-opinion figures)"
LOW_FPRS = (0.01, 0.001)


def jax_privacy_version() -> str | None:
    """The installed jax-privacy's version, or None when it is not installed (or does not import)."""
    try:
        import jax_privacy  # noqa: F401  # deferred: the optional crosscheck extra (152 ms at import)
    except ImportError:
        return None
    return importlib.metadata.version("jax-privacy")


def _require() -> None:
    if jax_privacy_version() is None:
        raise ImportError(MISSING)


def jax_privacy_params(ledger: PrivacyLedger | Mapping[str, Any]) -> Any:
    """The ledger's schedule as jax-privacy's `DpParams` (see the module docstring)."""
    _require()
    from jax_privacy.accounting import (  # deferred: the optional crosscheck extra (152 ms at import)
        DpParams,
        SamplingMethod,
    )

    if not isinstance(ledger, PrivacyLedger):
        ledger = PrivacyLedger.from_dict(ledger)
    if not ledger.stages:
        raise ValueError("ledger.stages: empty (nothing to account)")
    starts = np.cumsum([0] + [s.steps for s in ledger.stages])[:-1]
    params = DpParams(
        noise_multipliers=[(int(t), float(s.noise_multiplier)) for t, s in zip(starts, ledger.stages, strict=True)],
        num_samples=int(ledger.dataset_size),
        delta=float(ledger.delta),
        batch_size=int(ledger.stages[0].expected_batch_size),
        sampling_method=SamplingMethod.POISSON,
    )
    # The documented read-only `batch_sizes`: (first step, batch size) pairs, as exact integers.
    object.__setattr__(
        params, "batch_sizes",
        [(int(t), int(s.expected_batch_size)) for t, s in zip(starts, ledger.stages, strict=True)],
    )  # fmt: skip
    return params


def jax_privacy_epsilon(ledger: PrivacyLedger | Mapping[str, Any]) -> float:
    """Epsilon of the ledger at its delta, computed by jax-privacy's `DpsgdTrainingAccountant`."""
    _require()
    from jax_privacy.accounting import (  # deferred: the optional crosscheck extra (152 ms at import)
        DpsgdTrainingAccountant,
        PldAccountantConfig,
        RdpAccountantConfig,
    )

    if not isinstance(ledger, PrivacyLedger):
        ledger = PrivacyLedger.from_dict(ledger)
    if any(s.noise_multiplier == 0 for s in ledger.stages):
        return math.inf
    config = (
        PldAccountantConfig(value_discretization_interval=PLD_DISCRETIZATION)
        if ledger.accountant == "pld"
        else RdpAccountantConfig(orders=list(DEFAULT_RDP_ORDERS))
    )
    accountant = DpsgdTrainingAccountant(config)
    return float(accountant.compute_epsilon(ledger.total_steps, jax_privacy_params(ledger)))


def jax_privacy_user_level_epsilon(
    ledger: PrivacyLedger | Mapping[str, Any],
    group_size: int | None = None,
    *,
    discretization: float = PLD_DISCRETIZATION,
) -> float:
    """Epsilon at the ledger's delta from jax-privacy's `DpsgdTrainingUserLevelAccountant` (PLD at
    `discretization`): of one document for a document-level ledger (`group_size` None), of a group of
    `group_size` sequences for a sequence-level one (see the module docstring)."""
    _require()
    from jax_privacy.accounting import (  # deferred: the optional crosscheck extra (152 ms at import)
        DpsgdTrainingUserLevelAccountant,
        PldAccountantConfig,
    )

    if not isinstance(ledger, PrivacyLedger):
        ledger = PrivacyLedger.from_dict(ledger)
    if ledger.is_document_level == (group_size is not None):
        raise ValueError(
            "group_size: give it for a sequence-level ledger (a group of sequences) and only then; "
            "a document-level ledger's unit is already one document"
        )
    if any(s.noise_multiplier == 0 for s in ledger.stages):
        return math.inf
    params = jax_privacy_params(ledger)
    object.__setattr__(params, "examples_per_user", 1 if group_size is None else int(group_size))
    accountant = DpsgdTrainingUserLevelAccountant(PldAccountantConfig(value_discretization_interval=discretization))
    return float(accountant.compute_epsilon(ledger.total_steps, params))


def jax_privacy_audit_figures(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    fprs: Sequence[float] = LOW_FPRS,
) -> dict[str, Any]:
    """jax-privacy's `CanaryScoreAuditor` figures for canary `scores` (higher = guessed "in") and their
    inclusion bits: `auroc`, `tpr_at_fpr` ([{fpr, tpr}]), `epsilon_lower_bound` (one-run) and
    `epsilon_lower_bound_fdp` (f-DP one-run), both at significance 1 - confidence and `delta`."""
    _require()
    from jax_privacy.auditing import CanaryScoreAuditor  # deferred: the optional crosscheck extra (152 ms at import)

    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.ndim != 1 or scores.shape != included.shape or not included.any() or included.all():
        raise ValueError("scores/included: expected 1-D arrays of the same length with canaries both in and out")
    auditor = CanaryScoreAuditor(scores[included], scores[~included])
    significance = 1.0 - confidence
    tprs = np.atleast_1d(auditor.tpr_at_given_fpr(np.asarray(fprs, dtype=np.float64)))
    return {
        "version": jax_privacy_version(),
        "auroc": float(auditor.attack_auroc()),
        "tpr_at_fpr": [{"fpr": float(f), "tpr": float(t)} for f, t in zip(fprs, tprs, strict=True)],
        "epsilon_lower_bound": float(auditor.epsilon_one_run(significance, delta)),
        "epsilon_lower_bound_fdp": float(auditor.epsilon_one_run_fdp(significance, delta)),
        "confidence": confidence,
        "delta": delta,
        "method": (
            "jax_privacy.auditing.CanaryScoreAuditor: epsilon_one_run (Steinke, Nasr, Jagielski 2023; one-sided, "
            "Bonferroni over thresholds) and epsilon_one_run_fdp (Mahloujifar, Melis, Chaudhuri 2024; Gaussian "
            "trade-off curves)"
        ),
    }
