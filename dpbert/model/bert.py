"""Flax NNX BERT built from a transformers `BertConfig` (tiny through BERT-Large).

Attribute paths are the Hugging Face parameter names, so `dpbert.model.hf_io` maps weights with a
handful of leaf renames; the encoder holds one layer whose parameters are stacked along a leading
layer axis and runs under `jax.lax.scan` (compile time does not grow with depth).

Guarantees: in inference mode the float32 outputs equal transformers' eval-mode outputs to float32
rounding (tested to 1e-4); dropout is a pure function of the key passed at call time; parameters
are stored in float32 whatever the compute dtype, softmax and LayerNorm statistics run in
float32; `remat=True` changes memory, never outputs or gradients; the masked-LM decoder is tied to
the word embeddings as in BERT. Details: docs/INTERNALS.md ("dpbert.model.bert").
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from transformers import BertConfig

from dpbert.model import hf_io


def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, x Phi(x), in the form PyTorch and BERT compute it: 0.5 x (1 + erf(x / sqrt 2)).

    Same float32 accuracy as `jax.nn.gelu(approximate=False)` in absolute terms (max error
    ~1e-6 against float64), whose erfc form compiles to ~6x more work on CPU.
    """
    return 0.5 * x * (1.0 + jax.lax.erf(x * 0.7071067811865476))


# transformers' ACT2FN names for the activations BERT checkpoints use.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu,
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_fast": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}

# Fixed dropout-site numbers: the key of a site is fold_in(parent_key, site).
SITE_EMBEDDINGS = 0
SITE_CLASSIFIER = 1
_SITE_LAYER_BASE = 16  # layer i folds in _SITE_LAYER_BASE + i
_SITE_ATTN_PROBS, _SITE_ATTN_OUT, _SITE_FFN_OUT = 0, 1, 2


@struct.dataclass
class BaseModelOutput:
    """Encoder output: ``last_hidden_state`` [B, L, H]; ``pooler_output`` [B, H] or None;
    ``hidden_states`` (embeddings output, then each layer's output) when asked."""

    last_hidden_state: jax.Array
    pooler_output: jax.Array | None = None
    hidden_states: tuple[jax.Array, ...] | None = None


@struct.dataclass
class MaskedLMOutput:
    """``logits`` [B, L, V] (or [B, P, V] at ``masked_positions``); ``hidden_states`` when asked."""

    logits: jax.Array
    hidden_states: tuple[jax.Array, ...] | None = None


@struct.dataclass
class SequenceClassifierOutput:
    """``logits`` [B, num_labels] (num_labels == 1: a regression score); ``hidden_states`` when asked."""

    logits: jax.Array
    hidden_states: tuple[jax.Array, ...] | None = None


def check_config(config: BertConfig) -> None:
    """Raise ValueError naming the field if ``config`` is not an encoder BERT this module builds."""
    if not isinstance(config, BertConfig):
        raise ValueError(f"config: expected a transformers.BertConfig, got {type(config).__name__}")
    if config.model_type != "bert":
        raise ValueError(f"config.model_type: expected 'bert', got {config.model_type!r}")
    if not isinstance(config.num_hidden_layers, int) or config.num_hidden_layers < 1:
        raise ValueError(f"config.num_hidden_layers: expected an integer >= 1, got {config.num_hidden_layers!r}")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"config.hidden_size ({config.hidden_size}) must be a multiple of "
            f"config.num_attention_heads ({config.num_attention_heads})"
        )
    if not isinstance(config.hidden_act, str) or config.hidden_act not in ACTIVATIONS:
        raise ValueError(f"config.hidden_act: expected one of {sorted(ACTIVATIONS)}, got {config.hidden_act!r}")
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(f"config.position_embedding_type: only 'absolute' is supported, got {position_type!r}")
    if config.is_decoder or config.add_cross_attention:
        raise ValueError("config.is_decoder / config.add_cross_attention: dpbert builds the bidirectional encoder only")


def fold_key(key: jax.Array | None, site: int) -> jax.Array | None:
    """The dropout key of site `site` under `key`: fold_in(key, site) (None stays None)."""
    return None if key is None else jax.random.fold_in(key, site)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; identity when ``key`` is None or ``rate`` is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """Scaled dot-product attention on [B, T, N, D] tensors (no head transposes), mask [B, 1, 1|T, S].

    Without ``dropout_rng`` this is ``jax.nn.dot_product_attention`` (fused kernels where the
    backend has them). With a key, the probabilities are materialised so that dropout can be
    applied to them, as BERT does; softmax runs in float32 on both paths.
    """
    if dropout_rng is None:
        return jax.nn.dot_product_attention(query, key, value, mask=mask)
    scale = query.shape[-1] ** -0.5
    logits = jnp.einsum("btnd,bsnd->bnts", query, key).astype(jnp.float32) * scale
    if mask is not None:
        # Same fill value as jax.nn.dot_product_attention, so fully padded rows stay finite.
        logits = jnp.where(mask, logits, -0.7 * jnp.finfo(jnp.float32).max)
    probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    probs = dropout(probs, dropout_rate, dropout_rng)
    return jnp.einsum("bnts,bsnd->btnd", probs, value)


def _linear(config: BertConfig, n_in: int, n_out: int, rngs: nnx.Rngs, dtype: Any) -> nnx.Linear:
    return nnx.Linear(
        n_in,
        n_out,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nnx.initializers.normal(config.initializer_range),
        bias_init=nnx.initializers.zeros_init(),
        rngs=rngs,
    )


def _layer_norm(config: BertConfig, rngs: nnx.Rngs, dtype: Any) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        config.hidden_size, epsilon=config.layer_norm_eps, dtype=dtype, param_dtype=jnp.float32, rngs=rngs
    )


def _embed(config: BertConfig, n: int, rngs: nnx.Rngs) -> nnx.Embed:
    return nnx.Embed(
        n,
        config.hidden_size,
        param_dtype=jnp.float32,
        embedding_init=nnx.initializers.normal(config.initializer_range),
        rngs=rngs,
    )


class Tap:
    """How a module's parameterized sub-layers are applied: plainly here; the ghost-clipping
    forward (`dpbert.model.ghost`) records their inputs and perturbs their outputs. `name` is
    the sub-layer's parameter path inside the module ("attention/self/query")."""

    def dense(self, name: str, layer: nnx.Linear, x: jax.Array) -> jax.Array:
        return layer(x)

    def layer_norm(self, name: str, ln: nnx.LayerNorm, x: jax.Array) -> jax.Array:
        return ln(x)

    def embed(self, name: str, table: jax.Array, ids: jax.Array) -> jax.Array:
        """Rows `ids` of `table` (float32: the caller casts after summing)."""
        return jnp.take(table, ids, axis=0)

    def positions(self, name: str, table: jax.Array, length: int, ids: jax.Array | None = None) -> jax.Array:
        """Rows `ids` of `table` (int position ids [..., L]), or its first `length` rows when None."""
        return table[:length] if ids is None else jnp.take(table, ids, axis=0)


NO_TAP = Tap()


class BertEmbeddings(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.word_embeddings = _embed(config, config.vocab_size, rngs)
        if config.pad_token_id is not None and 0 <= config.pad_token_id < config.vocab_size:
            # Hugging Face initialises the padding row to zero (nn.Embedding padding_idx).
            table = self.word_embeddings.embedding
            table[...] = table[...].at[config.pad_token_id].set(0.0)
        self.position_embeddings = _embed(config, config.max_position_embeddings, rngs)
        self.token_type_embeddings = _embed(config, config.type_vocab_size, rngs)
        self.LayerNorm = _layer_norm(config, rngs, dtype)
        self.dropout_rate = config.hidden_dropout_prob
        self.dtype = dtype

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array,
        key: jax.Array | None,
        tap: Tap = NO_TAP,
        *,
        position_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Embeddings of [B, L] ids; `position_ids` [B, L] picks each token's position row
        (None: positions 0..L-1, the same computation as before position ids existed)."""
        seq_len = input_ids.shape[-1]
        # Gather first, then cast: never materialise a casted copy of the whole table.
        x = (
            tap.embed("word_embeddings", self.word_embeddings.embedding[...], input_ids)
            + tap.embed("token_type_embeddings", self.token_type_embeddings.embedding[...], token_type_ids)
            + tap.positions("position_embeddings", self.position_embeddings.embedding[...], seq_len, position_ids)
        ).astype(self.dtype)
        return dropout(tap.layer_norm("LayerNorm", self.LayerNorm, x), self.dropout_rate, key)


class BertSelfAttention(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = h // config.num_attention_heads
        self.query = _linear(config, h, h, rngs, dtype)
        self.key = _linear(config, h, h, rngs, dtype)
        self.value = _linear(config, h, h, rngs, dtype)
        self.dropout_rate = config.attention_probs_dropout_prob

    def __call__(self, x: jax.Array, mask: jax.Array | None, key: jax.Array | None, tap: Tap = NO_TAP) -> jax.Array:
        heads = (*x.shape[:-1], self.num_heads, self.head_dim)
        q = tap.dense("attention/self/query", self.query, x).reshape(heads)
        k = tap.dense("attention/self/key", self.key, x).reshape(heads)
        v = tap.dense("attention/self/value", self.value, x).reshape(heads)
        rng = key if self.dropout_rate > 0.0 else None
        context = dot_product_attention(q, k, v, mask, dropout_rate=self.dropout_rate, dropout_rng=rng)
        return context.reshape(x.shape)


class BertSelfOutput(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.dense = _linear(config, config.hidden_size, config.hidden_size, rngs, dtype)
        self.LayerNorm = _layer_norm(config, rngs, dtype)
        self.dropout_rate = config.hidden_dropout_prob

    def __call__(self, x: jax.Array, residual: jax.Array, key: jax.Array | None, tap: Tap = NO_TAP) -> jax.Array:
        h = dropout(tap.dense("attention/output/dense", self.dense, x), self.dropout_rate, key) + residual
        return tap.layer_norm("attention/output/LayerNorm", self.LayerNorm, h)


class BertAttention(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.self = BertSelfAttention(config, rngs=rngs, dtype=dtype)
        self.output = BertSelfOutput(config, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array, mask: jax.Array | None, key: jax.Array | None, tap: Tap = NO_TAP) -> jax.Array:
        context = self.self(x, mask, fold_key(key, _SITE_ATTN_PROBS), tap)
        return self.output(context, x, fold_key(key, _SITE_ATTN_OUT), tap)


class BertIntermediate(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.dense = _linear(config, config.hidden_size, config.intermediate_size, rngs, dtype)
        self.hidden_act = config.hidden_act

    def __call__(self, x: jax.Array, tap: Tap = NO_TAP) -> jax.Array:
        return ACTIVATIONS[self.hidden_act](tap.dense("intermediate/dense", self.dense, x))


class BertOutput(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.dense = _linear(config, config.intermediate_size, config.hidden_size, rngs, dtype)
        self.LayerNorm = _layer_norm(config, rngs, dtype)
        self.dropout_rate = config.hidden_dropout_prob

    def __call__(self, x: jax.Array, residual: jax.Array, key: jax.Array | None, tap: Tap = NO_TAP) -> jax.Array:
        h = dropout(tap.dense("output/dense", self.dense, x), self.dropout_rate, key) + residual
        return tap.layer_norm("output/LayerNorm", self.LayerNorm, h)


class BertLayer(nnx.Module):
    """One encoder layer. Inside `BertEncoder` its parameters carry a leading layer axis and it
    is called only through `scan_layers`, on one layer's slice at a time."""

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.attention = BertAttention(config, rngs=rngs, dtype=dtype)
        self.intermediate = BertIntermediate(config, rngs=rngs, dtype=dtype)
        self.output = BertOutput(config, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array, mask: jax.Array | None, key: jax.Array | None, tap: Tap = NO_TAP) -> jax.Array:
        attended = self.attention(x, mask, key, tap)
        return self.output(self.intermediate(attended, tap), attended, fold_key(key, _SITE_FFN_OUT), tap)


def stack_modules(modules: list[nnx.Module]) -> nnx.Module:
    """One module of the same structure whose every variable is the stack (new leading axis) of
    the modules' variables, in order: the layout `scan_layers` runs."""
    if not modules:
        raise ValueError("stack_modules: expected at least one module")
    graphdef, _ = nnx.split(modules[0])
    return nnx.merge(graphdef, jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[nnx.state(m) for m in modules]))


def num_stacked(module: nnx.Module) -> int:
    """The length of the leading (layer) axis of a stacked module's variables."""
    return jax.tree_util.tree_leaves(nnx.state(module))[0].shape[0]


_UNROLL = False  # set by `unrolled_layers()`, read when a layer scan is traced


@contextlib.contextmanager
def unrolled_layers() -> Iterator[None]:
    """Within this context, layer scans traced (`scan_layers`, `layer_scan`: the encoder and the
    ghost-clipping passes over layers) are fully unrolled: the same computation as straight-line
    code. For FLOP counts only: XLA's cost analysis counts a loop body once, whatever its trip
    count (`dpbert.train.compile`); compile time grows with depth again in here."""
    global _UNROLL
    previous, _UNROLL = _UNROLL, True
    try:
        yield
    finally:
        _UNROLL = previous


def layer_scan(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any) -> tuple[Any, Any]:
    """`jax.lax.scan(f, init, xs)` over a leading layer axis (unrolled inside `unrolled_layers()`)."""
    return jax.lax.scan(f, init, xs, unroll=_UNROLL)


def scan_layers(
    layer: nnx.Module,
    x: jax.Array,
    body: Callable[[nnx.Module, jax.Array, jax.Array, Any], tuple[jax.Array, Any]],
    xs: Any = None,
    *,
    remat: bool = False,
) -> tuple[jax.Array, Any]:
    """Run `body(layer_i, x, i, xs_i) -> (x, y_i)` for each layer i of the stacked `layer` under
    `jax.lax.scan` (one compiled body, whatever the depth); returns (last x, ys stacked on a
    leading layer axis). `xs` is a pytree with a leading layer axis (or None); `i` is a traced
    int32 (fold it into keys as an int). `remat` wraps the body in `jax.checkpoint`."""
    graphdef, state = nnx.split(layer)

    def step(carry: jax.Array, inputs: tuple[Any, jax.Array, Any]) -> tuple[jax.Array, Any]:
        layer_state, i, xs_i = inputs
        return body(nnx.merge(graphdef, layer_state), carry, i, xs_i)

    if remat:
        step = jax.checkpoint(step)
    return layer_scan(step, x, (state, jnp.arange(num_stacked(layer), dtype=jnp.int32), xs))


def layer_key(key: jax.Array | None, i: int | jax.Array) -> jax.Array | None:
    """Dropout key of encoder layer i: fold_in(key, _SITE_LAYER_BASE + i)."""
    return fold_key(key, _SITE_LAYER_BASE + i)


class BertEncoder(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any, remat: bool = False):
        # Built layer by layer (the same rngs draws as separate layers), then stacked.
        self.layer = stack_modules([BertLayer(config, rngs=rngs, dtype=dtype) for _ in range(config.num_hidden_layers)])
        self.remat = remat

    def __call__(
        self, x: jax.Array, mask: jax.Array | None, key: jax.Array | None, *, output_hidden_states: bool = False
    ) -> tuple[jax.Array, tuple[jax.Array, ...] | None]:
        def body(layer: BertLayer, x: jax.Array, i: jax.Array, _: Any) -> tuple[jax.Array, jax.Array | None]:
            x = layer(x, mask, layer_key(key, i))
            return x, (x if output_hidden_states else None)

        last, states = scan_layers(self.layer, x, body, remat=self.remat)
        if not output_hidden_states:
            return last, None
        return last, (x, *(states[i] for i in range(states.shape[0])))


class BertPooler(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.dense = _linear(config, config.hidden_size, config.hidden_size, rngs, dtype)

    def __call__(self, x: jax.Array, tap: Tap = NO_TAP) -> jax.Array:
        return jnp.tanh(tap.dense("dense", self.dense, x[:, 0]))


class _PretrainedMixin:
    """``config`` / ``from_pretrained`` / ``save_pretrained`` shared by the public models.

    The config is kept as its JSON text: nnx graph definitions must be hashable (jit caches
    on them) and ``BertConfig`` is not; ``.config`` returns a fresh ``BertConfig`` each time.
    """

    _config_json: str

    def _set_config(self, config: BertConfig) -> None:
        check_config(config)
        self._config_json = config.to_json_string(use_diff=False)

    @property
    def config(self) -> BertConfig:
        return BertConfig.from_dict(json.loads(self._config_json))

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str,
        *,
        dtype: Any = jnp.float32,
        seed: int = 0,
        max_positions: int | None = None,
        **config_overrides: Any,
    ):
        """Load a Hugging Face BERT folder (config.json + model.safetensors / pytorch_model.bin).

        ``config_overrides`` set config fields before building (e.g. ``num_labels=3``,
        ``hidden_dropout_prob=0.0``). Weights absent from the checkpoint are allowed only for
        heads and the pooler; they are initialised from ``seed`` and named in a warning.
        ``max_positions`` above the checkpoint's: its position table is grown by repeating rows
        (``hf_io.repeat_positions``).
        """
        return hf_io.from_pretrained(
            cls, path_or_id, dtype=dtype, seed=seed, max_positions=max_positions, **config_overrides
        )

    def save_pretrained(self, path: str) -> None:
        """Write config.json + model.safetensors under Hugging Face names (atomic per folder/file)."""
        hf_io.save_pretrained(self, path)


def attention_mask_4d(attention_mask: jax.Array | None) -> jax.Array | None:
    """[B, S] 1 = attend, 0 = padding -> boolean [B, 1, 1, S] that broadcasts over heads and queries."""
    if attention_mask is None:
        return None
    return attention_mask.astype(jnp.bool_)[:, None, None, :]


class BertModel(_PretrainedMixin, nnx.Module):
    """The BERT encoder (embeddings, encoder, optional pooler); Hugging Face names without prefix."""

    def __init__(
        self,
        config: BertConfig,
        *,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        add_pooling_layer: bool = True,
        remat: bool = False,
    ):
        self._set_config(config)
        self.embeddings = BertEmbeddings(config, rngs=rngs, dtype=dtype)
        self.encoder = BertEncoder(config, rngs=rngs, dtype=dtype, remat=remat)
        self.pooler = BertPooler(config, rngs=rngs, dtype=dtype) if add_pooling_layer else None
        self.max_positions = config.max_position_embeddings

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        *,
        dropout_rng: jax.Array | None = None,
        output_hidden_states: bool = False,
        position_ids: jax.Array | None = None,
    ) -> BaseModelOutput:
        """Encode [B, L] int token ids; ``attention_mask`` is 1 for real tokens, 0 for padding;
        ``position_ids`` [B, L] (each < config.max_position_embeddings) are the tokens' positions,
        None for 0..L-1 (bit-identical to the model without position ids)."""
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids: expected shape [batch, seq_len], got {input_ids.shape}")
        if input_ids.shape[1] > self.max_positions:
            raise ValueError(
                f"input_ids: seq_len {input_ids.shape[1]} exceeds config.max_position_embeddings {self.max_positions}"
            )
        if position_ids is not None:
            position_ids = jnp.asarray(position_ids)
            if position_ids.shape != input_ids.shape:
                raise ValueError(
                    f"position_ids: expected the shape of input_ids {input_ids.shape}, got {position_ids.shape}"
                )
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        mask = attention_mask_4d(None if attention_mask is None else jnp.asarray(attention_mask))
        x = self.embeddings(
            input_ids,
            jnp.asarray(token_type_ids),
            fold_key(dropout_rng, SITE_EMBEDDINGS),
            position_ids=position_ids,
        )
        x, states = self.encoder(x, mask, dropout_rng, output_hidden_states=output_hidden_states)
        pooled = None if self.pooler is None else self.pooler(x)
        return BaseModelOutput(last_hidden_state=x, pooler_output=pooled, hidden_states=states)


class BertPredictionHeadTransform(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.dense = _linear(config, config.hidden_size, config.hidden_size, rngs, dtype)
        self.LayerNorm = _layer_norm(config, rngs, dtype)
        self.hidden_act = config.hidden_act

    def __call__(self, x: jax.Array, tap: Tap = NO_TAP) -> jax.Array:
        return tap.layer_norm(
            "LayerNorm", self.LayerNorm, ACTIVATIONS[self.hidden_act](tap.dense("dense", self.dense, x))
        )


class BertLMPredictionHead(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.transform = BertPredictionHeadTransform(config, rngs=rngs, dtype=dtype)
        self.bias = nnx.Param(jnp.zeros((config.vocab_size,), jnp.float32))
        self.decoder = (
            None
            if config.tie_word_embeddings
            else nnx.Linear(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                dtype=dtype,
                kernel_init=nnx.initializers.normal(config.initializer_range),
                rngs=rngs,
            )
        )
        self.dtype = dtype

    def __call__(self, x: jax.Array, word_embeddings: jax.Array) -> jax.Array:
        x = self.transform(x)
        if self.decoder is None:
            # Tied decoder: contract over the hidden axis of the [V, H] table, no explicit transpose.
            logits = jnp.einsum("...h,vh->...v", x, word_embeddings.astype(self.dtype))
        else:
            logits = self.decoder(x)
        return logits + self.bias[...].astype(self.dtype)


class BertOnlyMLMHead(nnx.Module):
    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any):
        self.predictions = BertLMPredictionHead(config, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array, word_embeddings: jax.Array) -> jax.Array:
        return self.predictions(x, word_embeddings)


class BertForMaskedLM(_PretrainedMixin, nnx.Module):
    """BERT with the masked-LM head (no pooler, as in Hugging Face ``BertForMaskedLM``)."""

    base_model_prefix = "bert"

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32, remat: bool = False):
        self._set_config(config)
        self.bert = BertModel(config, rngs=rngs, dtype=dtype, add_pooling_layer=False, remat=remat)
        self.cls = BertOnlyMLMHead(config, rngs=rngs, dtype=dtype)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        *,
        dropout_rng: jax.Array | None = None,
        output_hidden_states: bool = False,
        masked_positions: jax.Array | None = None,
        position_ids: jax.Array | None = None,
    ) -> MaskedLMOutput:
        """MLM logits [B, L, V]; with ``masked_positions`` [B, P] (int indices into L) only
        those positions are decoded, giving [B, P, V] (the vocabulary projection dominates
        the cost of pretraining, and only masked positions carry loss). ``position_ids`` as
        `BertModel`."""
        out = self.bert(
            input_ids,
            attention_mask,
            token_type_ids,
            dropout_rng=dropout_rng,
            output_hidden_states=output_hidden_states,
            position_ids=position_ids,
        )
        x = out.last_hidden_state
        if masked_positions is not None:
            x = jnp.take_along_axis(x, jnp.asarray(masked_positions)[..., None], axis=1)
        logits = self.cls(x, self.bert.embeddings.word_embeddings.embedding[...])
        return MaskedLMOutput(logits=logits, hidden_states=out.hidden_states)


class BertForSequenceClassification(_PretrainedMixin, nnx.Module):
    """BERT + pooler + dropout + linear classifier; ``num_labels == 1`` is a regression head."""

    base_model_prefix = "bert"

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, num_labels: int | None = None, dtype: Any = jnp.float32):
        if num_labels is not None:
            if num_labels < 1:
                raise ValueError(f"num_labels: expected >= 1, got {num_labels}")
            config = copy.deepcopy(config)
            config.num_labels = num_labels  # also resets id2label/label2id to match
        self._set_config(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, rngs=rngs, dtype=dtype, add_pooling_layer=True)
        self.classifier = _linear(config, config.hidden_size, config.num_labels, rngs, dtype)
        self.dropout_rate = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        )

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        *,
        dropout_rng: jax.Array | None = None,
        output_hidden_states: bool = False,
        position_ids: jax.Array | None = None,
    ) -> SequenceClassifierOutput:
        """Logits [B, num_labels]; ``position_ids`` as `BertModel`."""
        out = self.bert(
            input_ids,
            attention_mask,
            token_type_ids,
            dropout_rng=dropout_rng,
            output_hidden_states=output_hidden_states,
            position_ids=position_ids,
        )
        pooled = dropout(out.pooler_output, self.dropout_rate, fold_key(dropout_rng, SITE_CLASSIFIER))
        return SequenceClassifierOutput(logits=self.classifier(pooled), hidden_states=out.hidden_states)
