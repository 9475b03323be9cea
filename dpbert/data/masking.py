"""Dynamic masked-LM masking (BERT's 80/10/10), pure and jittable.

Masking is redrawn every time an example is used, from a key that depends only on
(run key, step, example index) — see `example_mask_key` — so a resumed run masks every
example exactly as the uninterrupted run did, whatever the batch layout or device count. The
optional per-example position offset (`example_position_offset`) derives from the same key.

Guarantees of `mask_tokens`:
- a sequence with n eligible tokens (not special, not padding) has exactly
  `num_to_mask(n, mask_prob)` = max(1, round(mask_prob * n)) of them selected (0 if n = 0), a
  uniformly random subset, as BERT's own `create_pretraining_data` selects them; special and
  [PAD] tokens are never selected, never changed. A fixed count (rather than one coin per token)
  bounds the positions the MLM head decodes by the mean, where a Binomial count needs a margin
  of several standard deviations (13 slots instead of 4 for 16 tokens at 30%);
- a selected token becomes [MASK] with probability 0.8, a uniformly random NON-special token
  with probability 0.1, and stays unchanged with probability 0.1;
- the result depends only on (rng, input_ids): same key, same mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

# Domain separation for the data stream. Deliberately far above any step count: the DP core
# derives its step keys as fold_in(run_key, step), so a small constant here would make the
# masking stream of step s collide with the keys of step DATA_STREAM.
DATA_STREAM = 0x6D61736B  # "mask" in ASCII

# Domain separation of the position-offset draw from the masking draw of the same example and step.
POSITION_STREAM = 0x706F7369  # "posi" in ASCII

MASK_FRACTION = 0.8
RANDOM_FRACTION = 0.1


def example_mask_key(run_key: jax.Array, step: int | jax.Array, example_index: int | jax.Array) -> jax.Array:
    """The masking key of one example at one step.

    ``fold_in(fold_in(fold_in(run_key, DATA_STREAM), step), example_index)``. `example_index` is
    the example's index in the token store (so the mask does not depend on where the example
    lands in the batch); padding rows may use any index, their loss is masked anyway.
    Jittable and vmappable over `example_index`.
    """
    data_key = jax.random.fold_in(run_key, DATA_STREAM)
    return jax.random.fold_in(jax.random.fold_in(data_key, step), example_index)


def example_position_offset(
    run_key: jax.Array, step: int | jax.Array, example_index: int | jax.Array, max_offset: int
) -> jax.Array:
    """The position offset of one example at one step: uniform on {0, ..., max_offset} (int32),
    drawn with ``fold_in(example_mask_key(run_key, step, example_index), POSITION_STREAM)``.

    Like the mask, it depends only on (run key, step, store index): the same for any batch layout,
    micro-batch size or device count, and replayed by a resumed run. Data-independent randomness:
    it leaves the DP guarantee and the ledger unchanged. Jittable and vmappable."""
    key = jax.random.fold_in(example_mask_key(run_key, step, example_index), POSITION_STREAM)
    return jax.random.randint(key, (), 0, max_offset + 1, dtype=jnp.int32)


def num_to_mask(num_eligible: int | jax.Array, mask_prob: float) -> jax.Array:
    """Tokens selected in a sequence of `num_eligible` eligible tokens: round(mask_prob * n)
    (halves up), at least 1 when n > 0, 0 when n = 0."""
    n = jnp.asarray(num_eligible)
    return jnp.where(n > 0, jnp.maximum(1, jnp.floor(mask_prob * n + 0.5)), 0).astype(jnp.int32)


def mask_tokens(
    rng: jax.Array,
    input_ids: jax.Array,
    *,
    vocab_size: int,
    mask_token_id: int,
    special_token_ids: Sequence[int],
    mask_prob: float = 0.15,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Select and corrupt tokens for masked-LM training.

    input_ids: int array of any shape (one example [L], or a batch [B, L]); the last axis is the
    sequence whose eligible tokens are counted.
    special_token_ids: ids never selected ([PAD], [CLS], [SEP], [MASK], [UNK], ...); [PAD] must
    be among them. Static Python ints (a tuple or list).
    Returns ``(masked_input_ids, labels, label_weights)`` of input_ids' shape: labels hold the
    original id at selected positions and 0 elsewhere; label_weights is float32, 1.0 exactly at
    selected positions. An example may have no selected token (all weights 0): normalize the
    loss accordingly.
    """
    specials = tuple(sorted({int(s) for s in special_token_ids}))
    if not 0.0 < mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in (0, 1]; got {mask_prob}")
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id must be in [0, vocab_size={vocab_size}); got {mask_token_id}")
    if any(not 0 <= s < vocab_size for s in specials):
        raise ValueError(f"special_token_ids must lie in [0, vocab_size={vocab_size}); got {list(specials)}")
    if len(specials) >= vocab_size:
        raise ValueError("special_token_ids cover the whole vocabulary: no token is left to mask")

    select_key, action_key, random_key = jax.random.split(rng, 3)
    input_ids = jnp.asarray(input_ids)
    eligible = ~jnp.isin(input_ids, jnp.asarray(specials, dtype=input_ids.dtype))
    # A uniformly random subset of k eligible positions: the k smallest uniform scores (specials
    # score 2, above any eligible token's).
    k = num_to_mask(eligible.sum(-1, keepdims=True), mask_prob)
    scores = jnp.where(eligible, jax.random.uniform(select_key, input_ids.shape), 2.0)
    rank = jnp.argsort(jnp.argsort(scores, axis=-1), axis=-1)
    selected = eligible & (rank < k)

    action = jax.random.uniform(action_key, input_ids.shape)
    to_mask = selected & (action < MASK_FRACTION)
    to_random = selected & (action >= MASK_FRACTION) & (action < MASK_FRACTION + RANDOM_FRACTION)

    # Draw uniformly among the vocab_size - len(specials) ordinary ids: draw a rank, then step it
    # over each special id (ascending) that is <= it, which maps ranks onto non-special ids.
    random_ids = jax.random.randint(random_key, input_ids.shape, 0, vocab_size - len(specials))
    for special in specials:
        random_ids = random_ids + (random_ids >= special)

    masked = jnp.where(to_mask, jnp.asarray(mask_token_id, input_ids.dtype), input_ids)
    masked = jnp.where(to_random, random_ids.astype(input_ids.dtype), masked)
    labels = jnp.where(selected, input_ids, jnp.zeros_like(input_ids))
    return masked, labels, selected.astype(jnp.float32)
