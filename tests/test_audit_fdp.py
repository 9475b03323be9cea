"""The f-DP one-run bound (Mahloujifar, Melis, Chaudhuri, ICML 2025): dpbert's implementation against
jax-privacy's auditor, the cases where theory fixes its value or its order, and its validity."""

import math

import numpy as np
import pytest
import scipy.stats

from dpbert.privacy import audit_bounds as audit
from dpbert.privacy.audit_fdp import fdp_epsilon_lower_bound, gaussian_delta, gaussian_mu


@pytest.mark.parametrize("epsilon, delta", [(0.0, 1e-5), (1.0, 1e-5), (4.0, 1e-6), (8.0, 1e-6), (30.0, 1e-10)])
def test_gaussian_mu_is_the_curve_through_epsilon_delta(epsilon, delta):
    mu = gaussian_mu(epsilon, delta)
    assert gaussian_delta(epsilon, mu) == pytest.approx(delta, rel=1e-9)
    # delta(epsilon) of mu-GDP written out (Dong, Roth, Su 2022, Corollary 2.13).
    phi = scipy.stats.norm.cdf
    assert phi(-epsilon / mu + mu / 2) - math.exp(epsilon) * phi(-epsilon / mu - mu / 2) == pytest.approx(
        delta, rel=1e-6
    )
    with pytest.raises(ValueError, match="delta"):
        gaussian_mu(epsilon, 0.0)


# The same counts through jax-privacy's f-DP one-run test (`Explicit` threshold: no correction) and
# dpbert's. Tolerance 1e-5: jax-privacy stops its root search at xtol 1e-6 in epsilon and dpbert bisects
# to 1e-10; both calibrate mu of the Gaussian curve to ~1e-12 (measured differences: 1e-7 to 3e-7).
@pytest.mark.parametrize(
    "guesses, correct, delta", [(100, 90, 1e-5), (500, 400, 1e-6), (1000, 620, 1e-5), (64, 64, 1e-6)]
)
def test_fdp_bound_at_a_fixed_guess_count_matches_jax_privacy(guesses, correct, delta):
    pytest.importorskip("jax_privacy")
    from jax_privacy.auditing import CanaryScoreAuditor, Explicit

    m = 2000
    scores = np.arange(m, 0, -1, dtype=np.float64)  # distinct: the top `guesses` are the first ones
    included = np.zeros(m, bool)
    included[:correct] = True
    included[guesses : guesses + (m // 2 - correct)] = True
    auditor = CanaryScoreAuditor(scores[included], scores[~included])
    theirs = auditor.epsilon_one_run_fdp(0.05, delta, threshold_strategy=Explicit(scores[guesses - 1]))
    ours = fdp_epsilon_lower_bound(
        num_canaries=m, num_guesses=guesses, num_correct=correct, delta=delta, significance=0.05
    )
    assert ours > 0 and ours == pytest.approx(theirs, abs=1e-5)


def test_audit_scores_reports_the_fdp_bound_of_its_own_candidate():
    rng = np.random.default_rng(1)
    included = rng.random(4000) < 0.5
    result = audit.audit_scores(rng.normal(size=4000) + 1.5 * included, included, delta=1e-6)
    assert result.fdp_trade_off == "gaussian"
    again = fdp_epsilon_lower_bound(
        num_canaries=4000,
        num_guesses=result.fdp_num_guesses,
        num_correct=result.fdp_num_correct,
        delta=1e-6,
        significance=0.05 / result.num_candidates,
    )
    assert result.epsilon_lower_bound_fdp == again > result.epsilon_lower_bound > 0
    assert result.fdp_num_guesses == result.fdp_k_plus + result.fdp_k_minus
    # delta = 0: no Gaussian curve has it; the (epsilon, 0) curve is used and said so.
    assert audit.audit_scores(included.astype(float), included, delta=0.0).fdp_trade_off == "epsilon_delta"


@pytest.mark.parametrize("m, k", [(100, 20), (2000, 512), (10_000, 4096)])
def test_pure_dp_perfect_guesses_give_exactly_the_binomial_bound(m, k):
    # Theory: with delta = 0 and every guess right, both analyses are exact for epsilon-DP
    # (randomized response attains them): P[k of k] = q^k, so the bound is logit(tau^(1/k)).
    tau = 0.05
    fdp = fdp_epsilon_lower_bound(
        num_canaries=m, num_guesses=k, num_correct=k, delta=0.0, significance=tau, trade_off="epsilon_delta"
    )
    snj = audit.epsilon_lower_bound(num_canaries=m, num_guesses=k, num_correct=k, delta=0.0, significance=tau)
    q = tau ** (1 / k)
    assert fdp == pytest.approx(math.log(q / (1 - q)), abs=1e-8) and fdp == pytest.approx(snj, abs=1e-8)


@pytest.mark.parametrize("m, k, v", [(1000, 100, 80), (2000, 512, 400), (10_000, 2000, 1500), (10_000, 4096, 4096)])
@pytest.mark.parametrize("delta", [1e-6, 1e-5])
def test_gaussian_curve_bound_is_at_least_the_epsilon_delta_curve_bound(m, k, v, delta):
    # Theory: the Gaussian curve of (epsilon, delta) lies above the (epsilon, delta)-DP curve, and the
    # recursion only rejects more for a higher curve; so on the same counts the Gaussian bound is larger.
    kw = dict(num_canaries=m, num_guesses=k, num_correct=v, delta=delta, significance=0.05)
    gauss = fdp_epsilon_lower_bound(**kw)
    eps_delta = fdp_epsilon_lower_bound(**kw, trade_off="epsilon_delta")
    assert gauss >= eps_delta > 0


@pytest.mark.parametrize("m, k", [(2000, 512), (10_000, 4096)])
@pytest.mark.parametrize("delta", [1e-9, 1e-6])
def test_fdp_bound_is_at_least_steinkes_when_every_guess_is_right(m, k, delta):
    # Every guess right (the no-noise audit): at delta = 0 the f-DP analysis of the (epsilon, 0) curve
    # equals Steinke et al.'s bound (test above), Steinke et al.'s p-value only grows with delta, and
    # the Gaussian curve lies above the (epsilon, delta) one; measured here at delta > 0 on both steps.
    tau = 0.05 / 22  # a Bonferroni level of the audit's grid at m = 10,000
    kw = dict(num_canaries=m, num_guesses=k, num_correct=k, delta=delta, significance=tau)
    snj = audit.epsilon_lower_bound(**kw)
    eps_delta = fdp_epsilon_lower_bound(**kw, trade_off="epsilon_delta")
    gauss = fdp_epsilon_lower_bound(**kw)
    assert gauss >= eps_delta >= snj > 0
    if (m, delta) == (10_000, 1e-6):  # the figures of the tiny recipe's no-noise audit
        assert snj == pytest.approx(6.30, abs=0.01) and gauss == pytest.approx(10.36, abs=0.01)


def test_fdp_bound_stays_below_a_known_gaussian_epsilon_and_rises_with_separability():
    # Scores N(mu * in, 1), independent per canary: each canary's membership is exactly mu-GDP, the
    # null of the Gaussian family at epsilon(mu, delta). 10 seeds each, 95% confidence: a valid bound
    # exceeds the truth in about 5% of seeds at most (the Bonferroni grid makes it far rarer).
    delta = 1e-6
    means = []
    for mu in (0.5, 1.0, 2.0):
        truth = _gdp_epsilon(mu, delta)
        bounds = []
        for seed in range(10):
            rng = np.random.default_rng(seed)
            included = rng.random(2000) < 0.5
            bounds.append(audit.audit_scores(rng.normal(size=2000) + mu * included, included, delta=delta))
        assert all(b.epsilon_lower_bound_fdp <= truth for b in bounds), (mu, truth)
        assert all(b.epsilon_lower_bound <= b.epsilon_lower_bound_max_over_k <= truth for b in bounds)
        means.append(np.mean([b.epsilon_lower_bound_fdp for b in bounds]))
    assert means == sorted(means) and means[-1] > 2 * means[0] > 0


def _gdp_epsilon(mu: float, delta: float) -> float:
    lo, hi = 0.0, 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gaussian_delta(mid, mu) > delta else (lo, mid)
    return hi


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="trade_off"):
        fdp_epsilon_lower_bound(num_canaries=10, num_guesses=5, num_correct=5, delta=1e-5, trade_off="laplace")
    with pytest.raises(ValueError, match="significance"):
        fdp_epsilon_lower_bound(num_canaries=10, num_guesses=5, num_correct=5, delta=1e-5, significance=0.0)
    with pytest.raises(ValueError, match="num_correct/num_guesses/num_canaries"):
        fdp_epsilon_lower_bound(num_canaries=10, num_guesses=5, num_correct=6, delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        fdp_epsilon_lower_bound(num_canaries=10, num_guesses=5, num_correct=5, delta=0.0)
