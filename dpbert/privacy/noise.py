"""The Gaussian mechanism on a clipped gradient sum.

Guarantees: `privatize` adds N(0, (noise_multiplier * clip_norm)^2) independently to every
coordinate of the *global* sum, exactly once per call, and then divides by the public
`expected_batch_size` (never by the realized batch size, which is private under Poisson
sampling). With a sum of sensitivity `clip_norm` this is the subsampled Gaussian mechanism the
accountant is told about. The noise depends only on `key` and the shapes, not on how the sum
was computed or sharded.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def check_dp_params(*, clip_norm: float, noise_multiplier: float, expected_batch_size: int) -> None:
    """ValueError naming the field for a non-positive clip norm, negative noise or empty batch."""
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, int | float) or not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
    if (
        isinstance(noise_multiplier, bool)
        or not isinstance(noise_multiplier, int | float)
        or not noise_multiplier >= 0
    ):
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    if (
        isinstance(expected_batch_size, bool)
        or not isinstance(expected_batch_size, int)
        or expected_batch_size < 1
    ):
        raise ValueError(f"expected_batch_size must be an integer >= 1, got {expected_batch_size!r}")


def privatize(
    grad_sum: Any,
    key: jax.Array,
    *,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: int,
) -> Any:
    """(grad_sum + N(0, (noise_multiplier * clip_norm)^2 I)) / expected_batch_size, in float32."""
    check_dp_params(
        clip_norm=clip_norm, noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size
    )
    leaves, treedef = jax.tree_util.tree_flatten(grad_sum)
    keys = jax.random.split(key, len(leaves))
    std = noise_multiplier * clip_norm
    noisy = [
        (g.astype(jnp.float32) + std * jax.random.normal(k, g.shape, jnp.float32))
        / expected_batch_size
        for g, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, noisy)
