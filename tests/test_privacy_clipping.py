"""Per-example clipped gradient sum: bound, pass-through, padding, non-finite, micro-batching."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbert.privacy import clipping

# One compilation per (loss, shapes, clip, microbatch) instead of tracing the scan on every call.
clipped_grad_sum = jax.jit(
    clipping.clipped_grad_sum, static_argnums=0, static_argnames=("clip_norm", "microbatch_size")
)


def linear_loss(params, example, rng):
    # grad wrt (a, b) is exactly (example["x"], example["z"]): easy to reason about norms.
    del rng
    return jnp.dot(params["a"], example["x"]) + jnp.dot(params["b"], example["z"])


def keyed_loss(params, example, rng):
    # The gradient depends on the example's key, so key bookkeeping errors change the sum.
    u = jax.random.uniform(rng, ())
    return (1.0 + u) * jnp.dot(params["a"], example["x"]) + jnp.dot(params["b"], example["z"])


PARAMS = {"a": jnp.zeros(3), "b": jnp.zeros(2)}


def make_batch(x, z):
    return {"x": jnp.asarray(x, jnp.float32), "z": jnp.asarray(z, jnp.float32)}


def tree_norm(t):
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(v, np.float64))) for v in jax.tree.leaves(t))))


@pytest.mark.parametrize("scale", [1e3, 1e10, 1e30])
def test_huge_gradients_are_clipped_to_exactly_clip_norm(scale):
    clip = 0.7
    x = np.array([[1.0, -2.0, 0.5]]) * scale
    z = np.array([[3.0, 1.0]]) * scale
    total, stats = clipped_grad_sum(
        linear_loss,
        PARAMS,
        make_batch(x, z),
        jnp.zeros(1, bool),
        jax.random.key(0),
        clip_norm=clip,
        microbatch_size=1,
    )
    # One example: the sum is that example's clipped gradient, norm exactly C (not dropped).
    assert tree_norm(total) == pytest.approx(clip, rel=1e-5)
    assert float(stats.num_clipped) == 1 and float(stats.num_nonfinite) == 0
    # Direction is kept: clipping rescales the whole gradient (all leaves together).
    full = np.concatenate([x[0], z[0]])
    got = np.concatenate([np.asarray(total["a"]), np.asarray(total["b"])])
    np.testing.assert_allclose(got, full / np.linalg.norm(full) * clip, rtol=1e-5)


def test_adversarial_batch_sum_respects_sensitivity():
    clip = 1.0
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)) * 10.0 ** rng.integers(-3, 30, size=(16, 1))
    z = rng.normal(size=(16, 2)) * 10.0 ** rng.integers(-3, 30, size=(16, 1))
    batch = make_batch(x, z)
    pad = jnp.zeros(16, bool)
    full, _ = clipped_grad_sum(linear_loss, PARAMS, batch, pad, jax.random.key(0), clip_norm=clip, microbatch_size=4)
    for i in range(16):
        # Removing any one example moves the sum by at most C.
        without, _ = clipped_grad_sum(
            linear_loss, PARAMS, batch, pad.at[i].set(True), jax.random.key(0), clip_norm=clip, microbatch_size=4
        )
        diff = jax.tree.map(lambda a, b: a - b, full, without)
        assert tree_norm(diff) <= clip * (1 + 1e-5)


def test_clip_uses_global_norm_not_per_leaf_norm():
    # Each leaf has norm 0.8 (< C = 1) but together sqrt(2) * 0.8 > C: must be clipped.
    x = np.array([[0.8, 0.0, 0.0]])
    z = np.array([[0.0, 0.8]])
    total, stats = clipped_grad_sum(
        linear_loss, PARAMS, make_batch(x, z), jnp.zeros(1, bool), jax.random.key(0), clip_norm=1.0, microbatch_size=1
    )
    assert tree_norm(total) == pytest.approx(1.0, rel=1e-6)
    assert float(stats.num_clipped) == 1


def test_small_gradients_pass_unchanged():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 3)) * 0.05
    z = rng.normal(size=(8, 2)) * 0.05  # every norm well below C = 1
    total, stats = clipped_grad_sum(
        linear_loss, PARAMS, make_batch(x, z), jnp.zeros(8, bool), jax.random.key(0), clip_norm=1.0, microbatch_size=2
    )
    np.testing.assert_allclose(total["a"], x.sum(0), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(total["b"], z.sum(0), rtol=1e-6, atol=1e-7)
    assert float(stats.num_clipped) == 0 and float(stats.num_examples) == 8


def test_padding_contributes_nothing_whatever_its_content():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 3))
    z = rng.normal(size=(8, 2))
    pad = np.zeros(8, bool)
    pad[5:] = True
    garbage_x = x.copy()
    garbage_x[5] = np.nan
    garbage_x[6] = 1e30
    garbage_x[7] = np.inf
    clean, _ = clipped_grad_sum(
        linear_loss,
        PARAMS,
        make_batch(x[:5], z[:5]),
        jnp.zeros(5, bool),
        jax.random.key(0),
        clip_norm=0.5,
        microbatch_size=5,
    )
    padded, stats = clipped_grad_sum(
        linear_loss,
        PARAMS,
        make_batch(garbage_x, z),
        jnp.asarray(pad),
        jax.random.key(0),
        clip_norm=0.5,
        microbatch_size=4,
    )
    for k in clean:
        np.testing.assert_allclose(padded[k], clean[k], rtol=1e-6)
    assert float(stats.num_examples) == 5 and float(stats.num_nonfinite) == 0


def test_nonfinite_example_contributes_zero_and_is_counted():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 3))
    z = rng.normal(size=(4, 2))
    bad = x.copy()
    bad[1] = [np.nan, 0.0, 1.0]
    bad[3] = [np.inf, 0.0, 0.0]
    expected, _ = clipped_grad_sum(
        linear_loss,
        PARAMS,
        make_batch(x[[0, 2]], z[[0, 2]]),
        jnp.zeros(2, bool),
        jax.random.key(0),
        clip_norm=1.0,
        microbatch_size=1,
    )
    got, stats = clipped_grad_sum(
        linear_loss, PARAMS, make_batch(bad, z), jnp.zeros(4, bool), jax.random.key(0), clip_norm=1.0, microbatch_size=2
    )
    for k in got:
        assert np.all(np.isfinite(got[k]))
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-6)
    assert float(stats.num_nonfinite) == 2
    assert np.isfinite(float(stats.loss_sum))


def test_result_does_not_depend_on_microbatch_size():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 3)) * 3
    z = rng.normal(size=(16, 2)) * 3
    pad = jnp.asarray(np.arange(16) >= 13)
    results = [
        clipped_grad_sum(
            keyed_loss, PARAMS, make_batch(x, z), pad, jax.random.key(7), clip_norm=1.0, microbatch_size=m
        )[0]
        for m in (1, 4, 16)
    ]
    for other in results[1:]:
        for k in other:
            np.testing.assert_allclose(other[k], results[0][k], rtol=1e-5, atol=1e-6)
    # position_offset shifts every example's key: a different sum (the keys matter).
    shifted, _ = clipped_grad_sum(
        keyed_loss,
        PARAMS,
        make_batch(x, z),
        pad,
        jax.random.key(7),
        clip_norm=1.0,
        microbatch_size=4,
        position_offset=16,
    )
    assert not np.allclose(shifted["a"], results[0]["a"])


def test_bad_arguments_name_the_field():
    batch = make_batch(np.ones((4, 3)), np.ones((4, 2)))
    pad = jnp.zeros(4, bool)
    with pytest.raises(ValueError, match="clip_norm"):
        clipping.clipped_grad_sum(linear_loss, PARAMS, batch, pad, jax.random.key(0), clip_norm=0.0, microbatch_size=2)
    with pytest.raises(ValueError, match="microbatch_size"):
        clipping.clipped_grad_sum(linear_loss, PARAMS, batch, pad, jax.random.key(0), clip_norm=1.0, microbatch_size=3)
    with pytest.raises(ValueError, match="leading dimension"):
        clipping.clipped_grad_sum(
            linear_loss, PARAMS, batch, jnp.zeros(5, bool), jax.random.key(0), clip_norm=1.0, microbatch_size=1
        )
