"""White-box audit of the DP-SGD engine with gradient canaries, in one run.

Each canary owns one coordinate of an auxiliary parameter vector no other example's gradient
touches, with a Dirac gradient larger than the clip norm; each joins the dataset with probability
1/2. The REAL engine runs the recipe's schedule (`poisson_sample`, `make_dp_train_step`), and the
auditor, who sees every intermediate model, scores each canary by the Neyman-Pearson
log-likelihood ratio of "in" versus "out" summed over steps.

Guarantees: the bound (`dpbert.privacy.audit_bounds`) is a valid lower bound at `confidence` for the run's
own claim at its delta plus truncation delta; all randomness comes from the audit's secret
(`audit_keys`), never from anything published. The score's derivation: docs/INTERNALS.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpbert.privacy.accounting import PrivacyLedger, calibrate_noise_multiplier, sampling_rate
from dpbert.privacy.audit_bounds import OneRunAudit, audit_scores
from dpbert.privacy.dp_step import make_dp_train_step
from dpbert.privacy.randomness import RunSecret, mechanism_key, step_key
from dpbert.privacy.sampling import physical_batch_size, poisson_sample
from dpbert.privacy.schedule import BatchSchedule


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradientCanaryConfig:
    """One gradient-canary audit run.

    `schedule` is what runs (its noise multipliers, unless `target_epsilon` is set: then one
    noise multiplier for all stages is calibrated to it for the realized dataset size, as a
    recipe with `target_epsilon` does). `num_other_examples` zero-gradient examples stand
    for the rest of the training set. `dataset_size`: the public N of q = B/N (default: every
    stored row, others plus included canaries); every stored row is sampled at q, and the
    truncation is accounted for `dataset_size_bound` (default: max(N, stored rows)). An audit of
    a release passes the release's N, so that it audits the release's q and sigma.
    """

    schedule: BatchSchedule
    num_canaries: int
    num_other_examples: int
    clip_norm: float
    delta: float
    secret: RunSecret
    microbatch_size: int = 256
    canary_gradient_norm: float | None = None
    target_epsilon: float | None = None
    accountant: str = "pld"
    confidence: float = 0.95
    dataset_size: int | None = None
    dataset_size_bound: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, BatchSchedule):
            raise ValueError(f"schedule: expected a BatchSchedule, got {self.schedule!r}")
        for name, low in (("num_canaries", 2), ("num_other_examples", 0), ("microbatch_size", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {v!r}")
        if not (isinstance(self.clip_norm, int | float) and self.clip_norm > 0):
            raise ValueError(f"clip_norm: expected a number > 0, got {self.clip_norm!r}")
        g = self.canary_gradient_norm
        if g is not None and not (isinstance(g, int | float) and g > 0):
            raise ValueError(f"canary_gradient_norm: expected null or a number > 0, got {g!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta: expected a probability in (0, 1), got {self.delta!r}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence: expected a number in (0, 1), got {self.confidence!r}")
        t = self.target_epsilon
        if t is not None and not (isinstance(t, int | float) and 0 < t < math.inf):
            raise ValueError(f"target_epsilon: expected null or a finite number > 0, got {t!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CanaryAuditResult:
    """The claim (ledger, epsilon) next to the audited lower bound, plus the raw evidence."""

    ledger: PrivacyLedger
    epsilon_claimed: float
    audit: OneRunAudit
    scores: np.ndarray
    included: np.ndarray
    score: str

    @property
    def delta(self) -> float:
        return self.audit.delta


def canary_inclusion(key: jax.Array, num_canaries: int) -> np.ndarray:
    """Independent fair coin per canary: bool [num_canaries], True = in the training set."""
    return np.asarray(jax.random.bernoulli(key, 0.5, (num_canaries,)))


def audit_keys(secret: RunSecret, kind: str) -> tuple[jax.Array, jax.Array]:
    """(run_key, canary_key) of a `kind` audit: its training run's key and its canary draw's key,
    domain-separated from each other and from every training mechanism of the same secret."""
    return mechanism_key(secret, f"audit/{kind}/run"), mechanism_key(secret, f"audit/{kind}/canaries")


def _loss_fn(g: float):
    def loss(params: Any, example: dict[str, jax.Array], rng: jax.Array) -> jax.Array:
        del rng
        return jnp.where(example["is_canary"], g * params["aux"][example["canary"]], 0.0)

    return loss


def run_gradient_canary_audit(config: GradientCanaryConfig) -> CanaryAuditResult:
    """Train the auxiliary vector with the real DP step and audit it (see the module doc)."""
    c = config
    run_key, canary_key = audit_keys(c.secret, "gradient")
    included = canary_inclusion(canary_key, c.num_canaries)
    canary_ids = np.flatnonzero(included).astype(np.int32)
    stored = c.num_other_examples + canary_ids.size
    n = stored if c.dataset_size is None else c.dataset_size
    bound = max(stored, n if c.dataset_size_bound is None else c.dataset_size_bound)
    for i, stage in enumerate(c.schedule.stages):
        if stage.expected_batch_size > n:
            raise ValueError(
                f"schedule.stages[{i}].expected_batch_size={stage.expected_batch_size} exceeds the "
                f"dataset size {n} (num_other_examples + included canaries)"
            )
    schedule = c.schedule
    if c.target_epsilon is not None:
        schedule = calibrate_noise_multiplier(
            schedule, dataset_size=n, target_epsilon=c.target_epsilon, delta=c.delta, accountant=c.accountant
        )
    physical = [
        physical_batch_size(s.expected_batch_size, n, multiple=c.microbatch_size, dataset_size_bound=bound)
        for s in schedule.stages
    ]
    ledger = PrivacyLedger.for_schedule(
        schedule,
        dataset_size=n,
        delta=c.delta,
        clip_norm=c.clip_norm,
        accountant=c.accountant,
        physical_batch_sizes=physical,
        target_epsilon=c.target_epsilon,
        dataset_size_bound=bound if bound != n else None,
    )
    # Dataset rows: the other examples first, then the included canaries (order is irrelevant
    # to Poisson sampling).
    is_canary = np.concatenate([np.zeros(c.num_other_examples, bool), np.ones(canary_ids.size, bool)])
    canary_of_row = np.concatenate([np.zeros(c.num_other_examples, np.int32), canary_ids])

    g = c.canary_gradient_norm if c.canary_gradient_norm is not None else 10.0 * c.clip_norm
    loss = _loss_fn(g)
    optimizer = optax.sgd(1.0)
    params = {"aux": jnp.zeros((c.num_canaries,), jnp.float32)}
    opt_state = optimizer.init(params)
    use_ratio = all(s.noise_multiplier > 0 for s in schedule.stages)
    scores = np.zeros(c.num_canaries, np.float64)
    t = 0
    for stage, phys in zip(schedule.stages, physical, strict=True):
        step = make_dp_train_step(
            loss,
            optimizer,
            clip_norm=c.clip_norm,
            noise_multiplier=stage.noise_multiplier,
            expected_batch_size=stage.expected_batch_size,
            microbatch_size=c.microbatch_size,
            donate=False,
        )
        q = sampling_rate(stage.expected_batch_size, n)
        sigma = stage.noise_multiplier
        for _ in range(stage.steps):
            sample = poisson_sample(run_key, t, n, stage.expected_batch_size, phys, stored_units=stored)
            batch = {
                "is_canary": jnp.asarray(is_canary[sample.indices]),
                "canary": jnp.asarray(canary_of_row[sample.indices]),
            }
            new_params, opt_state, _ = step(
                params, opt_state, batch, jnp.asarray(sample.is_padding), step_key(run_key, t)
            )
            # SGD at rate 1: old - new = noisy_sum / B; the auditor inverts the public divisor.
            noisy_sum = (
                np.asarray(params["aux"], np.float64) - np.asarray(new_params["aux"], np.float64)
            ) * stage.expected_batch_size
            if use_ratio:
                y = noisy_sum / (sigma * c.clip_norm)
                # A member adds its clipped gradient min(g, C) to its coordinate: mean mu in y's units.
                mu = min(g, c.clip_norm) / (sigma * c.clip_norm)
                scores += (
                    np.logaddexp(np.log1p(-q), math.log(q) + mu * y - mu * mu / 2) if q < 1 else (mu * y - mu * mu / 2)
                )
            else:
                scores += noisy_sum
            params = new_params
            t += 1
    epsilon = ledger.epsilon()
    delta = c.delta + (ledger.truncation_delta(epsilon) if math.isfinite(epsilon) else 0.0)
    result = audit_scores(scores, included, delta=min(delta, 1.0), confidence=c.confidence)
    return CanaryAuditResult(
        ledger=ledger,
        epsilon_claimed=epsilon,
        audit=result,
        scores=scores,
        included=included,
        score="log_likelihood_ratio" if use_ratio else "sum",
    )
