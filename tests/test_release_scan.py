"""Scan every file of a real release for what must never leave the run folder (issue 37, items 2 and 5).

A short private run (`dpbert.train.pretrain`, a synthetic corpus whose counts are distinctive numbers,
a WordPiece learned from it, 2 DP steps) writes RUN_DIR/release as `dpbert export RUN_DIR` does; the
same run is exported again with `include_private_metrics=True`. Every file of each release is read
(weights included, as bytes) and searched for:

- a path of the machine: the run folder, the pytest temporary root, the corpus and store folders, the
  home folder, dpbert's cache folder, the working directory, or any absolute path at all;
- an exact count of the private data: the store's training sequences, documents, the most and the
  mean sequences per document; and the held-out figures of the private split (accuracy, loss, the
  unigram baseline, examples and masked tokens), in every way a release writes a number.

Without the flag none of them appears; with it the held-out figures do, and the card's privacy
section says they are not covered by the guarantee. The store's counts never appear.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from tiny_run import PHRASES, SLOTS  # noqa: E402

from dpbert.release import export_run, verify_folder  # noqa: E402
from dpbert.release.metadata import local_paths  # noqa: E402

# Document lengths (in 3-phrase chunks of about 1 sequence of 32 tokens): one long document, so that
# the most sequences per document is a number of its own, and many short ones.
LONG_DOCUMENT = 7


def _write_recipe(root: Path) -> Path:
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for d in range(170):
        n = 130 if d == LONG_DOCUMENT else rng.choice([1, 2, 3, 5])
        (corpus / f"doc{d:03d}.txt").write_text(
            " ".join(rng.choice(PHRASES).format(w=rng.choice(SLOTS)) for _ in range(3 * n))
        )
    recipe = {
        "model": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64},
        "data": {
            "corpus": str(corpus),
            "store": str(root / "store"),
            "tokenizer": "train",
            "train_vocab_size": 120,
            "seq_len": 32,
            "eval_fraction": 0.1,
            "num_proc": 1,
        },
        "schedule": [{"steps": 2, "expected_batch_size": 8}],
        "privacy": {
            "enabled": True,
            "clip_norm": 1.0,
            "delta": 1.0e-4,
            "accountant": "rdp",
            "noise_multiplier": 1.0,
            "target_epsilon": 30.0,
        },
        "optimizer": {"learning_rate": 1.0e-2, "warmup_steps": 0},
        "train": {
            "microbatch_size": 8,
            "checkpoint_every": 2,
            "eval_every": 0,
            "eval_batches": 4,
            "eval_batch_size": 16,
        },
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run folder, its default release, and a release with the private held-out figures."""
    from dpbert.release import metadata
    from dpbert.train.pretrain import pretrain

    root = tmp_path_factory.mktemp("scan")
    with pytest.MonkeyPatch.context() as mp:
        # Two group sizes instead of four: the table's cost (a PLD per size) is not what is tested here.
        mp.setattr(metadata, "GROUP_SIZES", (2, 8))
        pretrain(_write_recipe(root), root / "run", progress=False, log=lambda s: None)
        private = export_run(root / "run", root / "with_private_metrics", include_private_metrics=True)
    return {"root": root, "run": root / "run", "default": root / "run" / "release", "private": private}


# ---- what to look for


def _number_forms(value: float | int) -> set[str]:
    """How a release could write `value`: as JSON/YAML do, and as the card's formats do."""
    if isinstance(value, int):
        return {str(value), f"{value:,}"}
    forms = {repr(value), f"{value:.3g}", f"{value:.4g}", f"{value:.6g}", f"{value:.4f}", f"{100 * value:.2f}"}
    return {f for f in forms if len(f.replace("0", "").replace(".", "")) >= 2}  # not "0.1", "5"


def _find_number(text: str, forms: Iterable[str]) -> list[str]:
    found = []
    for form in forms:
        if re.search(rf"(?<![\w.]){re.escape(form)}(?![\w]|\.\d)", text):
            found.append(form)
    return found


def _text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def private_figures(run: Path, store: Path) -> dict[str, dict[str, float | int]]:
    """{"store": the train split's exact counts, "held_out": the private held-out figures} of a run."""
    manifest = json.loads((store / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    store = {
        "train sequences": train["num_examples"],
        "train documents": train["num_documents"],
        "max sequences per document": train["max_sequences_per_document"],
        "mean sequences per document": train["mean_sequences_per_document"],
    }
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    last = [r for r in evals if r.get("kind") == "eval" and r.get("eval_public") is not True][-1]
    held_out = {k: v for k, v in last.items() if k.startswith("eval_") and isinstance(v, (int, float))}
    held_out = {k: v for k, v in held_out.items() if not isinstance(v, bool)}
    return {"store": store, "held_out": held_out}


def machine_paths(run: Path, root: Path) -> dict[str, str]:
    """The paths of the machine that built the release."""
    paths = {
        "run folder": str(run.resolve()),
        "pytest root": str(root.resolve().parent),
        "corpus": str((root / "corpus").resolve()),
        "store": str((root / "store").resolve()),
        "home": str(Path.home()),
        "dpbert cache": str(Path(os.environ.get("DPBERT_CACHE") or Path.home() / ".cache" / "dpbert")),
        "working directory": os.getcwd(),
    }
    return {k: v for k, v in paths.items() if len(Path(v).parts) > 1}


def scan(release: Path, figures: dict[str, dict[str, float | int]], paths: dict[str, str]) -> dict[str, list[str]]:
    """{"file: what": [found forms]} for every machine path and private figure found in any file of
    `release`. Integers below 100 are not searched (a 2-digit number is in every config)."""
    found: dict[str, list[str]] = {}
    for path in sorted(p for p in release.rglob("*") if p.is_file()):
        text = _text(path)
        for what, value in paths.items():
            if value in text or value.replace("/", "\\/") in text:
                found[f"{path.name}: {what}"] = [value]
        if not path.name.endswith(".safetensors"):
            absolute = local_paths(text)
            if absolute:
                found[f"{path.name}: absolute path"] = sorted(set(absolute))
            for group, values in figures.items():
                for what, value in values.items():
                    if isinstance(value, int) and value < 100:
                        continue
                    forms = _find_number(text, _number_forms(value))
                    if forms:
                        found[f"{path.name}: {group} {what}"] = forms
    return found


# ---- the tests


def test_a_default_release_holds_no_machine_path_and_no_private_figure(releases: dict[str, Any]) -> None:
    run, release = releases["run"], releases["default"]
    figures = private_figures(run, releases["root"] / "store")
    assert figures["store"]["train sequences"] >= 800 and figures["store"]["max sequences per document"] >= 150
    assert {"eval_mlm_accuracy", "eval_mlm_loss", "eval_unigram_accuracy", "eval_masked_tokens"} <= set(
        figures["held_out"]
    )
    assert scan(release, figures, machine_paths(run, releases["root"])) == {}
    # The run folder keeps them: the scan does find them there.
    assert scan(releases["root"] / "store", figures, {})["manifest.json: store train sequences"]
    result = verify_folder(release)
    assert result.ok and result.status == "private (except its vocabulary)", result.summary()
    data = json.loads((release / "privacy.json").read_text())
    assert data["vocabulary"]["source"] == "train" and data["vocabulary"]["learned_from_private_data"] is True
    assert data["evaluation"]["included"] is False and data["evaluation"]["values"] is None
    # dpbert's vocabulary origin marker travels with the tokenizer, hashed, with no path in it.
    assert (run / "hf" / "dpbert_vocab_origin.json").is_file()
    assert "dpbert_vocab_origin.json" in data["tokenizer"]


def test_with_include_private_metrics_the_held_out_figures_appear_labelled(releases: dict[str, Any]) -> None:
    run, release = releases["run"], releases["private"]
    figures = private_figures(run, releases["root"] / "store")
    found = scan(release, figures, machine_paths(run, releases["root"]))
    # The store's counts and the machine's paths still never appear; the held-out figures do.
    assert not [
        k for k in found if " store " in k or "path" in k or k.split(": ")[1] in machine_paths(run, releases["root"])
    ]
    for name in ("eval_mlm_accuracy", "eval_mlm_loss", "eval_unigram_accuracy", "eval_masked_tokens"):
        if figures["held_out"][name] == 0:  # a short run may score 0.0: a zero is no findable figure
            continue
        assert f"privacy.json: held_out {name}" in found, name
        assert f"README.md: held_out {name}" in found, name
    data = json.loads((release / "privacy.json").read_text())
    assert data["evaluation"]["values"] == figures["held_out"] and data["evaluation"]["included"] is True
    card = (release / "README.md").read_text()
    privacy = card.split("<!-- dpbert:begin _privacy_mlm.md.j2 -->")[1].split("<!-- dpbert:end _privacy_mlm.md.j2 -->")[
        0
    ]
    assert (
        "The figures below were computed without noise on the held-out split of the private corpus: they are "
        "**not covered by the guarantee**" in privacy
    )
    result = verify_folder(release)
    assert result.ok, result.summary()
