"""DP-AdamBC (Tang et al. 2024, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply
Bias Correction)"): Adam whose second moment has the DP noise's variance taken out.

The noisy gradient of a DP-SGD step is g~ = g + z / B with z ~ N(0, (sigma C)^2 I), so each
coordinate of g~ has noise variance phi = (sigma C / B)^2 and Adam's second moment v estimates
E[g~^2] = g^2 + phi: at DP scale phi dominates, v is nearly constant and Adam acts as SGD with a
fixed learning rate. AdamBC divides by sqrt(max(v_hat - phi_hat, floor x phi_hat)) instead, where
phi_hat is the b2-moving average of the steps' phi with v's bias correction (the schedule's stages
may change sigma and B, so phi changes from stage to stage). The floor is a multiple of phi_hat, so
one value suits every stage and recipe: at 1, a coordinate whose second moment is all noise steps
as far as under Adam (m_hat / sqrt(phi_hat)), and one that carries signal loses the noise's share of
its denominator. A floor far below phi_hat lets noise-only coordinates divide by a fluctuating
sqrt(v_hat - phi_hat) near 0 (docs/RESULTS.md: an absolute floor of 1e-8 left the default at the
unigram plateau).

Guarantees: the transformation reads only the noisy gradient and public numbers (sigma, C, B of
each stage), so it is post-processing: the DP guarantee and the ledger do not change. With phi = 0
everywhere the floor is 0 and it computes optax.adamw's update.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpbert.privacy.schedule import BatchSchedule

_F32 = jnp.float32


class ScaleByAdamBCState(NamedTuple):
    """Adam's `count`, `mu` and `nu`, and `phi`: the b2-moving average (not yet bias-corrected)
    of the noise variance of the steps taken so far (a float32 scalar)."""

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    phi: jax.Array


def noise_variance_schedule(schedule: BatchSchedule, clip_norm: float) -> optax.Schedule:
    """`count -> phi_t`: the per-coordinate noise variance (sigma_s C / B_s)^2 of the averaged noisy
    gradient at global step t (0-based), s the stage holding t; past the last stage, the last's."""
    if not clip_norm > 0:
        raise ValueError(f"clip_norm: expected a positive number, got {clip_norm!r}")
    stages = schedule.stages
    values = jnp.asarray([(s.noise_multiplier * clip_norm / s.expected_batch_size) ** 2 for s in stages], _F32)
    ends = jnp.asarray(np.cumsum([s.steps for s in stages])[:-1], jnp.int32)

    def phi(count: jax.Array) -> jax.Array:
        return values[jnp.searchsorted(ends, count, side="right")]

    return phi


def scale_by_adam_bc(
    noise_variance: optax.Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    floor: float = 1.0,
) -> optax.GradientTransformation:
    """Adam's scaling m_hat / (sqrt(max(v_hat - phi_hat, floor * phi_hat)) + eps), `noise_variance(t)` the
    noise variance phi_t of step t's gradient (`noise_variance_schedule`) and phi_hat its
    b2-average with the bias correction of v_hat, so that E[v_hat] - phi_hat is the average of the
    noise-free g^2."""
    if not floor > 0:
        raise ValueError(f"floor: expected a positive multiple of the noise variance, got {floor!r}")

    def init(params: Any) -> ScaleByAdamBCState:
        return ScaleByAdamBCState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.zeros_like(params),
            phi=jnp.zeros([], _F32),
        )

    def update(updates: Any, state: ScaleByAdamBCState, params: Any = None) -> tuple[Any, ScaleByAdamBCState]:
        del params
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        phi = b2 * state.phi + (1.0 - b2) * noise_variance(state.count).astype(_F32)
        count = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        phi_hat = phi / (1.0 - jnp.asarray(b2, _F32) ** count.astype(_F32))

        def scale(m: jax.Array, v: jax.Array) -> jax.Array:
            phi_v = phi_hat.astype(v.dtype)
            return m / (jnp.sqrt(jnp.maximum(v - phi_v, floor * phi_v)) + eps)

        updates = jax.tree.map(scale, mu_hat, nu_hat)
        return updates, ScaleByAdamBCState(count=count, mu=mu, nu=optax.tree.cast_like(nu, state.nu), phi=phi)

    return optax.GradientTransformation(init, update)


def adam_bc(
    learning_rate: float | optax.Schedule,
    noise_variance: optax.Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Any = None,
    floor: float = 1.0,
) -> optax.GradientTransformation:
    """DP-AdamBC with decoupled weight decay: optax.adamw's chain with `scale_by_adam_bc` in
    place of Adam's scaling (same arguments, plus the noise variance and the floor, a multiple of it)."""
    return optax.chain(
        scale_by_adam_bc(noise_variance, b1=b1, b2=b2, eps=eps, floor=floor),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
