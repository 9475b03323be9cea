"""Pure functional view of the dpbert BERT models, for the DP core and the trainers.

`split_params`/`merge` move between a module and (graphdef, params); `mlm_logits`,
`classifier_logits` and `hidden_states` are pure (jit-, grad- and vmap-friendly) and take one
example or a batch; `unstack_layers`/`stack_layers` convert between the scanned (stacked) and the
per-layer params layouts exactly.

Guarantees: `dropout_rng=None` is inference mode; with a key every dropout site draws from a
`fold_in` of it, so the same key reproduces the same output. The API with shapes and the
per-example vmap form: docs/INTERNALS.md ("dpbert.model.functional").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpbert.model.bert import BertForMaskedLM, BertForSequenceClassification, BertModel
from dpbert.model.hf_io import layer_path, stacked_layer_axis


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """Split a dpbert model into its static graph definition and its parameter pytree."""
    return nnx.split(model, nnx.Param)


def merge(graphdef: nnx.GraphDef, params: nnx.State) -> Any:
    """Rebuild the module from ``split_params`` output."""
    return nnx.merge(graphdef, params)


def _row(x: Any, i: int) -> Any:
    """Row i of a stacked leaf (an array, or a ShapeDtypeStruct whose sharding loses that axis)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        sharding = x.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            spec = tuple(sharding.spec) + (None,) * (len(x.shape) - len(sharding.spec))
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)
    return x[i]


def _stack(xs: list[Any]) -> Any:
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    return jnp.stack(xs)


def _map_leaf(leaf: Any, fn: Any) -> Any:
    return leaf.replace(fn(leaf.get_value())) if isinstance(leaf, nnx.Variable) else fn(leaf)


def unstack_layers(params: nnx.State) -> nnx.State:
    """The per-layer layout of a stacked params tree (or of any tree of the same structure, such
    as an optimizer moment): ``bert/encoder/layer/<leaf path>`` [L, ...] becomes
    ``bert/encoder/layer/<i>/<leaf path>`` for i < L. Leaves may be arrays or ShapeDtypeStructs."""
    flat = []
    for path, leaf in nnx.to_flat_state(params):
        if stacked_layer_axis(path) is None:
            flat.append((path, leaf))
            continue
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        for i in range(value.shape[0]):
            flat.append((layer_path(path, i), _map_leaf(leaf, lambda v, i=i: _row(v, i))))
    return nnx.from_flat_state(flat)


def stack_layers(params: nnx.State) -> nnx.State:
    """Inverse of `unstack_layers`: per-layer ``bert/encoder/layer/<i>/...`` leaves stacked (in
    layer order) into ``bert/encoder/layer/...`` [L, ...]. Raises ValueError when layers are
    missing or do not share one structure."""
    flat, groups = [], {}
    for path, leaf in nnx.to_flat_state(params):
        at = next((j for j in range(1, len(path) - 1) if path[j - 1] == "encoder" and path[j] == "layer"), None)
        if at is None or not str(path[at + 1]).isdigit():
            flat.append((path, leaf))
            continue
        stacked = (*path[: at + 1], *path[at + 2 :])
        groups.setdefault(stacked, {})[int(path[at + 1])] = leaf
        if len(groups[stacked]) == 1:
            flat.append((stacked, None))
    for j, (path, leaf) in enumerate(flat):
        if leaf is not None:
            continue
        rows = groups[path]
        if sorted(rows) != list(range(len(rows))) or len(rows) != len(next(iter(groups.values()))):
            raise ValueError(f"{'/'.join(map(str, path))}: layers {sorted(rows)} do not form one stack")
        ordered = [rows[i] for i in range(len(rows))]
        values = [x.get_value() if isinstance(x, nnx.Variable) else x for x in ordered]
        first = ordered[0]
        flat[j] = (path, first.replace(_stack(values)) if isinstance(first, nnx.Variable) else _stack(values))
    return nnx.from_flat_state(flat)


def _batched_like(x: Any, single: bool) -> Any:
    """`x` with a leading batch axis when the input ids were one example (None stays None)."""
    return None if x is None else jnp.asarray(x)[None] if single else jnp.asarray(x)


def _batched(input_ids: Any, attention_mask: Any, token_type_ids: Any) -> tuple[jax.Array, Any, Any, bool]:
    single = jnp.ndim(input_ids) == 1
    return (*(_batched_like(x, single) for x in (input_ids, attention_mask, token_type_ids)), single)


def _expect(model: Any, kind: type, fn: str) -> None:
    if not isinstance(model, kind):
        raise ValueError(f"{fn}: graphdef is a {type(model).__name__}, expected {kind.__name__}")


def mlm_logits(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    token_type_ids: jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
    *,
    masked_positions: jax.Array | None = None,
    position_ids: jax.Array | None = None,
) -> jax.Array:
    """Masked-LM logits of a ``BertForMaskedLM`` (compute dtype of the model); ``position_ids``
    shaped like ``input_ids`` (None: positions 0..L-1)."""
    model = merge(graphdef, params)
    _expect(model, BertForMaskedLM, "mlm_logits")
    ids, mask, types, single = _batched(input_ids, attention_mask, token_type_ids)
    if masked_positions is not None and single:
        masked_positions = jnp.asarray(masked_positions)[None]
    positions = _batched_like(position_ids, single)
    logits = model(
        ids, mask, types, dropout_rng=dropout_rng, masked_positions=masked_positions, position_ids=positions
    ).logits
    return logits[0] if single else logits


def classifier_logits(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    token_type_ids: jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
    *,
    position_ids: jax.Array | None = None,
) -> jax.Array:
    """Logits [B, num_labels] of a ``BertForSequenceClassification`` (num_labels == 1: regression)."""
    model = merge(graphdef, params)
    _expect(model, BertForSequenceClassification, "classifier_logits")
    ids, mask, types, single = _batched(input_ids, attention_mask, token_type_ids)
    logits = model(ids, mask, types, dropout_rng=dropout_rng, position_ids=_batched_like(position_ids, single)).logits
    return logits[0] if single else logits


def hidden_states(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    token_type_ids: jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
    *,
    position_ids: jax.Array | None = None,
) -> jax.Array:
    """Last encoder layer [B, L, H] of any dpbert BERT (the encoder of a model with a head)."""
    model = merge(graphdef, params)
    encoder = model if isinstance(model, BertModel) else model.bert
    ids, mask, types, single = _batched(input_ids, attention_mask, token_type_ids)
    positions = _batched_like(position_ids, single)
    states = encoder(ids, mask, types, dropout_rng=dropout_rng, position_ids=positions).last_hidden_state
    return states[0] if single else states
