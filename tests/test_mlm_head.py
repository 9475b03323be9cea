"""The masked-only MLM head (logits at `max_predictions` gathered positions) gives the loss and
the gradients of the full head (logits at every position) restricted to the masked positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from transformers import BertConfig

from dpbert.config.recipe import load_recipe_dict
from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM
from dpbert.privacy.clipping import clipped_grad_sum
from dpbert.privacy.ghost_clipping import ghost_clipped_grad_sum
from dpbert.privacy.randomness import SUPPLIED, RunSecret
from dpbert.train.mesh import make_mesh
from dpbert.train.mlm import MaskedMLMGhostLoss, all_selected_masked, make_loss_fn, make_masker, max_predictions
from dpbert.train.pretrain import build_setup
from dpbert.train.state import bert_config

VOCAB, SEQ = 97, 24
SPECIALS = (0, 1, 2, 3, 4)  # [PAD] [UNK] [CLS] [SEP] [MASK]


def _masker(mask_prob: float, num_predictions: int | None = None):
    """The pretraining masker over this module's vocabulary, decoding `max_predictions` slots
    unless told otherwise."""
    return make_masker(
        vocab_size=VOCAB,
        mask_token_id=4,
        special_token_ids=SPECIALS,
        pad_id=0,
        mask_prob=mask_prob,
        num_predictions=max_predictions(SEQ, mask_prob) if num_predictions is None else num_predictions,
    )


@pytest.fixture(scope="module")
def setup():
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    graphdef, params = functional.split_params(BertForMaskedLM(config, rngs=nnx.Rngs(0)))
    masker = _masker(0.15)
    rng = np.random.default_rng(0)
    ids = rng.integers(5, VOCAB, (6, SEQ)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 2, 3
    ids[1, 15:] = 0  # a padded example
    ids[1, 14] = 3
    batch = {
        "input_ids": jnp.asarray(ids),
        "index": jnp.arange(6, dtype=jnp.int32),
        "step": jnp.full((6,), 3, jnp.int32),
    }
    return graphdef, params, masker, batch


def full_head_loss(graphdef, masker, run_key):
    """The reference: logits at EVERY position, cross-entropy weighted by the mask's label weights."""

    def loss(params, example, rng):
        ids = example["input_ids"]
        from dpbert.data.masking import example_mask_key, mask_tokens

        masked, labels, weights = mask_tokens(
            example_mask_key(run_key, example["step"], example["index"]),
            ids,
            vocab_size=VOCAB,
            mask_token_id=4,
            special_token_ids=SPECIALS,
            mask_prob=0.15,
        )
        logits = functional.mlm_logits(graphdef, params, masked, (ids != 0).astype(jnp.int32), None, rng)
        assert logits.shape == (SEQ, VOCAB)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
        return jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    return loss


def test_max_predictions_is_the_count_of_a_full_sequence_and_nothing_goes_unscored():
    # round(0.15 * 62) = 9 slots for 64 tokens; the default recipe's 32 at 30%: round(9.0) = 9.
    assert (max_predictions(64, 0.15), max_predictions(32, 0.3), max_predictions(16, 0.3)) == (9, 9, 4)
    masker = _masker(0.3)
    ids = np.random.default_rng(2).integers(5, VOCAB, (200, SEQ)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 2, 3  # a full packed row: [CLS] ... [SEP]
    ids[100:, SEQ // 2 :] = 0  # and rows with a padding tail
    ids[100:, SEQ // 2 - 1] = 3
    x = jax.vmap(masker, in_axes=(None, None, 0, 0))(jax.random.key(0), 0, jnp.arange(200), jnp.asarray(ids))
    scored = np.asarray(x["label_weights"]).sum(1)
    corrupted = (np.asarray(x["input_ids"]) != ids).sum(1)
    assert (scored[:100] == max_predictions(SEQ, 0.3)).all()  # every slot used by a full row
    assert (corrupted <= scored).all()  # every corrupted token is scored


def test_masked_only_head_equals_full_head_loss_and_gradients(setup):
    graphdef, params, masker, batch = setup
    run_key = jax.random.key(7)
    masked_only = make_loss_fn(graphdef, masker, run_key)
    full = full_head_loss(graphdef, masker, run_key)
    rngs = jax.random.split(jax.random.key(1), 6)
    masked_only_grad, full_grad = (jax.jit(jax.value_and_grad(f)) for f in (masked_only, full))
    for i in range(6):
        example = jax.tree_util.tree_map(lambda x, i=i: x[i], batch)
        selected = masker(run_key, example["step"], example["index"], example["input_ids"])["label_weights"].sum()
        assert selected > 0  # every example scores something (else the test would be vacuous)
        lo, go = masked_only_grad(params, example, rngs[i])
        lf, gf = full_grad(params, example, rngs[i])
        np.testing.assert_allclose(lo, lf, rtol=1e-5)
        for a, b in zip(jax.tree_util.tree_leaves(go), jax.tree_util.tree_leaves(gf), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


def test_clipped_sums_of_masked_only_and_full_heads_agree(setup):
    """The DP step's clipped sum (ghost clipping of the masked-only head, and vmap of it) equals
    the vmap clipped sum of the full head: per-example norms and clipping are unchanged."""
    graphdef, params, masker, batch = setup
    run_key = jax.random.key(7)
    padding = jnp.asarray([False, False, False, False, False, True])
    kw = {"clip_norm": 0.5, "microbatch_size": 2}
    key = jax.random.key(3)
    ref, ref_stats = clipped_grad_sum(full_head_loss(graphdef, masker, run_key), params, batch, padding, key, **kw)
    vm, _ = clipped_grad_sum(make_loss_fn(graphdef, masker, run_key), params, batch, padding, key, **kw)
    ghost_loss = MaskedMLMGhostLoss(graphdef=graphdef, masker=masker, run_key=run_key)
    gh, gh_stats = ghost_clipped_grad_sum(ghost_loss, params, batch, padding, key, **kw)
    assert float(ref_stats.num_clipped) > 0  # clipping is exercised
    np.testing.assert_allclose(gh_stats.loss_sum, ref_stats.loss_sum, rtol=1e-5)
    for a, b, c in zip(*(jax.tree_util.tree_leaves(t) for t in (ref, vm, gh)), strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-6)
        np.testing.assert_allclose(c, a, rtol=2e-4, atol=2e-6)


def test_held_out_scoring_shows_every_selected_token_as_mask():
    """Training shows 10% of the selected tokens unchanged and 10% as random tokens; scoring held-out
    text shows [MASK] at all of them (a model that copies its input must not score), nothing else moves."""
    masker = _masker(0.3, num_predictions=SEQ)
    ids = np.random.default_rng(1).integers(5, VOCAB, (400, SEQ)).astype(np.int32)
    ids[:, 0] = 2  # [CLS]: never selected, where the masker's unused slots point
    x = jax.vmap(masker, in_axes=(None, None, 0, 0))(jax.random.key(0), 0, jnp.arange(400), jnp.asarray(ids))
    w = np.asarray(x["label_weights"]) > 0
    rows = np.arange(400)[:, None]
    trained = np.asarray(x["input_ids"])[rows, np.asarray(x["masked_positions"])][w]
    labels = np.asarray(x["labels"])[w]
    kept = np.mean(trained == labels)
    assert 0.08 < kept < 0.13, kept  # 10% kept + 1/92 of the random 10% (about 2,900 selected tokens)
    shown = np.asarray(all_selected_masked(x, 4))
    assert np.all(shown[rows, np.asarray(x["masked_positions"])][w] == 4)
    selected = np.zeros(ids.shape, bool)
    np.put_along_axis(selected, np.asarray(x["masked_positions"]), w, axis=1)
    assert np.array_equal(shown[~selected], ids[~selected])


def _setup_masking(**data):
    """`build_setup`'s two maskers for a one-layer recipe over this module's vocabulary."""
    recipe = load_recipe_dict(
        {
            "model": {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2},
            "data": {"seq_len": SEQ, **data},
            "schedule": [{"steps": 2, "expected_batch_size": 8}],
            "privacy": {"noise_multiplier": 1.0, "delta": 1e-5},
        }
    )
    token_ids = {"mask_token_id": 4, "special_token_ids": SPECIALS, "pad_id": 0}
    setup = build_setup(
        recipe,
        make_mesh(devices=jax.devices()[:1]),
        config=bert_config(recipe),
        seq_len=SEQ,
        token_ids=token_ids,
        secret=RunSecret(bytes(range(32)), SUPPLIED),
        mechanism="pretrain",
    )
    return setup.masker, setup.eval_masker


def test_held_out_masks_follow_eval_mask_prob_not_the_training_rate():
    """A run trained at 45% masking with `eval_mask_prob: 0.3` is scored on exactly the masks of a
    run trained at 30%; without `eval_mask_prob` held-out scoring masks at the training rate."""
    ids = np.random.default_rng(3).integers(5, VOCAB, (64, SEQ)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 2, 3

    def masks(masker):
        x = jax.vmap(masker, in_axes=(None, None, 0, 0))(jax.random.key(9), 0, jnp.arange(64), jnp.asarray(ids))
        return {k: np.asarray(v) for k, v in x.items()}

    train30, eval30 = map(masks, _setup_masking(mask_prob=0.3))
    train45, eval45 = map(masks, _setup_masking(mask_prob=0.45, eval_mask_prob=0.3))
    for k in eval30:
        np.testing.assert_array_equal(eval45[k], eval30[k], err_msg=k)
        np.testing.assert_array_equal(eval30[k], train30[k], err_msg=k)
    # round(0.3 * 22) = 7 and round(0.45 * 22) = 10 tokens selected in every full row.
    assert (eval45["label_weights"].sum(1) == 7).all()
    assert (train45["label_weights"].sum(1) == 10).all()
