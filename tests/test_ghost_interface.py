"""The ghost-clipping interface with models that are not BERT, written here in plain JAX: a
2-layer MLP (dense taps, dropout keys) and a tiny GPT-style decoder (token and position tables,
a scanned stack of LayerNorm + causal attention + MLP blocks, a final LayerNorm, a decoder tied
to the token table and an output bias). Their ghost-clipped sums equal explicit per-example
clipping (per-example gradients, clip, sum), padding and non-finite examples contribute exactly
zero, and a loss whose taps do not cover the parameters is refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpbert.privacy.ghost_clipping import (
    Bias,
    Dense,
    Lookup,
    Positions,
    ScaleBias,
    Tape,
    TapGroup,
    ghost_clipped_grad_sum,
    ghost_sq_norms,
)

B, MB = 6, 3


def _init(rng: np.random.Generator, shapes: dict) -> dict:
    return {
        k: _init(rng, v) if isinstance(v, dict) else jnp.asarray(rng.normal(0, 0.3, v), jnp.float32)
        for k, v in shapes.items()
    }


def _reference(loss, params, batch, is_padding, key, clip_norm):
    """Explicit per-example clipping: each real example's gradient (key fold_in(key, i)), scaled to
    norm <= clip_norm, summed; non-finite examples skipped. Returns (sum, norms)."""
    grad = jax.jit(jax.grad(loss))
    total = jax.tree_util.tree_map(jnp.zeros_like, params)
    norms = []
    for i in range(is_padding.shape[0]):
        g = grad(params, jax.tree_util.tree_map(lambda x, i=i: x[i], batch), jax.random.fold_in(key, i))
        norm = float(optax.tree.norm(g))
        norms.append(norm)
        if bool(is_padding[i]) or not np.isfinite(norm):
            continue
        scale = min(1.0, clip_norm / norm)
        total = jax.tree_util.tree_map(lambda t, x, s=scale: t + s * x, total, g)
    return total, np.asarray(norms)


def _assert_close(got, want):
    scale = float(optax.tree.norm(want))
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        err = float(jnp.max(jnp.abs(a - flat_want[path])))
        assert err <= 2e-5 * scale + 1e-6, f"{jax.tree_util.keystr(path)}: max error {err} (sum norm {scale})"


def _ghost(loss, params, batch, is_padding, key, clip_norm):
    return jax.jit(
        lambda p, b: ghost_clipped_grad_sum(loss, p, b, is_padding, key, clip_norm=clip_norm, microbatch_size=MB)
    )(params, batch)


# ----------------------------------------------------------------------------- a 2-layer MLP


@dataclasses.dataclass(frozen=True)
class MLPLoss:
    """Cross-entropy of a tanh MLP with dropout on its hidden layer; `mode` for both dense taps."""

    mode: str = "mixed"
    dropout: float = 0.25

    def __call__(self, params, example, rng):
        return self.tapped(params, example, rng, None)[0]

    def tap_groups(self, params):
        return {
            "mlp": TapGroup(
                {
                    "l1": Dense(("l1", "kernel"), ("l1", "bias"), mode=self.mode),
                    "l2": Dense(("l2", "kernel"), ("l2", "bias"), mode=self.mode),
                }
            )
        }

    def tapped(self, params, example, rng, z):
        tape = Tape(None if z is None else z["mlp"])
        x = example["x"]
        h = jnp.tanh(tape("l1", x @ params["l1"]["kernel"] + params["l1"]["bias"], x))
        keep = jax.random.bernoulli(rng, 1.0 - self.dropout, h.shape)
        h = jnp.where(keep, h / (1.0 - self.dropout), 0.0)
        logits = tape("l2", h @ params["l2"]["kernel"] + params["l2"]["bias"], h)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, example["y"])
        return loss, {"mlp": tape.inputs}, {"mlp": tape.outputs}


@pytest.fixture(scope="module")
def mlp():
    rng = np.random.default_rng(0)
    params = _init(rng, {"l1": {"kernel": (5, 7), "bias": (7,)}, "l2": {"kernel": (7, 3), "bias": (3,)}})
    batch = {"x": jnp.asarray(rng.normal(0, 2.0, (B, 5)), jnp.float32), "y": jnp.asarray(rng.integers(0, 3, B))}
    # A padding row full of NaN: it must not matter.
    batch["x"] = batch["x"].at[2].set(jnp.nan)
    return params, batch, jnp.asarray([False, False, True, False, False, False]), jax.random.key(3)


@pytest.mark.parametrize("mode", ["ghost", "instantiate"])
def test_mlp_ghost_sum_equals_per_example_clipping(mlp, mode):
    params, batch, is_padding, key = mlp
    loss = MLPLoss(mode=mode)
    _, norms = _reference(loss, params, batch, is_padding, key, 1.0)
    real = norms[~np.asarray(is_padding)]
    clip_norm = float(np.mean(np.sort(real)[1:3]))  # between the 2nd and 3rd smallest: 3 of 5 clipped
    want, _ = _reference(loss, params, batch, is_padding, key, clip_norm)
    got, stats = _ghost(loss, params, batch, is_padding, key, clip_norm)
    _assert_close(got, want)
    assert float(stats.num_examples) == 5 and float(stats.num_clipped) == 3
    # The ghost norms themselves are the per-example gradient norms.
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(B))
    _, sq = ghost_sq_norms(loss, params, batch, keys)
    np.testing.assert_allclose(np.sqrt(np.asarray(sq))[~np.asarray(is_padding)], real, rtol=1e-5)


def test_mlp_nonfinite_example_contributes_exactly_zero(mlp):
    params, batch, is_padding, key = mlp
    loss = MLPLoss()
    bad = dict(batch, x=batch["x"].at[4, 1].set(jnp.inf))
    got, stats = _ghost(loss, params, bad, is_padding, key, 0.5)
    want, _ = _reference(loss, params, batch, is_padding.at[4].set(True), key, 0.5)
    _assert_close(got, want)
    assert float(stats.num_nonfinite) == 1 and float(stats.num_examples) == 5
    # Alone in the batch (every other row padding), it adds exact zeros.
    alone, stats = _ghost(loss, params, bad, jnp.arange(B) != 4, key, 0.5)
    assert all(bool(jnp.all(x == 0)) for x in jax.tree_util.tree_leaves(alone))
    assert float(stats.num_nonfinite) == 1


def test_taps_must_cover_every_parameter_once(mlp):
    params, batch, is_padding, key = mlp
    loss = MLPLoss()
    extra = dict(params, l3={"kernel": jnp.ones((3, 2))})
    with pytest.raises(ValueError, match=r"without a tap.*l3/kernel"):
        _ghost(loss, extra, batch, is_padding, key, 1.0)

    @dataclasses.dataclass(frozen=True)
    class Declared(MLPLoss):
        groups: tuple = ()

        def tap_groups(self, params):
            return {"mlp": TapGroup(dict(self.groups))}

    l1, l2 = Dense(("l1", "kernel"), ("l1", "bias")), Dense(("l2", "kernel"), ("l2", "bias"))
    twice = Declared(groups=(("l1", l1), ("l2", Dense(("l1", "kernel"), ("l2", "bias")))))
    with pytest.raises(ValueError, match="l1/kernel is tapped by mlp/l1, mlp/l2"):
        _ghost(twice, params, batch, is_padding, key, 1.0)
    absent = Declared(groups=(("l1", l1), ("l2", Dense(("l2", "weight"), ("l2", "bias")))))
    with pytest.raises(ValueError, match="l2/weight is not a parameter"):
        _ghost(absent, params, batch, is_padding, key, 1.0)
    # Declared taps that the forward does not record are refused too.
    with pytest.raises(ValueError, match="recorded taps"):
        _ghost(Declared(groups=(("l1", l1), ("l2b", l2))), params, batch, is_padding, key, 1.0)
    with pytest.raises(ValueError, match="GhostLoss"):
        ghost_clipped_grad_sum(lambda p, e, r: 0.0, params, batch, is_padding, key, clip_norm=1.0, microbatch_size=MB)


# ----------------------------------------------------------------------------- a tiny GPT


H, L, LAYERS = 8, 10, 3


def _layer_norm(tape: Tape, name: str, p: dict, x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, -1, keepdims=True)
    xhat = (x - mean) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5)
    return tape(name, xhat * p["scale"] + p["bias"], xhat)


def _dense(tape: Tape, name: str, p: dict, x: jax.Array) -> jax.Array:
    return tape(name, x @ p["kernel"] + p["bias"], x)


BLOCK_TAPS = {
    "ln1": ScaleBias(("ln1", "scale"), ("ln1", "bias")),
    **{n: Dense((n, "kernel"), (n, "bias")) for n in ("q", "k", "v", "o", "fc", "proj")},
    "ln2": ScaleBias(("ln2", "scale"), ("ln2", "bias")),
}


@dataclasses.dataclass(frozen=True)
class GPTLoss:
    """Next-token cross-entropy (weighted mean) of a pre-LayerNorm causal decoder whose blocks
    are stacked on a leading axis and run under `lax.scan`; the decoder is tied to `wte`."""

    def __call__(self, params, example, rng):
        return self.tapped(params, example, rng, None)[0]

    def tap_groups(self, params):
        top = {
            "wte": Lookup(("wte",)),
            "wpe": Positions(("wpe",)),
            "ln_f": ScaleBias(("ln_f", "scale"), ("ln_f", "bias")),
            "decoder": Dense(("wte",), transposed=True),
            "out_bias": Bias(("out_bias",)),
        }
        return {"top": TapGroup(top), "blocks": TapGroup(BLOCK_TAPS, stacked_at=("blocks",))}

    def tapped(self, params, example, rng, z):
        tape = Tape(None if z is None else z["top"])
        ids = example["ids"]
        x = tape("wte", params["wte"][ids], ids) + tape("wpe", params["wpe"][: ids.shape[0]])
        causal = jnp.tril(jnp.ones((ids.shape[0], ids.shape[0]), bool))

        def block(x, xs):
            p, z_i = xs
            t = Tape(z_i)
            h = _layer_norm(t, "ln1", p["ln1"], x)
            q, k, v = (_dense(t, n, p[n], h) for n in ("q", "k", "v"))
            att = jax.nn.softmax(jnp.where(causal, q @ k.T / np.sqrt(H), -1e9), axis=-1)
            x = x + _dense(t, "o", p["o"], att @ v)
            h = _layer_norm(t, "ln2", p["ln2"], x)
            x = x + _dense(t, "proj", p["proj"], jax.nn.gelu(_dense(t, "fc", p["fc"], h)))
            return x, (t.inputs, t.outputs if z is None else None)

        x, (block_inputs, block_outputs) = jax.lax.scan(
            block, x, (params["blocks"], None if z is None else z["blocks"])
        )
        x = _layer_norm(tape, "ln_f", params["ln_f"], x)
        logits = tape("out_bias", tape("decoder", x @ params["wte"].T, x) + params["out_bias"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:-1], ids[1:])
        w = example["weights"][1:]
        loss = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)
        return loss, {"top": tape.inputs, "blocks": block_inputs}, {"top": tape.outputs, "blocks": block_outputs}


@pytest.mark.parametrize("vocab", [7, 61])  # 7 <= L ids: per-example table rows; 61: scattered rows
def test_tiny_gpt_ghost_sum_equals_per_example_clipping(vocab):
    rng = np.random.default_rng(1)
    block = {
        "ln1": {"scale": (H,), "bias": (H,)},
        **{n: {"kernel": (H, H), "bias": (H,)} for n in ("q", "k", "v", "o")},
        "fc": {"kernel": (H, 2 * H), "bias": (2 * H,)},
        "proj": {"kernel": (2 * H, H), "bias": (H,)},
        "ln2": {"scale": (H,), "bias": (H,)},
    }
    params = _init(rng, {"wte": (vocab, H), "wpe": (L + 2, H), "ln_f": {"scale": (H,), "bias": (H,)}})
    params["out_bias"] = jnp.asarray(rng.normal(0, 0.3, vocab), jnp.float32)
    params["blocks"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[_init(rng, block) for _ in range(LAYERS)])
    ids = rng.integers(0, vocab, (B, L))
    ids[:, 3] = ids[:, 6]  # a token twice: its row gets two input gradients
    weights = np.ones((B, L), np.float32)
    weights[1, 7:] = 0
    batch = {"ids": jnp.asarray(ids, jnp.int32), "weights": jnp.asarray(weights)}
    is_padding = jnp.asarray([False, True, False, False, False, False])
    loss, key = GPTLoss(), jax.random.key(5)
    _, norms = _reference(loss, params, batch, is_padding, key, 1.0)
    real = norms[~np.asarray(is_padding)]
    clip_norm = float(np.mean(np.sort(real)[1:3]))
    want, _ = _reference(loss, params, batch, is_padding, key, clip_norm)
    got, stats = _ghost(loss, params, batch, is_padding, key, clip_norm)
    _assert_close(got, want)
    assert float(stats.num_clipped) == 3
    # The tied table gets both its uses: lookup rows and decoder.
    assert float(jnp.abs(got["wte"]).sum()) > 0
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(B))
    _, sq = ghost_sq_norms(loss, params, batch, keys)
    np.testing.assert_allclose(np.sqrt(np.asarray(sq))[~np.asarray(is_padding)], real, rtol=1e-4)
    # A non-finite example (an infinite weight) is dropped exactly: the sum is that without it.
    bad = dict(batch, weights=batch["weights"].at[3, 2].set(jnp.inf))
    got, stats = _ghost(loss, params, bad, is_padding, key, clip_norm)
    want, _ = _reference(loss, params, batch, is_padding.at[3].set(True), key, clip_norm)
    _assert_close(got, want)
    assert float(stats.num_nonfinite) == 1
