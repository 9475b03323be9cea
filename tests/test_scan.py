"""The scanned encoder (one layer body under `lax.scan` over stacked layer parameters) computes
what the unrolled one does: logits, gradients, per-example ghost norms and clipped sums, on a
tiny-shaped (2 x 128) and a 3-layer config; Hugging Face folders are unchanged on disk; and
a checkpoint written before the scan (one array per layer) restores, or is refused by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from transformers import BertConfig

from dpbert.model import bert as bert_lib
from dpbert.model import functional
from dpbert.model.bert import BertEmbeddings, BertForMaskedLM, BertLayer
from dpbert.model.ghost import MLMGhostLoss, mlm_loss_from_logits
from dpbert.privacy.clipping import clipped_grad_sum
from dpbert.privacy.ghost_clipping import ghost_clipped_grad_sum, ghost_sq_norms

SEQ, P, B, MB = 12, 4, 6, 3
CONFIGS = {
    # BERT tiny's layer shapes (2 x 128, 2 heads, FFN 512) with a small vocabulary.
    "tiny": dict(vocab_size=97, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "3-layer": dict(
        vocab_size=61,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=24,
        type_vocab_size=3,
    ),
}


def _config(name: str) -> BertConfig:
    return BertConfig(
        max_position_embeddings=16, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **CONFIGS[name]
    )


def _batch(config: BertConfig, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, config.vocab_size, (B, SEQ))
    mask = np.ones((B, SEQ), np.int32)
    mask[1, 8:] = 0
    return {
        "input_ids": jnp.asarray(ids, jnp.int32),
        "attention_mask": jnp.asarray(mask),
        "token_type_ids": jnp.asarray(rng.integers(0, config.type_vocab_size, (B, SEQ)), jnp.int32),
        "masked_positions": jnp.asarray(rng.integers(1, 6, (B, P)), jnp.int32),
        "labels": jnp.asarray(rng.integers(0, config.vocab_size, (B, P)), jnp.int32),
        "label_weights": jnp.asarray([[1, 1, 0, 1]] * B, jnp.float32),
    }


def unrolled_logits(graphdef, params, example, key):
    """One example's MLM logits with the encoder's layers unrolled: a Python loop over layer
    slices of the stacked parameters, each run by the same `BertLayer` code (the reference)."""
    model = functional.merge(graphdef, params)
    ids, mask, types = (example[k][None] for k in ("input_ids", "attention_mask", "token_type_ids"))
    x = model.bert.embeddings(ids, types, bert_lib.fold_key(key, bert_lib.SITE_EMBEDDINGS))
    layer_graph, stacked = nnx.split(model.bert.encoder.layer)
    for i in range(bert_lib.num_stacked(model.bert.encoder.layer)):
        layer = nnx.merge(layer_graph, jax.tree_util.tree_map(lambda a, i=i: a[i], stacked))
        x = layer(x, bert_lib.attention_mask_4d(mask), bert_lib.layer_key(key, i))
    x = jnp.take_along_axis(x, example["masked_positions"][None, :, None], axis=1)
    return model.cls(x, model.bert.embeddings.word_embeddings.embedding[...])[0]


def _max_err(got, want) -> tuple[float, float]:
    err = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True)
    )
    return err, float(optax.tree.norm(want))


@pytest.fixture(scope="module", params=list(CONFIGS))
def setup(request):
    config = _config(request.param)
    graphdef, params = functional.split_params(BertForMaskedLM(config, rngs=nnx.Rngs(0)))
    # Non-trivial LayerNorms and biases (the init has LayerNorm = (1, 0) and zero biases).
    gen = np.random.default_rng(1)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    params = jax.tree_util.tree_unflatten(
        treedef, [x + 0.05 * gen.standard_normal(x.shape).astype(np.float32) for x in leaves]
    )
    loss = MLMGhostLoss(graphdef=graphdef)
    batch = _batch(config)
    key = jax.random.key(7)

    def unrolled_loss(p, example, k):
        return mlm_loss_from_logits(unrolled_logits(graphdef, p, example, k), example)

    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(B))
    losses, grads = jax.jit(jax.vmap(jax.value_and_grad(unrolled_loss), in_axes=(None, 0, 0)))(params, batch, keys)
    return config, graphdef, params, loss, batch, key, keys, unrolled_loss, losses, grads


def test_stacked_parameters_are_the_per_layer_initialisation():
    config = _config("3-layer")
    _, params = functional.split_params(BertForMaskedLM(config, rngs=nnx.Rngs(0)))
    # The same rngs draws as before the scan: embeddings, then each layer in turn.
    rngs = nnx.Rngs(0)
    BertEmbeddings(config, rngs=rngs, dtype=jnp.float32)
    for i in range(config.num_hidden_layers):
        want = nnx.state(BertLayer(config, rngs=rngs, dtype=jnp.float32), nnx.Param)
        got = jax.tree_util.tree_map(lambda a, i=i: a[i], params["bert"]["encoder"]["layer"])
        assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), got, want))
    # Stacked <-> per-layer layout, both ways, exactly.
    per_layer = functional.unstack_layers(params)
    assert per_layer["bert"]["encoder"]["layer"][2]["output"]["dense"]["kernel"].shape == (24, 16)
    back = functional.stack_layers(per_layer)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    assert all(
        bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params))
    )


def test_scanned_logits_and_gradients_equal_unrolled(setup):
    config, graphdef, params, loss, batch, key, keys, unrolled_loss, want_losses, want_grads = setup
    example = jax.tree_util.tree_map(lambda x: x[1], batch)
    for k in (None, keys[1]):  # inference and dropout (same fold_in sites per layer)
        got = jax.jit(
            lambda p, k=k: functional.mlm_logits(
                graphdef,
                p,
                example["input_ids"],
                example["attention_mask"],
                example["token_type_ids"],
                k,
                masked_positions=example["masked_positions"],
            )
        )(params)
        want = jax.jit(lambda p, k=k: unrolled_logits(graphdef, p, example, k))(params)
        err, _ = _max_err(got, want)
        assert err <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(want)))), err
    # hidden states come out per layer, as before the scan.
    out = functional.merge(graphdef, params).bert(batch["input_ids"], output_hidden_states=True)
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert bool(jnp.array_equal(out.hidden_states[-1], out.last_hidden_state))
    # Per-example gradients of the scanned loss (the vmap path's) equal the unrolled ones.
    losses, grads = jax.jit(jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0, 0)))(params, batch, keys)
    assert float(jnp.max(jnp.abs(losses - want_losses))) <= 1e-5
    err, scale = _max_err(grads, want_grads)
    assert err <= 1e-5 * scale, (err, scale)


def test_ghost_norms_and_clipped_sums_equal_unrolled(setup):
    config, graphdef, params, loss, batch, key, keys, unrolled_loss, want_losses, want_grads = setup
    want_sq = jax.vmap(lambda g: optax.tree.norm(g) ** 2)(want_grads)
    losses, sq = jax.jit(lambda p: ghost_sq_norms(loss, p, batch, keys))(params)
    assert float(jnp.max(jnp.abs(losses - want_losses))) <= 1e-5
    np.testing.assert_allclose(np.asarray(sq), np.asarray(want_sq), rtol=1e-5)
    # Clipped sums: some examples clipped, one padding row; both clipping paths.
    is_padding = jnp.arange(B) == 2
    norms = np.sqrt(np.asarray(want_sq))
    clip_norm = float(np.median(norms))
    factor = np.where(np.asarray(is_padding), 0.0, np.minimum(1.0, clip_norm / norms))
    want = jax.tree_util.tree_map(lambda g: jnp.tensordot(jnp.asarray(factor, jnp.float32), g, axes=1), want_grads)
    for impl in (ghost_clipped_grad_sum, clipped_grad_sum):
        got, stats = jax.jit(
            lambda p, impl=impl: impl(loss, p, batch, is_padding, key, clip_norm=clip_norm, microbatch_size=MB)
        )(params)
        err, scale = _max_err(got, want)
        assert err <= 1e-5 * scale, (impl.__name__, err, scale)
        assert float(stats.num_examples) == B - 1


def test_hf_folder_unchanged_through_the_scanned_model(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    reference = transformers.BertForMaskedLM(_config("3-layer")).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    reference.save_pretrained(tmp_path / "hf")
    ours = BertForMaskedLM.from_pretrained(str(tmp_path / "hf"))
    assert ours.bert.encoder.layer.attention.self.query.kernel.shape == (3, 16, 16)
    ours.save_pretrained(str(tmp_path / "ours"))
    saved, original = (
        load_file(tmp_path / "ours" / "model.safetensors"),
        load_file(tmp_path / "hf" / "model.safetensors"),
    )
    assert "bert.encoder.layer.2.output.dense.weight" in saved
    # Every tensor transformers wrote comes back bit for bit (tied decoder and buffers aside).
    assert set(saved) == {
        k
        for k in original
        if k not in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
        and not k.endswith(("position_ids", "token_type_ids"))
    }
    for name, value in saved.items():
        assert np.array_equal(value, original[name]), name
    back, info = transformers.BertForMaskedLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def _train_state(config: BertConfig):
    from dpbert.train.state import TrainState, ledger_text

    _, params = functional.split_params(BertForMaskedLM(config, rngs=nnx.Rngs(0)))
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(params)
    updates, opt_state = optimizer.update(jax.tree_util.tree_map(lambda p: 0.5 * p + 0.1, params), opt_state, params)
    params = optax.apply_updates(params, updates)
    return TrainState(params=params, opt_state=opt_state, step=3, ledger_json=ledger_text({"steps": 3}))


def test_checkpoint_written_before_the_scan_restores_or_is_refused(tmp_path, monkeypatch):
    from dpbert.train import checkpoint
    from dpbert.train.checkpoint import CheckpointStore, _map_states

    config = _config("3-layer")
    state = _train_state(config)
    # A checkpoint as dpbert wrote it before the scan: per-layer arrays, format .../1.
    legacy = state.replace(
        params=functional.unstack_layers(state.params),
        opt_state=_map_states(state.opt_state, functional.unstack_layers),
    )
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "FORMAT", checkpoint.LEGACY_FORMAT)
        store = CheckpointStore(tmp_path / "old")
        store.save(legacy, {"model": "m"})
        store.close()
    like = jax.eval_shape(lambda: state)
    old = CheckpointStore(tmp_path / "old")
    restored = old.restore(like, {"model": "m"})
    assert restored.step == 3
    assert jax.tree_util.tree_structure(restored.opt_state) == jax.tree_util.tree_structure(state.opt_state)
    for a, b in zip(
        jax.tree_util.tree_leaves((restored.params, restored.opt_state)),
        jax.tree_util.tree_leaves((state.params, state.opt_state)),
        strict=True,
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # A new checkpoint is written in the stacked layout and restores as is.
    store = CheckpointStore(tmp_path / "new")
    store.save(restored, {"model": "m"})
    again = store.restore(like, {"model": "m"})
    store.close()
    (meta,) = [f for f in (tmp_path / "new" / "3" / "meta").iterdir() if f.suffix != ".txt"]
    assert json.loads(meta.read_text())["format"] == checkpoint.FORMAT
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(state.params))
    )
    # A per-layer checkpoint that cannot be stacked into this model is refused by name.
    wider = BertConfig(max_position_embeddings=16, **(CONFIGS["3-layer"] | {"hidden_size": 20}))
    other = jax.eval_shape(lambda: _train_state(wider))
    with pytest.raises(ValueError, match=r"old/3: written before the scanned-layer layout"):
        old.restore(other, {"model": "m"})
    old.close()
