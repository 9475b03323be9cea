"""Exact per-example clipping without per-example gradients ("ghost" norms + book-keeping).

For every layer whose parameters enter linearly, the per-example gradient is a product of two
quantities a backward pass already has: the layer's input `a` [T, d_in] and the gradient of
the loss with respect to its output `g` [T, d_out] (taken with the perturbation trick: a
zero tensor `z` is added to each layer output and d loss / d z is the output gradient). So

- the squared per-example norm of a dense kernel is ||a^T g||_F^2, computed either as
  sum_{t,s} (a_t . a_s)(g_t . g_s) (the "ghost" norm, T^2 (d_in + d_out) flops) or from
  the per-example gradient a^T g itself (T d_in d_out flops), chosen statically per layer
  shape (`dense_layer_mode`: "mixed" ghost clipping, Bu et al. 2022);
- the clipped sum is sum_i w_i a_i^T g_i with w_i = min(1, C / ||grad_i||), one einsum per
  layer, or a contraction of the instantiated per-example gradients with w ("book-keeping",
  Bu et al. 2023): no second backward pass, and no [M, params] tensor beyond the layers that
  are instantiated (their per-micro-batch memory is M d_in d_out floats each).

`MLMGhostLoss` is the BERT-aware part: a per-example masked-LM loss for a dpbert
`BertForMaskedLM` that covers EVERY parameter (dense kernels and biases, LayerNorm scale and
bias, word / position / token-type embeddings, the MLM bias) and the tied word embedding,
whose per-example gradient is the sum of its two uses (input lookup G_in and decoder G_dec):
||G_in + G_dec||^2 = ||G_in||^2 + ||G_dec||^2 + 2 <G_in, G_dec>, the cross term exactly
sum_{t,p} e_p[id_t] (x_p . g_t). The object is also a plain `loss_fn(params, example, rng)`,
so the vmap path (`dpbert.privacy.clipping`) and this path clip the same function.

`ghost_clipped_grad_sum(loss, params, batch, is_padding, rng, ...)` has the signature and the
guarantees of `clipping.clipped_grad_sum` (sensitivity clip_norm, padding and non-finite
examples contribute exactly zero, per-example keys fold_in(rng, global position), ClipStats
not private). The two paths agree to float tolerance; the choice changes neither the noise
nor the accounting (noise is added by the step on the returned sum). One difference at the
extreme: a finite gradient whose squared norm overflows float32 (norm > ~1e19) is dropped
(counted non-finite) here, clipped there; both keep the sensitivity at clip_norm.

Documents (`privacy.unit: document`, `dpbert.privacy.documents`): an example may be a document of
K sequences (`input_ids` [K, L] and `sequence_padding` [K]); its loss is the sum of its sequences'
losses, its taps hold all its K L tokens, and every norm above is then that of the document's summed
gradient (for a dense layer ||sum_{t in S} a_t g_t^T||_F^2 = sum_{t,s in S} (a_t . a_s)(g_t . g_s)
over the document's token set S; a position row sums the K tokens at its position).

Forward numerics: the tapped forward calls the model's own submodules (Linear, LayerNorm,
attention, dropout sites), so the loss and its dropout masks are those of the plain loss.

Depth: the encoder's layers are the model's own scanned layer body (`bert.scan_layers`) with
taps (`bert.Tap`): one layer is traced and compiled whatever the depth, its tap inputs come
out stacked on a leading layer axis, the output gradients of the perturbations too (the
backward of the scan is a scan), and the per-layer norms and clipped sums run as one
`lax.scan` over the layer axis each. Compile time does not grow with depth, and no piece of
the program grows with the micro-batch size M either (per-example sums are one dot for
M > 8, see `_weighted_example_sum`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpbert.model import bert as bert_lib
from dpbert.model.bert import BertForMaskedLM
from dpbert.model.functional import merge
from dpbert.privacy.clipping import ClipStats, clip_scale, example_keys, scan_microbatches
from dpbert.privacy.clipping import clipped_grad_sum as clipped_grad_sum_vmap
from dpbert.privacy.documents import SEQUENCE_PADDING
from dpbert.privacy.tuning import best_seconds, placeholder

Path = tuple[Any, ...]
_F32 = jnp.float32


def mlm_loss_from_logits(logits: jax.Array, example: dict[str, jax.Array]) -> jax.Array:
    """Mean cross-entropy over the example's weighted masked positions (0 if none)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(_F32), example["labels"])
    w = example["label_weights"]
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


class _Tape(bert_lib.Tap):
    """Records, during one traced forward, each tap's input and output shape and adds its zero
    perturbation. One tape for the taps outside the encoder ("rest"), one per scanned layer
    body (its names are the sub-layer paths inside a layer, "attention/self/query")."""

    def __init__(self, z: dict[str, jax.Array] | None):
        self.z = z
        self.inputs: dict[str, Any] = {}
        self.outputs: dict[str, jax.ShapeDtypeStruct] = {}

    def out(self, name: str, y: jax.Array, record: Any) -> jax.Array:
        self.inputs[name] = record
        self.outputs[name] = jax.ShapeDtypeStruct(y.shape, y.dtype)
        return y if self.z is None else y + self.z[name]

    def dense(self, name: str, layer: nnx.Linear, x: jax.Array) -> jax.Array:
        return self.out(name, layer(x), x)

    def layer_norm(self, name: str, ln: nnx.LayerNorm, x: jax.Array) -> jax.Array:
        # Same statistics as flax's LayerNorm (float32, fast variance); xhat is the input of the
        # affine part, whose per-example gradients are sum_t g_t * xhat_t and sum_t g_t.
        xf = x.astype(_F32)
        mean = jnp.mean(xf, -1, keepdims=True)
        var = jnp.maximum(jnp.mean(jnp.square(xf), -1, keepdims=True) - jnp.square(mean), 0.0)
        xhat = (xf - mean) * jax.lax.rsqrt(var + ln.epsilon)
        return self.out(name, ln(x), xhat)


def _key(path: Path) -> str:
    return "/".join(str(p) for p in path)


# Taps are grouped: "rest" (embeddings, MLM head: one array per example) and "layers" (the
# encoder's, from the scanned layer body: a leading layer axis, then the example axis once
# vmapped). `ghost_clipped_grad_sum` vmaps `tapped` with these axes.
_REST, _LAYERS = "rest", "layers"
_TAP_AXES = {_REST: 0, _LAYERS: 1}
_LAYER_PARAMS: Path = ("bert", "encoder", "layer")


def _tapped_mlm_forward(
    model: BertForMaskedLM, example: dict[str, jax.Array], rng: jax.Array | None, z: dict[str, Any] | None
) -> tuple[jax.Array, dict[str, Any], dict[str, Any]]:
    """(logits [P, V], tap inputs, tap output shapes) of ONE example: the model's own computation
    with taps (batch axis of 1 inside, exactly like `functional.mlm_logits` on an unbatched
    example); the encoder runs the model's scanned layer body, taps inside.

    A document example (`input_ids` [K, L]: K sequences, see `dpbert.privacy.documents`) runs
    as a batch of K inside and gives logits [K, P, V]: its taps hold all the document's tokens,
    so the per-example norms below are those of the document's summed gradient."""
    tape = _Tape(None if z is None else z[_REST])
    document = example["input_ids"].ndim == 2
    batched = (lambda x: x) if document else (lambda x: x[None])
    ids = batched(example["input_ids"])
    types = example.get("token_type_ids")
    types = jnp.zeros_like(ids) if types is None else batched(types)
    mask = example.get("attention_mask")
    mask = bert_lib._attention_mask(None if mask is None else batched(mask))
    emb = model.bert.embeddings
    seq_len = ids.shape[-1]
    x = (
        jnp.take(emb.word_embeddings.embedding[...], ids, axis=0)
        + jnp.take(emb.token_type_embeddings.embedding[...], types, axis=0)
        + emb.position_embeddings.embedding[...][:seq_len]
    ).astype(emb.dtype)
    x = tape.out("embeddings", x, {"ids": ids, "types": types})
    x = tape.layer_norm(_key(("bert", "embeddings", "LayerNorm")), emb.LayerNorm, x)
    x = bert_lib.dropout(x, emb.dropout_rate, bert_lib._fold(rng, bert_lib._SITE_EMBEDDINGS))

    layer_shapes: dict[str, jax.ShapeDtypeStruct] = {}

    def body(layer: Any, x: jax.Array, i: jax.Array, z_i: dict[str, jax.Array] | None):
        layer_tape = _Tape(z_i)
        x = layer(x, mask, bert_lib.layer_key(rng, i), layer_tape)
        layer_shapes.update(layer_tape.outputs)  # static shapes, seen while the body is traced
        return x, layer_tape.inputs

    layers = model.bert.encoder.layer
    x, layer_inputs = bert_lib.scan_layers(layers, x, body, None if z is None else z[_LAYERS])
    n = bert_lib.num_stacked(layers)
    layer_outputs = {k: jax.ShapeDtypeStruct((n, *v.shape), v.dtype) for k, v in layer_shapes.items()}

    positions = example.get("masked_positions")
    if positions is not None:
        x = jnp.take_along_axis(x, batched(positions)[:, :, None], axis=1)
    head = model.cls.predictions
    tr = head.transform
    x = bert_lib.ACTIVATIONS[tr.hidden_act](tape.dense(_key(("cls", "predictions", "transform", "dense")), tr.dense, x))
    x = tape.layer_norm(_key(("cls", "predictions", "transform", "LayerNorm")), tr.LayerNorm, x)
    if head.decoder is None:
        table = emb.word_embeddings.embedding[...]
        logits = jnp.einsum("...h,vh->...v", x, table.astype(head.dtype))
    else:
        logits = head.decoder(x)
    logits = tape.out("logits", logits + head.bias[...].astype(head.dtype), x)
    logits = logits if document else logits[0]
    return logits, {_REST: tape.inputs, _LAYERS: layer_inputs}, {_REST: tape.outputs, _LAYERS: layer_outputs}


# ---------------------------------------------------------------------------- per-layer algebra
# Every function below takes float32 taps of a micro-batch of M examples: inputs `a` [M, T, d_in]
# and output gradients `g` [M, T, d_out].

LAYER_MODES = ("mixed", "ghost", "instantiate")


def _flat(x: jax.Array) -> jax.Array:
    """[M, 1, ..., d] -> [M, T, d] float32 (T = product of the middle axes)."""
    return x.reshape(x.shape[0], -1, x.shape[-1]).astype(_F32)


def dense_layer_mode(layer_mode: str, t: int, d_in: int, d_out: int, *, backend: str | None = None) -> str:
    """How a dense kernel's per-example norm and clipped sum are computed (static, per shape).

    "ghost": norm from the Gram matrices, sum_{t,s} (a_t . a_s)(g_t . g_s) (T^2 (d_in + d_out)
    flops per example), then the clipped sum as one weighted einsum (T d_in d_out, the cost of
    the non-private weight gradient). "instantiate": the per-example gradient a_i^T g_i
    (T d_in d_out per example: the non-private weight gradient's flops, once), whose norm and
    clip-weighted sum over examples are then passes of M d_in d_out. "mixed" takes, per layer,
    the cheaper one for `backend` (default: JAX's default backend):
    - accelerators, by flops: instantiate when 2 d_in d_out <= T^2 (d_in + d_out) (Bu et al.,
      mixed ghost clipping);
    - CPU, measured: XLA CPU runs the batched per-example product slower than the plain
      weight gradient (with its norm and weighted sum, M = 4, T = 128: 0.73-1.2x the speed at
      tiny and mini shapes, 0.33-0.37x at base's FFN) and streams M d_in d_out fresh floats
      through memory, so instantiate only when 2 T (d_in + d_out) >= d_in d_out (at T = 128:
      every layer of BERT tiny and mini; ghost for every encoder layer of base, which made a
      base DP step at batch 8 1.37x faster: 5.60 -> 4.07 s, the non-private step 3.39 s)."""
    if layer_mode != "mixed":
        return layer_mode
    if (backend or jax.default_backend()) == "cpu":
        return "instantiate" if 2 * t * (d_in + d_out) >= d_in * d_out else "ghost"
    return "instantiate" if 2 * d_in * d_out <= t * t * (d_in + d_out) else "ghost"


def _ghost_sq_norm(a: jax.Array, g: jax.Array) -> jax.Array:
    """||a_i^T g_i||_F^2 per example from the Gram matrices of a and g."""
    return jnp.sum(jnp.einsum("mtd,msd->mts", a, a) * jnp.einsum("mtd,msd->mts", g, g), axis=(1, 2))


_TYPE_TABLE: Path = ("bert", "embeddings", "token_type_embeddings", "embedding")
_MLM_BIAS: Path = ("cls", "predictions", "bias")


def _path(tap: str) -> Path:
    """The parameter path prefix of a tap name ("bert/encoder/layer/0/...")."""
    return tuple(int(p) if p.isdigit() else p for p in tap.split("/"))


def _kernels_transposed(a: jax.Array, g: jax.Array) -> bool:
    """Whether `_per_example_kernels` lays out a_i^T g_i as [M, d_out, d_in] (when d_in > d_out)."""
    return a.shape[2] > g.shape[2]


def _per_example_kernels(a: jax.Array, g: jax.Array) -> jax.Array:
    """Per-example kernel gradients a_i^T g_i, laid out [M, d_in, d_out], or [M, d_out, d_in]
    when d_in > d_out: XLA CPU computes the batched product with the larger dimension last
    faster (BERT tiny's FFN output, 512 -> 128, M = 4, with norm and weighted sum: 0.83 -> 0.60
    ms; the whole ghost sum of a tiny BERT batch of 64: 400 -> 358 ms)."""
    return jnp.einsum("mti,mto->moi" if _kernels_transposed(a, g) else "mti,mto->mio", a, g)


def _weighted_outer(a: jax.Array, g: jax.Array, w: jax.Array) -> jax.Array:
    """sum_i w_i a_i^T g_i [d_in, d_out]; w multiplies the smaller operand (fewer bytes moved)."""
    if a.shape[2] <= g.shape[2]:
        return jnp.einsum("mti,mto->io", a * w[:, None, None], g)
    return jnp.einsum("mti,mto->io", a, g * w[:, None, None])


# Micro-batches up to this size sum per-example gradients as an unrolled chain of M
# multiply-adds (one fused elementwise loop: the fastest form on XLA CPU for M = 4); larger ones
# as one [M] x [M, N] dot. The unrolled chain made the program, its compile time and its compile
# memory grow linearly with M (one multiply-add per example per per-example tensor, ~35 tensors
# for tiny BERT): the tiny recipe's DP step at micro-batch 256 took 2.5x the compile seconds
# and memory of micro-batch 16, and at 1,024 it went past 9 GB resident before the compile ended.
_UNROLL_MAX = 8


def _weighted_example_sum(x: jax.Array, w: jax.Array) -> jax.Array:
    """sum_i w_i x_i over the leading (example) axis: unrolled for M <= _UNROLL_MAX, else one dot
    (its program size does not depend on M)."""
    m = x.shape[0]
    if m <= _UNROLL_MAX:
        return sum((w[i] * x[i] for i in range(1, m)), w[0] * x[0])
    return jnp.matmul(w.astype(x.dtype), x.reshape(m, -1), precision=jax.lax.Precision.HIGHEST).reshape(x.shape[1:])


def _sq(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x), axis=tuple(range(1, x.ndim)))


def _where_kept(keep: jax.Array, x: jax.Array) -> jax.Array:
    """x with the rows of dropped examples set to exactly 0 (0 * NaN would still be NaN)."""
    return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLMGhostLoss:
    """Per-example masked-LM loss of a dpbert `BertForMaskedLM`, with ghost clipping support.

    `example` holds `input_ids` [L], `masked_positions` [P], `labels` [P], `label_weights` [P]
    and optionally `attention_mask` [L] and `token_type_ids` [L] (zeros when absent).
    `loss_from_logits(logits [P, V], example) -> scalar` defaults to the weighted mean
    cross-entropy. `layer_mode` ("mixed", "ghost" or "instantiate", see `dense_layer_mode`)
    picks how each dense kernel is clipped: speed and memory only, the result is the same.
    Call it as a plain `loss_fn(params, example, rng)`.
    """

    graphdef: nnx.GraphDef
    loss_from_logits: Callable[[jax.Array, dict[str, jax.Array]], jax.Array] = mlm_loss_from_logits
    layer_mode: str = "mixed"

    def __post_init__(self) -> None:
        if not isinstance(self.graphdef, nnx.GraphDef):
            raise ValueError(f"graphdef: expected an nnx.GraphDef, got {type(self.graphdef).__name__}")
        if not callable(self.loss_from_logits):
            raise ValueError("loss_from_logits: expected a callable (logits, example) -> scalar")
        if self.layer_mode not in LAYER_MODES:
            raise ValueError(f"layer_mode: expected one of {LAYER_MODES}, got {self.layer_mode!r}")

    def __call__(self, params: Any, example: dict[str, jax.Array], rng: jax.Array) -> jax.Array:
        return self.tapped(params, example, rng, None)[0]

    def tapped(self, params: Any, example: dict[str, jax.Array], rng: jax.Array | None, z: dict | None):
        """(loss, tap inputs, tap output shapes) of one example, z added at each tap output.

        Taps come in two groups: "rest" (embeddings and MLM head) and "layers" (the encoder's
        scanned layer body, every array with a leading layer axis); `ghost_clipped_grad_sum`
        vmaps this over examples with the example axis after the layer axis (`_TAP_AXES`)."""
        model = merge(self.graphdef, params)
        if not isinstance(model, BertForMaskedLM):
            raise ValueError(f"graphdef: expected a BertForMaskedLM, got {type(model).__name__}")
        logits, inputs, outputs = _tapped_mlm_forward(model, example, rng, z)
        if SEQUENCE_PADDING not in example:
            return self.loss_from_logits(logits, example), inputs, outputs
        # A document: the sum of its real sequences' losses (`dpbert.privacy.documents`).
        padding = example[SEQUENCE_PADDING]
        sequences = {k: v for k, v in example.items() if k != SEQUENCE_PADDING}
        losses = jax.vmap(self.loss_from_logits)(logits, sequences)
        return jnp.sum(jnp.where(padding, 0.0, losses.astype(_F32))), inputs, outputs

    def _tap_sq_norms(
        self, inputs: dict[str, Any], grads: dict[str, jax.Array]
    ) -> tuple[jax.Array | float, dict[Path, jax.Array]]:
        """(summed ghost squared norms [M] of the dense taps clipped by ghost norms, the
        per-example gradients of the others: biases, LayerNorm scales, instantiated kernels),
        keyed by the tap's parameter path."""
        total: jax.Array | float = 0.0
        per_example: dict[Path, jax.Array] = {}
        for name, g in grads.items():
            if name in ("embeddings", "logits"):
                continue
            path = _path(name)
            a, g = _flat(inputs[name]), _flat(g)
            per_example[path + ("bias",)] = jnp.sum(g, axis=1)
            if name.endswith("LayerNorm"):
                per_example[path + ("scale",)] = jnp.sum(g * a, axis=1)
            elif dense_layer_mode(self.layer_mode, a.shape[1], a.shape[2], g.shape[2]) == "instantiate":
                per_example[path + ("kernel",)] = _per_example_kernels(a, g)
            else:
                total += _ghost_sq_norm(a, g)
        return total, per_example

    def sq_norms(
        self, params: Any, inputs: dict[str, Any], grads: dict[str, Any]
    ) -> tuple[jax.Array, dict[str, dict[Path, jax.Array]]]:
        """(squared norm [M] of each example's whole gradient, the per-example gradients that the
        norm was computed from: {"rest": {path: [M, ...]}, "layers": {path inside a layer:
        [L, M, ...]}}: biases, LayerNorm scales, token-type and MLM-bias rows, and the kernels
        clipped by instantiation, `_per_example_kernels`). `weighted_sums` reuses them instead of
        reading the taps again. The encoder's layers are done by one `lax.scan` over the layer
        axis (one compiled body, whatever the depth)."""
        total, rest = self._tap_sq_norms(inputs[_REST], grads[_REST])
        embedding_total, embedding_rows = self._embedding_sq_norms(params, inputs[_REST], grads[_REST])
        rest |= embedding_rows
        total = total + embedding_total + sum(_sq(x) for x in rest.values())

        def layer(total: jax.Array, taps: tuple[dict[str, Any], dict[str, jax.Array]]):
            layer_total, per_example = self._tap_sq_norms(*taps)
            return total + layer_total + sum(_sq(x) for x in per_example.values()), per_example

        # The carry starts from the other taps' total: it varies per device like them under shard_map.
        total, layers = bert_lib.layer_scan(layer, total, (inputs[_LAYERS], grads[_LAYERS]))
        return total, {_REST: rest, _LAYERS: layers}

    def _embedding_sq_norms(
        self, params: Any, inputs: dict[str, Any], grads: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[Path, jax.Array]]:
        """(squared norms of the word and position tables, tied decoder included; the per-example
        token-type and MLM-bias gradients, whose norms the caller adds)."""
        m, seq_len = grads["embeddings"].shape[0], inputs["embeddings"]["ids"].shape[-1]
        ids = inputs["embeddings"]["ids"].reshape(m, -1)
        types = inputs["embeddings"]["types"].reshape(ids.shape)
        g = _flat(grads["embeddings"])  # [M, T, H]: gradient of each lookup's output row (T = K L tokens)
        e = _flat(grads["logits"])  # [M, P, V]: gradient of the logits
        x = _flat(inputs["logits"])  # [M, P, H]: decoder input
        n_types = params["bert"]["embeddings"]["token_type_embeddings"]["embedding"].shape[0]
        rows = {
            _TYPE_TABLE: jnp.einsum("mtk,mth->mkh", jax.nn.one_hot(types, n_types, dtype=_F32), g),
            _MLM_BIAS: jnp.sum(e, axis=1),
        }
        # Position row p receives the gradients of the tokens at position p of each of the
        # example's K sequences (K = 1 for a sequence, up to max_sequences_per_document for a document).
        total = _sq(jnp.sum(g.reshape(m, -1, seq_len, g.shape[-1]), axis=1))
        # Each word-table row receives the sum of its tokens' gradients: add every token's gradient
        # at its id's first position (an L x L id comparison and a scatter; the L^2 H Gram of g
        # it replaces took 1.6x longer on CPU for tiny BERT).
        first = jnp.argmax(ids[:, :, None] == ids[:, None, :], axis=2)
        word_in = _sq(jnp.zeros_like(g).at[jnp.arange(g.shape[0])[:, None], first].add(g))
        # The decoder decodes only the P masked positions: its ghost norm (P^2 (H + V)) is far
        # cheaper than a [V, H] gradient per example.
        decoder = _ghost_sq_norm(x, e)
        if self._tied(params):
            e_at_ids = jnp.take_along_axis(e, ids[:, None, :], axis=2)  # [M, P, L]: e_p[id_t]
            cross = jnp.sum(e_at_ids * jnp.einsum("mph,mth->mpt", x, g), axis=(1, 2))
            return total + word_in + decoder + 2.0 * cross, rows
        return total + word_in + decoder, rows

    @staticmethod
    def _tied(params: Any) -> bool:
        return "decoder" not in params["cls"]["predictions"]

    def _tap_weighted_sums(
        self, inputs: dict[str, Any], grads: dict[str, jax.Array], w: jax.Array, per_example: dict[Path, jax.Array]
    ) -> dict[Path, jax.Array]:
        """sum_i w_i grad_i of the dense and LayerNorm taps' parameters, keyed by parameter path."""
        out = {path: _weighted_example_sum(x, w) for path, x in per_example.items()}
        for name, g in grads.items():
            if name in ("embeddings", "logits") or name.endswith("LayerNorm"):
                continue
            kernel = _path(name) + ("kernel",)
            a, g = _flat(inputs[name]), _flat(g)
            if kernel not in out:
                out[kernel] = _weighted_outer(a, g, w)
            elif _kernels_transposed(a, g):
                out[kernel] = out[kernel].T
        return out

    def weighted_sums(
        self,
        params: Any,
        inputs: dict[str, Any],
        grads: dict[str, Any],
        w: jax.Array,
        per_example: dict[str, dict[Path, jax.Array]],
        clean: Callable[[jax.Array], jax.Array] = lambda x: x,
    ) -> dict[Path, jax.Array]:
        """sum_i w_i grad_i for every parameter, keyed by parameter path (float32); the encoder's
        stacked parameters [L, ...] by one `lax.scan` over the layer axis. `clean` is applied to
        every float tap, output gradient and per-example gradient of one micro-batch ([M, ...])
        before it is used (the caller zeroes the rows of dropped examples with it)."""

        def cleaned(tree: Any) -> Any:
            return jax.tree_util.tree_map(lambda x: clean(x) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

        rest_in, rest_g, rest_pe = cleaned((inputs[_REST], grads[_REST], per_example[_REST]))
        out = self._tap_weighted_sums(rest_in, rest_g, w, rest_pe)
        out |= self._embedding_weighted_sums(params, rest_in, rest_g, w)

        def layer(carry: None, taps: tuple[Any, Any, Any]) -> tuple[None, dict[Path, jax.Array]]:
            return None, self._tap_weighted_sums(*cleaned(taps[:2]), w, cleaned(taps[2]))

        _, layers = bert_lib.layer_scan(layer, None, (inputs[_LAYERS], grads[_LAYERS], per_example[_LAYERS]))
        out |= {_LAYER_PARAMS + path: x for path, x in layers.items()}
        return out

    def _embedding_weighted_sums(
        self, params: Any, inputs: dict[str, Any], grads: dict[str, jax.Array], w: jax.Array
    ) -> dict[Path, jax.Array]:
        """sum_i w_i grad_i of the word and position tables and of the untied decoder."""
        out = {}
        m = w.shape[0]
        seq_len = inputs["embeddings"]["ids"].shape[-1]
        ids = inputs["embeddings"]["ids"].reshape(m, -1)
        g = _flat(grads["embeddings"]) * w[:, None, None]
        e = _flat(grads["logits"])
        x = _flat(inputs["logits"]) * w[:, None, None]  # [M, P, H]: far smaller than e [M, P, V]
        emb = params["bert"]["embeddings"]
        table = emb["word_embeddings"]["embedding"]
        pos_table = emb["position_embeddings"]["embedding"]
        word = jnp.zeros(table.shape, _F32).at[ids.reshape(-1)].add(g.reshape(-1, g.shape[-1]))
        decoder = jnp.einsum("mpv,mph->vh", e, x)
        if self._tied(params):
            word = word + decoder
        else:
            out[("cls", "predictions", "decoder", "kernel")] = decoder.T
        out[("bert", "embeddings", "word_embeddings", "embedding")] = word
        out[("bert", "embeddings", "position_embeddings", "embedding")] = (
            jnp.zeros(pos_table.shape, _F32).at[:seq_len].set(jnp.sum(g.reshape(-1, seq_len, g.shape[-1]), axis=0))
        )
        return out


def _param_path(path: tuple[Any, ...]) -> Path:
    return tuple(k.key if hasattr(k, "key") else k.idx for k in path if hasattr(k, "key") or hasattr(k, "idx"))


def _ghost_norms(loss: MLMGhostLoss, params: Any, examples: Any, keys: jax.Array, like: jax.Array):
    """(losses [M], squared gradient norms [M], per-example gradients, tap inputs, output
    gradients) of one micro-batch: one tapped forward and one backward to the tap outputs.
    `like` ([M], e.g. the padding mask) types the zero perturbations (see below)."""
    # Examples vmapped; the encoder's taps keep their layer axis first (`_TAP_AXES`), so the
    # scans over layers in `sq_norms` and `weighted_sums` read them without a transpose.
    tapped = jax.vmap(
        lambda p, e, k, z: loss.tapped(p, e, k, z)[:2], in_axes=(None, 0, 0, _TAP_AXES), out_axes=(0, _TAP_AXES)
    )
    shapes = jax.eval_shape(
        jax.vmap(lambda p, e, k: loss.tapped(p, e, k, None)[2], in_axes=(None, 0, 0), out_axes=_TAP_AXES),
        params,
        examples,
        keys,
    )
    # Zeros shaped like the taps but typed like `like`: under shard_map they vary per device,
    # so each device's output gradients stay its own examples' (not a sum over devices).
    z = jax.tree_util.tree_map(lambda s: jnp.zeros_like(like, shape=s.shape, dtype=s.dtype), shapes)
    # Params are closed over: the backward pass stops at the layer outputs (no weight grads).
    losses, vjp, inputs = jax.vjp(lambda z: tapped(params, examples, keys, z), z, has_aux=True)
    (out_grads,) = vjp(jnp.ones_like(losses))
    sq_norms, per_example = loss.sq_norms(params, inputs, out_grads)
    return losses, sq_norms, per_example, inputs, out_grads


def ghost_sq_norms(loss: MLMGhostLoss, params: Any, examples: Any, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(losses [M], squared norms [M] of each example's whole gradient) by ghost norms, example i
    with dropout key keys[i]: the quantities `ghost_clipped_grad_sum` clips with (diagnostics, tests)."""
    losses, sq_norms, *_ = _ghost_norms(loss, params, examples, keys, jnp.zeros(keys.shape[:1], jnp.bool_))
    return losses, sq_norms


def ghost_clipped_grad_sum(
    loss: MLMGhostLoss,
    params: Any,
    batch: Any,
    is_padding: jax.Array,
    rng: jax.Array,
    *,
    clip_norm: float,
    microbatch_size: int,
    position_offset: int | jax.Array = 0,
) -> tuple[Any, ClipStats]:
    """`clipping.clipped_grad_sum` by ghost norms and book-keeping (same arguments, same result
    to float tolerance, same guarantees); `loss` must expose taps (an `MLMGhostLoss`)."""
    if not isinstance(loss, MLMGhostLoss):
        raise ValueError(
            f"loss_fn: the ghost clipping path needs an MLMGhostLoss (a loss with layer taps), "
            f"got {type(loss).__name__}; use clipping_method='vmap' for other losses"
        )
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
    leaves = {_param_path(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(params)}

    def one_microbatch(carry: tuple[dict[Path, jax.Array], ClipStats], xs: tuple[Any, jax.Array, jax.Array]):
        total, stats = carry
        examples, padding, index = xs
        keys = example_keys(rng, position_offset, index, microbatch_size)
        losses, sq_norms, per_example, inputs, out_grads = _ghost_norms(loss, params, examples, keys, padding)
        keep, scale, stats = clip_scale(stats, jnp.sqrt(sq_norms), losses, padding, clip_norm)

        def weighted_sums(clean: Callable[[jax.Array], jax.Array]) -> dict[Path, jax.Array]:
            return loss.weighted_sums(params, inputs, out_grads, scale, per_example, clean)

        # Every tap enters its example's squared norm multiplied by itself, so finite norms mean
        # finite taps, and a factor of 0 (padding, non-finite loss) then gives exact zeros. Only a
        # micro-batch with a non-finite norm pays for zeroing the dropped rows first (0 * NaN = NaN).
        # (Cleaning inside one weighted sum, each tree behind its own cond, compiled 15-30% faster
        # but ran 15-20% slower: the identity branches copy every tap.)
        sums = jax.lax.cond(
            jnp.all(jnp.isfinite(sq_norms)),
            lambda: weighted_sums(lambda x: x),
            lambda: weighted_sums(lambda x: _where_kept(keep, x)),
        )
        if set(sums) != set(total):
            # A parameter without a tap would silently escape clipping: refuse instead.
            raise ValueError(
                f"ghost clipping does not match the parameters: missing {sorted(set(total) - set(sums))}, "
                f"unknown {sorted(set(sums) - set(total))}"
            )
        return ({k: total[k] + sums[k] for k in total}, stats), None

    init_total = {k: jnp.zeros(v.shape, _F32) for k, v in leaves.items()}
    total, stats = scan_microbatches(one_microbatch, init_total, batch, is_padding, microbatch_size)
    paths = [_param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    grads = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), [total[p] for p in paths])
    return grads, stats


CLIPPING_METHODS = ("vmap", "ghost", "auto")
_AUTO_CHOICES: dict[Any, str] = {}


def time_clipping_methods(
    loss: MLMGhostLoss, params: Any, batch: Any, *, clip_norm: float, microbatch_size: int, repeats: int = 3
) -> dict[str, float]:
    """Seconds per micro-batch of each clipping method, measured on placeholder inputs with the
    shapes of `params` and of one micro-batch of `batch` (never on private data; arrays or
    ShapeDtypeStructs are accepted). Best of `repeats` runs after one warm-up."""
    # Concrete evaluation even when called while an outer step is being traced.
    with jax.ensure_compile_time_eval():
        p = jax.tree_util.tree_map(placeholder, params)
        b = jax.tree_util.tree_map(
            lambda x: placeholder(jax.ShapeDtypeStruct(x.shape[1:], x.dtype), microbatch_size), batch
        )
        pad = np.zeros((microbatch_size,), np.bool_)
        key = jax.random.key(0)
        seconds = {}
        for name, impl in {"vmap": clipped_grad_sum_vmap, "ghost": ghost_clipped_grad_sum}.items():
            fn = (
                jax.jit(
                    lambda p, b, impl=impl: impl(
                        loss, p, b, pad, key, clip_norm=clip_norm, microbatch_size=microbatch_size
                    )
                )
                .lower(p, b)
                .compile()
            )
            seconds[name] = best_seconds(lambda fn=fn: fn(p, b), repeats)
    return seconds


def clipped_sum_for(method: str, loss_fn: Any) -> Callable[..., tuple[Any, ClipStats]]:
    """The clipped-sum function (signature of `clipping.clipped_grad_sum`) for `method`.

    "vmap": per-example gradients by vmap (any loss). "ghost": ghost norms + book-keeping
    (needs an `MLMGhostLoss`). "auto": for an `MLMGhostLoss`, the faster of the two for the
    model and shapes, timed once per shape on placeholder inputs when the step is traced
    (the choice never depends on data); for any other loss, "vmap". The result, the noise and
    the accounting are the same whichever method runs.
    """
    if method not in CLIPPING_METHODS:
        raise ValueError(f"clipping_method: expected one of {CLIPPING_METHODS}, got {method!r}")
    ghost_capable = isinstance(loss_fn, MLMGhostLoss)
    if method == "vmap" or (method == "auto" and not ghost_capable):
        return clipped_grad_sum_vmap
    if not ghost_capable:
        raise ValueError(
            f"clipping_method='ghost' needs a loss with layer taps (MLMGhostLoss), got {type(loss_fn).__name__}"
        )
    if method == "ghost":
        return ghost_clipped_grad_sum

    def auto(loss, params, batch, is_padding, rng, *, clip_norm, microbatch_size, position_offset=0):
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
        signature = (loss, str(shapes), microbatch_size)
        if signature not in _AUTO_CHOICES:
            seconds = time_clipping_methods(loss, *shapes, clip_norm=clip_norm, microbatch_size=microbatch_size)
            _AUTO_CHOICES[signature] = min(seconds, key=seconds.get)
        impl = ghost_clipped_grad_sum if _AUTO_CHOICES[signature] == "ghost" else clipped_grad_sum_vmap
        return impl(
            loss,
            params,
            batch,
            is_padding,
            rng,
            clip_norm=clip_norm,
            microbatch_size=microbatch_size,
            position_offset=position_offset,
        )

    return auto
