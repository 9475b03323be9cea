"""Ghost-clipping taps of dpbert's BERT models: per-example losses that implement the DP core's
`GhostLoss` interface (`dpbert.privacy.ghost_clipping`), so DP-SGD clips them exactly without
per-example gradients.

- `MLMGhostLoss`: the masked-LM loss of a `BertForMaskedLM` (pretraining), one sequence or one
  document (`input_ids` [K, L] with `sequence_padding` [K], `dpbert.privacy.documents`);
- `ClassifierGhostLoss`: the loss of a `BertForSequenceClassification` (GLUE fine-tuning of
  every parameter: the "all" trainable subset).

Each is also a plain `loss_fn(params, example, rng)`, so the vmap path
(`dpbert.privacy.clipping`) and the ghost path clip the same function. Their taps cover every
parameter, declared from the params tree: word and token-type tables (`Lookup`), position
table (`Positions`), every sub-module with a kernel (`Dense`) or a LayerNorm scale
(`ScaleBias`), and the MLM decoder (`Dense` on the tied word table, transposed, with the MLM
bias; or the untied decoder's kernel). The encoder's taps form one stacked group: the model's
own scanned layer body runs with taps (`bert.Tap`), so compile time does not grow with depth.

Forward numerics: the tapped forward calls the model's own submodules (embeddings, Linear,
LayerNorm, attention, pooler, dropout sites and keys), so the loss and its dropout masks are
those of the plain forward (`dpbert.model.functional`). `remat` is ignored here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dpbert.model import bert
from dpbert.model.bert import BertForMaskedLM, BertForSequenceClassification, BertModel
from dpbert.model.functional import merge
from dpbert.privacy.documents import SEQUENCE_PADDING
from dpbert.privacy.ghost_clipping import (
    LAYER_MODES,
    Dense,
    Lookup,
    Path,
    Positions,
    ScaleBias,
    Tape,
    TapGroup,
    TapKind,
)

_F32 = jnp.float32
# Tap groups: "rest" (one array per example) and "layers" (the encoder's scanned layer body).
REST, LAYERS = "rest", "layers"
_LAYER_PARAMS: Path = ("bert", "encoder", "layer")
_EMBEDDINGS: Path = ("bert", "embeddings")


def mlm_loss_from_logits(logits: jax.Array, example: dict[str, jax.Array]) -> jax.Array:
    """Mean cross-entropy over the example's weighted masked positions (0 if none)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(_F32), example["labels"])
    w = example["label_weights"]
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def classifier_loss_from_logits(logits: jax.Array, example: dict[str, jax.Array]) -> jax.Array:
    """Cross-entropy of the logits [num_labels] against the integer `labels`."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(_F32), example["labels"])


class _Taps(bert.Tap):
    """`bert.Tap` that records every sub-layer on a `Tape` under `prefix` + its name."""

    def __init__(self, tape: Tape, prefix: str = ""):
        self.tape = tape
        self.prefix = prefix

    def dense(self, name: str, layer: nnx.Linear, x: jax.Array) -> jax.Array:
        return self.tape(self.prefix + name, layer(x), x)

    def layer_norm(self, name: str, ln: nnx.LayerNorm, x: jax.Array) -> jax.Array:
        # Same statistics as flax's LayerNorm (float32, fast variance); xhat is the input of the
        # affine part, whose per-example gradients are sum_t g_t * xhat_t and sum_t g_t.
        xf = x.astype(_F32)
        mean = jnp.mean(xf, -1, keepdims=True)
        var = jnp.maximum(jnp.mean(jnp.square(xf), -1, keepdims=True) - jnp.square(mean), 0.0)
        xhat = (xf - mean) * jax.lax.rsqrt(var + ln.epsilon)
        return self.tape(self.prefix + name, ln(x), xhat)

    def embed(self, name: str, table: jax.Array, ids: jax.Array) -> jax.Array:
        return self.tape(self.prefix + name, super().embed(name, table, ids), ids)

    def positions(self, name: str, table: jax.Array, length: int) -> jax.Array:
        return self.tape(self.prefix + name, super().positions(name, table, length))


def _name(path: Path) -> str:
    return "/".join(map(str, path))


def _leaf_paths(tree: Any) -> set[Path]:
    return {
        tuple(k.key if hasattr(k, "key") else k.idx for k in p if hasattr(k, "key") or hasattr(k, "idx"))
        for p, _ in jax.tree_util.tree_leaves_with_path(tree)
    }


def _module_taps(tree: Any, layer_mode: str, prefix: Path = ()) -> dict[str, TapKind]:
    """A `Dense` tap for every sub-module of `tree` with a kernel, a `ScaleBias` for every one with
    a scale (LayerNorm), named by their path (under `prefix`); biases go with them."""
    leaves = _leaf_paths(tree)
    taps: dict[str, TapKind] = {}
    for path in leaves:
        parent = (*prefix, *path[:-1])
        bias = (*parent, "bias") if (*path[:-1], "bias") in leaves else None
        if path[-1] == "kernel":
            taps[_name(parent)] = Dense((*parent, "kernel"), bias, mode=layer_mode)
        elif path[-1] == "scale":
            taps[_name(parent)] = ScaleBias((*parent, "scale"), bias)
    return taps


def _embedding_taps(params: Any) -> dict[str, TapKind]:
    table = lambda name: (*_EMBEDDINGS, name, "embedding")  # noqa: E731
    return {
        _name((*_EMBEDDINGS, "word_embeddings")): Lookup(table("word_embeddings")),
        _name((*_EMBEDDINGS, "token_type_embeddings")): Lookup(table("token_type_embeddings")),
        _name((*_EMBEDDINGS, "position_embeddings")): Positions(table("position_embeddings")),
        **_module_taps(params["bert"]["embeddings"]["LayerNorm"], "mixed", (*_EMBEDDINGS, "LayerNorm")),
    }


def _encoder_group(params: Any, layer_mode: str) -> TapGroup:
    layers = params["bert"]["encoder"]["layer"]
    return TapGroup(_module_taps(layers, layer_mode), stacked_at=_LAYER_PARAMS, scan=bert.layer_scan)


def _tapped_encoder(
    encoder: BertModel, example: dict[str, jax.Array], rng: jax.Array | None, tape: Tape, z_layers: Any, batched: Any
) -> tuple[jax.Array, Any, Any]:
    """(last hidden states [B, L, H], layer tap inputs, layer tap outputs (None unless probing:
    z_layers None)) of the example's sequences as a batch `batched(x)`; embeddings on `tape`."""
    ids = batched(example["input_ids"])
    types = example.get("token_type_ids")
    types = jnp.zeros_like(ids) if types is None else batched(types)
    mask = example.get("attention_mask")
    mask = bert.attention_mask_4d(None if mask is None else batched(mask))
    embed_taps = _Taps(tape, _name(_EMBEDDINGS) + "/")
    x = encoder.embeddings(ids, types, bert.fold_key(rng, bert.SITE_EMBEDDINGS), embed_taps)

    def body(layer: Any, x: jax.Array, i: jax.Array, z_i: Any) -> tuple[jax.Array, Any]:
        layer_tape = Tape(z_i)
        x = layer(x, mask, bert.layer_key(rng, i), _Taps(layer_tape))
        return x, (layer_tape.inputs, layer_tape.outputs if z_layers is None else None)

    x, (inputs, outputs) = bert.scan_layers(encoder.encoder.layer, x, body, z_layers)
    return x, inputs, outputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class _BertGhostLoss:
    graphdef: nnx.GraphDef
    layer_mode: str = "mixed"

    def __post_init__(self) -> None:
        if not isinstance(self.graphdef, nnx.GraphDef):
            raise ValueError(f"graphdef: expected an nnx.GraphDef, got {type(self.graphdef).__name__}")
        if not callable(getattr(self, "loss_from_logits", None)):
            raise ValueError("loss_from_logits: expected a callable (logits, example) -> scalar")
        if self.layer_mode not in LAYER_MODES:
            raise ValueError(f"layer_mode: expected one of {LAYER_MODES}, got {self.layer_mode!r}")

    def __call__(self, params: Any, example: dict[str, jax.Array], rng: jax.Array) -> jax.Array:
        return self.tapped(params, example, rng, None)[0]

    def _model(self, params: Any, kind: type) -> Any:
        model = merge(self.graphdef, params)
        if not isinstance(model, kind):
            raise ValueError(f"graphdef: expected a {kind.__name__}, got {type(model).__name__}")
        return model


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLMGhostLoss(_BertGhostLoss):
    """Per-example masked-LM loss of a dpbert `BertForMaskedLM`, with ghost clipping support.

    `example` holds `input_ids` [L], `masked_positions` [P], `labels` [P], `label_weights` [P]
    and optionally `attention_mask` [L] and `token_type_ids` [L] (zeros when absent); a
    document holds K sequences of each ([K, L], [K, P]) and `sequence_padding` [K], and its loss
    is the sum of its real sequences' losses. `loss_from_logits(logits [P, V], example) ->
    scalar` defaults to the weighted mean cross-entropy. `layer_mode` ("mixed", "ghost" or
    "instantiate", see `dense_layer_mode`) picks how each dense kernel is clipped: speed and
    memory only, the result is the same. Call it as a plain `loss_fn(params, example, rng)`.
    """

    loss_from_logits: Callable[[jax.Array, dict[str, jax.Array]], jax.Array] = mlm_loss_from_logits

    def tap_groups(self, params: Any) -> dict[str, TapGroup]:
        predictions = ("cls", "predictions")
        tied = "decoder" not in params["cls"]["predictions"]
        # The decoder reads only the P masked positions: its ghost norm (P^2 (H + V)) is far
        # cheaper than a [V, H] gradient per example, whatever the layer mode.
        decoder = Dense(
            (*_EMBEDDINGS, "word_embeddings", "embedding") if tied else (*predictions, "decoder", "kernel"),
            (*predictions, "bias"),
            transposed=tied,
            mode="ghost",
        )
        rest = {
            **_embedding_taps(params),
            **_module_taps(params["cls"]["predictions"]["transform"], self.layer_mode, (*predictions, "transform")),
            _name((*predictions, "decoder")): decoder,
        }
        return {REST: TapGroup(rest), LAYERS: _encoder_group(params, self.layer_mode)}

    def tapped(self, params: Any, example: dict[str, jax.Array], rng: jax.Array | None, z: dict | None):
        """(loss, tap inputs, tap outputs) of one example, z added at each tap output (z None:
        nothing added, and the outputs are returned to shape z; otherwise the layers' are None).

        A document example (`input_ids` [K, L]) runs as a batch of K inside: its taps hold all
        the document's tokens, so the per-example norms are those of its summed gradient."""
        model = self._model(params, BertForMaskedLM)
        tape = Tape(None if z is None else z[REST])
        document = example["input_ids"].ndim == 2
        batched = (lambda x: x) if document else (lambda x: x[None])
        x, layer_inputs, layer_outputs = _tapped_encoder(
            model.bert, example, rng, tape, None if z is None else z[LAYERS], batched
        )
        positions = example.get("masked_positions")
        if positions is not None:
            x = jnp.take_along_axis(x, batched(positions)[:, :, None], axis=1)
        head = model.cls.predictions
        x = head.transform(x, _Taps(tape, "cls/predictions/transform/"))
        if head.decoder is None:
            table = model.bert.embeddings.word_embeddings.embedding[...]
            logits = jnp.einsum("...h,vh->...v", x, table.astype(head.dtype))
        else:
            logits = head.decoder(x)
        logits = tape("cls/predictions/decoder", logits + head.bias[...].astype(head.dtype), x)
        inputs = {REST: tape.inputs, LAYERS: layer_inputs}
        outputs = {REST: tape.outputs, LAYERS: layer_outputs}
        if not document:
            return self.loss_from_logits(logits[0], example), inputs, outputs
        # A document: the sum of its real sequences' losses (`dpbert.privacy.documents`).
        padding = example[SEQUENCE_PADDING]
        sequences = {k: v for k, v in example.items() if k != SEQUENCE_PADDING}
        losses = jax.vmap(self.loss_from_logits)(logits, sequences)
        return jnp.sum(jnp.where(padding, 0.0, losses.astype(_F32))), inputs, outputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassifierGhostLoss(_BertGhostLoss):
    """Per-example loss of a dpbert `BertForSequenceClassification` over EVERY parameter
    (embeddings, encoder, pooler, classifier), with ghost clipping support.

    `example` holds `input_ids` [L], `attention_mask` [L], `token_type_ids` [L] and `labels`
    (a scalar); `loss_from_logits(logits [num_labels], example) -> scalar` defaults to the
    cross-entropy (pass a squared error for a regression task). The logits are those of
    `functional.classifier_logits` with the same dropout key. `layer_mode` as `MLMGhostLoss`.
    """

    loss_from_logits: Callable[[jax.Array, dict[str, jax.Array]], jax.Array] = classifier_loss_from_logits

    def tap_groups(self, params: Any) -> dict[str, TapGroup]:
        rest = {
            **_embedding_taps(params),
            **_module_taps(params["bert"]["pooler"], self.layer_mode, ("bert", "pooler")),
            **_module_taps(params["classifier"], self.layer_mode, ("classifier",)),
        }
        return {REST: TapGroup(rest), LAYERS: _encoder_group(params, self.layer_mode)}

    def tapped(self, params: Any, example: dict[str, jax.Array], rng: jax.Array | None, z: dict | None):
        """(loss, tap inputs, tap outputs) of one example, as `MLMGhostLoss.tapped`."""
        model = self._model(params, BertForSequenceClassification)
        tape = Tape(None if z is None else z[REST])
        x, layer_inputs, layer_outputs = _tapped_encoder(
            model.bert, example, rng, tape, None if z is None else z[LAYERS], lambda x: x[None]
        )
        pooled = model.bert.pooler(x, _Taps(tape, "bert/pooler/"))
        pooled = bert.dropout(pooled, model.dropout_rate, bert.fold_key(rng, bert.SITE_CLASSIFIER))
        logits = _Taps(tape).dense("classifier", model.classifier, pooled)
        inputs = {REST: tape.inputs, LAYERS: layer_inputs}
        outputs = {REST: tape.outputs, LAYERS: layer_outputs}
        return self.loss_from_logits(logits[0], example), inputs, outputs
