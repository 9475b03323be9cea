"""The f-DP one-run bound: Mahloujifar, Melis, Chaudhuri (ICML 2025, "Auditing f-Differential
Privacy in One Run", arXiv 2410.22235), on the experiment of `dpbert.privacy.audit_bounds`.

Same experiment as Steinke, Nasr and Jagielski's (`m` canaries, each in with probability 1/2,
`k` guesses of which `v` are correct); the null hypothesis is that the mechanism is f-DP with
respect to each canary for a symmetric trade-off curve f, indexed by epsilon at the audit's delta:
"gaussian" (G_mu at (epsilon, delta), the paper's and jax-privacy's choice: an empirical estimate
of epsilon) or "epsilon_delta" (the (epsilon, delta)-DP curve itself: its rejection refutes
(epsilon, delta)-DP exactly). The "gaussian" bound is never below the "epsilon_delta" one.

Guarantee: with probability >= 1 - significance over the canary coin flips and the mechanism's
randomness, a mechanism that is f-DP for the family's curve at epsilon gives a bound <= epsilon.
Pure numpy/scipy; compared with jax-privacy's auditor in the tests. The recursion and why each
family means what it does: docs/INTERNALS.md ("dpbert.privacy.audit_fdp").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import scipy.optimize
import scipy.special

TradeOff = Literal["gaussian", "epsilon_delta"]
TRADE_OFFS: tuple[TradeOff, ...] = ("gaussian", "epsilon_delta")

_EPSILON_SEARCH_MAX = 100.0
_BISECTION_STEPS = 40


def gaussian_delta(epsilon: float, mu: float) -> float:
    """delta(epsilon) of mu-GDP: Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2)."""
    if mu <= 0:
        return 0.0
    log_a = scipy.special.log_ndtr(-epsilon / mu + mu / 2)
    log_b = epsilon + scipy.special.log_ndtr(-epsilon / mu - mu / 2)
    return float(math.exp(log_a) * -math.expm1(min(log_b - log_a, 0.0)))


def gaussian_mu(epsilon: float, delta: float) -> float:
    """The mu whose mu-GDP curve is (epsilon, delta)-DP with equality (to ~1e-12 relative)."""
    if not epsilon >= 0 or math.isinf(epsilon):
        raise ValueError(f"epsilon: expected a finite number >= 0, got {epsilon!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta: expected a probability in (0, 1), got {delta!r}")
    lo, hi = 0.0, 1.0
    while gaussian_delta(epsilon, hi) < delta:  # delta(epsilon) grows with mu
        lo, hi = hi, 2 * hi
    return float(scipy.optimize.brentq(lambda mu: gaussian_delta(epsilon, mu) - delta, lo, hi, xtol=1e-14, rtol=1e-13))


def blow_up_inverse(trade_off: TradeOff, epsilon: float, delta: float) -> Callable[[float], float]:
    """y -> f(1 - y) for the family's curve f at (epsilon, delta): the least probability, in one
    world, of an event that has probability y in the neighbouring world."""
    if trade_off == "gaussian":
        mu = gaussian_mu(epsilon, delta)
        return lambda y: float(scipy.special.ndtr(scipy.special.ndtri(y) - mu))
    if trade_off == "epsilon_delta":
        e = math.exp(epsilon)
        return lambda y: max(0.0, (y - delta) / e, 1.0 - delta - e * (1.0 - y))
    raise ValueError(f"trade_off: expected one of {list(TRADE_OFFS)}, got {trade_off!r}")


def fdp_rejects(
    *,
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    blow_up_inverse: Callable[[float], float],
    significance: float,
) -> bool:
    """True if `num_correct` of `num_guesses` right, out of `num_canaries`, rejects the curve
    of `blow_up_inverse` at level `significance` (the recursion of the module docstring)."""
    m, k, v = num_canaries, num_guesses, num_correct
    if not 0 <= v <= k <= m:
        raise ValueError(
            f"num_correct/num_guesses/num_canaries: expected 0 <= num_correct <= num_guesses "
            f"<= num_canaries, got {v}, {k}, {m}"
        )
    r, h = significance * v / m, significance * (k - v) / m
    for i in range(v - 1, -1, -1):
        h_next = max(h, blow_up_inverse(r))
        if h_next == h:  # neither r nor h can move any more
            break
        r, h = min(r + i / (k - i) * (h_next - h), 1.0), h_next
    return r + h > k / m


def fdp_epsilon_lower_bound(
    *,
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    delta: float,
    significance: float = 0.05,
    trade_off: TradeOff = "gaussian",
) -> float:
    """Largest epsilon (to ~1e-10 absolute) whose curve in the `trade_off` family at `delta` the
    counts reject at level `significance`; 0.0 if not even epsilon = 0 is rejected."""
    if not 0 < significance < 1:
        raise ValueError(f"significance: expected a number in (0, 1), got {significance!r}")
    if trade_off not in TRADE_OFFS:
        raise ValueError(f"trade_off: expected one of {list(TRADE_OFFS)}, got {trade_off!r}")
    if trade_off == "gaussian" and not 0 < delta < 1:
        raise ValueError(f"delta: expected a probability in (0, 1) for the Gaussian family, got {delta!r}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta: expected a probability in [0, 1), got {delta!r}")

    def rejected(eps: float) -> bool:
        return fdp_rejects(
            num_canaries=num_canaries,
            num_guesses=num_guesses,
            num_correct=num_correct,
            blow_up_inverse=blow_up_inverse(trade_off, eps, delta),
            significance=significance,
        )

    return largest_rejected_epsilon(rejected)


def largest_rejected_epsilon(rejected: Callable[[float], bool]) -> float:
    """The largest epsilon in [0, `_EPSILON_SEARCH_MAX`] that `rejected` still rejects (0 when it
    rejects none), by doubling then bisection; valid because rejecting epsilon rejects every smaller
    one. Shared by both one-run bounds."""
    if not rejected(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejected(hi):
        lo, hi = hi, 2 * hi
        if hi > _EPSILON_SEARCH_MAX:
            return _EPSILON_SEARCH_MAX
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if rejected(mid):
            lo = mid
        else:
            hi = mid
    return lo
