"""dpbert.model: Flax BERT vs transformers (PyTorch) numerics, both weight directions, errors."""

from __future__ import annotations

import functools
import json
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from minilm import minilm_dir

from dpbert.data.tokenizer import load_tokenizer, train_wordpiece
from dpbert.model import (
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    classifier_logits,
    mlm_logits,
    split_params,
)
from dpbert.model.bert import dot_product_attention, dropout, gelu

ATOL = 1e-4


def odd_config(**overrides) -> transformers.BertConfig:
    """Hidden 30 with 5 heads (head dim 6), 3 token types, 24 positions: nothing a power of two."""
    kw = dict(
        vocab_size=97,
        hidden_size=30,
        num_hidden_layers=2,
        num_attention_heads=5,
        intermediate_size=37,
        max_position_embeddings=24,
        type_vocab_size=3,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    kw.update(overrides)
    return transformers.BertConfig(**kw)


def perturb_torch(model: torch.nn.Module, seed: int) -> None:
    # Default init has LayerNorm = (1, 0) and zero biases, which would hide swapped or dropped weights.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))


def perturb_nnx(model: nnx.Module, seed: int) -> None:
    # numpy noise: an eager jax.random call per parameter shape would cost a compilation each.
    gen = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    leaves = [x + 0.2 * gen.standard_normal(x.shape, np.float32) for x in leaves]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))


def batch(vocab_size: int, type_vocab_size: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """3 sequences of 11 tokens, two of them right-padded, with random token types."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab_size, (3, 11))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    types = rng.integers(0, type_vocab_size, ids.shape)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def torch_out(model: torch.nn.Module, inputs: dict[str, np.ndarray], **kw):
    with torch.no_grad():
        return model(**{k: torch.tensor(v) for k, v in inputs.items()}, **kw)


@functools.partial(jax.jit, static_argnames=("graphdef", "output_hidden_states"))
def _forward(graphdef, params, ids, mask, types, dropout_rng, output_hidden_states):
    return nnx.merge(graphdef, params)(
        ids, mask, types, dropout_rng=dropout_rng, output_hidden_states=output_hidden_states
    )


def call(model, inputs, *, dropout_rng=None, output_hidden_states=False):
    """The model's forward pass, jitted: one compilation per config instead of one per op."""
    graphdef, params = nnx.split(model)
    ids, mask, types = (inputs[k] for k in ("input_ids", "attention_mask", "token_type_ids"))
    return _forward(graphdef, params, ids, mask, types, dropout_rng, output_hidden_states)


@pytest.fixture(scope="module")
def hf_mlm_dir(tmp_path_factory):
    torch.manual_seed(0)
    # One layer keeps the jit/grad compilations of the tests below cheap; multi-layer mapping is
    # covered by the parametrised test and the 6-layer real checkpoint.
    model = transformers.BertForMaskedLM(odd_config(num_hidden_layers=1)).eval()
    perturb_torch(model, 0)
    path = tmp_path_factory.mktemp("hf_mlm")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "overrides",
    [{}, {"hidden_size": 36, "num_attention_heads": 6, "hidden_act": "gelu_new"}, {"hidden_act": "relu"}],
    ids=["gelu-30x5", "gelu_new-36x6", "relu"],
)
def test_torch_checkpoint_loads_with_matching_logits(tmp_path, overrides):
    torch.manual_seed(1)
    reference = transformers.BertForMaskedLM(odd_config(**overrides)).eval()
    perturb_torch(reference, 1)
    reference.save_pretrained(tmp_path)
    inputs = batch(97)

    model = BertForMaskedLM.from_pretrained(tmp_path)
    out = call(model, inputs, output_hidden_states=True)
    expected = torch_out(reference, inputs, output_hidden_states=True)

    assert out.logits.shape == (3, 11, 97)
    # transformers masks keys only, so padded query positions match as well.
    np.testing.assert_allclose(out.logits, expected.logits.numpy(), atol=ATOL, rtol=0)
    assert len(out.hidden_states) == len(expected.hidden_states) == 3
    for ours, theirs in zip(out.hidden_states, expected.hidden_states, strict=True):
        np.testing.assert_allclose(ours, theirs.numpy(), atol=ATOL, rtol=0)


def test_position_ids_match_transformers_and_default_to_0_to_L(hf_mlm_dir):
    reference = transformers.BertForMaskedLM.from_pretrained(hf_mlm_dir).eval()
    graphdef, params = split_params(BertForMaskedLM.from_pretrained(hf_mlm_dir))
    inputs = batch(97)
    offsets = np.array([[0], [13], [5]])  # up to 24 - 11 = 13 in the 24-row table
    positions = offsets + np.arange(11)[None]
    logits = jax.jit(mlm_logits, static_argnums=0)
    got = logits(graphdef, params, **inputs, position_ids=positions)
    want = torch_out(reference, {**inputs, "position_ids": positions}).logits.numpy()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    # Positions 0..L-1 given explicitly are the default (to float rounding: another program).
    explicit = logits(graphdef, params, **inputs, position_ids=np.broadcast_to(np.arange(11), (3, 11)))
    np.testing.assert_allclose(explicit, logits(graphdef, params, **inputs), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="position_ids: expected the shape of input_ids"):
        mlm_logits(graphdef, params, inputs["input_ids"], position_ids=positions[:, :5])


def test_pytorch_bin_with_legacy_names_loads_like_safetensors(tmp_path, hf_mlm_dir):
    # A torch state dict as older checkpoints have it: pytorch_model.bin, LayerNorm gamma/beta,
    # the tied decoder weight and bias stored twice, and the position_ids buffer.
    reference = transformers.BertForMaskedLM.from_pretrained(hf_mlm_dir)
    state = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in reference.state_dict().items()
    }
    state["bert.embeddings.position_ids"] = torch.arange(24)[None]
    assert "cls.predictions.decoder.weight" in state
    shutil.copy(hf_mlm_dir / "config.json", tmp_path / "config.json")
    torch.save(state, tmp_path / "pytorch_model.bin")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unexpected, nothing initialised
        from_bin = BertForMaskedLM.from_pretrained(tmp_path)
    from_safetensors = BertForMaskedLM.from_pretrained(hf_mlm_dir)
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, nnx.state(from_bin, nnx.Param), nnx.state(from_safetensors, nnx.Param)
    )


def test_save_pretrained_loads_in_transformers_and_fill_mask(tmp_path):
    corpus = [
        "the cat sat on the mat .",
        "a dog sat on the log .",
        "privacy is measured by epsilon .",
        "the model predicts the masked word .",
    ] * 25
    tok = train_wordpiece(corpus, vocab_size=120, out_dir=tmp_path / "tok", min_frequency=1)
    config = odd_config(vocab_size=len(tok), max_position_embeddings=32)
    model = BertForMaskedLM(config, rngs=nnx.Rngs(3))
    perturb_nnx(model, 3)
    out_dir = tmp_path / "export"
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)  # into the existing folder: the weights must survive
    model.save_pretrained(out_dir)  # and a second save over an existing folder keeps the tokenizer

    reference, info = transformers.AutoModelForMaskedLM.from_pretrained(out_dir, output_loading_info=True)
    assert type(reference).__name__ == "BertForMaskedLM"
    assert {k: set(v) for k, v in info.items()} == {
        "missing_keys": set(),
        "unexpected_keys": set(),
        "mismatched_keys": set(),
        "error_msgs": set(),
    }
    reference.eval()
    inputs = batch(len(tok))
    np.testing.assert_allclose(
        call(model, inputs).logits, torch_out(reference, inputs).logits.numpy(), atol=ATOL, rtol=0
    )

    fill = transformers.pipeline("fill-mask", model=str(out_dir))
    preds = fill("the cat sat on the [MASK] .")
    assert len(preds) == 5 and all(p["sequence"].startswith("the cat sat on the") for p in preds)
    enc = dict(tok("the cat sat on the [MASK] .", return_tensors="np"))
    position = int(np.argmax(enc["input_ids"][0] == tok.mask_token_id))
    probs = jax.nn.softmax(call(model, enc).logits[0, position])
    assert preds[0]["token"] == int(jnp.argmax(probs))
    assert preds[0]["score"] == pytest.approx(float(probs.max()), abs=ATOL)


def test_real_minilm_encoder_matches_transformers():
    folder = minilm_dir()
    tok = load_tokenizer(folder)
    sentences = [
        "Differential privacy bounds what any single example can reveal.",
        "BERT reads text in both directions.",
        "A short one.",
    ]
    inputs = dict(tok(sentences, padding=True, return_tensors="np"))
    assert inputs["attention_mask"].min() == 0  # the batch really is padded

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every weight used, nothing initialised
        model = BertModel.from_pretrained(folder)
    out = call(model, inputs)
    reference = transformers.BertModel.from_pretrained(folder).eval()
    expected = torch_out(reference, inputs)
    real = inputs["attention_mask"] == 1
    np.testing.assert_allclose(
        np.asarray(out.last_hidden_state)[real], expected.last_hidden_state.numpy()[real], atol=ATOL, rtol=0
    )
    np.testing.assert_allclose(out.pooler_output, expected.pooler_output.numpy(), atol=ATOL, rtol=0)

    # The same folder is a bare BertModel save: a masked-LM loads the encoder under the ``bert.``
    # prefix, initialises the head and says so.
    with pytest.warns(UserWarning, match=r"newly initialised: .*cls\.predictions\.transform\.dense\.weight"):
        mlm = BertForMaskedLM.from_pretrained(folder)
    ours, theirs = nnx.state(mlm.bert, nnx.Param), nnx.state(model, nnx.Param)
    ours.pop("pooler", None)
    theirs.pop("pooler")
    jax.tree_util.tree_map(np.testing.assert_array_equal, ours, theirs)


def test_classification_heads_and_round_trips(tmp_path, hf_mlm_dir):
    inputs = batch(97)
    # dpbert -> transformers
    model = BertForSequenceClassification(odd_config(), num_labels=3, rngs=nnx.Rngs(5))
    assert model.config.num_labels == 3
    perturb_nnx(model, 5)
    model.save_pretrained(tmp_path / "cls")
    reference, info = transformers.BertForSequenceClassification.from_pretrained(
        tmp_path / "cls", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    reference.eval()
    logits = call(model, inputs).logits
    assert logits.shape == (3, 3)
    np.testing.assert_allclose(logits, torch_out(reference, inputs).logits.numpy(), atol=ATOL)

    # transformers -> dpbert, regression head
    torch.manual_seed(2)
    reg = transformers.BertForSequenceClassification(odd_config(num_labels=1)).eval()
    perturb_torch(reg, 2)
    reg.save_pretrained(tmp_path / "reg")
    loaded = BertForSequenceClassification.from_pretrained(tmp_path / "reg")
    assert loaded.num_labels == 1
    logits = jax.jit(classifier_logits, static_argnums=0)(*split_params(loaded), **inputs)
    assert logits.shape == (3, 1)
    np.testing.assert_allclose(logits, torch_out(reg, inputs).logits.numpy(), atol=ATOL)
    with pytest.raises(ValueError, match="mlm_logits: graphdef is a BertForSequenceClassification"):
        mlm_logits(*split_params(loaded), inputs["input_ids"])

    # A masked-LM checkpoint has no pooler or classifier: both are initialised, with a warning naming them.
    with pytest.warns(UserWarning, match=r"newly initialised: .*classifier\.weight") as record:
        fresh = BertForSequenceClassification.from_pretrained(hf_mlm_dir, num_labels=3)
    assert any("bert.pooler.dense.weight" in str(w.message) for w in record)
    assert fresh.classifier.kernel.shape == (30, 3)
    np.testing.assert_array_equal(  # the encoder did load
        fresh.bert.embeddings.word_embeddings.embedding[...],
        BertForMaskedLM.from_pretrained(hf_mlm_dir).bert.embeddings.word_embeddings.embedding[...],
    )


def test_dropout_rate_and_rescaling():
    # ``rate`` is the drop probability (not the keep probability) and survivors are rescaled.
    dropped = dropout(jnp.ones((4000,)), 0.1, jax.random.key(0))
    assert 0.08 < float(jnp.mean(dropped == 0.0)) < 0.12
    np.testing.assert_allclose(dropped[dropped != 0.0], 1.0 / 0.9, rtol=1e-6)
    np.testing.assert_array_equal(dropout(jnp.ones((5,)), 0.1, None), 1.0)


def test_gelu_matches_pytorch_values_and_gradient():
    # Exact GELU in PyTorch's erf form, checked against float64 over the range activations reach.
    x = np.linspace(-12.0, 12.0, 20001, dtype=np.float32)
    ref = torch.nn.functional.gelu(torch.from_numpy(x).double())
    np.testing.assert_allclose(jax.jit(gelu)(x), ref.numpy(), atol=2e-6, rtol=0)
    xt = torch.from_numpy(x).double().requires_grad_()
    torch.nn.functional.gelu(xt).sum().backward()
    np.testing.assert_allclose(jax.jit(jax.grad(lambda v: jnp.sum(gelu(v))))(x), xt.grad.numpy(), atol=2e-6, rtol=0)
    # The tanh approximation is a different function (up to ~5e-4 away), so the test can tell.
    assert np.max(np.abs(jax.nn.gelu(x, approximate=True) - ref.numpy())) > 1e-4


def test_materialised_attention_path_equals_fused_path():
    q, k, v = np.random.default_rng(0).standard_normal((3, 2, 7, 3, 6), np.float32)
    mask = jnp.asarray([[1] * 7, [1] * 4 + [0] * 3], bool)[:, None, None, :]
    fused = dot_product_attention(q, k, v, mask)
    explicit = dot_product_attention(q, k, v, mask, dropout_rate=0.0, dropout_rng=jax.random.key(1))
    np.testing.assert_allclose(fused, explicit, atol=1e-6)


def test_functional_view_dropout_keys_jit_vmap_grad(hf_mlm_dir):
    model = BertForMaskedLM.from_pretrained(hf_mlm_dir)
    graphdef, params = split_params(model)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    inputs = batch(97)
    ids, mask, types = inputs["input_ids"], inputs["attention_mask"], inputs["token_type_ids"]

    logits_fn = jax.jit(mlm_logits, static_argnums=0)
    logits = logits_fn(graphdef, params, ids, mask, types)
    np.testing.assert_allclose(logits, call(model, inputs).logits, atol=1e-5)
    # No dropout key: inference mode, equal to transformers in eval mode.
    reference = transformers.BertForMaskedLM.from_pretrained(hf_mlm_dir).eval()
    np.testing.assert_allclose(logits, torch_out(reference, inputs).logits.numpy(), atol=ATOL, rtol=0)
    positions = jnp.asarray([[1, 2], [0, 6], [2, 2]])
    gathered = logits_fn(graphdef, params, ids, mask, types, masked_positions=positions)
    np.testing.assert_allclose(gathered, jnp.take_along_axis(logits, positions[..., None], axis=1), atol=1e-5)

    # Per-example use as in the DP core: vmap over single examples ([L] inputs), params unbatched,
    # one dropout key per example.
    def loss(p, i, m, t, r):
        return jnp.mean(mlm_logits(graphdef, p, i, m, t, r) ** 2)

    per_example = jax.jit(jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0, 0, 0, 0)))
    keys = jax.random.split(jax.random.key(0), 3)
    # numpy from here on: an eager jax op per parameter shape would cost a compilation each.
    losses, grads = jax.tree_util.tree_map(np.asarray, per_example(params, ids, mask, types, keys))
    assert losses.shape == (3,)
    assert all(g.shape[0] == 3 and np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))
    # An example's loss and gradient depend on that example and its key only, not on its batch position.
    order = np.array([2, 0, 1])
    losses_p, grads_p = jax.tree_util.tree_map(
        np.asarray, per_example(params, ids[order], mask[order], types[order], keys[order])
    )
    np.testing.assert_allclose(losses_p, losses[order], rtol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b[order], rtol=1e-4, atol=1e-6), grads_p, grads)
    # Dropout is keyed: the same keys reproduce exactly, other keys differ, and keyed differs from inference.
    np.testing.assert_array_equal(per_example(params, ids, mask, types, keys)[0], losses)
    other = np.asarray(per_example(params, ids, mask, types, jax.random.split(jax.random.key(1), 3))[0])
    assert np.abs(other - losses).min() > 1e-4
    clean = np.mean(np.asarray(logits) ** 2, axis=(1, 2))
    assert np.abs(losses - clean).min() > 1e-4

    with pytest.raises(ValueError, match="classifier_logits: graphdef is a BertForMaskedLM"):
        classifier_logits(graphdef, params, ids)


def test_bfloat16_compute_close_to_float32(hf_mlm_dir):
    inputs = batch(97)
    f32 = call(BertForMaskedLM.from_pretrained(hf_mlm_dir), inputs).logits
    model = BertForMaskedLM.from_pretrained(hf_mlm_dir, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    bf16 = call(model, inputs).logits
    assert bf16.dtype == jnp.bfloat16
    err = float(jnp.abs(bf16.astype(jnp.float32) - f32).max())
    assert err < 0.05 * float(jnp.abs(f32).max()), err


def test_sequence_longer_than_positions_is_rejected(hf_mlm_dir):
    model = BertForMaskedLM.from_pretrained(hf_mlm_dir)
    with pytest.raises(ValueError, match="seq_len 25 exceeds config.max_position_embeddings 24"):
        model(np.ones((1, 25), np.int32))


def test_bad_inputs_name_the_file_and_the_mismatch(tmp_path, hf_mlm_dir):
    with pytest.raises(FileNotFoundError, match="dpbert pull"):
        BertForMaskedLM.from_pretrained("google-bert/bert-base-uncased")

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"{empty}/config\.json"):
        BertForMaskedLM.from_pretrained(empty)

    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    with pytest.raises(ValueError, match=rf"{gpt}/config\.json: model_type is 'gpt2', expected 'bert'"):
        BertForMaskedLM.from_pretrained(gpt)

    wrong = tmp_path / "wrong"
    shutil.copytree(hf_mlm_dir, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["intermediate_size"] = 40
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        BertForMaskedLM.from_pretrained(wrong)
    message = str(err.value)
    assert f"{wrong}/model.safetensors" in message
    assert "bert.encoder.layer.0.intermediate.dense.weight: expected shape (40, 30), found (37, 30)" in message

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(hf_mlm_dir / "config.json", no_weights / "config.json")
    with pytest.raises(FileNotFoundError, match="no weights file"):
        BertForMaskedLM.from_pretrained(no_weights)

    with pytest.raises(ValueError, match="config.hidden_act"):
        BertModel(odd_config(hidden_act="mish"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="not_a_field: not a BertConfig field"):
        BertForMaskedLM.from_pretrained(hf_mlm_dir, not_a_field=1)


def test_remat_gives_the_same_loss_and_gradients():
    config = odd_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    inputs = batch(97)
    grads = {}
    for remat in (False, True):
        graphdef, params = split_params(BertForMaskedLM(config, rngs=nnx.Rngs(0), remat=remat))

        def loss(p, graphdef=graphdef):
            logits = mlm_logits(
                graphdef, p, inputs["input_ids"], inputs["attention_mask"], inputs["token_type_ids"], jax.random.key(3)
            )
            return jnp.mean(logits**2)

        # Same dropout masks (keys), same values: only the memory/compute trade-off differs.
        grads[remat] = jax.jit(jax.value_and_grad(loss))(params)
    np.testing.assert_allclose(grads[True][0], grads[False][0], rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), *grads.values())
    jaxpr = str(jax.make_jaxpr(lambda p: mlm_logits(graphdef, p, inputs["input_ids"]))(params))
    assert "checkpoint" in jaxpr or "remat" in jaxpr
