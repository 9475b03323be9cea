"""`verify` proves a release matches the recipe it carries, its weights, its tokenizer and its own copies.

Each tampered release below stays internally consistent: epsilon is recomputed after the edit and
written everywhere (privacy.json, card front matter and body, config.json) by `write_release`, so only
the checks that rebuild the ledger from the recipe, hash the weights and the tokenizer, render the
card's guarantee sections again or inspect the ledger itself can catch it. Every failure is asserted
with its exact message.
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
    no_recipe,
    plan_ledger,
    recipe_text,
)

_KEEP = object()

INFO = CardInfo(model_name="tiny-dp", architecture="tiny BERT", reproduce_command="dpbert pretrain recipe.yaml")


@pytest.fixture(scope="module")
def base(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """A genuine release of the calibrated two-stage recipe of test_release (N = 1000, rounded)."""
    root = tmp_path_factory.mktemp("base")
    out = export_run(_make_run(root, hf_model_dir, ledger=plan_ledger()), root / "release")
    result = verify_folder(out)
    assert result.ok and result.checks[0].rebuilt, result.summary()
    return out


def _rewrite(folder: Path, out: Path, *, edit=None, recipe=_KEEP, unit=None, **changes) -> Path:
    """A consistent copy of the release `folder` at `out`: its ledger edited by `edit(ledger)`, its
    recipe replaced (None: removed), its unit replaced and/or other metadata `changes`, epsilon
    recomputed, everything (privacy.json with the recipe's sha256, the card's front matter and body,
    config.json, the weights' and the tokenizer's hashes) written again by `write_release`. The
    group-privacy table (a minute of accounting per ledger) is dropped unless `unit` gives one."""
    meta = metadata_from_json(json.loads((folder / "privacy.json").read_text()), "privacy.json")
    (g,) = meta.guarantees
    ledger = copy.deepcopy(dict(g.ledger))
    if edit is not None:
        edit(ledger)
    if unit is None:
        unit = {k: v for k, v in (g.unit or {}).items() if k != "group_epsilon"}
    g = Guarantee.from_ledger(
        scope=g.scope,
        data=g.data,
        ledger=ledger,
        randomness=g.randomness,
        unit=unit or None,
        noise=noise_record(ledger, coordinates=(g.noise or {}).get("coordinates")),
    )
    meta = dataclasses.replace(
        meta, guarantees=(g,), recipe_content=meta.recipe_content if recipe is _KEEP else recipe, **changes
    )
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
        ledger["dataset_size_bound"] *= 10
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
    from dpbert.config.plan import plan_recipe
    from dpbert.config.recipe import load_recipe_dict

    ledger = plan_recipe(load_recipe_dict(raw)).ledger.to_dict()
    release = export_run(_make_run(tmp_path, hf_model_dir, ledger=ledger, recipe=text), tmp_path / "genuine")
    result = verify_folder(release)
    assert result.ok and result.checks[0].rebuilt, result.summary()

    def inflate(ledger: dict) -> None:
        ledger["dataset_size"] = 10_000
        ledger["dataset_size_bound"] = 12_500
        for stage in ledger["stages"]:
            stage["sampling_rate"] = stage["expected_batch_size"] / 10_000

    out = _rewrite(release, tmp_path / "r", edit=inflate)
    # The forged N is named against the recipe's declaration.
    assert _problems(out) == (
        f"{out / 'privacy.json'}: ledger.dataset_size: 10000 but recipe.content declares privacy.dataset_size 1000",
    )


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
    line = "  published in `privacy.json` (`recipe.content`, sha256 `{}...`). Its seed"
    assert _problems(stale) == (
        f"{stale / 'privacy.json'}: recipe.sha256: {old!r} but recipe.content hashes to {new!r}",
        f"{stale / 'privacy.json'}: guarantees[0].ledger.clip_norm: 1 in the ledger, 2 rebuilt from the recipe",
        # the card states the sha256 of the recipe it was written with
        f"{stale / 'README.md'}: body (_privacy_mlm.md.j2): {line.format(old[:16])!r} differs from what "
        f"privacy.json states: {line.format(new[:16])!r}",
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
    train = recipe_text({**RECIPE, "data": {**RECIPE["data"], "tokenizer": "train"}})
    run = _make_run(tmp_path, hf_model_dir, ledger=plan_ledger(train), vocab_origin="trained on sotu", recipe=train)
    out = export_run(run, tmp_path / "out")
    assert json.loads((out / "privacy.json").read_text())["vocabulary"]["source"] == "train"
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


# ---- the unit: public figures only, never a count of the store


def test_the_unit_states_public_figures_only(hf_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
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

    raw = {**RECIPE, "data": {"corpus": str(corpus), "store": str(store), "seq_len": 16}}
    run = _make_run(tmp_path, hf_model_dir, ledger=plan_ledger(recipe_text(raw)), recipe=recipe_text(raw))
    shutil.rmtree(run / "store")  # the recipe's store is the real one
    out = export_run(run, tmp_path / "release")
    data = json.loads((out / "privacy.json").read_text())
    (g,) = data["guarantees"]
    # The store's counts (5 documents, 11 sequences, at most 4 and 2.2 on average per document) are not
    # published: the group table is for public sizes.
    assert sorted(g["unit"]) == ["group_epsilon", "sequence_tokens"] and g["unit"]["sequence_tokens"] == 16
    assert [row["sequences"] for row in g["unit"]["group_epsilon"]] == [2, 8, 32, 128]
    card = (out / "README.md").read_text()
    assert "a document of this corpus has up to" not in card and "(mean 2.2)" not in card
    # Nor the machine's paths: the published recipe and the data's description name the folders only.
    assert str(tmp_path) not in json.dumps(data) + card
    published = yaml.safe_load(data["recipe"]["content"])["data"]
    assert (published["corpus"], published["store"]) == ("<local path: corpus>", "<local path: store>")
    result = verify_folder(out)
    assert result.ok and result.checks[0].rebuilt, result.summary()

    # A unit that publishes a count of the store is refused.
    forged = shutil.copytree(out, tmp_path / "counts")
    data["guarantees"][0]["unit"].update(documents=5, mean_sequences_per_document=2.2)
    (forged / "privacy.json").write_text(json.dumps(data))
    where = f"{forged / 'privacy.json'}: guarantees[0].unit"
    tail = (
        ": a figure of the private data is published (a release states only public figures: N, its bound, the "
        "declared cap on sequences per document, the sequence length)"
    )
    assert _problems(forged) == (f"{where}.documents{tail}", f"{where}.mean_sequences_per_document{tail}")

    # A group table that is not the accountant's is caught.
    data = json.loads((out / "privacy.json").read_text())
    stated = data["guarantees"][0]["unit"]["group_epsilon"][0]["epsilon"]
    data["guarantees"][0]["unit"]["group_epsilon"][0]["epsilon"] = stated / 2
    forged = shutil.copytree(out, tmp_path / "group")
    (forged / "privacy.json").write_text(json.dumps(data))
    assert _problems(forged) == (
        f"{where.replace('counts', 'group')}.group_epsilon[0]: {stated / 2:.6g} stated, group privacy for 2 "
        f"sequences gives {stated:.6g}",
    )


# ---- the forgeries of the review (issue 37, item 7): each fails with an exact message


def test_a_tokenizer_with_two_ids_swapped_is_caught_by_its_sha256(base: Path, tmp_path: Path) -> None:
    out = shutil.copytree(base, tmp_path / "r")
    vocab = out / "vocab.txt"
    recorded = hashlib.sha256(vocab.read_bytes()).hexdigest()
    tokens = vocab.read_text().splitlines()
    i, j = tokens.index("cat"), tokens.index("dog")
    tokens[i], tokens[j] = tokens[j], tokens[i]  # "cat" now reads as "dog": same file size, a loadable tokenizer
    vocab.write_text("\n".join(tokens) + "\n")
    actual = hashlib.sha256(vocab.read_bytes()).hexdigest()
    assert _problems(out) == (
        f"{out / 'privacy.json'}: tokenizer.vocab.txt: sha256 {recorded[:16]}... in privacy.json, "
        f"{actual[:16]}... for the file (the tokenizer is not the one released)",
    )


def test_a_tokenizer_json_with_two_ids_swapped_is_caught(tmp_path: Path) -> None:
    """The review's forgery on a real fast tokenizer folder: two ids swapped inside tokenizer.json."""
    from dpbert.data.tokenizer import public_vocab_subset_dir

    tokenizer = public_vocab_subset_dir(2048, cache_dir=tmp_path / "cache")
    folder = _tiny_release(tmp_path, tokenizer)
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["the"], vocab["of"] = vocab["of"], vocab["the"]
    recorded = json.loads((folder / "privacy.json").read_text())["tokenizer"]["tokenizer.json"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    actual = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    assert _problems(folder) == (
        f"{folder / 'privacy.json'}: tokenizer.tokenizer.json: sha256 {recorded[:16]}... in privacy.json, "
        f"{actual[:16]}... for the file (the tokenizer is not the one released)",
    )


def _tiny_release(tmp_path: Path, tokenizer: Path) -> Path:
    """A verified release of a random tiny BERT over the fast tokenizer folder `tokenizer`."""
    from transformers import BertConfig, BertForMaskedLM

    model = tmp_path / "model"
    BertForMaskedLM(
        BertConfig(vocab_size=2048, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(model)
    raw = {**RECIPE, "data": {**RECIPE["data"], "tokenizer": "bert-base-uncased-2k"}}
    run = _make_run(tmp_path, model, ledger=plan_ledger(recipe_text(raw)), recipe=recipe_text(raw))
    out = export_run(run, tmp_path / "release", tokenizer=tokenizer)
    result = verify_folder(out)
    assert result.ok, result.summary()
    return out


def test_a_card_body_that_claims_a_smaller_epsilon_is_caught(base: Path, tmp_path: Path) -> None:
    out = shutil.copytree(base, tmp_path / "r")
    card = out / "README.md"
    stated = json.loads((out / "privacy.json").read_text())["guarantees"][0]["epsilon"]
    text = card.read_text()
    line = next(ln for ln in text.splitlines() if "-differentially private" in ln)
    forged = line.replace(f"({stated:.4g}, ", "(1.0, ")
    assert forged != line
    card.write_text(text.replace(line, forged))  # the front matter is untouched
    assert _problems(out) == (
        f"{card}: body (_claim_mlm.md.j2): {forged!r} differs from what privacy.json states: {line!r}",
    )
    # The guarantee table, likewise.
    card.write_text(text.replace(f"| epsilon | {stated:.4g} |", "| epsilon | 1 |"))
    assert _problems(out) == (
        f"{card}: body (_privacy_mlm.md.j2): '| epsilon | 1 |' differs from what privacy.json states: "
        f"'| epsilon | {stated:.4g} |'",
    )
    # A claim added outside the sections rendered from privacy.json.
    card.write_text(
        text.replace("## How to use", "This model is (1.0, 1e-05)-differentially private.\n\n## How to use")
    )
    assert _problems(out) == (
        f"{card}: body: a privacy claim outside the sections rendered from privacy.json: "
        "'This model is (1.0, 1e-05)-differentially private.'",
    )
    # Sections removed.
    body_start = text.index("<!-- dpbert:begin _claim_mlm.md.j2 -->")
    card.write_text(text[:body_start] + "# a card without its guarantee\n")
    assert _problems(out) == (
        f"{card}: body: its guarantee sections are [] (expected ['_claim_mlm.md.j2', '_privacy_mlm.md.j2'] or "
        "['_claim_glue.md.j2', '_privacy_glue.md.j2'], each between <!-- dpbert:begin NAME --> and "
        "<!-- dpbert:end NAME -->, as `dpbert export` writes them)",
    )


def test_a_release_without_its_recipe_fails_by_rule(base: Path, tmp_path: Path) -> None:
    out = _rewrite(base, tmp_path / "r", recipe=None)  # public_inputs and the card follow: "not included"
    data = json.loads((out / "privacy.json").read_text())
    assert (
        data["recipe"] is None
        and {"input": "recipe", "value": None, "source": "not included"} in (data["public_inputs"])
    )
    assert _problems(out) == (
        f"{out / 'privacy.json'} has no recipe: a private release must publish its recipe so that the ledger can "
        "be rebuilt",
    )
    assert no_recipe(out) == _problems(out)[0]


def test_a_rounded_dataset_size_must_have_two_significant_digits(base: Path, tmp_path: Path) -> None:
    def exact(ledger: dict) -> None:  # the store's exact count, published as if rounded
        ledger["dataset_size"] = 1037
        for stage in ledger["stages"]:
            stage["sampling_rate"] = stage["expected_batch_size"] / 1037

    out = _rewrite(base, tmp_path / "r", edit=exact)
    assert _problems(out) == (
        f"{out / 'privacy.json'}: guarantees[0].ledger.dataset_size: 1037 is not a 2-significant-digit number, yet "
        "dataset_size_source is 'rounded' (the trainer rounds the count down to 2 significant digits, e.g. 1000; "
        "any other N can be the exact private count)",
    )


def test_the_vocabulary_must_be_what_the_recipe_says(base: Path, tmp_path: Path) -> None:
    train = recipe_text({**RECIPE, "data": {**RECIPE["data"], "tokenizer": "train"}})
    # A `tokenizer: train` recipe whose release calls its vocabulary packaged and public.
    out = _rewrite(base, tmp_path / "train", recipe=train)
    where = f"{out / 'privacy.json'}: vocabulary"
    assert _problems(out) == (
        f"{where}.learned_from_private_data: false, but the recipe's data.tokenizer is 'train' (a vocabulary "
        "learned from the private corpus without privacy: expected true, and no differential-privacy tags)",
        f"{where}.source: 'packaged', but the recipe's data.tokenizer is 'train' (expected 'train')",
    )
    # A vocabulary said to be learned under DP while the ledger holds no event.
    dp = recipe_text(
        {**RECIPE, "data": {**RECIPE["data"], "tokenizer": "dp", "vocab_epsilon": 1.0, "vocab_delta": 1e-6}}
    )
    out = _rewrite(
        base,
        tmp_path / "dp",
        recipe=dp,
        vocabulary_learned_from_private_data=True,
        vocabulary_kind="dp",
        vocabulary_covered=False,
    )
    problems = _problems(out)
    where = f"{out / 'privacy.json'}: vocabulary"
    assert f"{where}: the recipe's data.tokenizer is 'dp', but no ledger holds the DP vocabulary's event" in problems
    # A folder declared public by the recipe that the release calls packaged (so the card does not say
    # "declared public").
    declared = recipe_text(
        {**RECIPE, "data": {**RECIPE["data"], "tokenizer": "my-public-tokenizer", "tokenizer_declared_public": True}}
    )
    out = _rewrite(base, tmp_path / "declared", recipe=declared)
    assert _problems(out) == (
        f"{out / 'privacy.json'}: vocabulary.source: 'packaged', but the recipe declares its tokenizer folder public "
        "(data.tokenizer_declared_public: true; expected 'declared', and the card says so)",
    )
    out = _rewrite(base, tmp_path / "declared-ok", recipe=declared, vocabulary_kind="declared")
    assert verify_folder(out).ok, verify_folder(out).summary()
    assert (
        "declared public by the user (`data.tokenizer_declared_public: true` in the recipe)"
        in (out / "README.md").read_text()
    )


def test_the_total_delta_must_stay_below_one_over_n(hf_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    ledger = {
        "accountant": "pld",
        "delta": 9.99e-4,  # below 1/N = 1e-3 on its own
        "dataset_size": 1000,
        "clip_norm": 1.0,
        "stages": [
            {"steps": 20, "expected_batch_size": 64, "noise_multiplier": 1.1, "sampling_rate": 0.064,
             "physical_batch_size": 110}
        ],
        "target_epsilon": None,
        "sampling": "poisson",
        "privacy_unit": "one example sequence",
        "neighboring_relation": "add_or_remove_one",
        "dataset_size_source": "exact",
    }  # fmt: skip
    g = Guarantee.from_ledger(scope="pretraining", data="sotu", ledger=ledger, randomness={"source": "os-csprng"})
    assert 1e-6 < g.truncation_delta < 1e-2 * 9.99e-4  # truncation alone is allowed, the sum is not
    meta = ReleaseMetadata(
        guarantees=(g,), vocabulary_origin="public", vocabulary_covered=True, vocabulary_learned_from_private_data=False
    )
    out = write_release(tmp_path / "r", model=hf_model_dir, meta=meta, info=INFO)
    total = 9.99e-4 + g.truncation_delta
    assert _problems(out) == (
        f"{out / 'privacy.json'}: guarantees[0]: total delta {total:.3g} (delta 0.000999 + truncation "
        f"{g.truncation_delta:.3g} + vocabulary selection 0) is not below 1/N = 1/1000 (a delta this large allows "
        "publishing an example outright)",
    )


def test_a_public_evaluation_corpus_must_be_the_recipes(base: Path, tmp_path: Path) -> None:
    evaluation = {
        "corpus": "wikitext-103 test",
        "public": True,
        "step": 20,
        "included": True,
        "values": {"eval_mlm_accuracy": 0.5},
        "not_covered": [],
    }
    out = _rewrite(base, tmp_path / "r", evaluation=evaluation)  # the recipe names no eval corpus
    assert _problems(out) == (
        f"{out / 'privacy.json'}: evaluation.corpus: 'wikitext-103 test' is called public, but the recipe's "
        "data.eval_corpus is None",
    )
