"""LoRA: the merged export equals the unmerged forward; per-example clipping covers the factors."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import BertConfig

from dpbert.model import BertForSequenceClassification
from dpbert.model.functional import classifier_logits
from dpbert.model.lora import LoRAConfig, LoRALinear, add_lora, is_lora_path, lora_layers, merge_lora

H, L, FF, V = 32, 2, 64, 50


def _config() -> BertConfig:
    return BertConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=2, intermediate_size=FF,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        initializer_range=0.2,  # logits of order 1, so a 1e-5 agreement is a real test
    )  # fmt: skip


def _lora_model(
    targets: tuple[str, ...] = ("query", "value", "intermediate"), rank: int = 4
) -> BertForSequenceClassification:
    """A random classifier with LoRA whose B factors are non-zero (at init B = 0 and LoRA is a no-op)."""
    model = BertForSequenceClassification(_config(), rngs=nnx.Rngs(0), num_labels=2)
    add_lora(model, LoRAConfig(rank=rank, alpha=8.0, targets=targets), nnx.Rngs(1))
    for i, (_, _, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = 0.3 * jax.random.normal(jax.random.key(10 + i), layer.lora_b[...].shape)
    return model


def _batch(n: int = 3, seq: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, V, size=(n, seq)).astype(np.int32)
    mask = np.ones((n, seq), np.int32)
    mask[0, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros((n, seq), np.int32)}


def test_lora_starts_as_the_base_model_and_counts_its_factors() -> None:
    base = BertForSequenceClassification(_config(), rngs=nnx.Rngs(0), num_labels=2)
    batch = _batch()
    before = base(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits
    add_lora(base, LoRAConfig(rank=4, targets=("query", "value")), nnx.Rngs(1))
    after = base(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits
    np.testing.assert_array_equal(np.asarray(before), np.asarray(after))  # B = 0 at init
    factors = [x for path, x in nnx.to_flat_state(nnx.state(base, nnx.Param)) if is_lora_path(path)]
    # 2 targets x (A [L, H, r] + B [L, r, H]) = 2 * 2 * L * H * r
    assert sum(int(np.prod(x.get_value().shape)) for x in factors) == 2 * 2 * L * H * 4
    with pytest.raises(ValueError, match="already a LoRALinear"):
        add_lora(base, LoRAConfig(rank=4, targets=("query",)), nnx.Rngs(2))
    with pytest.raises(ValueError, match="lora.targets"):
        LoRAConfig(targets=("qkv",))


def test_merged_export_equals_unmerged_forward(tmp_path: Path) -> None:
    model = _lora_model()
    batch = _batch()
    unmerged = np.asarray(model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits)
    # A non-trivial update: the LoRA model differs from its base by far more than the tolerance.
    base_logits = np.asarray(
        merge_lora(_zeroed(model))(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits
    )
    assert np.max(np.abs(unmerged - base_logits)) > 1e-2 and np.max(np.abs(unmerged)) > 0.1

    model = _lora_model()
    merge_lora(model)
    assert not list(lora_layers(model)) and isinstance(model.bert.encoder.layer.attention.self.query, nnx.Linear)
    merged = np.asarray(model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits)
    np.testing.assert_allclose(merged, unmerged, atol=1e-5, rtol=0)

    model.save_pretrained(str(tmp_path / "export"))
    reloaded = BertForSequenceClassification.from_pretrained(str(tmp_path / "export"))
    again = np.asarray(reloaded(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits)
    np.testing.assert_allclose(again, unmerged, atol=1e-5, rtol=0)

    torch = pytest.importorskip("torch")
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "export")).eval()
    with torch.no_grad():
        logits = hf(**{k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}).logits.numpy()
    np.testing.assert_allclose(logits, unmerged, atol=1e-5, rtol=0)


def _zeroed(model: BertForSequenceClassification) -> BertForSequenceClassification:
    """A copy of `model` with every LoRA B set to zero (the base model)."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree_util.tree_map(jnp.copy, state))
    for _, _, layer in lora_layers(copy):
        layer.lora_b[...] = jnp.zeros_like(layer.lora_b[...])
    return copy


def test_exact_per_example_clipping_covers_lora_factors() -> None:
    """The DP core's clipped sum over LoRA factors + head equals a loop of single-example
    gradients, each clipped to C and summed (the definition), for any micro-batch size."""
    import optax

    from dpbert.privacy.clipping import clipped_grad_sum
    from dpbert.train.classifier import trainable_filter

    model = _lora_model(targets=("query", "value"))
    assert isinstance(model.bert.encoder.layer.attention.self.value, LoRALinear)
    graphdef, params = nnx.split(model, nnx.Param)
    trainable, frozen = params.split(trainable_filter("lora", fresh_pooler=False), ...)
    paths = [path for path, _ in nnx.to_flat_state(trainable)]
    assert any(is_lora_path(p) for p in paths) and all(is_lora_path(p) or p[0] == "classifier" for p in paths)

    batch = {**_batch(n=4, seed=3), "labels": np.array([0, 1, 1, 0], np.int32)}

    def loss(p, example, rng):
        logits = classifier_logits(graphdef, nnx.merge_state(p, frozen), example["input_ids"],
                                   example["attention_mask"], example["token_type_ids"], None)  # fmt: skip
        return optax.softmax_cross_entropy_with_integer_labels(logits, example["labels"])

    clip = 0.05  # below every example's gradient norm: each one is scaled
    expected = jax.tree_util.tree_map(jnp.zeros_like, trainable)
    norms = []
    grad = jax.jit(jax.grad(loss))
    for i in range(4):
        g = grad(trainable, {k: v[i] for k, v in batch.items()}, None)
        norm = float(jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(g))))
        norms.append(norm)
        scale = min(1.0, clip / norm)
        expected = jax.tree_util.tree_map(lambda e, x, s=scale: e + s * x, expected, g)
    assert min(norms) > clip
    lora_grad = [x for path, x in nnx.to_flat_state(expected) if is_lora_path(path)]
    assert all(float(jnp.max(jnp.abs(x.get_value() if hasattr(x, "get_value") else x))) > 0 for x in lora_grad)
    padding = np.zeros(4, bool)
    for micro in (1, 4):
        total, stats = clipped_grad_sum(loss, trainable, batch, padding, jax.random.key(0), clip_norm=clip,
                                        microbatch_size=micro)  # fmt: skip
        assert float(stats.num_clipped) == 4
        for got, want in zip(jax.tree_util.tree_leaves(total), jax.tree_util.tree_leaves(expected), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-5)
