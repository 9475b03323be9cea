"""Document-level DP: a document, not a sequence, is the unit that is sampled and clipped.

A document example is a pytree whose leaves lead with K = `max_sequences_per_document` sequence
slots, plus `sequence_padding` (bool [K]). `document_loss(loss_fn)` sums a per-sequence loss over
the real slots, so the clipped sum clips each document's summed gradient to C as a whole: adding
or removing one document changes the step's sum by at most C, however many sequences it has.
With Poisson sampling over documents the accountant's subsampled Gaussian is exactly the
mechanism for add-or-remove-one-document neighbours (derivation: docs/INTERNALS.md).

Guarantees: unused slots contribute exactly 0 to the loss and gradient, whatever their content;
slot k of a document gets the key fold_in(document key, k), so results do not depend on
micro-batch size or devices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dpbert.privacy.clipping import LossFn

SEQUENCE_PADDING = "sequence_padding"


def document_loss(loss_fn: LossFn) -> LossFn:
    """The per-document loss (sum over the real sequence slots) of a per-sequence `loss_fn`."""

    def loss(params: Any, document: dict[str, Any], rng: jax.Array) -> jax.Array:
        padding = document[SEQUENCE_PADDING]
        sequences = {k: v for k, v in document.items() if k != SEQUENCE_PADDING}
        keys = jax.vmap(lambda k: jax.random.fold_in(rng, k))(jnp.arange(padding.shape[0]))
        losses = jax.vmap(loss_fn, in_axes=(None, 0, 0))(params, sequences, keys)
        # where(), not a product: a padding slot's loss never reaches the sum, even if not finite.
        return jnp.sum(jnp.where(padding, 0.0, losses.astype(jnp.float32)))

    return loss
