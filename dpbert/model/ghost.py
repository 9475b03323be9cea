"""Ghost-clipping taps of dpbert's BERT models: per-example losses implementing the DP core's
`GhostLoss` interface (`dpbert.privacy.ghost_clipping`), so DP-SGD clips them exactly without
per-example gradients: `MLMGhostLoss` (pretraining, one sequence or one document) and
`ClassifierGhostLoss` (fine-tuning, every parameter or a subset with the rest frozen).

Guarantees: each is also a plain `loss_fn(params, example, rng)`, so the vmap and ghost paths clip
the same function; the taps cover every trained parameter (a frozen one gets none), declared from
the params tree; the tapped forward runs the model's own submodules, so the loss and its dropout
masks are the plain forward's. The taps of each layer kind: docs/INTERNALS.md ("dpbert.model.ghost").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dpbert.model import bert
from dpbert.model.bert import BertForMaskedLM, BertForSequenceClassification, BertModel
from dpbert.model.functional import merge
from dpbert.model.lora import LoRALinear
from dpbert.privacy.documents import SEQUENCE_PADDING
from dpbert.privacy.ghost_clipping import (
    LAYER_MODES,
    Bias,
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
    """`bert.Tap` that records the declared taps (`taps`: name -> kind, names under `prefix`) on a
    `Tape`; a sub-layer without a tap (its parameters frozen) runs plainly."""

    def __init__(self, tape: Tape, taps: Mapping[str, TapKind], prefix: str = ""):
        self.tape = tape
        self.taps = taps
        self.prefix = prefix

    def _record(self, name: str, y: jax.Array, x: Any = None) -> jax.Array:
        kind = self.taps.get(name)
        if kind is None:
            return y
        return self.tape(name, y, None if isinstance(kind, Bias) else x)

    def dense(self, name: str, layer: nnx.Linear, x: jax.Array) -> jax.Array:
        name = self.prefix + name
        if isinstance(layer, LoRALinear):  # taps "<name>/base", "<name>/lora_a", "<name>/lora_b"
            return layer(x, lambda part, y, a: self._record(f"{name}/{part}", y, a))
        return self._record(name, layer(x), x)

    def layer_norm(self, name: str, ln: nnx.LayerNorm, x: jax.Array) -> jax.Array:
        name = self.prefix + name
        if not isinstance(self.taps.get(name), ScaleBias):  # frozen, or a Bias tap on the output
            return self._record(name, ln(x))
        # Same statistics as flax's LayerNorm (float32, fast variance); xhat is the input of the
        # affine part, whose per-example gradients are sum_t g_t * xhat_t and sum_t g_t.
        xf = x.astype(_F32)
        mean = jnp.mean(xf, -1, keepdims=True)
        var = jnp.maximum(jnp.mean(jnp.square(xf), -1, keepdims=True) - jnp.square(mean), 0.0)
        xhat = (xf - mean) * jax.lax.rsqrt(var + ln.epsilon)
        return self.tape(name, ln(x), xhat)

    def embed(self, name: str, table: jax.Array, ids: jax.Array) -> jax.Array:
        return self._record(self.prefix + name, super().embed(name, table, ids), ids)

    def positions(self, name: str, table: jax.Array, length: int, ids: jax.Array | None = None) -> jax.Array:
        # A Positions tap's input is its position ids (None: rows 0..L-1).
        return self._record(self.prefix + name, super().positions(name, table, length, ids), ids)


def _name(path: Path) -> str:
    return "/".join(map(str, path))


def _leaf_paths(tree: Any) -> set[Path]:
    return {
        tuple(k.key if hasattr(k, "key") else k.idx for k in p if hasattr(k, "key") or hasattr(k, "idx"))
        for p, _ in jax.tree_util.tree_leaves_with_path(tree)
    }


def _module_taps(
    tree: Any, layer_mode: str, prefix: Path = (), trained: Callable[[Path], bool] = lambda path: True
) -> dict[str, TapKind]:
    """Taps of the sub-modules of `tree` whose parameters are `trained` (paths under `prefix`),
    named by their path: a `Dense` for a trained kernel or LoRA factor (with its bias when that is
    trained too), a `ScaleBias` for a trained LayerNorm scale (and bias), a `Bias` on the output
    of a layer whose bias alone is trained. Frozen parameters get nothing."""
    leaves = _leaf_paths(tree)
    taps: dict[str, TapKind] = {}
    for path in leaves:
        parent = (*prefix, *path[:-1])
        full = (*prefix, *path)
        bias = (*parent, "bias") if (*path[:-1], "bias") in leaves and trained((*parent, "bias")) else None
        if path[-1] == "kernel" and trained(full):
            taps[_name(parent)] = Dense(full, bias, mode=layer_mode)
        elif path[-1] == "scale" and trained(full):
            taps[_name(parent)] = ScaleBias(full, bias)
        elif path[-1] in ("kernel", "scale") and bias is not None:
            taps[_name(parent)] = Bias(bias)
        elif path[-1] in ("lora_a", "lora_b") and trained(full):
            taps[_name(full)] = Dense(full, mode=layer_mode)
    return taps


def _embedding_taps(params: Any, trained: Callable[[Path], bool] = lambda path: True) -> dict[str, TapKind]:
    tables = {
        "word_embeddings": Lookup,
        "token_type_embeddings": Lookup,
        "position_embeddings": Positions,
    }
    taps: dict[str, TapKind] = {
        _name((*_EMBEDDINGS, name)): kind((*_EMBEDDINGS, name, "embedding"))
        for name, kind in tables.items()
        if trained((*_EMBEDDINGS, name, "embedding"))
    }
    layer_norm = (*_EMBEDDINGS, "LayerNorm")
    return taps | _module_taps(params["bert"]["embeddings"]["LayerNorm"], "mixed", layer_norm, trained)


def _encoder_taps(params: Any, layer_mode: str, trained: Callable[[Path], bool] = lambda path: True):
    """The encoder layer's taps (paths inside one layer of the stack)."""
    layers = params["bert"]["encoder"]["layer"]
    return _module_taps(layers, layer_mode, (), lambda path: trained((*_LAYER_PARAMS, *path)))


def _groups(rest: dict[str, TapKind], layers: dict[str, TapKind]) -> dict[str, TapGroup]:
    """The tap groups, leaving out a group without taps (nothing trained there)."""
    groups = {REST: TapGroup(rest), LAYERS: TapGroup(layers, stacked_at=_LAYER_PARAMS, scan=bert.layer_scan)}
    return {name: group for name, group in groups.items() if group.taps}


def _tapped_encoder(
    encoder: BertModel,
    example: dict[str, jax.Array],
    rng: jax.Array | None,
    tape: Tape,
    groups: Mapping[str, TapGroup],
    z_layers: Any,
    batched: Any,
) -> tuple[jax.Array, Any, Any]:
    """(last hidden states [B, L, H], layer tap inputs, layer tap outputs (None unless probing:
    z_layers None)) of the example's sequences as a batch `batched(x)`; embeddings on `tape`;
    the taps declared in `groups`."""
    ids = batched(example["input_ids"])
    types = example.get("token_type_ids")
    types = jnp.zeros_like(ids) if types is None else batched(types)
    mask = example.get("attention_mask")
    mask = bert.attention_mask_4d(None if mask is None else batched(mask))
    positions = example.get("position_ids")
    embed_taps = _Taps(tape, _group_taps(groups, REST), _name(_EMBEDDINGS) + "/")
    x = encoder.embeddings(
        ids,
        types,
        bert.fold_key(rng, bert.SITE_EMBEDDINGS),
        embed_taps,
        position_ids=None if positions is None else batched(positions),
    )
    layer_taps = _group_taps(groups, LAYERS)

    def body(layer: Any, x: jax.Array, i: jax.Array, z_i: Any) -> tuple[jax.Array, Any]:
        layer_tape = Tape(z_i)
        x = layer(x, mask, bert.layer_key(rng, i), _Taps(layer_tape, layer_taps))
        return x, (layer_tape.inputs, layer_tape.outputs if z_layers is None else None)

    x, (inputs, outputs) = bert.scan_layers(encoder.encoder.layer, x, body, z_layers)
    return x, inputs, outputs


def _group_taps(groups: Mapping[str, TapGroup], name: str) -> Mapping[str, TapKind]:
    return groups[name].taps if name in groups else {}


def _only(groups: Mapping[str, TapGroup], trees: Mapping[str, Any]) -> dict[str, Any]:
    """The tapped trees of the declared groups (a group without taps is not returned)."""
    return {name: tree for name, tree in trees.items() if name in groups}


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
    and optionally `attention_mask` [L], `token_type_ids` [L] (zeros when absent) and
    `position_ids` [L] (absent: 0..L-1); a
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
        return _groups(rest, _encoder_taps(params, self.layer_mode))

    def tapped(self, params: Any, example: dict[str, jax.Array], rng: jax.Array | None, z: dict | None):
        """(loss, tap inputs, tap outputs) of one example, z added at each tap output (z None:
        nothing added, and the outputs are returned to shape z; otherwise the layers' are None).

        A document example (`input_ids` [K, L]) runs as a batch of K inside: its taps hold all
        the document's tokens, so the per-example norms are those of its summed gradient."""
        model = self._model(params, BertForMaskedLM)
        groups = self.tap_groups(params)
        tape = Tape(None if z is None else z[REST])
        document = example["input_ids"].ndim == 2
        batched = (lambda x: x) if document else (lambda x: x[None])
        x, layer_inputs, layer_outputs = _tapped_encoder(
            model.bert, example, rng, tape, groups, None if z is None else z[LAYERS], batched
        )
        positions = example.get("masked_positions")
        if positions is not None:
            x = jnp.take_along_axis(x, batched(positions)[:, :, None], axis=1)
        head = model.cls.predictions
        x = head.transform(x, _Taps(tape, groups[REST].taps, "cls/predictions/transform/"))
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
    """Per-example loss of a dpbert `BertForSequenceClassification` over its trained parameters,
    with ghost clipping support: `params` is every parameter (`frozen` None), or the trained
    subset and `frozen` the rest (an `nnx.State`, e.g. `params.split(filter, ...)`: bias terms +
    head, LoRA factors + head, the head alone). Only the trained parameters have taps, so the
    clipped sum is over them alone, as the vmap path's gradient of the same function.

    `example` holds `input_ids` [L], `attention_mask` [L], `token_type_ids` [L], `labels`
    (a scalar) and optionally `position_ids` [L]; `loss_from_logits(logits [num_labels], example) -> scalar` defaults to the
    cross-entropy (pass a squared error for a regression task). The logits are those of
    `functional.classifier_logits` on the merged parameters with the same dropout key.
    `layer_mode` as `MLMGhostLoss`. `frozen` takes no part in comparisons or the hash (its
    values do not change the program)."""

    loss_from_logits: Callable[[jax.Array, dict[str, jax.Array]], jax.Array] = classifier_loss_from_logits
    frozen: Any = dataclasses.field(default=None, compare=False)

    def _all(self, params: Any) -> Any:
        return params if self.frozen is None else nnx.merge_state(params, self.frozen)

    def tap_groups(self, params: Any) -> dict[str, TapGroup]:
        full, trained = self._all(params), _leaf_paths(params)
        is_trained = trained.__contains__
        rest = {
            **_embedding_taps(full, is_trained),
            **_module_taps(full["bert"]["pooler"], self.layer_mode, ("bert", "pooler"), is_trained),
            **_module_taps(full["classifier"], self.layer_mode, ("classifier",), is_trained),
        }
        return _groups(rest, _encoder_taps(full, self.layer_mode, is_trained))

    def tapped(self, params: Any, example: dict[str, jax.Array], rng: jax.Array | None, z: dict | None):
        """(loss, tap inputs, tap outputs) of one example, as `MLMGhostLoss.tapped`."""
        model = self._model(self._all(params), BertForSequenceClassification)
        groups = self.tap_groups(params)
        tape = Tape(None if z is None else z.get(REST))
        x, layer_inputs, layer_outputs = _tapped_encoder(
            model.bert, example, rng, tape, groups, None if z is None else z.get(LAYERS), lambda x: x[None]
        )
        rest = _group_taps(groups, REST)
        pooled = model.bert.pooler(x, _Taps(tape, rest, "bert/pooler/"))
        pooled = bert.dropout(pooled, model.dropout_rate, bert.fold_key(rng, bert.SITE_CLASSIFIER))
        logits = _Taps(tape, rest).dense("classifier", model.classifier, pooled)
        inputs = _only(groups, {REST: tape.inputs, LAYERS: layer_inputs})
        outputs = _only(groups, {REST: tape.outputs, LAYERS: layer_outputs})
        return self.loss_from_logits(logits[0], example), inputs, outputs
