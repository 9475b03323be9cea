"""Exposure of a planted secret (Carlini et al. 2019, "The Secret Sharer"), exactly, in pure numpy.

A secret is P digits; a model scores a candidate c (any of the 10^P digit strings) by the sum over
positions p of `log_probs[p, c_p]` (a masked LM scoring all P masked positions in one pass; the
score factorizes over positions). The rank of the secret is 1 + the number of candidates whose score
is *strictly* greater: ties count in the secret's favour (its best rank among equals), and `ties`
reports how many other candidates share its score. Exposure = log2(10^P) - log2(rank).

Guarantees: every candidate is scored (no sampling, no approximation of the rank); all scores are
summed in float64 in the same order (position 0 first), so equal sums compare equal and the rank
equals a brute-force count over the candidates. A measurement of memorization, not a privacy bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

NUM_DIGITS = 10
TIES = "a candidate ranks above the secret only when its score is strictly greater (ties count for the secret)"
# 10^7 float64 scores are 80 MB: beyond that the exact table is too large to hold.
MAX_POSITIONS = 7


def _table(log_probs: np.ndarray) -> np.ndarray:
    table = np.asarray(log_probs, dtype=np.float64)
    if table.ndim != 2 or table.shape[1] != NUM_DIGITS or not 1 <= table.shape[0] <= MAX_POSITIONS:
        raise ValueError(
            f"log_probs: expected shape [positions, {NUM_DIGITS}] with 1 <= positions <= {MAX_POSITIONS}, "
            f"got {table.shape}"
        )
    if np.isnan(table).any():
        raise ValueError("log_probs: expected no NaN")
    return table


def _digits(secrets: np.ndarray, positions: int) -> np.ndarray:
    digits = np.asarray(secrets)
    if digits.ndim == 1:
        digits = digits[None, :]
    if digits.ndim != 2 or digits.shape[1] != positions or digits.dtype.kind not in "iu":
        raise ValueError(f"secrets: expected integer digits of shape [n, {positions}], got {digits.shape}")
    if digits.size and (digits.min() < 0 or digits.max() >= NUM_DIGITS):
        raise ValueError(f"secrets: expected digits in 0..{NUM_DIGITS - 1}")
    return digits.astype(np.int64)


def candidate_scores(log_probs: np.ndarray) -> np.ndarray:
    """float64 [10^P]: the score of every candidate; index i is the candidate whose digits are i
    written in base 10 with P digits (position 0 most significant)."""
    table = _table(log_probs)
    scores = np.zeros(1, np.float64)
    for row in table:
        scores = (scores[:, None] + row[None, :]).ravel()
    return scores


def candidate_index(secrets: np.ndarray) -> np.ndarray:
    """int64 [n]: each secret's index in `candidate_scores` (its digits as a base-10 number)."""
    digits = _digits(secrets, np.asarray(secrets).shape[-1])
    return digits @ (NUM_DIGITS ** np.arange(digits.shape[1] - 1, -1, -1, dtype=np.int64))


def ranks(log_probs: np.ndarray, secrets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rank, ties), int64 [n] each: rank = 1 + #candidates scoring strictly higher than the secret;
    ties = #other candidates scoring exactly the same."""
    table = _table(log_probs)
    digits = _digits(secrets, table.shape[0])
    scores = candidate_scores(table)
    own = scores[candidate_index(digits)]
    ordered = np.sort(scores)
    above = scores.size - np.searchsorted(ordered, own, side="right")
    equal = np.searchsorted(ordered, own, side="right") - np.searchsorted(ordered, own, side="left")
    return (above + 1).astype(np.int64), (equal - 1).astype(np.int64)


def exposure_from_rank(rank: np.ndarray | int, num_candidates: int) -> np.ndarray:
    """log2(num_candidates) - log2(rank), in [0, log2(num_candidates)] for 1 <= rank <= num_candidates."""
    r = np.asarray(rank, dtype=np.float64)
    if (r < 1).any() or (r > num_candidates).any():
        raise ValueError(f"rank: expected 1 <= rank <= {num_candidates}")
    return math.log2(num_candidates) - np.log2(r)


def exposure(log_probs: np.ndarray, secrets: np.ndarray) -> np.ndarray:
    """float64 [n]: each secret's exposure among all 10^P candidates (ties as in `ranks`)."""
    table = _table(log_probs)
    rank, _ = ranks(table, secrets)
    return exposure_from_rank(rank, NUM_DIGITS ** table.shape[0])


def exposure_summary(secrets: Sequence[Mapping[str, Any]], repetitions: Sequence[int]) -> list[dict[str, Any]]:
    """Per repetition count r: the number of secrets planted r times and the mean and max of their
    `exposure_dp` and `exposure_nonprivate`; ValueError for a count without secrets."""
    rows = []
    for r in repetitions:
        dp = [float(s["exposure_dp"]) for s in secrets if s["repetitions"] == r]
        nonprivate = [float(s["exposure_nonprivate"]) for s in secrets if s["repetitions"] == r]
        if not dp:
            raise ValueError(f"secrets: no secret was planted {r} times")
        rows.append(
            {
                "repetitions": int(r),
                "num_secrets": len(dp),
                "mean_dp": float(np.mean(dp)),
                "max_dp": max(dp),
                "mean_nonprivate": float(np.mean(nonprivate)),
                "max_nonprivate": max(nonprivate),
            }
        )
    return rows
