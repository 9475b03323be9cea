"""The default recipe (recipes/tiny.yaml, what `make run` runs): its public vocabulary subset,
its accounting, its non-private reference (the `reference` section), and `dpbert bench`'s preset of
its shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpbert.bench import MODELS, RECIPE_PRESETS
from dpbert.config.plan import make_plan, plan_recipe
from dpbert.config.recipe import load_recipe
from dpbert.data.tokenizer import (
    load_tokenizer,
    public_subset_size,
    public_vocab,
    public_vocab_dir,
    public_vocab_subset,
    public_vocab_subset_dir,
    resolve_tokenizer,
)
from dpbert.train.mlm import max_predictions
from dpbert.train.pretrain_report import recipe_reference

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TEXT = (
    "The President of the United States addressed the Congress on unemployment, inflation and the "
    "Naïve économie of 1848; 日本 too."
)


@pytest.mark.parametrize(
    "spec, size",
    [
        ("bert-base-uncased-8k", 8192),
        ("public-4096", 4096),
        ("bert-base-uncased", None),
        ("train", None),
        ("/some/folder", None),
    ],
)
def test_public_subset_specs(spec, size):
    assert public_subset_size(spec) == size


def test_public_subset_is_a_prefix_of_bert_vocabulary_and_tokenizes_without_unk(tmp_path):
    full = public_vocab()
    vocab = public_vocab_subset(8192)
    assert len(vocab) == len(set(vocab)) == 8192
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert not any(t.startswith("[unused") for t in vocab)
    # Words come in bert-base-uncased's own order (its WordPiece order), never from a corpus.
    words = [t for t in vocab[5:] if len(t) > 1 and not (len(t) == 3 and t.startswith("##"))]
    position = {t: i for i, t in enumerate(full)}
    assert [position[t] for t in words] == sorted(position[t] for t in words)
    assert words[:4] == ["the", "of", "and", "in"]

    folder = public_vocab_subset_dir(8192, tmp_path)
    assert public_vocab_subset_dir(8192, tmp_path) == folder  # cached, same content
    assert str(folder) == resolve_tokenizer("bert-base-uncased-8k", tmp_path)
    tok, ref = load_tokenizer(folder), load_tokenizer(public_vocab_dir(tmp_path))
    assert len(tok) == 8192 and tok.is_fast
    assert [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id] == [
        0,
        1,
        2,
        3,
        4,
    ]
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert tok.unk_token_id not in ids and ref.unk_token_id not in ref(TEXT)["input_ids"]
    # Same text once decoded: the subset only splits rarer words into more pieces.
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ref(TEXT)["input_ids"], skip_special_tokens=True)
    assert len(ids) > len(ref(TEXT)["input_ids"])
    with pytest.raises(ValueError, match="at least"):
        public_vocab_subset(100)


@pytest.mark.parametrize("name", ["tiny.yaml", "small.yaml"])
def test_dp_recipe_is_private_public_and_within_its_budget(name):
    recipe = load_recipe(RECIPES / name)
    p = recipe.privacy
    assert p.enabled and p.target_epsilon <= 8.0 and p.delta <= 1e-6 and p.dataset_size is not None
    plan = make_plan(recipe, p.dataset_size, dataset_size_source="declared")
    assert plan.ledger.epsilon() <= p.target_epsilon
    assert plan.ledger.truncation_delta() <= 0.01 * p.delta
    assert public_subset_size(recipe.data.tokenizer) is not None or recipe.data.tokenizer in (
        "public",
        "bert-base-uncased",
    )


def test_tiny_recipes_state_the_nonprivate_reference():
    for name in ("tiny.yaml", "tiny_nonprivate.yaml"):
        recipe = load_recipe(RECIPES / name)
        reference = recipe_reference(recipe)
        assert reference is not None and 0 < reference[0] < 1, name
        assert recipe.reference.recipe == "tiny_nonprivate.yaml" and reference[1].startswith("tiny_nonprivate.yaml")
        assert (RECIPES / recipe.reference.recipe).is_file()
    assert recipe_reference(load_recipe(RECIPES / "tiny.yaml", ["reference.nonprivate_mlm_accuracy=null"])) is None


def test_the_reference_changes_no_privacy_plan():
    recipe = load_recipe(RECIPES / "tiny.yaml")
    bare = load_recipe(RECIPES / "tiny.yaml", ["reference={}"])
    assert recipe_reference(bare) is None and recipe.reference != bare.reference
    plan, plan_bare = plan_recipe(recipe), plan_recipe(bare)
    assert plan.schedule == plan_bare.schedule and plan.physical_batch_sizes == plan_bare.physical_batch_sizes
    assert plan.ledger.to_dict() == plan_bare.ledger.to_dict()


def test_bench_preset_has_the_default_recipe_shapes():
    recipe = load_recipe(RECIPES / "tiny.yaml")
    base, vocab, seq_len, predictions = RECIPE_PRESETS["tiny-recipe"]
    m = recipe.model
    assert MODELS[base] == (m.num_hidden_layers, m.hidden_size, m.num_attention_heads)
    assert m.intermediate_size == 4 * m.hidden_size
    assert vocab == public_subset_size(recipe.data.tokenizer)
    assert seq_len == recipe.data.seq_len
    assert predictions == max_predictions(recipe.data.seq_len, recipe.data.mask_prob)
    assert RECIPE_PRESETS["tiny-recipe-30k"][1] == len(load_tokenizer(public_vocab_dir()))
