"""Export a model to a Hugging Face folder with its privacy guarantee attached.

`write_release` writes config.json, the weights, the tokenizer files, privacy.json and the model
card; `export_run` exports a finished pretraining run (`dpbert export RUN_DIR OUT`).

Guarantees: the folder is written to a temporary sibling and renamed into place; a release is
refused when it would hold a noise secret or a path of the building machine; held-out figures of
the private corpus and training diagnostics are left out unless asked for, and then labelled not
covered; the card's title is the Hub repository's name, else the folder's (the run folder's for
RUN_DIR/release). What each file holds: docs/INTERNALS.md ("dpbert.release.export").
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml

from dpbert.atomic import replace_dir, write_json, write_text
from dpbert.release.card import CARD_FILE, CardInfo, render_card
from dpbert.release.metadata import (
    NEVER_RELEASED,
    PRIVACY_FILE,
    TOKENIZER_FILES,
    VOCAB_ORIGIN_FILE,
    VOCABULARY_SOURCES,
    WEIGHT_PATTERNS,
    Guarantee,
    ReleaseMetadata,
    count_parameters,
    local_paths,
    noise_record,
    packaged_vocabulary,
    redact_data,
    redact_paths,
    tokenizer_hashes,
    unit_record,
    weight_hashes,
)

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# Files a release writes itself; never copied from the model folder.
_RELEASE_FILES = (CARD_FILE, PRIVACY_FILE)
# Written by `dpbert audit` into its training runs before their first step: such a run is never exported.
AUDIT_RUN_FILE = "AUDIT_RUN.json"
RANDOMNESS_FILE = "randomness.json"  # RUN_DIR/randomness.json: {"source": "os-csprng" | "supplied-file"}
# Figures of an eval record computed with the private *training* data whatever the eval corpus: the
# unigram baseline predicts the most frequent training token.
PRIVATE_EVAL_FIGURES = ("eval_unigram_accuracy",)
_EVAL_LABELS = ("eval_public", "eval_corpus")


class SavesPretrained(Protocol):
    def save_pretrained(self, path: str | os.PathLike[str]) -> Any: ...


def _copy_model(model: str | os.PathLike[str] | SavesPretrained, dest: Path) -> None:
    if isinstance(model, (str, os.PathLike)):
        src = Path(model)
        if not (src / "config.json").is_file():
            raise FileNotFoundError(f"{src / 'config.json'}: missing (expected a Hugging Face model folder)")
        if not any((src / name).is_file() for name in _WEIGHT_FILES):
            raise FileNotFoundError(f"{src}: no weights (expected one of {', '.join(_WEIGHT_FILES)})")
        secrets = [name for name in NEVER_RELEASED if (src / name).exists()]
        if secrets:
            raise ValueError(f"{src / secrets[0]}: a noise secret is in the model folder; it must never be released")
        for item in sorted(src.iterdir()):
            # Shards of a sharded checkpoint are copied along with everything else at the top level.
            if item.is_file() and item.name not in _RELEASE_FILES:
                shutil.copy2(item, dest / item.name)
    else:
        model.save_pretrained(dest)


def _copy_tokenizer(tokenizer_dir: Path | None, dest: Path) -> None:
    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        found = [name for name in TOKENIZER_FILES if (src / name).is_file()]
        if not found:
            raise FileNotFoundError(f"{src}: no tokenizer files (expected some of {', '.join(TOKENIZER_FILES)})")
        for name in found:
            shutil.copy2(src / name, dest / name)
    if not ((dest / "tokenizer.json").is_file() or (dest / "vocab.txt").is_file()):
        raise FileNotFoundError(
            "tokenizer: neither the model folder nor the tokenizer folder has tokenizer.json or vocab.txt"
        )


def _redact_marker(folder: Path) -> None:
    """dpbert's vocabulary origin marker in `folder`, its local paths redacted (it may name the
    corpus folder the vocabulary was learned from)."""
    marker = folder / VOCAB_ORIGIN_FILE
    if not marker.is_file():
        return
    try:
        record = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(
            f"{VOCAB_ORIGIN_FILE}: not valid JSON; dpbert's vocabulary origin marker is unreadable"
        ) from None
    redacted = redact_data(record)
    if redacted != record:
        write_text(marker, json.dumps(redacted, indent=2) + "\n")


def _is_weight_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in WEIGHT_PATTERNS)


def release_local_paths(folder: str | os.PathLike[str]) -> dict[str, list[str]]:
    """{file name: absolute paths it holds} for every text file of a release folder (weights skipped)."""
    found: dict[str, list[str]] = {}
    for path in sorted(Path(folder).iterdir()):
        if not path.is_file() or _is_weight_file(path.name):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        paths = local_paths(text)
        if paths:
            found[path.name] = sorted(set(paths))
    return found


def write_release(
    out: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str] | SavesPretrained,
    meta: ReleaseMetadata,
    info: CardInfo,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    vocab_marker: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a release folder at `out` (atomically; see the module docstring) and return its path.
    `vocab_marker`: dpbert's vocabulary origin marker file to copy (its paths redacted) when neither the
    model folder nor the tokenizer folder holds one."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"{out}: already exists (pass overwrite=True / --overwrite to replace it)")
    with replace_dir(out) as tmp:
        _copy_model(model, tmp)
        _copy_tokenizer(None if tokenizer_dir is None else Path(tokenizer_dir), tmp)
        leaked = [name for name in NEVER_RELEASED if (tmp / name).exists()]
        if leaked:
            raise ValueError(f"{leaked[0]}: a noise secret was written into the release; it must never be released")
        if vocab_marker is not None and not (tmp / VOCAB_ORIGIN_FILE).exists() and Path(vocab_marker).is_file():
            shutil.copy2(vocab_marker, tmp / VOCAB_ORIGIN_FILE)
        _redact_marker(tmp)
        weights = weight_hashes(tmp)
        if not weights:
            raise FileNotFoundError(f"{out}: the model wrote no weight file (expected model.safetensors or shards)")
        meta = dataclasses.replace(meta, weights=weights, tokenizer=tokenizer_hashes(tmp))
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text())
        config["differential_privacy"] = meta.config_copy()
        write_json(config_path, config)
        write_json(tmp / PRIVACY_FILE, meta.to_dict(), sort_keys=False)
        write_text(tmp / CARD_FILE, render_card(meta, info))
        leaked_paths = release_local_paths(tmp)
        if leaked_paths:
            name, paths = next(iter(leaked_paths.items()))
            raise ValueError(
                f"{name}: holds the local path {paths[0]!r}; a release must not carry paths of the machine that "
                "built it (redact it where it comes from)"
            )
    return out


# ---- reading a pretraining run folder ----


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from a killed run
    return records


def _find_store(run_dir: Path, recipe: Mapping[str, Any], store: Path | None) -> Path | None:
    """The run's token store folder: `store` if given, else the recipe's, else RUN_DIR/store."""
    if store is not None:
        if not (store / "manifest.json").is_file():
            raise FileNotFoundError(f"{store / 'manifest.json'}: missing (expected a token store folder)")
        return store
    recipe_store = (recipe.get("data") or {}).get("store")
    for folder in ([Path(recipe_store)] if recipe_store else []) + [run_dir / "store"]:
        if (folder / "manifest.json").is_file():
            return folder
    return None


def _read_marker(*folders: Path | None) -> tuple[dict[str, Any] | None, Path | None]:
    """(dpbert's vocabulary origin marker, its file) of the first of `folders` that holds a readable one."""
    for folder in folders:
        if folder is None:
            continue
        path = Path(folder) / VOCAB_ORIGIN_FILE
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record, dict):
            return record, path
    return None, None


def _marker_kind(record: Mapping[str, Any] | None) -> str:
    """The vocabulary kind a marker (or a manifest: the same `vocab_origin`/`vocab_covered_by_dp_guarantee`
    fields) records: "packaged", "train", "dp" or "unknown"."""
    if record is None:
        return "unknown"
    for key in ("vocab_origin_kind", "source"):  # the kind dpbert.data.tokenizer.VocabularyOrigin records
        if record.get(key) in VOCABULARY_SOURCES:
            return str(record[key])
    origin = str(record.get("vocab_origin") or "")
    if origin == "public":
        return "packaged"
    if origin.startswith("trained on"):
        return "train"
    if record.get("vocab_covered_by_dp_guarantee") is True and origin:
        return "dp"
    return "unknown"


def vocabulary_record(
    recipe_data: Mapping[str, Any],
    ledger: Mapping[str, Any] | None,
    marker: Mapping[str, Any] | None,
) -> tuple[str, bool, bool, str]:
    """(origin sentence, covered by a guarantee?, learned from the private data?, kind) of a run's
    vocabulary. The kind comes from the ledger (a DP vocabulary event: "dp"), else the recipe's
    `data.tokenizer` ("train", "dp", a packaged name: "packaged"; a folder declared public with
    `data.tokenizer_declared_public`: "declared"), else dpbert's marker in the tokenizer folder (or the
    token store's record of it); nothing known is "unknown", treated as learned from the private data.
    A marker that says the vocabulary was learned from the corpus overrides a public recipe name."""
    spec = recipe_data.get("tokenizer")
    declared = recipe_data.get("tokenizer_declared_public") is True
    described = packaged_vocabulary(spec)
    from_marker = _marker_kind(marker)
    if ledger is not None and ledger.get("vocabulary") is not None:
        kind = "dp"
    elif spec in ("train", "dp"):
        kind = str(spec)
    elif from_marker == "train":
        kind = "train"
    elif described is not None:
        kind = "packaged"
    elif declared:
        kind = "declared"
    else:
        kind = from_marker
    if kind == "packaged":
        origin = (
            f"Vocabulary origin: public, packaged with dpbert ({spec}: {described})"
            if described is not None
            else "Vocabulary origin: public (a tokenizer folder whose dpbert marker records a vocabulary packaged with "
            "dpbert)"
        )
        return origin, True, False, kind
    if kind == "declared":
        return (
            "Vocabulary origin: a tokenizer folder declared public by the user (`data.tokenizer_declared_public: "
            "true` in the recipe)",
            True,
            False,
            kind,
        )
    if kind == "dp":
        if ledger is not None and ledger.get("vocabulary") is not None:
            return (
                "Vocabulary origin: learned from the private training corpus under differential privacy "
                "(`data.tokenizer: dp`), its event in the pretraining ledger",
                True,
                True,
                kind,
            )
        return (
            "Vocabulary origin: learned under differential privacy in a run whose ledger is not part of this "
            "release, so NOT covered by this release's guarantee",
            False,
            True,
            kind,
        )
    if kind == "train":
        return (
            "Vocabulary origin: a WordPiece learned from the private training corpus without privacy "
            "(`data.tokenizer: train`)",
            False,
            True,
            kind,
        )
    return (
        "Vocabulary origin: not recorded (no dpbert marker, not declared public), so it is treated as learned from "
        "the private corpus without privacy",
        False,
        True,
        "unknown",
    )


def _randomness(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/randomness.json as recorded by the trainer; {"source": "unknown"} when absent or unreadable."""
    path = run_dir / RANDOMNESS_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"source": "unknown", "note": f"{RANDOMNESS_FILE} missing or unreadable in the run folder"}
    if not isinstance(record, dict) or not isinstance(record.get("source"), str):
        return {"source": "unknown", "note": f"{RANDOMNESS_FILE} does not name a source"}
    return {"source": record["source"]}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _diagnostics(train: list[dict[str, Any]]) -> tuple[tuple[str, ...], dict[str, Any] | None]:
    """(names, values) of the data-dependent figures of the train records: realized batch size,
    examples/s, step time and every `nonprivate_diagnostics` entry (loss, clipped fraction, ...)."""
    rows = []
    for r in train:
        row = {k: _number(r.get(k)) for k in ("realized_batch_size", "examples_per_s", "step_time_s")}
        row.update({k: _number(v) for k, v in (r.get("nonprivate_diagnostics") or {}).items()})
        rows.append({k: v for k, v in row.items() if v is not None})
    names = tuple(sorted({k for row in rows for k in row}))
    if not rows:
        return names, None
    mean = {k: sum(row[k] for row in rows if k in row) / sum(1 for row in rows if k in row) for k in names}
    last = {"step": train[-1].get("step"), **rows[-1]}
    return names, {"records": len(rows), "mean": mean, "last": last}


def _figures(record: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in record.items() if k.startswith("eval_") and k not in _EVAL_LABELS and _number(v) is not None
    }


def evaluation_record(
    records: list[dict[str, Any]], *, include_private_metrics: bool
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the release's `evaluation` entry, the figures it publishes) from the eval records of
    metrics.jsonl. The last record on a public evaluation corpus (`eval_public: true`) is published,
    labelled with its `eval_corpus`, without the unigram baseline unless asked; else the last record
    on the private held-out split is named, and published only with `include_private_metrics`."""
    evals = [r for r in records if r.get("kind") == "eval" and r.get("eval_mlm_accuracy") is not None]
    public = [r for r in evals if r.get("eval_public") is True and r.get("eval_corpus")]
    if public:
        last = public[-1]
        figures = _figures(last)
        left_out = [k for k in PRIVATE_EVAL_FIGURES if k in figures and not include_private_metrics]
        figures = {k: v for k, v in figures.items() if k not in left_out}
        record = {
            "corpus": redact_paths(str(last["eval_corpus"])),
            "public": True,
            "step": last.get("step"),
            "included": True,
            "values": figures,
            "not_covered": [k for k in PRIVATE_EVAL_FIGURES if k in figures],
        }
        return record, figures
    if not evals:
        return None, {}
    last = evals[-1]
    figures = _figures(last)
    record = {
        "corpus": None,
        "public": False,
        "step": last.get("step"),
        "included": include_private_metrics,
        "values": figures if include_private_metrics else None,
        "not_covered": sorted(figures),
    }
    return record, figures if include_private_metrics else {}


def _published_recipe(text: str | None) -> str | None:
    """The recipe as published: the run's recipe.yaml, with every local path (data.corpus, data.store,
    a tokenizer folder) redacted; verbatim when it holds none."""
    if text is None or not local_paths(text):
        return text
    return yaml.safe_dump(redact_data(yaml.safe_load(text) or {}), sort_keys=False)


def _model_name(repo_id: str | None, out: Path, run_dir: Path) -> str:
    """The card's title: the Hub repository's name, else the release folder's, else (for the
    default RUN_DIR/release) the run folder's, as "dpbert-NAME"."""
    if repo_id:
        return repo_id.split("/")[-1]
    name = out.resolve().name
    return f"dpbert-{run_dir.resolve().name}" if name == "release" else name


def export_run(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    store: str | os.PathLike[str] | None = None,
    repo_id: str | None = None,
    non_private: bool = False,
    overwrite: bool = False,
    include_diagnostics: bool = False,
    include_private_metrics: bool = False,
) -> Path:
    """Export a finished pretraining run (RUN_DIR/hf + ledger + card) to the release folder `out`.

    The ledger is RUN_DIR/privacy.json; a run without one is refused unless `non_private=True`, which
    releases it as explicitly non-private (epsilon = infinity). The tokenizer comes from RUN_DIR/hf when
    the trainer saved one there, else from `tokenizer`. `include_diagnostics=True` adds the values of
    the data-dependent training figures (labelled "Non-private diagnostics"); by default only their
    names are published. `include_private_metrics=True` adds the held-out figures computed on the
    private corpus (card model-index, evaluation table, privacy.json `evaluation`), and the card's
    privacy section then says they are not covered by the guarantee; by default they stay in the run
    folder. Figures on a public evaluation corpus are always released.

    Args:
      run_dir: the finished run folder; out: the release folder (refused if it exists, unless
        `overwrite`); tokenizer, store: where the vocabulary comes from when RUN_DIR/hf has none;
      repo_id: the Hub id the card names.
    Returns:
      `out`, written whole (temporary sibling, then rename) and verified.
    """
    run_dir = Path(run_dir)
    if (run_dir / AUDIT_RUN_FILE).is_file():
        raise ValueError(
            f"{run_dir / AUDIT_RUN_FILE}: {run_dir} is an audit run (`dpbert audit`); audit models are never released"
        )
    hf_dir = run_dir / "hf"
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{hf_dir / 'config.json'}: missing (the trainer writes RUN_DIR/hf at the end of a run)"
        )
    recipe_path = run_dir / "recipe.yaml"
    recipe_text = recipe_path.read_text() if recipe_path.is_file() else None
    recipe = (yaml.safe_load(recipe_text) or {}) if recipe_text else {}
    recipe_data = recipe.get("data") or {}
    store_dir = _find_store(run_dir, recipe, None if store is None else Path(store))
    manifest = json.loads((store_dir / "manifest.json").read_text()) if store_dir is not None else None

    data = (manifest or {}).get("source") or recipe_data.get("corpus") or "the training corpus"
    data_desc = redact_paths(str(data))
    ledger_path = run_dir / PRIVACY_FILE
    ledger = None
    if ledger_path.is_file():
        ledger = json.loads(ledger_path.read_text())
        seq_len = (manifest or {}).get("seq_len") or recipe_data.get("seq_len")
        guarantee = Guarantee.from_ledger(
            scope="pretraining",
            data=data_desc,
            ledger=ledger,
            randomness=_randomness(run_dir),
            noise=noise_record(ledger, coordinates=count_parameters(hf_dir)),
            unit=unit_record(sequence_tokens=seq_len, ledger=ledger),
        )
    elif non_private:
        guarantee = Guarantee.non_private(scope="pretraining", data=data_desc)
    else:
        raise FileNotFoundError(
            f"{ledger_path}: missing; a release without a ledger makes no privacy claim "
            "(pass non_private=True / --non-private to release it as NOT private)"
        )

    records = _read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    evaluation, figures = evaluation_record(records, include_private_metrics=include_private_metrics)
    diagnostic_names, diagnostic_values = _diagnostics([r for r in records if r.get("kind") == "train"])

    has_tokenizer = any((hf_dir / name).is_file() for name in ("tokenizer.json", "vocab.txt"))
    if tokenizer is None and not has_tokenizer and store_dir is not None and (store_dir / "tokenizer").is_dir():
        tokenizer = store_dir / "tokenizer"  # where the token store saves the tokenizer it used
    marker, marker_file = _read_marker(
        Path(tokenizer) if tokenizer is not None else hf_dir,
        None if store_dir is None else store_dir / "tokenizer",
    )
    if marker is None and manifest is not None and "vocab_origin" in manifest:
        marker = {k: manifest.get(k) for k in ("vocab_origin", "vocab_origin_kind", "vocab_covered_by_dp_guarantee")}
    vocab_origin, vocab_covered, vocab_learned, vocab_kind = vocabulary_record(recipe_data, ledger, marker)
    meta = ReleaseMetadata(
        guarantees=(guarantee,),
        vocabulary_origin=vocab_origin,
        vocabulary_covered=vocab_covered,
        vocabulary_learned_from_private_data=vocab_learned,
        vocabulary_kind=vocab_kind,
        recipe_name=recipe_path.name if recipe_text is not None else None,
        recipe_content=_published_recipe(recipe_text),
        non_private_diagnostics=diagnostic_names,
        diagnostics=diagnostic_values if include_diagnostics else None,
        evaluation=evaluation,
    )
    config = json.loads((hf_dir / "config.json").read_text())
    step = "" if evaluation is None or evaluation.get("step") is None else f", step {evaluation['step']}"
    if evaluation is not None and evaluation["public"]:
        eval_dataset = f"{evaluation['corpus']} (public evaluation corpus){step}"
    else:
        eval_dataset = f"held-out split of {data_desc}{step}; private data, not covered by the guarantee"
    info = CardInfo(
        model_name=_model_name(repo_id, Path(out), run_dir),
        repo_id=repo_id,
        architecture=(
            f"Architecture: BERT, {config.get('num_hidden_layers')} layers, hidden size {config.get('hidden_size')}, "
            f"{config.get('num_attention_heads')} attention heads, vocabulary {config.get('vocab_size')}, "
            f"up to {config.get('max_position_embeddings')} positions."
        ),
        reproduce_command="dpbert pretrain recipe.yaml --output-dir RUN_DIR\ndpbert export RUN_DIR OUT",
        mlm_accuracy=figures.get("eval_mlm_accuracy"),
        eval_dataset=eval_dataset,
        eval_metrics={k: v for k, v in figures.items() if k != "eval_mlm_accuracy"},
    )
    return write_release(
        out,
        model=hf_dir,
        meta=meta,
        info=info,
        tokenizer_dir=tokenizer,
        overwrite=overwrite,
        vocab_marker=marker_file,
    )
