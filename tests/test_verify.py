"""`verify` proves a release matches the recipe it carries, its weights and its own copies.

Each tampered release below stays internally consistent: epsilon is recomputed after the edit and
written everywhere (privacy.json, card front matter, config.json) by `write_release`, so only the
checks that rebuild the ledger from the recipe, hash the weights or inspect the ledger itself can
catch it. Every failure is asserted with its exact message.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from dpbert.cli import main as cli_main
from dpbert.release import CardInfo, Guarantee, ReleaseMetadata, export_run, verify_folder, write_release
from dpbert.release.card import read_front_matter
from dpbert.release.metadata import metadata_from_json, noise_record

sys.path.insert(0, str(Path(__file__).parent))
from test_release import (  # noqa: E402
    RECIPE,
    _make_run,
    hf_model_dir,  # noqa: F401  (fixture)
    plan_ledger,
    recipe_text,
)

INFO = CardInfo(model_name="tiny-dp", architecture="tiny BERT", reproduce_command="dpbert pretrain recipe.yaml")


@pytest.fixture(scope="module")
def base(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """A genuine release of the calibrated two-stage recipe of test_release (N = 1000, rounded)."""
    root = tmp_path_factory.mktemp("base")
    out = export_run(_make_run(root, hf_model_dir, ledger=plan_ledger()), root / "release")
    result = verify_folder(out)
    assert result.ok and result.checks[0].rebuilt, result.summary()
    return out


def _rewrite(folder: Path, out: Path, *, edit=None, recipe: str | None = None) -> Path:
    """A consistent copy of the release `folder` at `out`: its ledger edited by `edit(ledger)` and/or
    its recipe replaced, epsilon recomputed, everything (privacy.json with the recipe's sha256, the
    card's front matter, config.json, the weights' hashes) written again by `write_release`."""
    meta = metadata_from_json(json.loads((folder / "privacy.json").read_text()), "privacy.json")
    (g,) = meta.guarantees
    ledger = copy.deepcopy(dict(g.ledger))
    if edit is not None:
        edit(ledger)
    unit = dict(g.unit or {})
    if "document_group_epsilon" in unit:  # the card's group privacy follows the edited ledger
        from dpbert.release.metadata import document_group_epsilon, epsilon_to_json

        unit["document_group_epsilon"] = epsilon_to_json(
            document_group_epsilon(ledger, unit["max_sequences_per_document"])
        )
    g = Guarantee.from_ledger(
        scope=g.scope,
        data=g.data,
        ledger=ledger,
        randomness=g.randomness,
        unit=unit or None,
        noise=noise_record(ledger, coordinates=(g.noise or {}).get("coordinates")),
    )
    meta = dataclasses.replace(meta, guarantees=(g,), recipe_content=recipe or meta.recipe_content)
    return write_release(out, model=folder, meta=meta, info=INFO)


def _problems(folder: Path) -> tuple[str, ...]:
    result = verify_folder(folder)
    assert not result.ok
    return result.problems


def test_a_removed_stage_is_caught_by_the_recipe(base: Path, tmp_path: Path) -> None:
    def drop_last_stage(ledger: dict) -> None:
        ledger["stages"] = ledger["stages"][:1]

    out = _rewrite(base, tmp_path / "r", edit=drop_last_stage)
    stated = json.loads((out / "privacy.json").read_text())["guarantees"][0]["epsilon"]
    assert stated < 4.0  # half the steps: a smaller epsilon, stated consistently everywhere
    assert read_front_matter(out / "README.md")["differential_privacy"]["guarantees"][0]["epsilon"] == stated
    assert _problems(out) == (
        f"{out / 'privacy.json'}: guarantees[0].ledger.stages: 1 stage(s) in the ledger, 2 rebuilt from the recipe",
    )


def test_a_dataset_ten_times_larger_is_caught_by_the_recipe(base: Path, tmp_path: Path) -> None:
    def inflate(ledger: dict) -> None:
        ledger["dataset_size"] *= 10
        for stage in ledger["stages"]:
            stage["sampling_rate"] = stage["expected_batch_size"] / ledger["dataset_size"]

    out = _rewrite(base, tmp_path / "r", edit=inflate)
    ledger = json.loads((out / "privacy.json").read_text())["guarantees"][0]["ledger"]
    # The recipe calibrates its noise to the target for N: for 10 N it would have added far less noise.
    rebuilt = plan_ledger(dataset_size=10_000)
    sigma, sigma10 = ledger["stages"][0]["noise_multiplier"], rebuilt["stages"][0]["noise_multiplier"]
    assert sigma10 < 0.7 * sigma
    where = f"{out / 'privacy.json'}: guarantees[0].ledger"
    expected = [
        f"{where}.stages[{j}].noise_multiplier: {sigma:.6g} in the ledger, {sigma10:.6g} rebuilt from the recipe"
        for j in (0, 1)
    ]
    expected += [
        f"{where}.stages[{j}].physical_batch_size: {ledger['stages'][j]['physical_batch_size']} in the ledger, "
        f"{rebuilt['stages'][j]['physical_batch_size']} rebuilt from the recipe"
        for j in (0, 1)
        if ledger["stages"][j]["physical_batch_size"] != rebuilt["stages"][j]["physical_batch_size"]
    ]
    assert sorted(_problems(out)) == sorted(expected)


def test_a_declared_dataset_size_is_checked_even_with_fixed_noise(hf_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    raw = copy.deepcopy(RECIPE)
    raw["privacy"] = {**raw["privacy"], "noise_multiplier": 1.0, "target_epsilon": None, "dataset_size": 1000}
    text = recipe_text(raw)
    from dpbert.config.plan import make_plan
    from dpbert.config.recipe import load_recipe_dict

    ledger = make_plan(load_recipe_dict(raw), 1000, dataset_size_source="declared").ledger.to_dict()
    release = export_run(_make_run(tmp_path, hf_model_dir, ledger=ledger, recipe=text), tmp_path / "genuine")
    result = verify_folder(release)
    assert result.ok and result.checks[0].rebuilt, result.summary()

    def inflate(ledger: dict) -> None:
        ledger["dataset_size"] = 10_000
        for stage in ledger["stages"]:
            stage["sampling_rate"] = stage["expected_batch_size"] / 10_000

    out = _rewrite(release, tmp_path / "r", edit=inflate)
    problems = _problems(out)
    where = f"{out / 'privacy.json'}: guarantees[0].ledger"
    assert f"{where}.dataset_size: 10000 in the ledger, 1000 rebuilt from the recipe" in problems
    assert f"{where}.stages[0].sampling_rate: 0.0032 in the ledger, 0.032 rebuilt from the recipe" in problems
    assert all(p.startswith(f"{where}.") and p.endswith("rebuilt from the recipe") for p in problems), problems


def test_emptied_stages_with_epsilon_zero_are_refused(base: Path, tmp_path: Path) -> None:
    def empty(ledger: dict) -> None:
        ledger["stages"] = []

    out = _rewrite(base, tmp_path / "r", edit=empty)
    assert json.loads((out / "privacy.json").read_text())["guarantees"][0]["epsilon"] == 0.0
    assert _problems(out) == (
        f"{out / 'privacy.json'}: guarantees[0].ledger.stages: empty (expected at least one stage of DP-SGD; a ledger "
        "without steps is not the record of a training run)",
    )


def test_doubled_noise_multipliers_are_caught_by_the_recipe(base: Path, tmp_path: Path) -> None:
    def double(ledger: dict) -> None:
        for stage in ledger["stages"]:
            stage["noise_multiplier"] *= 2

    out = _rewrite(base, tmp_path / "r", edit=double)
    sigma = plan_ledger()["stages"][0]["noise_multiplier"]
    assert _problems(out) == tuple(
        f"{out / 'privacy.json'}: guarantees[0].ledger.stages[{j}].noise_multiplier: {2 * sigma:.6g} in the ledger, "
        f"{sigma:.6g} rebuilt from the recipe"
        for j in (0, 1)
    )


def test_an_edited_recipe_is_caught_with_or_without_its_sha256(base: Path, tmp_path: Path) -> None:
    edited = recipe_text({**RECIPE, "privacy": {**RECIPE["privacy"], "clip_norm": 2.0}})
    out = _rewrite(base, tmp_path / "r", recipe=edited)
    data = json.loads((out / "privacy.json").read_text())
    assert data["recipe"]["sha256"] == hashlib.sha256(edited.encode()).hexdigest()  # the sha was updated
    assert _problems(out) == (
        f"{out / 'privacy.json'}: guarantees[0].ledger.clip_norm: 1 in the ledger, 2 rebuilt from the recipe",
    )
    # The same edit without updating the sha256 is caught by the hash as well.
    stale = shutil.copytree(base, tmp_path / "s")
    data = json.loads((stale / "privacy.json").read_text())
    data["recipe"]["content"] = edited
    (stale / "privacy.json").write_text(json.dumps(data))
    old = hashlib.sha256(recipe_text().encode()).hexdigest()
    new = hashlib.sha256(edited.encode()).hexdigest()
    assert _problems(stale) == (
        f"{stale / 'privacy.json'}: recipe.sha256: {old!r} but recipe.content hashes to {new!r}",
        f"{stale / 'privacy.json'}: guarantees[0].ledger.clip_norm: 1 in the ledger, 2 rebuilt from the recipe",
    )


def test_changed_weights_are_caught_by_their_sha256(base: Path, tmp_path: Path) -> None:
    out = shutil.copytree(base, tmp_path / "r")
    weights = out / "model.safetensors"
    recorded = hashlib.sha256(weights.read_bytes()).hexdigest()
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0x01  # one bit of the last tensor: still a loadable checkpoint, not the released one
    weights.write_bytes(bytes(blob))
    actual = hashlib.sha256(bytes(blob)).hexdigest()
    assert _problems(out) == (
        f"{out / 'privacy.json'}: weights.model.safetensors: sha256 {recorded[:16]}... in privacy.json, "
        f"{actual[:16]}... for the file (the weights are not the ones released)",
    )
    # An extra weight file that nothing records is not released weights either.
    shutil.copy(base / "model.safetensors", out / "model.safetensors")
    (out / "pytorch_model.bin").write_bytes(b"not released")
    assert _problems(out) == (
        f"{out / 'privacy.json'}: weights: pytorch_model.bin is in the release but its sha256 is not recorded",
    )


def test_every_shard_of_a_sharded_release_is_hashed(hf_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    from transformers import BertForMaskedLM

    sharded = tmp_path / "sharded_model"
    BertForMaskedLM.from_pretrained(hf_model_dir).save_pretrained(sharded, max_shard_size="40KB")
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(hf_model_dir / name, sharded / name)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2
    out = export_run(_make_run(tmp_path, sharded, ledger=plan_ledger()), tmp_path / "release")
    weights = json.loads((out / "privacy.json").read_text())["weights"]
    assert sorted(weights) == sorted([*shards, "model.safetensors.index.json"])
    assert verify_folder(out).ok
    (out / shards[0]).unlink()
    assert _problems(out) == (
        f"{out / 'privacy.json'}: weights.{shards[0]}: recorded, but {out / shards[0]} is missing",
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "delta",
            1e-3,
            "guarantees[0].ledger.delta: 0.001 >= 1/dataset_size = 1/1000 (expected delta < 1/N: a delta "
            "this large allows publishing an example outright)",
        ),
        (
            "privacy_unit",
            "one user",
            "guarantees[0].ledger.privacy_unit: 'one user' is not a known privacy "
            "unit (expected one of ['one example sequence', 'one document'])",
        ),
        (
            "privacy_unit",
            "one document",
            "guarantees[0].ledger.max_sequences_per_document: None (expected an "
            "integer >= 1: a document-level ledger states how many sequences of one "
            "document a step may take)",
        ),
        (
            "accountant",
            "gdp",
            "guarantees[0].ledger.accountant: 'gdp' is not a known accountant (expected one of ['pld', 'rdp'])",
        ),
    ],
)
def test_a_ledger_outside_what_dpbert_accounts_is_refused(base: Path, tmp_path: Path, field, value, message) -> None:
    if field == "delta":  # still a ledger epsilon can be recomputed from: rewritten consistently
        out = _rewrite(base, tmp_path / "r", edit=lambda ledger: ledger.update(delta=value))
    else:  # no epsilon can be computed for it, so privacy.json alone is edited
        out = shutil.copytree(base, tmp_path / "r")
        data = json.loads((out / "privacy.json").read_text())
        data["guarantees"][0]["ledger"][field] = value
        (out / "privacy.json").write_text(json.dumps(data))
    assert _problems(out) == (f"{out / 'privacy.json'}: {message}",)


def _edit_front_matter(folder: Path, edit) -> None:
    card = folder / "README.md"
    matter = read_front_matter(card)
    edit(matter)
    body = card.read_text().split("\n---\n", 1)[1]
    card.write_text("---\n" + yaml.safe_dump(matter, sort_keys=False) + "---\n" + body)


def test_a_card_or_config_copy_that_disagrees_with_the_ledger_is_caught(base: Path, tmp_path: Path) -> None:
    out = shutil.copytree(base, tmp_path / "card")
    _edit_front_matter(out, lambda m: m["differential_privacy"]["guarantees"][0].update(dataset_size=10_000))
    assert _problems(out) == (
        f"{out / 'README.md'}: dataset_size for 'pretraining' is 10000 but privacy.json has 1000",
    )

    out = shutil.copytree(base, tmp_path / "source")
    _edit_front_matter(out, lambda m: m["differential_privacy"]["guarantees"][0].update(dataset_size_source="declared"))
    assert _problems(out) == (
        f"{out / 'README.md'}: dataset_size_source for 'pretraining' is 'declared' but privacy.json has 'rounded'",
    )

    out = shutil.copytree(base, tmp_path / "config")
    config = json.loads((out / "config.json").read_text())
    config["differential_privacy"]["guarantees"][0]["accountant"] = "pld"
    (out / "config.json").write_text(json.dumps(config))
    assert _problems(out) == (
        f"{out / 'config.json'}: accountant for 'pretraining' is 'pld' but privacy.json has 'rdp'",
    )


def test_public_inputs_must_be_what_the_metadata_implies(base: Path, tmp_path: Path) -> None:
    out = shutil.copytree(base, tmp_path / "r")
    data = json.loads((out / "privacy.json").read_text())
    data["public_inputs"][0]["source"] = "declared"  # claims N was fixed in advance; the ledger says rounded
    (out / "privacy.json").write_text(json.dumps(data))
    (problem,) = _problems(out)
    assert problem.startswith(
        f"{out / 'privacy.json'}: public_inputs: [{{'input': 'dataset_size', 'scope': "
        "'pretraining', 'value': 1000, 'source': 'declared'}"
    )
    assert (
        "but the rest of privacy.json states [{'input': 'dataset_size', 'scope': 'pretraining', 'value': 1000, "
        "'source': 'rounded'}" in problem
    )


def test_unknown_randomness_fails_and_a_supplied_secret_warns(hf_model_dir: Path, tmp_path: Path, capsys) -> None:  # noqa: F811
    out = export_run(
        _make_run(tmp_path / "a", hf_model_dir, ledger=plan_ledger(), randomness=None), tmp_path / "unknown"
    )
    data = json.loads((out / "privacy.json").read_text())
    assert data["guarantees"][0]["randomness"]["source"] == "unknown"
    assert read_front_matter(out / "README.md")["differential_privacy"]["guarantees"][0]["randomness"] == "unknown"
    assert "unknown: nothing records that the noise was secret" in (out / "README.md").read_text()
    assert _problems(out) == (
        f"{out / 'privacy.json'}: randomness of 'pretraining' (guarantees[0].randomness) is unknown: nothing records "
        "that its noise came from a secret (expected source 'os-csprng' or 'supplied-file'), so the guarantee "
        "cannot be relied on",
    )

    out = export_run(
        _make_run(tmp_path / "b", hf_model_dir, ledger=plan_ledger(), randomness="supplied-file"), tmp_path / "supplied"
    )
    result = verify_folder(out)
    assert result.ok and result.status == "private", result.summary()
    assert result.warnings == (
        "pretraining: the noise secret was supplied from a file (randomness 'supplied-file'): whoever holds that file "
        "can regenerate the noise; the guarantee holds against everyone else",
    )
    assert cli_main(["verify", str(out)]) == 0
    assert "  warning: pretraining: the noise secret was supplied from a file" in capsys.readouterr().out


def test_a_vocabulary_from_the_private_corpus_makes_the_dp_tags_a_failure(hf_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    run = _make_run(tmp_path, hf_model_dir, ledger=plan_ledger(), vocab_origin="trained on sotu")
    out = export_run(run, tmp_path / "out")
    matter = read_front_matter(out / "README.md")
    assert not {"differential-privacy", "dp-sgd"} & set(matter["tags"])
    assert {"non-private", "non-private-vocabulary"} <= set(matter["tags"])
    assert matter["differential_privacy"]["vocabulary"]["learned_from_private_data"] is True
    assert (
        "the release is NOT\ndifferentially private with respect to its vocabulary" in (out / "README.md").read_text()
    )
    result = verify_folder(out)
    assert result.ok and result.status == "private (except its vocabulary)", result.summary()
    assert "vocabulary: learned from the private corpus without privacy" in result.summary()

    _edit_front_matter(out, lambda m: m.update(tags=[*m["tags"], "differential-privacy", "dp-sgd"]))
    assert _problems(out) == (
        f"{out / 'README.md'}: the vocabulary was learned from the private corpus without privacy (privacy.json: "
        "vocabulary.learned_from_private_data), so the release must not carry the tags ['differential-privacy', "
        "'dp-sgd']",
    )
    # Hiding the vocabulary's origin in the card alone is caught too.
    out2 = export_run(run, tmp_path / "out2")
    _edit_front_matter(out2, lambda m: m["differential_privacy"]["vocabulary"].update(learned_from_private_data=False))
    (problem,) = _problems(out2)
    assert problem.startswith(f"{out2 / 'README.md'}: differential_privacy.vocabulary is ")


def test_a_noise_secret_never_reaches_a_release(base: Path, hf_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    run = _make_run(tmp_path, hf_model_dir, ledger=plan_ledger())
    (run / "hf" / "noise_secret").write_text("{}")
    with pytest.raises(ValueError, match="noise_secret: a noise secret is in the model folder"):
        export_run(run, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    out = shutil.copytree(base, tmp_path / "leaked")
    (out / "noise_secret").write_text("{}")
    assert _problems(out) == (f"{out / 'noise_secret'}: a noise secret is in the release; it must never be published",)


# ---- fine-tuning releases: the task ledger is rebuilt from the fine-tuning config


@pytest.fixture(scope="module")
def finetuned(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A release as `dpbert finetune --dp` writes it: the source's pretraining guarantee copied, a
    task guarantee from `plan_dp`, the fine-tuning config as the recipe."""
    from dpbert.config.finetune import load_config, plan_dp
    from dpbert.release.metadata import guarantees_from_json

    config = load_config(None, ["dp=true", "privacy.accountant=rdp", "private.batch_size=200", "private.epochs=4"])
    plan = plan_dp(800, config)
    source = json.loads((base / "privacy.json").read_text())
    meta = ReleaseMetadata(
        guarantees=(
            *guarantees_from_json(source, "source"),
            Guarantee.from_ledger(
                scope="fine-tuning (sst2)",
                data="GLUE SST-2 training set (800 examples)",
                ledger=plan.ledger.to_dict(),
                randomness={"source": "os-csprng"},
            ),
        ),
        vocabulary_origin=source["vocabulary"]["origin"],
        vocabulary_covered=True,
        vocabulary_learned_from_private_data=False,
        recipe_name="finetune.yaml",
        recipe_content=yaml.safe_dump(dataclasses.asdict(config), sort_keys=False),
    )
    info = dataclasses.replace(INFO, template="bert_glue.md.j2", pipeline_tag="text-classification")
    return write_release(tmp_path_factory.mktemp("ft") / "model", model=base, meta=meta, info=info)


def test_a_fine_tuning_release_rebuilds_its_task_ledger_and_says_what_it_did_not(finetuned: Path) -> None:
    result = verify_folder(finetuned)
    assert result.ok and result.status == "private", result.summary()
    assert [(c.scope, c.rebuilt) for c in result.checks] == [("pretraining", False), ("fine-tuning (sst2)", True)]
    assert result.not_checked[0] == (
        "pretraining: this fine-tuned release carries its fine-tuning recipe only; the pretraining ledger was copied "
        "from the source checkpoint, whose own release carries its recipe"
    )
    assert "not checked: pretraining: this fine-tuned release" in result.summary()
    text = (finetuned / "README.md").read_text()
    assert "### What is treated as public" in text and "Randomness (fine-tuning (sst2))" in text


def test_a_fine_tuning_ledger_that_its_config_does_not_give_is_caught(finetuned: Path, tmp_path: Path) -> None:
    meta = metadata_from_json(json.loads((finetuned / "privacy.json").read_text()), "privacy.json")
    pretraining, task = meta.guarantees
    ledger = copy.deepcopy(dict(task.ledger))
    sigma = ledger["stages"][0]["noise_multiplier"]
    ledger["stages"][0]["noise_multiplier"] = 2 * sigma
    edited = dataclasses.replace(
        meta,
        guarantees=(
            pretraining,
            Guarantee.from_ledger(scope=task.scope, data=task.data, ledger=ledger, randomness=task.randomness),
        ),
    )
    info = dataclasses.replace(INFO, template="bert_glue.md.j2", pipeline_tag="text-classification")
    out = write_release(tmp_path / "r", model=finetuned, meta=edited, info=info)
    assert _problems(out) == (
        f"{out / 'privacy.json'}: guarantees[1].ledger.stages[0].noise_multiplier: {2 * sigma:.6g} in the ledger, "
        f"{sigma:.6g} rebuilt from the recipe",
    )


# ---- the unit: sequences per document, counted by the token store


def test_the_token_store_counts_sequences_per_document_and_the_card_states_them(
    hf_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    from dpbert.data.store import prepare_store, read_manifest

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # "the" is one token of the public vocabulary; at seq_len 16 a sequence holds 14 of them.
    for i, n in enumerate([5, 14, 15, 42, 43]):  # 1, 1, 2, 3 and 4 sequences
        (corpus / f"doc{i}.txt").write_text(" ".join(["the"] * n))
    store = tmp_path / "store"
    prepare_store(store, corpus=str(corpus), tokenizer="public", seq_len=16, eval_fraction=0.0, num_proc=1)
    train = read_manifest(store).splits["train"]
    assert (train.num_documents, train.num_examples) == (5, 11)
    assert train.max_sequences_per_document == 4 and train.mean_sequences_per_document == pytest.approx(11 / 5)

    raw = {**RECIPE, "data": {"corpus": str(corpus), "store": str(store), "seq_len": 16}}
    run = _make_run(tmp_path, hf_model_dir, ledger=plan_ledger(recipe_text(raw)), recipe=recipe_text(raw))
    shutil.rmtree(run / "store")  # the recipe's store is the real one
    out = export_run(run, tmp_path / "release")
    unit = json.loads((out / "privacy.json").read_text())["guarantees"][0]["unit"]
    from dpbert.privacy.accounting import PrivacyLedger, group_epsilon

    ledger = json.loads((out / "privacy.json").read_text())["guarantees"][0]["ledger"]
    whole = group_epsilon(PrivacyLedger.from_dict(ledger), 4)  # the largest document: 4 sequences
    assert unit == {
        "sequence_tokens": 16,
        "documents": 5,
        "max_sequences_per_document": 4,
        "mean_sequences_per_document": pytest.approx(2.2),
        "document_group_epsilon": whole,
    }
    assert (
        "| privacy unit | one sequence of 16 tokens; a document of this corpus has up to 4 sequences "
        f"(mean 2.2); a whole document of 4 sequences is protected only at epsilon = {whole:.4g} (group "
        "privacy, computed by dp_accounting as a mixture of Gaussians, same delta) |"
    ) in (out / "README.md").read_text()
    assert verify_folder(out).ok
    # A stated group privacy that is not the accountant's is caught.
    data = json.loads((out / "privacy.json").read_text())
    data["guarantees"][0]["unit"]["document_group_epsilon"] = whole / 2
    (out / "privacy.json").write_text(json.dumps(data))
    assert any(
        "unit.document_group_epsilon" in p and "group privacy for 4 sequences gives" in p
        for p in verify_folder(out).problems
    )

    # A store written before these counts: the card says they are unknown.
    run2 = _make_run(
        tmp_path / "old",
        hf_model_dir,
        ledger=plan_ledger(),
        split={"file": "train.bin", "num_examples": 1000, "num_documents": 400, "num_tokens": 25000},
    )
    out2 = export_run(run2, tmp_path / "old_release")
    assert (
        "one sequence of 32 tokens; how many sequences a document of this corpus contributes is unknown"
        in (out2 / "README.md").read_text()
    )
