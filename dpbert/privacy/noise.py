"""The Gaussian mechanism on a clipped gradient sum.

Guarantees: `privatize` adds N(0, (noise_multiplier * clip_norm)^2) independently to every
coordinate of the *global* sum, exactly once per call, and divides by the public
`expected_batch_size` (never by the realized batch size). The noise depends only on `key` and the
shapes. The sampler (`gaussian`, Box-Muller on 32-bit words with a 192-bit geometric radius) never
exceeds |z| <= 16.357, and a run's deviation from exact Gaussian noise is bounded by
`tail_deviation` (rule 7 of `dpbert.privacy`): below 1e-3 delta, not added. The derivation of the
bound and its worked numbers: docs/INTERNALS.md ("dpbert.privacy.noise").
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

EXPONENT_WORDS = 6
EXPONENT_BITS = 32 * EXPONENT_WORDS
MAX_ABS_Z = math.sqrt(2 * (EXPONENT_BITS + 1) * math.log(2)) * (1 + 2**-20)
_ALIGN = 128  # pairs per draw and leaf offsets into it: XLA CPU ran misaligned ones 5-10x slower


def check_dp_params(*, clip_norm: float, noise_multiplier: float, expected_batch_size: int) -> None:
    """ValueError naming the field for a non-positive clip norm, negative noise or empty batch."""
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, int | float) or not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, int | float) or not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    if isinstance(expected_batch_size, bool) or not isinstance(expected_batch_size, int) or expected_batch_size < 1:
        raise ValueError(f"expected_batch_size must be an integer >= 1, got {expected_batch_size!r}")


def tail_deviation(*, coordinates: int, steps: int, epsilon: float) -> float:
    """(1 + e^epsilon) * coordinates * steps * 2^-(K+1): at most this much can be added to the
    delta of an (epsilon, delta) guarantee computed for exact Gaussian noise, when each of `steps`
    steps uses `coordinates` normals from `gaussian` (see the module docstring)."""
    gamma = coordinates * steps * 2.0 ** -(EXPONENT_BITS + 1)
    if gamma == 0:
        return 0.0
    log_deviation = epsilon + math.log1p(math.exp(-epsilon)) + math.log(gamma)
    return math.exp(log_deviation) if log_deviation < 700 else math.inf


def _pairs(size: int) -> int:
    """Box-Muller pairs drawn for `size` normals: ceil(size / 2), rounded up to a multiple of 128."""
    return -(-size // (2 * _ALIGN)) * _ALIGN


def _leading_zeros(words: list[jax.Array]) -> jax.Array:
    """Leading zeros of the bit string words[0] words[1] ... (32 * len(words) if all are zero)."""
    count = jnp.full(words[0].shape, 32 * len(words), jnp.uint32)
    for i, word in reversed(list(enumerate(words))):
        count = jnp.where(word != 0, 32 * i + jax.lax.clz(word), count)
    return count


def _cos_turns(turns: jax.Array) -> jax.Array:
    """cos(2 pi turns / 2^32) for uint32 `turns`, to float32 accuracy (24 bits of angle)."""
    j = (turns >> 8) + (1 << 21)  # 24-bit angle, shifted so that j >> 22 is the nearest quarter
    quarter = (j >> 22) & 3
    x = ((j & ((1 << 22) - 1)).astype(jnp.int32) - (1 << 21)).astype(jnp.float32) * (2 * math.pi / 2**24)
    x2 = x * x  # x in [-pi/4, pi/4): Taylor to x^10, error < 2e-9
    cos = 1 - x2 / 2 * (1 - x2 / 12 * (1 - x2 / 30 * (1 - x2 / 56 * (1 - x2 / 90))))
    sin = x * (1 - x2 / 6 * (1 - x2 / 20 * (1 - x2 / 42 * (1 - x2 / 72))))
    value = jnp.where((quarter & 1) == 1, sin, cos)  # cos(q pi/2 + x) = cos x, -sin x, -cos x, sin x
    return jnp.where(((quarter + 1) & 2) == 2, -value, value)


def _box_muller(exponent: jax.Array, mantissa: jax.Array, angle: jax.Array) -> jax.Array:
    """[2, P] normals from P pairs: radius sqrt(-2 ln u1), u1 = 2^-exponent * v with v in [1/2, 1)
    from the top 23 bits of `mantissa`; cosine of the angle and of the angle plus a quarter turn."""
    v = jax.lax.bitcast_convert_type(jnp.uint32(0x3F000000) | (mantissa >> 9), jnp.float32)
    radius = jnp.sqrt(2 * (exponent.astype(jnp.float32) * math.log(2) - jnp.log(v)))
    return radius * _cos_turns(angle + jnp.array([[0], [1 << 30]], jnp.uint32))


def gaussian(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Independent N(0, 1) float32 draws of `shape`, a function of `key` and `shape` only, never
    above MAX_ABS_Z in magnitude (see the module docstring for how close to exact they are)."""
    size = math.prod(shape)
    p = _pairs(size)
    # Three keys from one draw on `key` (cheaper to compile than jax.random.split).
    data = jax.random.bits(key, (3, *jax.random.key_data(key).shape), jnp.uint32)
    first_key, word_key, tail_key = jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
    first = jax.random.bits(first_key, (p,), jnp.uint32)

    def sample(exponent: jax.Array) -> jax.Array:
        return _box_muller(exponent, *jax.random.bits(word_key, (2, p), jnp.uint32))

    # Computing the normals inside the cond also keeps them in memory, so that XLA does not
    # recompute the cipher inside every consumer of the noise (every leaf of `privatize`).
    normals = jax.lax.cond(
        jnp.any(first == 0),
        lambda: sample(_leading_zeros([first, *jax.random.bits(tail_key, (EXPONENT_WORDS - 1, p), jnp.uint32)])),
        lambda: sample(jax.lax.clz(first)),
    )
    return normals.reshape(-1)[:size].reshape(shape)


def privatize(
    grad_sum: Any,
    key: jax.Array,
    *,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: int,
) -> Any:
    """The Gaussian mechanism on a clipped sum (rules 1 and 7 of `dpbert.privacy`).

    Args:
      grad_sum: the global clipped gradient sum (a pytree; sensitivity `clip_norm`).
      key: the step's noise key (`dpbert.privacy.randomness.noise_key`).
      clip_norm, noise_multiplier: C and sigma; expected_batch_size: the public B.
    Returns:
      (grad_sum + N(0, (sigma C)^2 I)) / B in float32, one draw of `gaussian` for all leaves.
    """
    check_dp_params(clip_norm=clip_norm, noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size)
    leaves, treedef = jax.tree_util.tree_flatten(grad_sum)
    starts = np.cumsum([0] + [-(-g.size // _ALIGN) * _ALIGN for g in leaves]).tolist()
    noise = gaussian(key, (starts[-1],))
    std = noise_multiplier * clip_norm
    noisy = [
        (g.astype(jnp.float32) + std * noise[start : start + g.size].reshape(g.shape)) / expected_batch_size
        for g, start in zip(leaves, starts[:-1], strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, noisy)
