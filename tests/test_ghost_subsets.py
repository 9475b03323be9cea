"""Ghost clipping of a trained subset (LoRA factors + head, bias terms + head, the head alone) with
the rest frozen: the clipped sum equals per-example gradients taken one by one and vmap's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from transformers import BertConfig

from dpbert.model import functional
from dpbert.model.bert import BertForSequenceClassification
from dpbert.model.ghost import ClassifierGhostLoss
from dpbert.model.lora import LoRAConfig, add_lora
from dpbert.privacy.clipping import clipped_grad_sum
from dpbert.privacy.ghost_clipping import Bias, Dense, ScaleBias, ghost_clipped_grad_sum
from dpbert.train.classifier import trainable_filter

V, L, B, MB = 53, 10, 6, 3


def _setup(subset: str, layer_mode: str = "mixed"):
    config = BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=16, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)  # fmt: skip
    model = BertForSequenceClassification(config, rngs=nnx.Rngs(3), num_labels=3)
    if subset == "lora":
        add_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=("query", "value", "intermediate")), nnx.Rngs(4))
    graphdef, params = nnx.split(model, nnx.Param)
    trained, frozen = params.split(trainable_filter(subset, fresh_pooler=True), ...)
    if subset == "lora":  # B starts at zero (so would A's gradient): give both factors a gradient
        trained = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.3 * jax.random.normal(jax.random.key(len(p)), x.shape) if "lora_b" in str(p) else x,
            trained,
        )
    loss = ClassifierGhostLoss(graphdef=graphdef, frozen=frozen, layer_mode=layer_mode)
    rng = np.random.default_rng(5)
    mask = np.ones((B, L), np.int32)
    mask[0, 6:] = 0
    mask[4, 3:] = 0
    batch = {
        "input_ids": jnp.asarray(rng.integers(1, V, (B, L)), jnp.int32),
        "attention_mask": jnp.asarray(mask),
        "token_type_ids": jnp.asarray(rng.integers(0, 2, (B, L)), jnp.int32),
        "labels": jnp.asarray(rng.integers(0, 3, B), jnp.int32),
    }
    return graphdef, frozen, trained, loss, batch


def _one_by_one(graphdef, frozen, trained, batch, is_padding, key, clip_norm):
    """sum_i min(1, C/||g_i||) g_i with g_i the gradient of the plain forward's loss, one example at a time."""

    def plain(p, ex, k):
        logits = functional.classifier_logits(
            graphdef, nnx.merge_state(p, frozen), ex["input_ids"], ex["attention_mask"], ex["token_type_ids"], k
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, ex["labels"])

    grad = jax.jit(jax.grad(plain))
    total, norms = jax.tree_util.tree_map(jnp.zeros_like, trained), []
    for i in range(B):
        g = grad(trained, jax.tree_util.tree_map(lambda x, i=i: x[i], batch), jax.random.fold_in(key, i))
        norms.append(float(optax.tree.norm(g)))
        if not is_padding[i]:
            s = min(1.0, clip_norm / norms[-1])
            total = jax.tree_util.tree_map(lambda t, x, s=s: t + s * x, total, g)
    return total, np.asarray(norms)


def _assert_close(got, want):
    scale = float(optax.tree.norm(want))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True):
        err = float(jnp.max(jnp.abs(a - b)))
        assert err <= 1e-5 * scale + 1e-7, f"{jax.tree_util.keystr(path)}: max error {err} (sum norm {scale})"


@pytest.mark.parametrize(
    ("subset", "layer_mode"),
    # Both ways of clipping a LoRA factor ("mixed" picks one of them per shape).
    [("lora", "ghost"), ("lora", "instantiate"), ("bias", "mixed"), ("head", "mixed")],
)
def test_subset_ghost_sum_equals_per_example_clipping(subset: str, layer_mode: str) -> None:
    graphdef, frozen, trained, loss, batch = _setup(subset, layer_mode)
    key = jax.random.key(9)
    is_padding = np.array([False, False, True, False, False, False])
    _, norms = _one_by_one(graphdef, frozen, trained, batch, is_padding, key, 1.0)
    real = np.sort(norms[~is_padding])
    clip_norm = float(real[2] + real[3]) / 2  # 2 of the 5 real examples clipped
    want, _ = _one_by_one(graphdef, frozen, trained, batch, is_padding, key, clip_norm)
    kw = dict(clip_norm=clip_norm, microbatch_size=MB)
    pad = jnp.asarray(is_padding)
    got, stats = jax.jit(lambda p: ghost_clipped_grad_sum(loss, p, batch, pad, key, **kw))(trained)
    vmapped, vstats = jax.jit(lambda p: clipped_grad_sum(loss, p, batch, pad, key, **kw))(trained)
    _assert_close(got, want)
    _assert_close(vmapped, want)
    assert float(stats.num_clipped) == float(vstats.num_clipped) == 2 and float(stats.num_examples) == 5
    assert all(float(jnp.abs(x).sum()) > 0 for x in jax.tree_util.tree_leaves(got))  # every trained leaf


def test_only_trained_parameters_are_tapped() -> None:
    _, _, trained, loss, _ = _setup("lora")
    groups = loss.tap_groups(trained)
    layer = groups["layers"].taps
    # The LoRA factors are two dense taps each; the frozen base layers (and LayerNorms) get none.
    assert layer["attention/self/query/lora_a"] == Dense(("attention", "self", "query", "lora_a"))
    assert layer["intermediate/dense/lora_b"] == Dense(("intermediate", "dense", "lora_b"))
    assert sorted(layer) == sorted(f"{t}/lora_{f}" for t in ("attention/self/query", "attention/self/value",
                                                             "intermediate/dense") for f in "ab")  # fmt: skip
    assert sorted(groups["rest"].taps) == ["bert/pooler/dense", "classifier"]
    _, _, trained, loss, _ = _setup("bias")
    groups = loss.tap_groups(trained)
    assert groups["layers"].taps["attention/self/query"] == Bias(("attention", "self", "query", "bias"))
    assert groups["layers"].taps["output/LayerNorm"] == Bias(("output", "LayerNorm", "bias"))
    assert groups["rest"].taps["bert/pooler/dense"] == Dense(("bert", "pooler", "dense", "kernel"),
                                                             ("bert", "pooler", "dense", "bias"))  # fmt: skip
    assert not any(isinstance(t, ScaleBias) for g in groups.values() for t in g.taps.values())
    _, _, trained, loss, _ = _setup("head")
    assert list(loss.tap_groups(trained)) == ["rest"]  # no encoder group: nothing trained there
