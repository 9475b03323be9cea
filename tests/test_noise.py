"""The DP noise sampler: an N(0, 1) whose tail reaches far past float32 `normal`'s 5.42, and
`privatize` built on one draw of it. Keys are fixed, so every statistical check is
deterministic; each tolerance is a few standard errors wide, so a wrong scale, a missing tail or
a reused stream fails."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpbert.privacy import noise
from dpbert.privacy.noise import MAX_ABS_Z, gaussian, privatize, tail_deviation

K = noise.EXPONENT_BITS
N = 20_000_000
draw_jit = jax.jit(gaussian, static_argnums=1)
privatize_jit = jax.jit(privatize, static_argnames=("clip_norm", "noise_multiplier", "expected_batch_size"))


def key(i: int) -> jax.Array:
    return jax.random.key(i, impl="threefry4x32")  # as `randomness.noise_key` gives


@pytest.fixture(scope="module")
def draw() -> np.ndarray:
    return np.asarray(draw_jit(key(0), (N,)))


def test_mean_std_and_shape_of_the_distribution(draw):
    assert draw.dtype == np.float32 and draw.shape == (N,) and np.abs(draw).max() <= MAX_ABS_Z
    se = 1 / math.sqrt(N)  # standard error of the mean; the std's is se / sqrt(2)
    assert abs(draw.mean()) < 5 * se
    assert abs(draw.std() - 1) < 5 * se / math.sqrt(2)
    assert stats.kstest(draw[:1_000_000], "norm").pvalue > 1e-3


def test_the_two_normals_of_a_pair_are_independent(draw):
    # `gaussian` lays out the cosines of all pairs, then their sines: z[i] and z[p + i] share a radius.
    p = noise._pairs(N)
    x, y = draw[:p].astype(np.float64), draw[p:].astype(np.float64)
    bound = 5 / math.sqrt(p)
    assert abs(np.corrcoef(x, y)[0, 1]) < bound
    assert abs(np.corrcoef(x * x, y * y)[0, 1]) < bound
    # The squared radius of a pair is chi-square with 2 degrees of freedom: P(r > t) = exp(-t^2 / 2).
    r2 = x * x + y * y
    for t in (2.0, 3.0, 4.0, 5.0):
        expected = p * math.exp(-t * t / 2)
        assert abs((r2 > t * t).sum() - expected) < 5 * math.sqrt(expected)


def test_tail_frequencies_match_the_normal(draw):
    for a in (3.0, 4.0):
        expected = N * 2 * stats.norm.sf(a)  # 54,000 and 1,267
        assert abs((np.abs(draw) > a).sum() - expected) < 5 * math.sqrt(expected)
    assert 2 <= (np.abs(draw) > 5).sum() <= 30  # Poisson(11.5): outside has probability < 2e-4


def test_draws_reach_past_the_float32_inverse_erf_cap():
    # jax.random.normal never exceeds sqrt(2) erfinv(1 - 2^-24) = 5.42. Over 1e8 draws an exact
    # normal exceeds 5.45 about 5.0 times and 5.0 about 57 times.
    count = jax.jit(lambda k: jnp.stack([jnp.sum(jnp.abs(gaussian(k, (N,))) > a) for a in (5.0, 5.45)]))
    beyond_5, beyond_cap = np.sum([np.asarray(count(key(100 + i))) for i in range(5)], axis=0)
    assert 30 <= beyond_5 <= 90
    assert beyond_cap >= 1


def test_radius_of_every_exponent_and_the_maximum():
    # u1 = 2^-k * v for k leading zeros (0..K) and v in [1/2, 1): radius sqrt(-2 ln u1) for each.
    k = np.repeat(np.arange(K + 1, dtype=np.uint32), 3)
    mantissa = np.tile(np.array([0, 1 << 31, 0xFFFFFFFF], np.uint32), K + 1)
    z = np.asarray(noise._box_muller(jnp.asarray(k), jnp.asarray(mantissa), jnp.zeros(k.size, jnp.uint32)))
    v = 0.5 + (mantissa >> 9).astype(np.float64) * 2.0**-24
    expected = np.sqrt(-2 * (np.log(v) - k * math.log(2)))
    np.testing.assert_allclose(z[0], expected, rtol=1e-6)  # cos(0) = 1
    np.testing.assert_allclose(z[1], 0, atol=1e-5)  # cos(pi / 2) = 0
    assert np.abs(z).max() <= MAX_ABS_Z
    assert np.abs(z).max() >= MAX_ABS_Z * (1 - 1e-5)
    assert pytest.approx(math.sqrt(2 * (K + 1) * math.log(2)), rel=1e-5) == MAX_ABS_Z


def test_cosine_of_turns_is_float32_accurate():
    turns = np.arange(0, 2**32, 2**32 // 1_000_003, dtype=np.uint64).astype(np.uint32)
    got = np.asarray(noise._cos_turns(jnp.asarray(turns)))
    want = np.cos(2 * np.pi * ((turns >> 8).astype(np.float64) / 2**24))
    assert np.abs(got - want).max() < 2e-7


def test_leading_zeros_span_all_exponent_words():
    words = np.zeros((noise.EXPONENT_WORDS, 6), np.uint32)
    words[0, 0] = 5  # 29 leading zeros
    words[0, 1] = 1 << 31  # none
    words[1, 2] = 1  # 32 + 31
    words[2, 3] = 1 << 30  # 64 + 1
    words[-1, 4] = 1  # 32 * (W - 1) + 31
    # column 5: all zero, the cap K
    got = np.asarray(noise._leading_zeros(list(jnp.asarray(words))))
    np.testing.assert_array_equal(got, [29, 0, 63, 65, K - 1, K])


def test_same_key_same_noise_and_other_keys_other_noise():
    a, b, c = (np.asarray(draw_jit(k, (3, 1000))) for k in (key(1), key(1), key(2)))
    np.testing.assert_array_equal(a, b)
    assert abs(np.corrcoef(a.ravel(), c.ravel())[0, 1]) < 0.15  # 3,000 draws: 5 standard errors
    assert draw_jit(jax.random.key(1), (7,)).dtype == jnp.float32  # other key types work too
    assert draw_jit(key(1), (0,)).shape == (0,)


def test_privatize_noise_std_and_leaves():
    sigma, clip, batch, d = 1.7, 0.5, 8, 2**19
    zeros = {"a": jnp.zeros((d // 1024, 1024)), "b": jnp.zeros(d, jnp.bfloat16), "c": jnp.zeros(3)}
    out = privatize_jit(zeros, key(3), clip_norm=clip, noise_multiplier=sigma, expected_batch_size=batch)
    assert {k: v.dtype for k, v in out.items()} == dict.fromkeys("abc", jnp.float32)
    target = sigma * clip / batch
    for leaf in ("a", "b"):
        x = np.asarray(out[leaf], np.float64).ravel()
        assert abs(x.std() / target - 1) < 5 / math.sqrt(2 * d)
        assert abs(x.mean()) < 5 * target / math.sqrt(d)
    # Leaves get independent noise: |corr| ~ 1 / sqrt(d) = 0.0014.
    assert abs(np.corrcoef(np.ravel(out["a"]), out["b"])[0, 1]) < 5 / math.sqrt(d)
    # The noise is one draw of `gaussian`, cut into the leaves in pytree order at multiples of 128.
    z = np.asarray(draw_jit(key(3), (2 * d + 128,)))
    for leaf, start in (("a", 0), ("b", d), ("c", 2 * d)):
        got = np.ravel(out[leaf]) * batch / (sigma * clip)
        np.testing.assert_allclose(got, z[start : start + got.size], rtol=1e-5, atol=1e-5)


def test_privatize_adds_the_noise_to_the_sum_once_then_divides():
    grads = {"w": jnp.arange(6.0).reshape(2, 3), "x": jnp.ones(5)}
    out = privatize_jit(grads, key(4), clip_norm=2.0, noise_multiplier=0.5, expected_batch_size=4)
    z = np.asarray(draw_jit(key(4), (256,)))  # "x" starts at the next multiple of 128
    np.testing.assert_allclose(out["w"], (np.arange(6.0).reshape(2, 3) + z[:6].reshape(2, 3)) / 4, rtol=1e-6)
    np.testing.assert_allclose(out["x"], (1 + z[128:133]) / 4, rtol=1e-6)
    exact = privatize_jit(grads, key(4), clip_norm=2.0, noise_multiplier=0.0, expected_batch_size=4)
    np.testing.assert_array_equal(exact["w"], np.arange(6.0).reshape(2, 3) / 4)
    with pytest.raises(ValueError, match="noise_multiplier"):
        privatize(grads, key(4), clip_norm=2.0, noise_multiplier=-1.0, expected_batch_size=4)


def test_tail_deviation_is_far_below_delta():
    # The paper's BERT-Large run: 3.4e8 parameters, 14,000 steps, epsilon 5.36 at delta 1e-8.
    large = tail_deviation(coordinates=340_000_000, steps=14_000, epsilon=5.36)
    assert large == pytest.approx((1 + math.exp(5.36)) * 340_000_000 * 14_000 * 2.0 ** -(K + 1))
    assert large < 1e-3 * 1e-8
    # The extreme the module docstring states: 1e9 coordinates, 1e6 steps, delta 1e-12, epsilon 64.
    assert tail_deviation(coordinates=10**9, steps=10**6, epsilon=64.0) < 1e-3 * 1e-12
