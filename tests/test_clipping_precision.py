"""The clipping bound holds in the arithmetic accelerators run (rule 8 of `dpbert.privacy`): with bfloat16
compute, every example's contribution to the clipped sum has norm <= C, on CPU and with an
accelerator's default matmul precision emulated (one-pass bfloat16 or TF32 operands for every
contraction not asked for at HIGHEST); and every float32 contraction of both clipping paths is
at HIGHEST precision (CPU computes float32 contractions exactly whatever is asked, so the
emulation and the jaxpr are what can tell)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jcore
from transformers import BertConfig

from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM
from dpbert.model.ghost import MLMGhostLoss
from dpbert.privacy.clipping import clipped_grad_sum
from dpbert.privacy.ghost_clipping import ghost_clipped_grad_sum, ghost_sq_norms

V, L, P, B = 97, 16, 4, 16
CLIP = 1e-4  # below every example's gradient norm: every example is clipped
HIGHEST = jax.lax.Precision.HIGHEST


@pytest.fixture(scope="module")
def setup():
    config = BertConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=L,
        type_vocab_size=2,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    graphdef, params = functional.split_params(BertForMaskedLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    rng = np.random.default_rng(0)
    batch = {
        "input_ids": jnp.asarray(rng.integers(1, V, (B, L)), jnp.int32),
        "token_type_ids": jnp.asarray(rng.integers(0, 2, (B, L)), jnp.int32),
        "masked_positions": jnp.asarray(rng.integers(0, L, (B, P)), jnp.int32),
        "labels": jnp.asarray(rng.integers(0, V, (B, P)), jnp.int32),
        "label_weights": jnp.ones((B, P), jnp.float32),
    }
    key = jax.random.key(3)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(B))
    _, sq_norms = jax.jit(ghost_sq_norms, static_argnums=0)(MLMGhostLoss(graphdef=graphdef), params, batch, keys)
    assert float(jnp.sqrt(sq_norms).min()) > 10 * CLIP
    return graphdef, params, batch, key


def _clipped_sum(setup, path: str):
    """(params, is_padding) -> the clipped sum, by `path`: "ghost-<layer mode>/<micro-batch>" or
    "vmap/<micro-batch>"."""
    graphdef, _, batch, key = setup
    method, microbatch = path.split("/")
    if method == "vmap":
        loss = MLMGhostLoss(graphdef=graphdef)
        return lambda p, pad: clipped_grad_sum(
            loss, p, batch, pad, key, clip_norm=CLIP, microbatch_size=int(microbatch)
        )[0]
    loss = MLMGhostLoss(graphdef=graphdef, layer_mode=method.removeprefix("ghost-"))
    return lambda p, pad: ghost_clipped_grad_sum(
        loss, p, batch, pad, key, clip_norm=CLIP, microbatch_size=int(microbatch)
    )[0]


# ---------------------------------------------------------------------------- emulated precision


def _round(x: jax.Array, precision: str) -> jax.Array:
    """A float32 operand as an accelerator's default contraction reads it: bfloat16 (one pass,
    8 mantissa bits) or TF32 (10 mantissa bits, round to nearest even)."""
    if x.dtype != jnp.float32:
        return x
    if precision == "bf16":
        return x.astype(jnp.bfloat16).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0xFFF) + ((bits >> 13) & 1)) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _is_highest(precision) -> bool:
    if isinstance(precision, tuple | list):
        return len(precision) > 0 and all(p == HIGHEST for p in precision)
    return precision == HIGHEST


_INLINED = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat"}


def _eval(jaxpr: jcore.Jaxpr, consts, *args, precision: str):
    """Evaluate `jaxpr` with every dot_general not at HIGHEST reading rounded float32 operands."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "dot_general" and not _is_highest(eqn.params["precision"]):
            outs = eqn.primitive.bind(*[_round(x, precision) for x in ins], **eqn.params)
        elif name in _INLINED:
            sub = next(eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in eqn.params)
            closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, [])
            outs = _eval(closed.jaxpr, closed.consts, *ins, precision=precision)
        else:  # scan, cond, while: the same primitive on rewritten bodies
            params = {}
            for k, v in eqn.params.items():
                if isinstance(v, jcore.ClosedJaxpr):
                    v = _rewrite(v, precision)
                elif isinstance(v, tuple) and v and all(isinstance(b, jcore.ClosedJaxpr) for b in v):
                    v = tuple(_rewrite(b, precision) for b in v)
                params[k] = v
            outs = eqn.primitive.bind(*ins, **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _rewrite(closed: jcore.ClosedJaxpr, precision: str) -> jcore.ClosedJaxpr:
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    new = jax.make_jaxpr(lambda *a: _eval(closed.jaxpr, closed.consts, *a, precision=precision))(*avals)
    assert not new.consts
    return new


def _emulated(f, precision: str | None):
    """f with an accelerator's default contraction precision ("bf16", "tf32"; None: as is)."""
    if precision is None:
        return f

    def g(*args):
        closed = jax.make_jaxpr(f)(*args)
        out = _eval(closed.jaxpr, closed.consts, *jax.tree_util.tree_leaves(args), precision=precision)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(jax.eval_shape(f, *args)), out)

    return g


def _contribution_norms(f, params) -> np.ndarray:
    """Norm (float64) of each example's contribution: the clipped sum of the batch with every
    other example marked padding."""
    alone = ~jnp.eye(B, dtype=bool)
    sums = jax.jit(jax.vmap(f, in_axes=(None, 0)))(params, alone)
    return np.sqrt(
        sum(np.sum(np.asarray(x, np.float64) ** 2, axis=tuple(range(1, x.ndim))) for x in jax.tree.leaves(sums))
    )


@pytest.mark.parametrize(
    ("path", "precision"),
    [
        ("ghost-ghost/16", None),
        ("ghost-ghost/16", "bf16"),
        ("ghost-instantiate/8", None),
        ("ghost-instantiate/8", "bf16"),
        ("vmap/8", None),
        ("vmap/8", "bf16"),
        ("vmap/8", "tf32"),
    ],
)
def test_every_clipped_contribution_is_within_the_clip_norm(setup, path, precision):
    """bfloat16 compute, every example clipped: each contribution's norm is C up to float32
    rounding (1e-6), under CPU's exact contractions and an accelerator's emulated defaults
    (before HIGHEST, bf16: up to 1 + 2.1e-4 by ghost norms, 1 + 3.0e-3 by vmap)."""
    norms = _contribution_norms(_emulated(_clipped_sum(setup, path), precision), setup[1])
    assert norms.max() / CLIP <= 1 + 1e-6, norms.max() / CLIP - 1
    assert norms.min() / CLIP >= 1 - 1e-4  # all clipped, none dropped


def _dots(jaxpr: jcore.Jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple | list) else [v]:
                if isinstance(sub, jcore.ClosedJaxpr):
                    yield from _dots(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    yield from _dots(sub)


@pytest.mark.parametrize("path", ["ghost-ghost/16", "ghost-instantiate/8", "ghost-mixed/4", "vmap/8"])
def test_clipping_contractions_are_float32_at_highest(setup, path):
    """With bfloat16 compute the model's contractions are bfloat16; every float32 one (norms,
    per-example gradients, the clipped sum) must be at HIGHEST precision, with float32 output."""
    jaxpr = jax.make_jaxpr(_clipped_sum(setup, path))(setup[1], jnp.zeros(B, bool)).jaxpr
    f32 = [e for e in _dots(jaxpr) if any(v.aval.dtype == jnp.float32 for v in e.invars)]
    assert len(f32) >= 2
    for eqn in f32:
        assert _is_highest(eqn.params["precision"]), (eqn.params["precision"], str(eqn.source_info.name_stack))
        assert all(v.aval.dtype == jnp.float32 for v in (*eqn.invars, *eqn.outvars)), eqn
