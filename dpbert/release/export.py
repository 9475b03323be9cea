"""Export a model to a Hugging Face folder with its privacy guarantee attached.

`write_release` is the reusable step (the trainer and fine-tuning call it): weights (a folder with
config.json + model.safetensors, or any object with `save_pretrained(path)`, like dpbert's Flax models),
a tokenizer folder, the `ReleaseMetadata` (guarantees with their ledgers) and a `CardInfo`. It writes

    config.json          the model config plus `differential_privacy` (private flag, epsilon per guarantee)
    model.safetensors    the weights, loadable by transformers' BertForMaskedLM / pipeline("fill-mask")
    tokenizer files      copied from the tokenizer folder (tokenizer.json, vocab.txt, ...)
    privacy.json         the full ledgers, and the sha256 of every weight file (`weights`; see
                         `dpbert.release.metadata`)
    README.md            the model card (see `dpbert.release.card`)

Guarantees: the output folder appears whole or not at all. Everything is written into a hidden
temporary sibling of `out`, which is renamed into place only after the last file is written; any
error removes the temporary folder. With `overwrite=True` an existing `out` is swapped out by rename
and deleted only after the new folder is in place. `privacy.json` records the sha256 of the weight
files exactly as written. A model folder holding a run's noise secret (`noise_secret`) is refused:
the secret never reaches a release.

`export_run` reads a pretraining run folder: RUN_DIR/hf (weights and tokenizer), RUN_DIR/privacy.json
(the ledger), RUN_DIR/randomness.json (where the noise secret came from: "os-csprng" or
"supplied-file"; a private run without it is released with randomness "unknown", which `verify`
rejects), RUN_DIR/recipe.yaml (the resolved recipe, published whole), the token store manifest
(vocabulary origin; sequence length and sequences per document of the train split, for the unit) and
RUN_DIR/metrics.jsonl (held-out evaluation; the data-dependent training figures are named but their
values are left out unless `include_diagnostics=True`). The secret itself (RUN_DIR/checkpoints/
noise_secret) is never read.
"""

from __future__ import annotations

import dataclasses
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
    Guarantee,
    ReleaseMetadata,
    count_parameters,
    noise_record,
    unit_record,
    weight_hashes,
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# Files a release writes itself; never copied from the model folder.
_RELEASE_FILES = (CARD_FILE, PRIVACY_FILE)
RANDOMNESS_FILE = "randomness.json"  # RUN_DIR/randomness.json: {"source": "os-csprng" | "supplied-file"}


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


def write_release(
    out: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str] | SavesPretrained,
    meta: ReleaseMetadata,
    info: CardInfo,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a release folder at `out` (atomically; see the module docstring) and return its path."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"{out}: already exists (pass overwrite=True / --overwrite to replace it)")
    with replace_dir(out) as tmp:
        _copy_model(model, tmp)
        _copy_tokenizer(None if tokenizer_dir is None else Path(tokenizer_dir), tmp)
        leaked = [name for name in NEVER_RELEASED if (tmp / name).exists()]
        if leaked:
            raise ValueError(f"{leaked[0]}: a noise secret was written into the release; it must never be released")
        weights = weight_hashes(tmp)
        if not weights:
            raise FileNotFoundError(f"{out}: the model wrote no weight file (expected model.safetensors or shards)")
        meta = dataclasses.replace(meta, weights=weights)
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text())
        config["differential_privacy"] = meta.config_copy()
        write_json(config_path, config)
        write_json(tmp / PRIVACY_FILE, meta.to_dict(), sort_keys=False)
        write_text(tmp / CARD_FILE, render_card(meta, info))
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


def _vocabulary(manifest: Mapping[str, Any] | None) -> tuple[str, bool, bool | None]:
    """(origin sentence, covered by the guarantee?, learned from the private corpus?) from a token
    store manifest.

    The manifest records `vocab_origin` ("public" or "trained on <corpus>"), the tokenizer's source
    and `vocab_covered_by_dp_guarantee`; an unrecorded origin counts as not covered and unknown.
    """
    if manifest is None:
        return "Its origin is not recorded (no token store manifest was found for this run)", False, None
    origin = str(manifest.get("vocab_origin", "unknown"))
    source = manifest.get("tokenizer_source")
    covered = manifest.get("vocab_covered_by_dp_guarantee") is True
    learned = True if origin.startswith("trained on") else False if origin == "public" else None
    text = f"Vocabulary origin: {origin}" + (f" (tokenizer: {source})" if source else "")
    return text, covered and learned is not True, learned


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
) -> Path:
    """Export a finished pretraining run (RUN_DIR/hf + ledger + card) to the release folder `out`.

    The ledger is RUN_DIR/privacy.json; a run without one is refused unless `non_private=True`, which
    releases it as explicitly non-private (epsilon = infinity). The tokenizer comes from RUN_DIR/hf when
    the trainer saved one there, else from `tokenizer`. `include_diagnostics=True` adds the values of
    the data-dependent training figures (labelled "Non-private diagnostics"); by default only their
    names are published.
    """
    run_dir = Path(run_dir)
    hf_dir = run_dir / "hf"
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{hf_dir / 'config.json'}: missing (the trainer writes RUN_DIR/hf at the end of a run)"
        )
    recipe_path = run_dir / "recipe.yaml"
    recipe_text = recipe_path.read_text() if recipe_path.is_file() else None
    recipe = (yaml.safe_load(recipe_text) or {}) if recipe_text else {}
    store_dir = _find_store(run_dir, recipe, None if store is None else Path(store))
    manifest = json.loads((store_dir / "manifest.json").read_text()) if store_dir is not None else None

    data = (manifest or {}).get("source") or (recipe.get("data") or {}).get("corpus") or "the training corpus"
    data_desc = str(data)
    ledger_path = run_dir / PRIVACY_FILE
    if ledger_path.is_file():
        ledger = json.loads(ledger_path.read_text())
        seq_len = (manifest or {}).get("seq_len") or (recipe.get("data") or {}).get("seq_len")
        guarantee = Guarantee.from_ledger(
            scope="pretraining",
            data=data_desc,
            ledger=ledger,
            randomness=_randomness(run_dir),
            noise=noise_record(ledger, coordinates=count_parameters(hf_dir)),
            unit=unit_record(
                sequence_tokens=seq_len, split=((manifest or {}).get("splits") or {}).get("train"), ledger=ledger
            ),
        )
    elif non_private:
        guarantee = Guarantee.non_private(scope="pretraining", data=data_desc)
    else:
        raise FileNotFoundError(
            f"{ledger_path}: missing; a release without a ledger makes no privacy claim "
            "(pass non_private=True / --non-private to release it as NOT private)"
        )

    records = _read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    evals = [r for r in records if r.get("kind") == "eval" and r.get("eval_mlm_accuracy") is not None]
    last_eval = evals[-1] if evals else {}
    diagnostic_names, diagnostic_values = _diagnostics([r for r in records if r.get("kind") == "train"])

    vocab_origin, vocab_covered, vocab_learned = _vocabulary(manifest)
    meta = ReleaseMetadata(
        guarantees=(guarantee,),
        vocabulary_origin=vocab_origin,
        vocabulary_covered=vocab_covered,
        vocabulary_learned_from_private_data=vocab_learned,
        recipe_name=recipe_path.name if recipe_text is not None else None,
        recipe_content=recipe_text,
        non_private_diagnostics=diagnostic_names,
        diagnostics=diagnostic_values if include_diagnostics else None,
    )
    config = json.loads((hf_dir / "config.json").read_text())
    info = CardInfo(
        model_name=repo_id.split("/")[-1] if repo_id else Path(out).name,
        repo_id=repo_id,
        architecture=(
            f"Architecture: BERT, {config.get('num_hidden_layers')} layers, hidden size {config.get('hidden_size')}, "
            f"{config.get('num_attention_heads')} attention heads, vocabulary {config.get('vocab_size')}, "
            f"up to {config.get('max_position_embeddings')} positions."
        ),
        reproduce_command="dpbert pretrain recipe.yaml --output-dir RUN_DIR\ndpbert export RUN_DIR OUT",
        mlm_accuracy=last_eval.get("eval_mlm_accuracy"),
        eval_dataset=f"held-out split of {data}" + (f", step {last_eval['step']}" if "step" in last_eval else ""),
        eval_metrics={k: v for k, v in last_eval.items() if k.startswith("eval_") and k != "eval_mlm_accuracy"},
    )
    has_tokenizer = any((hf_dir / name).is_file() for name in ("tokenizer.json", "vocab.txt"))
    if tokenizer is None and not has_tokenizer and store_dir is not None and (store_dir / "tokenizer").is_dir():
        tokenizer = store_dir / "tokenizer"  # where the token store saves the tokenizer it used
    return write_release(out, model=hf_dir, meta=meta, info=info, tokenizer_dir=tokenizer, overwrite=overwrite)
