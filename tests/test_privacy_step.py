"""The DP-SGD step: noise scale, division by the expected batch, replay, metrics, baseline."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from dpbert.privacy import (
    default_optimizer,
    make_dp_train_step,
    make_train_step,
    noise_key,
    privatize,
    step_key,
)


def quadratic_loss(params, example, rng):
    # Dropout-like use of the key so that per-example keys matter.
    keep = jax.random.bernoulli(rng, 0.9, example["x"].shape)
    pred = params["w"] @ (example["x"] * keep) + params["b"]
    return jnp.sum((pred - example["y"]) ** 2)


def init_params():
    return {"w": jnp.full((2, 3), 0.1), "b": jnp.zeros(2)}


def make_batch(n, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(n, 3)) * scale, jnp.float32),
        "y": jnp.asarray(rng.normal(size=(n, 2)), jnp.float32),
    }


def sgd_grad(step, params, batch, pad, key):
    """Run one step with SGD(lr=1) and return the gradient it applied."""
    opt = optax.sgd(1.0)
    new, _, metrics = step(params, opt.init(params), batch, pad, key)
    return jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, new), metrics


def test_sigma_zero_equals_average_of_one_by_one_clipped_grads():
    clip, expected_b = 3.0, 12
    batch = make_batch(16, scale=1.0)  # gradient norms 1-8: a mix of clipped and unclipped
    pad = np.zeros(16, bool)
    pad[10:] = True
    batch_with_garbage = {k: v.at[12].set(jnp.nan) for k, v in batch.items()}
    key = step_key(jax.random.key(3), 5)
    step = make_dp_train_step(
        quadratic_loss,
        optax.sgd(1.0),
        clip_norm=clip,
        noise_multiplier=0.0,
        expected_batch_size=expected_b,
        microbatch_size=4,
        donate=False,
    )
    grad, metrics = sgd_grad(step, init_params(), batch_with_garbage, jnp.asarray(pad), key)

    # Reference: one example at a time, with the same per-example key the step must use.
    example_parent = jax.random.fold_in(key, 1)
    total = {"w": np.zeros((2, 3)), "b": np.zeros(2)}
    clipped = 0
    for i in range(10):
        ex = {k: v[i] for k, v in batch.items()}
        g = jax.grad(quadratic_loss)(init_params(), ex, jax.random.fold_in(example_parent, i))
        norm = np.sqrt(sum(np.sum(np.square(np.asarray(v))) for v in g.values()))
        clipped += norm > clip
        for k in total:
            total[k] += np.asarray(g[k]) * min(1.0, clip / norm)
    assert 0 < clipped < 10
    for k in total:
        # Divided by the expected batch size (12), not the realized one (10).
        np.testing.assert_allclose(grad[k], total[k] / expected_b, rtol=1e-5, atol=1e-7)
    assert float(metrics["nonprivate/batch_size"]) == 10
    assert float(metrics["nonprivate/clipped_fraction"]) == pytest.approx(clipped / 10)


def zero_grad_loss(params, example, rng):
    # Gradient exactly zero but data-dependent (a constant one gets constant-folded slowly).
    del rng
    return 0.0 * example["x"][0] * jnp.sum(params["w"])


@pytest.mark.parametrize("physical", [16, 64])
def test_noise_std_is_sigma_c_over_expected_b_for_any_microbatching(physical):
    sigma, clip, expected_b, d = 2.0, 0.5, 100, 100_000
    params = {"w": jnp.zeros(d)}
    batch = {"x": jnp.ones((physical, 2))}
    pad = jnp.asarray(np.arange(physical) >= 10)
    key = step_key(jax.random.key(11), 0)
    updates = []
    for micro in (1, 4, 16):
        step = make_dp_train_step(
            zero_grad_loss,
            optax.sgd(1.0),
            clip_norm=clip,
            noise_multiplier=sigma,
            expected_batch_size=expected_b,
            microbatch_size=micro,
            donate=False,
        )
        grad, _ = sgd_grad(step, params, batch, pad, key)
        updates.append(grad["w"])
    target = sigma * clip / expected_b
    for u in updates:
        # std of 100k draws: relative standard error 1/sqrt(2d) = 0.22%; 1.5% is 6.7 standard errors.
        assert np.std(u) == pytest.approx(target, rel=0.015)
        assert abs(np.mean(u)) < 5 * target / np.sqrt(d)
        # Noise is drawn once from the step key: identical for every micro-batching.
        np.testing.assert_array_equal(u, updates[0])


def test_noise_is_gaussian_and_independent_across_steps_and_leaves():
    # Noise keys are Threefry-4x32 (128-bit keys); the noise they give must still be N(0, s^2).
    root = jax.random.key(7)
    assert jax.random.key_data(noise_key(step_key(root, 0))).shape == (4,)
    sigma, clip, d = 1.5, 2.0, 200_000
    zeros = {"a": jnp.zeros(d), "b": jnp.zeros(d)}
    draws = [
        privatize(zeros, noise_key(step_key(root, t)), clip_norm=clip, noise_multiplier=sigma, expected_batch_size=1)
        for t in (0, 1)
    ]
    for noise in draws:
        for leaf in jax.tree.leaves(noise):
            x = np.asarray(leaf) / (sigma * clip)
            # Scale: the std of 200k draws has relative standard error 0.16%; 1% is 6 of them.
            assert np.std(x) == pytest.approx(1.0, rel=0.01)
            # Shape: Kolmogorov-Smirnov against N(0, 1) (a uniform of the same std gives p ~ 0).
            assert stats.kstest(x, "norm").pvalue > 1e-4
    pairs = [(draws[0]["a"], draws[1]["a"]), (draws[0]["a"], draws[0]["b"])]
    for x, y in pairs:  # steps and leaves get independent streams: |corr| ~ 1/sqrt(d) = 0.0022
        assert abs(np.corrcoef(np.asarray(x), np.asarray(y))[0, 1]) < 0.012


def test_replaying_a_step_gives_identical_update():
    batch = make_batch(8)
    pad = jnp.zeros(8, bool)
    opt = default_optimizer(1e-2, weight_decay=0.1)
    step = make_dp_train_step(
        quadratic_loss, opt, clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, microbatch_size=4
    )
    run_key = jax.random.key(0)

    def run(t):
        params = init_params()  # fresh buffers each time: the step donates its inputs
        new, state, _ = step(params, opt.init(params), batch, pad, step_key(run_key, t))
        return new, state

    a, sa = run(3)
    b, sb = run(3)
    c, _ = run(4)
    for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.allclose(a["w"], c["w"])


def test_metrics_are_labelled_private_or_nonprivate():
    step = make_dp_train_step(
        quadratic_loss,
        optax.sgd(0.1),
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8,
        microbatch_size=2,
        donate=False,
    )
    params = init_params()
    _, _, metrics = step(params, optax.sgd(0.1).init(params), make_batch(8), jnp.zeros(8, bool), jax.random.key(1))
    assert metrics and all(k.startswith(("private/", "nonprivate/")) for k in metrics)
    assert {"nonprivate/loss", "nonprivate/clipped_fraction", "nonprivate/nonfinite_examples"} <= set(metrics)


def test_nonprivate_step_is_the_plain_mean_gradient():
    batch = make_batch(8)
    pad = jnp.asarray(np.arange(8) >= 6)
    key = step_key(jax.random.key(2), 0)
    step = make_train_step(quadratic_loss, optax.sgd(1.0), microbatch_size=2, donate=False)
    grad, metrics = sgd_grad(step, init_params(), batch, pad, key)
    example_parent = jax.random.fold_in(key, 1)
    expected = jax.tree.map(
        lambda *gs: np.mean(np.stack(gs), axis=0),
        *[
            jax.grad(quadratic_loss)(
                init_params(), {k: v[i] for k, v in batch.items()}, jax.random.fold_in(example_parent, i)
            )
            for i in range(6)
        ],
    )
    for k in expected:
        np.testing.assert_allclose(grad[k], expected[k], rtol=1e-5, atol=1e-7)
    assert float(metrics["nonprivate/batch_size"]) == 6


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("clip_norm", {"clip_norm": 0.0}),
        ("clip_norm", {"clip_norm": -1.0}),
        ("noise_multiplier", {"noise_multiplier": -0.1}),
        ("expected_batch_size", {"expected_batch_size": 0}),
        ("microbatch_size", {"microbatch_size": 0}),
    ],
)
def test_bad_step_config_names_the_field(field, kwargs):
    config = {"clip_norm": 1.0, "noise_multiplier": 1.0, "expected_batch_size": 8, "microbatch_size": 2} | kwargs
    with pytest.raises(ValueError, match=field):
        make_dp_train_step(quadratic_loss, optax.sgd(0.1), **config)


def test_parameter_average_is_the_debiased_ema_of_the_iterates():
    """`default_optimizer(ema_decay=d)` updates the parameters exactly as AdamW does and keeps
    sum_s (1 - d) d^(t-s) theta_s / (1 - d^t) of the iterates theta_1..theta_t."""
    from dpbert.privacy.dp_step import ema_params

    decay = 0.9
    params = {"w": jnp.array([1.0, -2.0, 0.5])}
    plain, averaged = (
        default_optimizer(1e-1, weight_decay=0.1),
        default_optimizer(1e-1, weight_decay=0.1, ema_decay=decay),
    )
    s_plain, s_avg = plain.init(params), averaged.init(params)
    assert jnp.array_equal(ema_params(s_avg, params, decay)["w"], params["w"])  # before any update
    p1 = p2 = params
    iterates = []
    for t in range(5):
        grads = {"w": jnp.array([0.3, -0.1, 0.2]) * (t + 1)}
        u1, s_plain = plain.update(grads, s_plain, p1)
        u2, s_avg = averaged.update(grads, s_avg, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
        np.testing.assert_array_equal(p1["w"], p2["w"])
        iterates.append(np.asarray(p2["w"], np.float64))
    t = len(iterates)
    expected = sum((1 - decay) * decay ** (t - 1 - s) * x for s, x in enumerate(iterates)) / (1 - decay**t)
    np.testing.assert_allclose(ema_params(s_avg, p2, decay)["w"], expected, rtol=1e-6)
    with pytest.raises(ValueError, match="ema_decay"):
        default_optimizer(1e-1, ema_decay=1.0)
    with pytest.raises(ValueError, match="no parameter average"):
        ema_params(s_plain, p1, decay)
