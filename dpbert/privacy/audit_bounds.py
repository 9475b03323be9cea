"""Empirical lower bounds on epsilon from canaries in one training run.

The one-run audit of Steinke, Nasr and Jagielski (2023): `m` canaries each included with
probability 1/2; an auditor guesses "in" for the highest scores and "out" for the lowest;
`p_value` is the paper's Theorem 3 bound on the number of correct guesses of an (epsilon,
delta)-DP mechanism, and `epsilon_lower_bound` the largest epsilon it still rejects.
`audit_scores` also reports the f-DP bound (`dpbert.privacy.audit_fdp`) on the same guess counts.

Guarantees: with probability at least `confidence` a mechanism that is (epsilon, delta)-DP gives a
bound <= epsilon; the headline bound is Bonferroni-corrected over a fixed guess grid that depends
only on m and the confidence (the uncorrected maximum is reported separately). Pure numpy/scipy.
How tight it can be, and the algorithm: docs/INTERNALS.md ("dpbert.privacy.audit_bounds").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import scipy.special
import scipy.stats

from dpbert.privacy import crosscheck
from dpbert.privacy.audit_fdp import TradeOff, fdp_epsilon_lower_bound, largest_rejected_epsilon


def correct_guesses(scores: np.ndarray, included: np.ndarray, *, k_plus: int, k_minus: int) -> int:
    """Number of correct guesses when guessing "in" for the `k_plus` highest scores and
    "out" for the `k_minus` lowest (ties broken by canary index, which is independent of
    inclusion)."""
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    m = _check_scores(scores, included)
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise ValueError(
            f"k_plus/k_minus: expected non-negative integers with k_plus + k_minus <= {m} "
            f"canaries, got k_plus={k_plus}, k_minus={k_minus}"
        )
    order = np.argsort(scores, kind="stable")  # ascending
    lowest, highest = order[:k_minus], order[m - k_plus :]
    return int(included[highest].sum() + (~included[lowest]).sum())


def p_value(*, num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[at least `num_correct` correct out of `num_guesses`] under
    (epsilon, delta)-DP with `num_canaries` canaries (Theorem 3 of Steinke et al.)."""
    m, r, v = num_canaries, num_guesses, num_correct
    if not 0 <= v <= r <= m:
        raise ValueError(
            f"num_correct/num_guesses/num_canaries: expected 0 <= num_correct <= num_guesses "
            f"<= num_canaries, got {v}, {r}, {m}"
        )
    if not epsilon >= 0:
        raise ValueError(f"epsilon: expected a non-negative number, got {epsilon!r}")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta: expected a probability in [0, 1], got {delta!r}")
    q = float(scipy.special.expit(epsilon))  # accuracy of epsilon-DP randomized response
    tail = float(scipy.stats.binom.sf(v - 1, r, q))  # f(v) = P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    i = np.arange(1, v + 1)
    # f(v - i) - f(v) = P[v - i <= Binomial(r, q) <= v - 1], for i = 1..v.
    window = float(scipy.stats.binom.cdf(v - 1, r, q)) - scipy.stats.binom.cdf(v - i - 1, r, q)
    alpha = float(np.max(window / i))
    return min(tail + 2.0 * m * delta * alpha, 1.0)


def epsilon_lower_bound(
    *,
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    delta: float,
    significance: float = 0.05,
) -> float:
    """Largest epsilon (to ~1e-11 absolute) that `num_correct` of `num_guesses` rejects
    at level `significance`; 0.0 if not even epsilon = 0 is rejected."""
    if not 0 < significance < 1:
        raise ValueError(f"significance: expected a number in (0, 1), got {significance!r}")

    def rejected(eps: float) -> bool:
        return (
            p_value(
                num_canaries=num_canaries,
                num_guesses=num_guesses,
                num_correct=num_correct,
                epsilon=eps,
                delta=delta,
            )
            < significance
        )

    # delta only adds to the p-value: if pure DP at epsilon 0 is not rejected, nothing is.
    if (
        p_value(num_canaries=num_canaries, num_guesses=num_guesses, num_correct=num_correct, epsilon=0.0, delta=0.0)
        >= significance
    ):
        return 0.0
    return largest_rejected_epsilon(rejected)


def guess_grid(num_canaries: int, *, confidence: float = 0.95) -> tuple[tuple[int, int], ...]:
    """Fixed (k_plus, k_minus) candidates: r guesses for r on a doubling grid up to
    `num_canaries` (plus r = m), each as all-"in" and as an even "in"/"out" split.

    Sizes too small to ever give a positive bound are left out, since every candidate costs
    Bonferroni level: r guesses, all correct, reject epsilon = 0 only if 2^-r is below the
    per-candidate level, so r starts at the smallest power of two with
    2^-r < (1 - confidence) / (number of candidates of the full grid). Dropping candidates only
    raises the per-candidate level, so no dropped size could have helped. Depends on m and the
    confidence only, never on the scores.
    """
    m = num_canaries

    def grid(sizes: list[int]) -> list[tuple[int, int]]:
        return [c for r in sizes for c in ([(r, 0)] + ([(r - r // 2, r // 2)] if r >= 2 else []))]

    sizes = sorted({*(2**j for j in range(int(math.log2(m)) + 1)), m})
    level = (1.0 - confidence) / len(grid(sizes))
    useful = [r for r in sizes if 0.5**r < level]
    return tuple(grid(useful or sizes[-1:]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneRunAudit:
    """Result of a one-run audit.

    `epsilon_lower_bound` holds with probability >= `confidence` (Bonferroni over the
    `num_candidates` guess counts tried); `epsilon_lower_bound_max_over_k` is the paper's
    reported figure (max over the same candidates, each at the full level, no correction).
    `num_guesses`/`num_correct`/`k_plus`/`k_minus` describe the candidate that gave the
    corrected bound.

    `epsilon_lower_bound_fdp` is the f-DP one-run bound (`dpbert.privacy.audit_fdp`) of the same
    candidates at the same corrected level, for the `fdp_trade_off` family ("gaussian" when
    delta > 0, else "epsilon_delta": no Gaussian curve has delta 0); `fdp_*` describe its candidate.
    """

    epsilon_lower_bound: float
    epsilon_lower_bound_max_over_k: float
    confidence: float
    delta: float
    num_canaries: int
    num_included: int
    num_guesses: int
    num_correct: int
    k_plus: int
    k_minus: int
    num_candidates: int
    epsilon_lower_bound_fdp: float
    fdp_trade_off: TradeOff
    fdp_num_guesses: int
    fdp_num_correct: int
    fdp_k_plus: int
    fdp_k_minus: int

    def __post_init__(self) -> None:
        if not self.epsilon_lower_bound <= self.epsilon_lower_bound_max_over_k:
            raise ValueError(
                "epsilon_lower_bound: expected <= epsilon_lower_bound_max_over_k, got "
                f"{self.epsilon_lower_bound} > {self.epsilon_lower_bound_max_over_k}"
            )
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence: expected a number in (0, 1), got {self.confidence!r}")
        if not 0 <= self.num_correct <= self.num_guesses <= self.num_canaries:
            raise ValueError(
                "num_correct/num_guesses: expected 0 <= num_correct <= num_guesses <= "
                f"num_canaries, got {self.num_correct}, {self.num_guesses}, {self.num_canaries}"
            )

    def to_dict(self) -> dict[str, float | int | str]:
        return dataclasses.asdict(self)


def audit_scores(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    candidates: Sequence[tuple[int, int]] | None = None,
) -> OneRunAudit:
    """One-run epsilon lower bound from canary `scores` (higher = guessed "in") and the
    true inclusion bits, searching the (k_plus, k_minus) `candidates` (default
    `guess_grid(m)`)."""
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    m = _check_scores(scores, included)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: expected a number in (0, 1), got {confidence!r}")
    candidates = tuple(candidates) if candidates is not None else guess_grid(m, confidence=confidence)
    if not candidates:
        raise ValueError("candidates: expected at least one (k_plus, k_minus) pair, got none")
    significance = 1.0 - confidence
    trade_off: TradeOff = "gaussian" if delta > 0 else "epsilon_delta"
    best: tuple[float, int, int, int, int] | None = None
    best_fdp: tuple[float, int, int, int, int] | None = None
    best_uncorrected = 0.0
    for k_plus, k_minus in candidates:
        v = correct_guesses(scores, included, k_plus=k_plus, k_minus=k_minus)
        r = k_plus + k_minus
        kw = dict(num_canaries=m, num_guesses=r, num_correct=v, delta=delta)
        corrected = epsilon_lower_bound(**kw, significance=significance / len(candidates))
        best_uncorrected = max(best_uncorrected, epsilon_lower_bound(**kw, significance=significance))
        if best is None or corrected > best[0]:
            best = (corrected, r, v, k_plus, k_minus)
        fdp = fdp_epsilon_lower_bound(**kw, significance=significance / len(candidates), trade_off=trade_off)
        if best_fdp is None or fdp > best_fdp[0]:
            best_fdp = (fdp, r, v, k_plus, k_minus)
    assert best is not None and best_fdp is not None
    eps, r, v, k_plus, k_minus = best
    return OneRunAudit(
        epsilon_lower_bound=eps,
        epsilon_lower_bound_max_over_k=max(best_uncorrected, eps),
        confidence=confidence,
        delta=delta,
        num_canaries=m,
        num_included=int(included.sum()),
        num_guesses=r,
        num_correct=v,
        k_plus=k_plus,
        k_minus=k_minus,
        num_candidates=len(candidates),
        epsilon_lower_bound_fdp=best_fdp[0],
        fdp_trade_off=trade_off,
        fdp_num_guesses=best_fdp[1],
        fdp_num_correct=best_fdp[2],
        fdp_k_plus=best_fdp[3],
        fdp_k_minus=best_fdp[4],
    )


def _check_scores(scores: np.ndarray, included: np.ndarray) -> int:
    if scores.ndim != 1 or scores.shape != included.shape or scores.size == 0:
        raise ValueError(
            "scores/included: expected two non-empty 1-D arrays of the same length, got shapes "
            f"{scores.shape} and {included.shape}"
        )
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores: expected finite numbers, got NaN or infinity")
    return int(scores.size)


# ---------------------------------------------------------------- ROC figures (empirical)
#
# Besides the lower bound, an audit reports how well its scores separate members from non-members:
# the area under the ROC curve and the true-positive rate at low false-positive rates. Both are taken
# on the ROC curve's concave majorant (a guesser may randomize between two thresholds), the definition
# of jax-privacy's `CanaryScoreAuditor` (`attack_auroc`, `tpr_at_given_fpr`), against which
# tests/test_crosscheck.py compares them. They describe the attack, not the mechanism: empirical
# figures, never privacy guarantees.

LOW_FPRS = (0.01, 0.001)
EMPIRICAL = (
    "empirical: AUROC, TPR at low FPR and every epsilon lower bound are measured on the audit's canaries "
    "(lower bounds on epsilon at the stated confidence); none is a privacy guarantee"
)


def roc_hull(scores: np.ndarray, included: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vertices (false positives, true positives), as integer counts from (0, 0) to (out, in), of the
    concave majorant of the ROC curve of guessing "in" for every score >= a threshold."""
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    m = _check_scores(scores, included)
    n_in = int(included.sum())
    if n_in in (0, m):
        raise ValueError("included: expected canaries both in and out of the training set")
    order = np.argsort(-scores, kind="stable")
    s, inc = scores[order], included[order]
    tp, fp = np.cumsum(inc), np.cumsum(~inc)
    last = np.r_[s[1:] != s[:-1], True]  # one point per distinct score: ties move together
    points = [(0, 0)] + list(zip(fp[last].tolist(), tp[last].tolist(), strict=True))
    hull: list[tuple[int, int]] = []
    for x, y in points:  # monotone chain, upper hull, exact integer cross products
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (y - y0) - (y1 - y0) * (x - x0) >= 0:
                hull.pop()
            else:
                break
        hull.append((x, y))
    xs, ys = np.array(hull, dtype=np.int64).T
    return xs, ys


def auroc(scores: np.ndarray, included: np.ndarray) -> float:
    """Area under the ROC curve's concave majorant (0.5: the scores tell nothing; 1: perfectly)."""
    fp, tp = roc_hull(scores, included)
    fpr, tpr = fp / fp[-1], tp / tp[-1]
    return float(np.sum((fpr[1:] - fpr[:-1]) * (tpr[1:] + tpr[:-1])) / 2)


def tpr_at_fpr(scores: np.ndarray, included: np.ndarray, fpr: float | Sequence[float]) -> np.ndarray:
    """Largest true-positive rate at false-positive rate `fpr` (each of them), on the concave majorant."""
    fp, tp = roc_hull(scores, included)
    targets = np.atleast_1d(np.asarray(fpr, dtype=np.float64))
    if not np.all((targets >= 0) & (targets <= 1)):
        raise ValueError(f"fpr: expected rates in [0, 1], got {fpr!r}")
    out = np.empty_like(targets)
    for i, f in enumerate(targets):
        x = f * fp[-1]
        j = min(int(np.searchsorted(fp, x, side="right")), len(fp) - 1)
        if fp[j] == fp[j - 1]:
            out[i] = tp[j] / tp[-1]
            continue
        w = (x - fp[j - 1]) / (fp[j] - fp[j - 1])
        out[i] = (tp[j - 1] + w * (tp[j] - tp[j - 1])) / tp[-1]
    return out


def empirical_figures(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    fprs: Sequence[float] = LOW_FPRS,
) -> dict[str, object]:
    """dpbert's ROC figures of an audit (`auroc`, `tpr_at_fpr`: [{fpr, tpr}]) and, next to them, the
    figures of jax-privacy's canary auditor when it is installed (`jax_privacy`:
    `dpbert.privacy.crosscheck.jax_privacy_audit_figures`, with `available: true`; else
    `available: false` and a `note`). Every figure is empirical (`EMPIRICAL`)."""
    included = np.asarray(included, dtype=bool)
    if included.all() or not included.any():  # a fair coin per canary: rare unless m is tiny
        note = "every canary was on the same side (all in or all out): no ROC curve"
        return {
            "auroc": None,
            "tpr_at_fpr": None,
            "jax_privacy": {"available": False, "note": note},
            "empirical": EMPIRICAL,
        }
    tprs = tpr_at_fpr(scores, included, fprs)
    jp: dict[str, object]
    if crosscheck.jax_privacy_version() is None:
        jp = {"available": False, "note": crosscheck.MISSING}
    else:
        jp = {
            "available": True,
            **crosscheck.jax_privacy_audit_figures(scores, included, delta=delta, confidence=confidence, fprs=fprs),
        }
    return {
        "auroc": auroc(scores, included),
        "tpr_at_fpr": [{"fpr": float(f), "tpr": float(t)} for f, t in zip(fprs, tprs, strict=True)],
        "jax_privacy": jp,
        "empirical": EMPIRICAL,
    }
