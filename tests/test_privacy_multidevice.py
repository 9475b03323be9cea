"""The DP step on 1 vs 8 fake CPU devices: same update, noise once on the global sum.

XLA fixes the number of host devices when jax initializes, so the comparison runs in a fresh
interpreter with XLA_FLAGS set before jax is imported (other test modules import jax first).
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from xla import subprocess_env

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from dpbert.privacy import data_mesh, make_dp_train_step, step_key

    assert jax.device_count() == 8, jax.devices()

    def loss_fn(params, example, rng):
        keep = jax.random.bernoulli(rng, 0.8, example["x"].shape)
        pred = jnp.tanh(params["w1"] @ (example["x"] * keep)) @ params["w2"]
        return (pred - example["y"]) ** 2

    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
              "w2": jnp.asarray(rng.normal(size=8), jnp.float32)}
    physical = 64
    batch = {"x": jnp.asarray(rng.normal(size=(physical, 4)) * 3, jnp.float32),
             "y": jnp.asarray(rng.normal(size=physical), jnp.float32)}
    pad = jnp.asarray(np.arange(physical) >= 50)
    key = step_key(jax.random.key(5), 9)

    def grad_of(mesh, micro, sigma, d_params=params):
        step = make_dp_train_step(loss_fn, optax.sgd(1.0), clip_norm=1.0, noise_multiplier=sigma,
                                  expected_batch_size=48, microbatch_size=micro, mesh=mesh, donate=False)
        new, _, m = step(d_params, optax.sgd(1.0).init(d_params), batch, pad, key)
        return {k: np.asarray(d_params[k] - new[k]).tolist() for k in d_params}, float(m["nonprivate/clipped_fraction"])

    out = {}
    out["none_0.0"] = grad_of(None, 8, 0.0)
    out["eight_0.0"] = grad_of(data_mesh(), 2, 0.0)
    out["eight_m8_0.0"] = grad_of(data_mesh(), 8, 0.0)
    out["none_1.5"] = grad_of(None, 8, 1.5)
    out["one_1.5"] = grad_of(data_mesh(jax.devices()[:1]), 8, 1.5)
    out["eight_1.5"] = grad_of(data_mesh(), 2, 1.5)

    # Noise scale on 8 devices: zero-gradient loss, many coordinates.
    d = 40_000
    zparams = {"w": jnp.zeros(d)}
    def zero_loss(p, example, rng):
        return 0.0 * example["y"] * jnp.sum(p["w"])
    stds = {}
    for name, mesh in (("one", data_mesh(jax.devices()[:1])), ("eight", data_mesh())):
        step = make_dp_train_step(zero_loss, optax.sgd(1.0), clip_norm=0.5, noise_multiplier=2.0,
                                  expected_batch_size=100, microbatch_size=4, mesh=mesh, donate=False)
        new, _, _ = step(zparams, optax.sgd(1.0).init(zparams), batch, pad, key)
        stds[name] = float(np.std(np.asarray(new["w"])))
    out["stds"] = stds
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def results():
    env = subprocess_env(8)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    for k in a[0]:
        np.testing.assert_allclose(np.asarray(a[0][k]), np.asarray(b[0][k]), rtol=rtol, atol=atol)
    assert a[1] == pytest.approx(b[1])


def test_eight_devices_give_the_same_clipped_average_as_one(results):
    # sigma = 0: the per-device clipped sums, psummed, equal the single-device sum for any
    # micro-batch size (a gradient psummed twice, or per-device keys, would break this).
    for name in ("eight_0.0", "eight_m8_0.0"):
        assert_same(results[name], results["none_0.0"])


def test_one_and_eight_devices_give_the_same_noisy_update(results):
    for name in ("one_1.5", "eight_1.5"):
        assert_same(results[name], results["none_1.5"])


def test_noise_is_added_once_on_the_global_sum(results):
    target = 2.0 * 0.5 / 100
    stds = results["stds"]
    # Per-device noise would give sqrt(8) times the std on 8 devices.
    assert stds["one"] == pytest.approx(target, rel=0.03)
    assert stds["eight"] == pytest.approx(target, rel=0.03)
    assert stds["eight"] == pytest.approx(stds["one"], rel=1e-6)
