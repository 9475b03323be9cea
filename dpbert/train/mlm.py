"""The masked-LM task of pretraining: dynamic masking, the per-example loss the DP core clips
(plain, or with layer taps for ghost clipping), and held-out scoring.

Guarantees: the masks (and, with `data.random_position_offsets`, the position offsets) of step t
derive from `example_mask_key(masking_key, t, store index)` only, so a replayed step masks
identically; held-out scoring masks with a fixed public key, the
same for every run, so private and non-private runs are scored on identical positions. The MLM
head decodes `max_predictions` positions per example: the number `mask_tokens` selects in a
full sequence, an exact bound (no selected token goes unscored).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from dpbert.config.recipe import Recipe
from dpbert.data.masking import example_mask_key, example_position_offset, mask_tokens, num_to_mask
from dpbert.data.store import TokenStore
from dpbert.model import functional
from dpbert.model.ghost import MLMGhostLoss
from dpbert.privacy.documents import SEQUENCE_PADDING
from dpbert.train import distributed

# Held-out masking uses its own fixed key, the same for every run and seed, so private and
# non-private runs are scored on identical masks.
EVAL_MASK_KEY_SEED = 0x65766C  # "evl"


def max_predictions(seq_len: int, mask_prob: float) -> int:
    """Decoded positions per example: `num_to_mask` of a full packed sequence (seq_len - 2
    eligible tokens besides [CLS] and [SEP]), the most any packed example has selected."""
    return int(num_to_mask(seq_len - 2, mask_prob))


def make_masker(
    *,
    vocab_size: int,
    mask_token_id: int,
    special_token_ids: tuple[int, ...],
    pad_id: int,
    mask_prob: float,
    num_predictions: int,
    max_position_offset: int = 0,
) -> Callable[[jax.Array, jax.Array, jax.Array, jax.Array], dict[str, jax.Array]]:
    """`(run_key, step, store_index, input_ids [L]) -> model inputs and MLM targets` for ONE
    example, masked with `example_mask_key(run_key, step, store_index)`. Pure; vmap it.

    With `max_position_offset` > 0 the inputs also hold `position_ids` [L] = o + 0..L-1, o the
    example's `example_position_offset` (uniform on 0..max_position_offset), so that training on
    short sequences reaches every row of a longer position table; 0: no `position_ids`
    (positions 0..L-1, the model's default)."""
    if max_position_offset < 0:
        raise ValueError(f"max_position_offset: expected an integer >= 0, got {max_position_offset!r}")

    def masker(run_key: jax.Array, step: jax.Array, index: jax.Array, ids: jax.Array) -> dict[str, jax.Array]:
        masked, labels, weights = mask_tokens(
            example_mask_key(run_key, step, index),
            ids,
            vocab_size=vocab_size,
            mask_token_id=mask_token_id,
            special_token_ids=special_token_ids,
            mask_prob=mask_prob,
        )
        (positions,) = jnp.nonzero(weights, size=num_predictions, fill_value=0)
        # Position 0 is [CLS], never selected: filler slots read weight 0 there.
        x = {
            "input_ids": masked,
            "attention_mask": (ids != pad_id).astype(jnp.int32),
            "masked_positions": positions.astype(jnp.int32),
            "labels": labels[positions],
            "label_weights": weights[positions],
        }
        if max_position_offset:
            offset = example_position_offset(run_key, step, index, max_position_offset)
            x["position_ids"] = offset + jnp.arange(ids.shape[-1], dtype=jnp.int32)
        return x

    return masker


def make_loss_fn(
    graphdef: nnx.GraphDef, masker: Callable[..., dict[str, jax.Array]], run_key: jax.Array
) -> Callable[[Any, dict[str, jax.Array], jax.Array], jax.Array]:
    """Per-example loss for the DP core: `example` = {"input_ids" [L], "index", "step"} (store
    index and global step, which key the masking); `rng` (from the DP core) keys dropout.
    Returns the mean cross-entropy over the example's masked tokens (0 if none)."""

    def loss_fn(params: Any, example: dict[str, jax.Array], rng: jax.Array) -> jax.Array:
        x = masker(run_key, example["step"], example["index"], example["input_ids"])
        logits = functional.mlm_logits(
            graphdef,
            params,
            x["input_ids"],
            x["attention_mask"],
            None,
            rng,
            masked_positions=x["masked_positions"],
            position_ids=x.get("position_ids"),
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), x["labels"])
        w = x["label_weights"]
        return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)

    return loss_fn


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class MaskedMLMGhostLoss(MLMGhostLoss):
    """`make_loss_fn`'s loss with layer taps, for ghost clipping: the same masking (keyed by
    run key, step and store index) and the same forward, so the clipped sum is unchanged."""

    masker: Callable[..., dict[str, jax.Array]]
    run_key: jax.Array

    def tapped(self, params: Any, example: dict[str, jax.Array], rng: jax.Array | None, z: dict | None):
        if SEQUENCE_PADDING not in example:
            x = self.masker(self.run_key, example["step"], example["index"], example["input_ids"])
            return super().tapped(params, x, rng, z)
        # A document ([K, L] sequences): each sequence masked with its own store index, as alone.
        x = jax.vmap(self.masker, in_axes=(None, 0, 0, 0))(
            self.run_key, example["step"], example["index"], example["input_ids"]
        )
        return super().tapped(params, {**x, SEQUENCE_PADDING: example[SEQUENCE_PADDING]}, rng, z)


def all_selected_masked(x: dict[str, jax.Array], mask_token_id: int) -> jax.Array:
    """The input ids of a masker's batch `x` with every selected position (label weight > 0)
    showing `mask_token_id`, where training shows [MASK], a random token or the token itself."""
    rows = jnp.arange(x["input_ids"].shape[0])[:, None]
    at = x["input_ids"][rows, x["masked_positions"]]
    return (
        x["input_ids"]
        .at[rows, x["masked_positions"]]
        .set(jnp.where(x["label_weights"] > 0, jnp.asarray(mask_token_id, at.dtype), at))
    )


def make_eval_fn(
    graphdef: nnx.GraphDef, masker: Callable[..., dict[str, jax.Array]], mask_token_id: int
) -> Callable[..., dict[str, jax.Array]]:
    """Jitted held-out scoring of a batch (rows with `valid` False count for nothing):
    sums of correct predictions, cross-entropy and masked tokens, and the correct predictions
    of the unigram baseline (`unigram_token` predicted everywhere) on the same masked positions.
    Masks with the fixed eval key, so every run and every call scores the same masks, at
    positions 0..L-1 (a masker's training position offsets are not applied).

    Every selected position is shown as [MASK], as fill-mask shows it: training's 10% of selected
    tokens left unchanged would otherwise score a model that copies its input, which a small
    model learns first (docs/RESULTS.md, "Design measurements")."""
    eval_key = jax.random.key(EVAL_MASK_KEY_SEED)

    @jax.jit
    def eval_fn(
        params: Any, indices: jax.Array, input_ids: jax.Array, valid: jax.Array, unigram_token: jax.Array
    ) -> dict[str, jax.Array]:
        x = jax.vmap(masker, in_axes=(None, None, 0, 0))(eval_key, 0, indices, input_ids)
        # No position_ids: held-out scoring is at offset 0, as inputs are seen after release.
        logits = functional.mlm_logits(
            graphdef,
            params,
            all_selected_masked(x, mask_token_id),
            x["attention_mask"],
            None,
            None,
            masked_positions=x["masked_positions"],
        ).astype(jnp.float32)
        w = x["label_weights"] * valid[:, None]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, x["labels"])
        correct = (jnp.argmax(logits, -1) == x["labels"]).astype(jnp.float32)
        unigram = (x["labels"] == unigram_token).astype(jnp.float32)
        return {
            "correct": jnp.sum(correct * w),
            "loss": jnp.sum(ce * w),
            "count": jnp.sum(w),
            "unigram_correct": jnp.sum(unigram * w),
        }

    return eval_fn


def make_mlm_loss(
    recipe: Recipe, graphdef: nnx.GraphDef, masker: Callable[..., dict[str, jax.Array]], run_key: jax.Array
) -> Any:
    """The per-example masked-LM loss the step clips: with layer taps (ghost clipping) unless
    the run is non-private or `train.clipping` is "vmap". With `privacy.unit: document` an
    example is a document (`dpbert.privacy.documents`) and the loss is always the tapped one,
    a plain loss too, so that both clipping paths clip the same function."""
    if recipe.privacy.enabled and (recipe.train.clipping != "vmap" or recipe.privacy.unit == "document"):
        return MaskedMLMGhostLoss(graphdef=graphdef, masker=masker, run_key=run_key, layer_mode=recipe.train.layer_mode)
    return make_loss_fn(graphdef, masker, run_key)


def unigram_token(store: TokenStore, dataset_size: int, special_token_ids: Iterable[int], *, chunk: int = 8192) -> int:
    """The most frequent non-special token among the first `dataset_size` train sequences: the
    unigram baseline predicts it at every masked position. NOT covered by the DP guarantee (a
    statistic of the private corpus, reported as a diagnostic beside the private accuracy)."""
    counts = np.zeros(store.manifest.vocab_size, np.int64)
    for start in range(0, dataset_size, chunk):
        rows = np.asarray(store[np.arange(start, min(start + chunk, dataset_size))])
        counts += np.bincount(rows.ravel(), minlength=counts.size)[: counts.size]
    counts[list(special_token_ids)] = 0
    return int(np.argmax(counts))


def evaluate(
    params: Any,
    eval_fn: Callable[..., Any],
    store: TokenStore,
    *,
    batches: int,
    batch_size: int,
    mesh: Mesh | None = None,
    unigram: int = 0,
) -> dict[str, float]:
    """Held-out MLM accuracy and loss on the first `batches * batch_size` eval examples (every
    process reads the same rows; with `mesh`, they enter the computation replicated on it), and
    the accuracy of always predicting token `unigram` on the same masked positions."""
    n = min(len(store), batches * batch_size)
    if n == 0:
        raise ValueError(f"token store {store.path}: the eval split is empty; raise data.eval_fraction")
    totals = {"correct": 0.0, "loss": 0.0, "count": 0.0, "unigram_correct": 0.0}
    for start in range(0, n, batch_size):
        # Fixed shapes (one compilation): the last batch is padded with row 0, marked invalid.
        idx = np.arange(start, start + batch_size)
        valid = idx < n
        idx = np.where(valid, idx, 0)
        args = (
            idx.astype(np.int32),
            np.asarray(store[idx], np.int32),
            valid.astype(np.float32),
            np.asarray(unigram, np.int32),
        )
        out = eval_fn(params, *(distributed.replicate(args, mesh) if mesh is not None else map(jnp.asarray, args)))
        for k in totals:
            totals[k] += float(out[k])
    count = max(totals["count"], 1.0)
    return {
        "eval_mlm_accuracy": totals["correct"] / count,
        "eval_mlm_loss": totals["loss"] / count,
        "eval_unigram_accuracy": totals["unigram_correct"] / count,
        "eval_masked_tokens": int(totals["count"]),
        "eval_examples": n,
    }


def fill_mask(
    graphdef: nnx.GraphDef, params: Any, tokenizer: Any, sentences: Iterable[str], top_k: int, seq_len: int
) -> tuple[tuple[str, tuple[tuple[str, float], ...]], ...]:
    """Top-k predictions (token, probability) for the one [MASK] of each sentence."""
    sentences = list(sentences)
    if not sentences:
        return ()
    enc = tokenizer(sentences, padding="max_length", truncation=True, max_length=seq_len, return_tensors="np")
    ids = enc["input_ids"]
    positions = []
    for sentence, row in zip(sentences, ids, strict=True):
        where = np.flatnonzero(row == tokenizer.mask_token_id)
        if where.size != 1:
            raise ValueError(
                f"fill-mask sentence {sentence!r}: expected exactly one {tokenizer.mask_token} "
                f"within the first {seq_len} tokens"
            )
        positions.append(where[:1])
    logits = jax.jit(functional.mlm_logits, static_argnums=0)(
        graphdef,
        params,
        jnp.asarray(ids),
        jnp.asarray(enc["attention_mask"]),
        None,
        None,
        masked_positions=jnp.asarray(np.stack(positions), jnp.int32),
    )
    probs = np.asarray(jax.nn.softmax(logits[:, 0].astype(jnp.float32), axis=-1))
    results = []
    for sentence, p in zip(sentences, probs, strict=True):
        top = np.argsort(-p)[:top_k]
        results.append((sentence, tuple((tokenizer.convert_ids_to_tokens(int(t)), float(p[t])) for t in top)))
    return tuple(results)
