"""Ghost clipping vs per-example gradients computed one by one (tiny BERT, padding, tied
embeddings, token types), the sequence-classification loss (every parameter) vs vmap clipping,
and the choice of path leaves the noise and the accounting alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from transformers import BertConfig

from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM, BertForSequenceClassification
from dpbert.model.ghost import ClassifierGhostLoss, MLMGhostLoss
from dpbert.privacy.clipping import clipped_grad_sum
from dpbert.privacy.dp_step import clipped_sum_for, make_dp_train_step
from dpbert.privacy.ghost_clipping import ghost_clipped_grad_sum, ghost_sq_norms

V, L, P, B, MB = 61, 12, 4, 6, 3


@pytest.fixture(scope="module")
def setup():
    config = BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        type_vocab_size=3,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    graphdef, params = functional.split_params(BertForMaskedLM(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    ids = rng.integers(1, V, (B, L))
    ids[:, 4] = ids[:, 7]  # a token twice in one example: its table row gets two input gradients
    mask = np.ones((B, L), np.int32)
    mask[1, 8:] = 0
    mask[3, 5:] = 0
    positions = rng.integers(1, 5, (B, P))
    labels = rng.integers(0, V, (B, P))
    labels[:, 0] = ids[np.arange(B), positions[:, 0]]  # decoder and input rows overlap: cross term
    batch = {
        "input_ids": jnp.asarray(ids, jnp.int32),
        "attention_mask": jnp.asarray(mask),
        "token_type_ids": jnp.asarray(rng.integers(0, 3, (B, L)), jnp.int32),
        "masked_positions": jnp.asarray(positions, jnp.int32),
        "labels": jnp.asarray(labels, jnp.int32),
        "label_weights": jnp.asarray([[1, 1, 0, 1]] * B, jnp.float32),
    }
    is_padding = jnp.asarray([False, False, True, False, False, False])
    loss = MLMGhostLoss(graphdef=graphdef)
    key = jax.random.key(7)
    # Reference: each example's gradient on its own (no vmap), with its key fold_in(key, i).
    grad_one = jax.jit(jax.grad(loss))
    per_example = [
        grad_one(params, jax.tree_util.tree_map(lambda x, i=i: x[i], batch), jax.random.fold_in(key, i))
        for i in range(B)
    ]
    return loss, params, batch, is_padding, key, per_example


def _reference(per_example, is_padding, clip_norm):
    total = jax.tree_util.tree_map(jnp.zeros_like, per_example[0])
    for g, pad in zip(per_example, np.asarray(is_padding)):
        if pad:
            continue
        scale = min(1.0, clip_norm / float(optax.tree.norm(g)))
        total = jax.tree_util.tree_map(lambda t, x, s=scale: t + x * s, total, g)
    return total


def _assert_close(got, want):
    scale = float(optax.tree.norm(want))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
        err = float(jnp.max(jnp.abs(a - b)))
        assert err <= 2e-5 * scale + 1e-6, f"{jax.tree_util.keystr(path)}: max error {err} (sum norm {scale})"


def test_both_paths_equal_per_example_grads_one_by_one(setup):
    loss, params, batch, is_padding, key, per_example = setup
    norms = sorted(float(optax.tree.norm(g)) for g, p in zip(per_example, is_padding) if not p)
    clip_norm = (norms[1] + norms[2]) / 2  # some examples clipped, some not
    want = _reference(per_example, is_padding, clip_norm)
    kw = dict(clip_norm=clip_norm, microbatch_size=MB)
    for impl in (clipped_grad_sum, ghost_clipped_grad_sum):
        got, stats = jax.jit(lambda p, impl=impl: impl(loss, p, batch, is_padding, key, **kw))(params)
        _assert_close(got, want)
        assert float(stats.num_examples) == 5 and float(stats.num_clipped) == 3
    # Every parameter got a gradient from both uses of the tied table (a real check, not zeros).
    word = got["bert"]["embeddings"]["word_embeddings"]["embedding"]
    assert float(jnp.abs(word).sum()) > 0 and "decoder" not in params["cls"]["predictions"]


def test_position_ids_keep_ghost_norms_and_sums_exact(setup):
    loss, params, batch, is_padding, key, _ = setup
    # Per-example offsets into the 16-row table (sequences of 12), and one example whose ids
    # repeat (a row then receives two positions' gradients, as a Lookup row does).
    offsets = np.array([0, 4, 1, 3, 4, 0])
    positions = offsets[:, None] + np.arange(L)[None]
    positions[5] = np.minimum(np.arange(L), 6)
    batch = dict(batch, position_ids=jnp.asarray(positions, jnp.int32))
    grad_one = jax.jit(jax.grad(loss))
    per_example = [
        grad_one(params, jax.tree_util.tree_map(lambda x, i=i: x[i], batch), jax.random.fold_in(key, i))
        for i in range(B)
    ]
    # The ids are used: rows past the sequence length get gradients (example 4, unpadded, offset 4),
    # those of offset 0 do not.
    rows = [g["bert"]["embeddings"]["position_embeddings"]["embedding"] for g in per_example]
    assert float(jnp.abs(rows[4][L:]).sum()) > 0 and float(jnp.abs(rows[0][L:]).sum()) == 0
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(B))
    _, sq = jax.jit(lambda p: ghost_sq_norms(loss, p, batch, keys))(params)
    want_norms = np.array([float(optax.tree.norm(g)) for g in per_example])
    np.testing.assert_allclose(np.sqrt(np.asarray(sq)), want_norms, rtol=2e-5)
    clip_norm = float(np.median(want_norms))
    want = _reference(per_example, is_padding, clip_norm)
    kw = dict(clip_norm=clip_norm, microbatch_size=MB)
    for impl in (clipped_grad_sum, ghost_clipped_grad_sum):
        got, _ = jax.jit(lambda p, impl=impl: impl(loss, p, batch, is_padding, key, **kw))(params)
        _assert_close(got, want)


@pytest.mark.parametrize("layer_mode", ["ghost", "instantiate"])
def test_every_layer_mode_equals_per_example_grads_one_by_one(setup, layer_mode):
    loss, params, batch, is_padding, key, per_example = setup
    # The default "mixed" mode is covered above; these force one mode on every dense kernel.
    loss = MLMGhostLoss(graphdef=loss.graphdef, layer_mode=layer_mode)
    clip_norm = float(np.median([float(optax.tree.norm(g)) for g in per_example]))
    want = _reference(per_example, is_padding, clip_norm)
    got, stats = jax.jit(
        lambda p: ghost_clipped_grad_sum(loss, p, batch, is_padding, key, clip_norm=clip_norm, microbatch_size=MB)
    )(params)
    _assert_close(got, want)
    assert float(stats.num_examples) == 5


def test_mixed_mode_picks_the_cheaper_form_per_shape():
    from dpbert.privacy.ghost_clipping import dense_layer_mode

    # Accelerators, by flops. Long sequences: the per-example gradient (T d_in d_out) beats Gram
    # matrices (T^2 (d_in + d_out)); few positions (the MLM head at P masked positions): ghost norms.
    assert dense_layer_mode("mixed", 128, 768, 3072, backend="tpu") == "instantiate"
    assert dense_layer_mode("mixed", 4, 1024, 4096, backend="gpu") == "ghost"
    # CPU, as measured: every encoder layer of base by ghost norms, every layer of mini
    # (256 x 256, 256 x 1024) instantiated.
    assert dense_layer_mode("mixed", 128, 768, 3072, backend="cpu") == "ghost"
    assert dense_layer_mode("mixed", 128, 3072, 768, backend="cpu") == "ghost"
    assert dense_layer_mode("mixed", 128, 768, 768, backend="cpu") == "ghost"
    assert dense_layer_mode("mixed", 128, 256, 256, backend="cpu") == "instantiate"
    assert dense_layer_mode("mixed", 128, 256, 1024, backend="cpu") == "instantiate"
    assert dense_layer_mode("mixed", 20, 768, 768, backend="cpu") == "ghost"
    assert dense_layer_mode("ghost", 128, 768, 3072) == "ghost"
    with pytest.raises(ValueError, match="layer_mode"):
        MLMGhostLoss(graphdef=nnx.graphdef(nnx.Linear(2, 2, rngs=nnx.Rngs(0))), layer_mode="fast")


def test_ghost_drops_nonfinite_example_exactly(setup):
    loss, params, batch, is_padding, key, per_example = setup
    bad = dict(batch, label_weights=batch["label_weights"].at[4, 0].set(jnp.nan))
    got, stats = jax.jit(
        lambda p: ghost_clipped_grad_sum(loss, p, bad, is_padding, key, clip_norm=1e9, microbatch_size=MB)
    )(params)
    want = _reference(per_example, is_padding.at[4].set(True), 1e9)
    _assert_close(got, want)
    assert float(stats.num_nonfinite) == 1


def test_clipping_method_changes_neither_noise_nor_update(setup):
    loss, params, batch, is_padding, key, _ = setup
    results = {}
    # "auto" only picks one of these two (timed on placeholder inputs), so two paths cover it.
    for method in ("vmap", "ghost"):
        step = make_dp_train_step(
            loss,
            optax.sgd(1.0),
            clip_norm=0.5,
            noise_multiplier=1.3,
            expected_batch_size=6,
            microbatch_size=MB,
            donate=False,
            clipping_method=method,
        )
        new, _, _ = step(params, optax.sgd(1.0).init(params), batch, is_padding, jax.random.key(3))
        results[method] = jax.tree_util.tree_map(lambda a, b: a - b, new, params)
    # Same noise draw and same clipped sum: the updates agree to float tolerance.
    _assert_close(results["ghost"], results["vmap"])


def test_bad_clipping_method_is_named():
    with pytest.raises(ValueError, match="clipping_method"):
        clipped_sum_for("fast", lambda p, e, r: 0.0)
    with pytest.raises(ValueError, match="GhostLoss"):
        clipped_sum_for("ghost", lambda p, e, r: 0.0)


def test_auto_microbatch_size_is_largest_that_fits():
    from dpbert.privacy.tuning import auto_microbatch_size, microbatch_peak_bytes

    params = {"w": jnp.zeros((128, 128))}
    example = {"x": jax.ShapeDtypeStruct((128,), jnp.float32)}

    def loss(p, ex, rng):
        return jnp.sum(jnp.tanh(ex["x"] @ p["w"]))

    peaks = {m: microbatch_peak_bytes(loss, params, example, microbatch_size=m, clip_norm=1.0) for m in (4, 8)}
    # Per-example gradients are materialised: 4 more examples cost at least 4 gradients (64 KiB each).
    assert peaks[8] - peaks[4] >= 4 * 128 * 128 * 4
    assert auto_microbatch_size(loss, params, example, memory_budget_bytes=peaks[4], clip_norm=1.0, max_size=64) == 4
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        auto_microbatch_size(loss, params, example, memory_budget_bytes=16, clip_norm=1.0)


def test_fastest_microbatch_size_is_the_fastest_that_fits():
    from dpbert.privacy.tuning import fastest_microbatch_size, microbatch_peak_bytes

    params = {"w": jnp.zeros((64, 64))}
    example = {"x": jax.ShapeDtypeStruct((64,), jnp.float32)}

    def loss(p, ex, rng):
        return jnp.sum(jnp.tanh(ex["x"] @ p["w"]))

    def sum_fn(p, b, pad, rng, *, microbatch_size):
        return clipped_grad_sum(loss, p, b, pad, rng, clip_norm=1.0, microbatch_size=microbatch_size)

    best, seconds = fastest_microbatch_size(sum_fn, params, example, candidates=(4, 1, 2), repeats=2)
    assert sorted(seconds) == [1, 2, 4] and best == min(seconds, key=seconds.get)
    assert all(s > 0 for s in seconds.values())
    # A budget that fits a micro-batch of 2 but not 4 stops the search there.
    budget = microbatch_peak_bytes(loss, params, example, microbatch_size=2, clip_norm=1.0)
    assert budget < microbatch_peak_bytes(loss, params, example, microbatch_size=4, clip_norm=1.0)
    best, seconds = fastest_microbatch_size(sum_fn, params, example, candidates=(1, 2, 4), memory_budget_bytes=budget)
    assert sorted(seconds) == [1, 2] and best in (1, 2)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        fastest_microbatch_size(sum_fn, params, example, memory_budget_bytes=16)
    with pytest.raises(ValueError, match="candidates"):
        fastest_microbatch_size(sum_fn, params, example, candidates=(0, 2))


def test_bfloat16_compute_keeps_float32_sum_and_the_clip_bound(setup):
    loss, params, batch, is_padding, key, per_example = setup
    config = functional.merge(loss.graphdef, params).config
    bf16_graphdef, _ = functional.split_params(BertForMaskedLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    bf16 = MLMGhostLoss(graphdef=bf16_graphdef)
    clip_norm = float(np.median([float(optax.tree.norm(g)) for g in per_example]))
    run = jax.jit(
        lambda lf, p, b, pad: ghost_clipped_grad_sum(lf, p, b, pad, key, clip_norm=clip_norm, microbatch_size=MB),
        static_argnums=0,
    )
    want, _ = run(loss, params, batch, is_padding)
    got, _ = run(bf16, params, batch, is_padding)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(got))
    # bfloat16 activations (8 mantissa bits) in float32 algebra: the sum within 5% of float32's.
    rel = float(optax.tree.norm(jax.tree_util.tree_map(jnp.subtract, got, want))) / float(optax.tree.norm(want))
    assert rel < 0.05, rel
    # Each example alone: the bf16 clipped contribution never exceeds C (norm and sum come from the
    # same taps in float32, so only float32 rounding remains).
    for i in np.flatnonzero(~np.asarray(is_padding)):
        alone = jnp.arange(B) != i
        one, _ = run(bf16, params, batch, alone)
        assert float(optax.tree.norm(one)) <= clip_norm * (1 + 1e-5)


@pytest.mark.parametrize("num_labels", [3, 1])  # classification (cross-entropy) and regression (squared error)
def test_classifier_ghost_sum_equals_vmap_clipping(num_labels):
    config = BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    model = BertForSequenceClassification(config, rngs=nnx.Rngs(1), num_labels=num_labels)
    graphdef, params = functional.split_params(model)
    rng = np.random.default_rng(1)
    mask = np.ones((B, L), np.int32)
    mask[0, 6:] = 0
    batch = {
        "input_ids": jnp.asarray(rng.integers(1, V, (B, L)), jnp.int32),
        "attention_mask": jnp.asarray(mask),
        "token_type_ids": jnp.asarray(rng.integers(0, 2, (B, L)), jnp.int32),
    }
    if num_labels == 1:
        batch["labels"] = jnp.asarray(rng.normal(2.0, 1.0, B), jnp.float32)
        loss = ClassifierGhostLoss(
            graphdef=graphdef,
            loss_from_logits=lambda logits, ex: jnp.square(logits[0].astype(jnp.float32) - ex["labels"]),
        )
    else:
        batch["labels"] = jnp.asarray(rng.integers(0, num_labels, B), jnp.int32)
        loss = ClassifierGhostLoss(graphdef=graphdef)
    key = jax.random.key(11)
    # The plain loss is that of the model's own forward (same dropout key, same sites).
    one = jax.tree_util.tree_map(lambda x: x[0], batch)
    logits = jax.jit(functional.classifier_logits, static_argnums=0)(
        graphdef, params, one["input_ids"], one["attention_mask"], one["token_type_ids"], key
    )
    want_loss = loss.loss_from_logits(logits, one)
    np.testing.assert_allclose(float(loss(params, one, key)), float(want_loss), rtol=1e-6)
    is_padding = jnp.asarray([False, False, False, True, False, False])
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(B))
    _, sq = jax.jit(lambda p: ghost_sq_norms(loss, p, batch, keys))(params)
    norms = np.sort(np.sqrt(np.asarray(sq))[~np.asarray(is_padding)])
    clip_norm = float(np.mean(norms[1:3]))  # 3 of 5 real examples clipped (the vmap path counts them too)
    kw = dict(clip_norm=clip_norm, microbatch_size=MB)
    want, want_stats = jax.jit(lambda p: clipped_grad_sum(loss, p, batch, is_padding, key, **kw))(params)
    got, stats = jax.jit(lambda p: ghost_clipped_grad_sum(loss, p, batch, is_padding, key, **kw))(params)
    _assert_close(got, want)
    assert float(stats.num_clipped) == float(want_stats.num_clipped) == 3
    # Every parameter has a non-zero clipped gradient: pooler, classifier, tables, encoder.
    assert all(float(jnp.abs(x).sum()) > 0 for x in jax.tree_util.tree_leaves(got))
