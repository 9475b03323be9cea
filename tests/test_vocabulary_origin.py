"""A vocabulary's origin is never assumed (rule 9 of `dpbert.privacy`): packaged names are public, a folder gets the
origin dpbert recorded in it, a folder of unknown origin is refused unless the recipe declares it
public, and no origin sentence holds a machine path."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import jax
import pytest

from dpbert.data.store import TOKENIZER_DIR, prepare_store
from dpbert.data.tokenizer import (
    DECLARED_PREFIX,
    VOCAB_ORIGIN_FILE,
    load_tokenizer,
    resolve_tokenizer,
    tokenizer_file_hashes,
    train_dp_wordpiece,
    train_wordpiece,
    vocabulary_files_sha256,
    vocabulary_origin,
)
from dpbert.privacy.accounting import VocabularyEvent

TEXTS = [f"the nation and the union {i} grow strong together in congress" for i in range(12)]
LEDGER = {"accountant": "rdp", "delta": 1e-6, "dataset_size": 100, "clip_norm": 1.0, "stages": []}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(TEXTS))
    return path


def _prepare(out: Path, corpus: Path, tokenizer: str):
    return prepare_store(out, corpus=str(corpus), tokenizer=tokenizer, seq_len=16, eval_fraction=0.25, num_proc=1)


def _no_path(tmp_path: Path, *texts: str) -> None:
    for text in texts:
        assert str(tmp_path) not in text and "/" not in text, text


def _hf_export(source: Path, out: Path, ledger: dict | None) -> Path:
    """A folder as dpbert's hf/ export writes it: the tokenizer saved by transformers (no marker)
    and, for a private run, the run's ledger as privacy.json."""
    load_tokenizer(source).save_pretrained(str(out))
    assert not (out / VOCAB_ORIGIN_FILE).exists()
    if ledger is not None:
        (out / "privacy.json").write_text(json.dumps(ledger))
    return out


def test_packaged_names_and_their_copies_are_public(tmp_path: Path, corpus: Path) -> None:
    folder = Path(resolve_tokenizer("bert-base-uncased-8k", tmp_path / "cache"))
    origin = vocabulary_origin(folder)
    assert (origin.kind, origin.text, origin.covered, origin.learned_from_private_data) == (
        "packaged",
        "public",
        True,
        False,
    )
    assert origin.source == "bert-base-uncased-8k (packaged public vocabulary, 8192 tokens)"
    # Recognised by content: a copy anywhere, without any marker, is the same public list.
    copied = tmp_path / "copied"
    shutil.copytree(folder, copied)
    assert resolve_tokenizer(str(copied)) == str(copied)
    manifest = _prepare(tmp_path / "store", corpus, str(copied))
    assert (manifest.vocab_origin_kind, manifest.vocab_origin, manifest.vocab_covered_by_dp_guarantee) == (
        "packaged",
        "public",
        True,
    )
    _no_path(tmp_path, manifest.vocab_origin, manifest.tokenizer_source)
    assert resolve_tokenizer("bert-base-uncased") == "bert-base-uncased"
    assert _prepare(tmp_path / "full", corpus, "bert-base-uncased").tokenizer_source.startswith(
        "bert-base-uncased (packaged public vocabulary, 30522 tokens)"
    )


def test_an_unknown_folder_is_refused_unless_declared(tmp_path: Path, corpus: Path) -> None:
    mine = tmp_path / "my_vocab"
    train_wordpiece(TEXTS, vocab_size=80, out_dir=mine, min_frequency=1)
    for private in (True, False):
        with pytest.raises(ValueError) as err:
            resolve_tokenizer(str(mine), private=private)
        message = str(err.value)
        assert f"tokenizer folder {mine}" in message and "the origin of its vocabulary is unknown" in message
        assert "--set data.tokenizer_declared_public=true" in message and "tokenizer_declared_public: true" in message

    spec = resolve_tokenizer(str(mine), declared_public=True)
    assert spec == DECLARED_PREFIX + str(mine.resolve())
    manifest = _prepare(tmp_path / "store", corpus, spec)
    digest = vocabulary_files_sha256(mine)[:16]
    assert manifest.vocab_origin_kind == "declared" and manifest.vocab_covered_by_dp_guarantee
    assert manifest.vocab_origin == (
        "declared public by the user (data.tokenizer_declared_public: true): "
        f"folder 'my_vocab' (sha256 {digest} of its vocabulary files)"
    )
    marker = json.loads((tmp_path / "store" / TOKENIZER_DIR / VOCAB_ORIGIN_FILE).read_text())
    assert marker["vocab_origin_kind"] == "declared" and marker["learned_from_private_data"] is False
    _no_path(tmp_path, manifest.vocab_origin, manifest.tokenizer_source, json.dumps(marker))
    # The store's tokenizer folder keeps the declaration: reused, it needs no new one.
    reused = tmp_path / "store" / TOKENIZER_DIR
    assert resolve_tokenizer(str(reused)) == str(reused)
    again = _prepare(tmp_path / "store2", corpus, str(reused))
    assert (again.vocab_origin_kind, again.vocab_origin) == ("declared", manifest.vocab_origin)
    # prepare_store itself never calls an unknown folder public.
    unknown = _prepare(tmp_path / "store3", corpus, str(mine))
    assert unknown.vocab_origin_kind == "unknown" and not unknown.vocab_covered_by_dp_guarantee
    assert unknown.vocab_origin.startswith("unknown: folder 'my_vocab'")


def test_a_train_runs_vocabulary_is_never_called_public(tmp_path: Path, corpus: Path) -> None:
    manifest = _prepare(tmp_path / "store", corpus, "train")
    assert manifest.vocab_origin_kind == "train" and not manifest.vocab_covered_by_dp_guarantee
    assert manifest.vocab_origin.startswith("trained on the run's private training corpus without differential")
    _no_path(tmp_path, manifest.vocab_origin, manifest.tokenizer_source)
    folder = tmp_path / "store" / TOKENIZER_DIR
    # Its folder (dpbert's marker says train) is refused for a private run, declared or not.
    for declared in (False, True):
        with pytest.raises(ValueError, match=r"learned from a corpus without differential privacy .*tokenizer: train"):
            resolve_tokenizer(str(folder), declared_public=declared)
    # A non-private run may use it; it stays labelled as learned from the corpus, not covered.
    assert resolve_tokenizer(str(folder), private=False) == str(folder)
    again = _prepare(tmp_path / "store2", corpus, str(folder))
    assert (again.vocab_origin_kind, again.vocab_origin) == ("train", manifest.vocab_origin)
    assert not again.vocab_covered_by_dp_guarantee

    # The hf/ export of a private `tokenizer: train` run (no marker; its ledger has no vocabulary event):
    # unknown, so refused; declared, it is "declared public" and no DP vocabulary.
    hf = _hf_export(folder, tmp_path / "run" / "hf", LEDGER)
    with pytest.raises(ValueError, match=r"origin of its vocabulary is unknown.*data\.tokenizer_declared_public"):
        resolve_tokenizer(str(hf))
    declared = vocabulary_origin(hf, declared_public=True)
    assert declared.kind == "declared" and "declared public by the user" in declared.text
    assert "DP" not in declared.text and declared.learned_from_private_data is False
    store = _prepare(tmp_path / "store3", corpus, resolve_tokenizer(str(hf), declared_public=True))
    assert store.vocab_origin_kind == "declared" and store.vocab_origin == declared.text
    _no_path(tmp_path, store.vocab_origin, store.tokenizer_source)
    # An older dpbert's "public" marker (written for any folder without one) proves nothing.
    (hf / VOCAB_ORIGIN_FILE).write_text(json.dumps({"vocab_origin": "public", "vocab_covered_by_dp_guarantee": True}))
    with pytest.raises(ValueError, match="origin of its vocabulary is unknown"):
        resolve_tokenizer(str(hf))
    # A release whose privacy.json says the vocabulary was learned from the private data.
    release = _hf_export(folder, tmp_path / "run" / "release", None)
    (release / "privacy.json").write_text(
        json.dumps(
            {
                "format": "dpbert-privacy/1",
                "guarantees": [{"ledger": LEDGER}],
                "vocabulary": {"origin": "trained on sotu", "covered": False, "learned_from_private_data": True},
            }
        )
    )
    with pytest.raises(ValueError, match="learned from private data without privacy"):
        resolve_tokenizer(str(release), declared_public=True)


def test_a_dp_vocabulary_of_another_run_is_refused(tmp_path: Path) -> None:
    event = VocabularyEvent(
        noise_multiplier=0.5, words_per_unit=10, selection_delta=1e-3, epsilon_share=1.0, unit="test unit"
    )
    folder = tmp_path / "other_run" / "vocabulary"
    train_dp_wordpiece(
        TEXTS * 40, event=event, key=jax.random.key(0), vocab_size=120, out_dir=folder, window=30, origin="DP test"
    )
    origin = vocabulary_origin(folder)
    assert (origin.kind, origin.covered, origin.learned_from_private_data) == ("dp", True, None)
    for declared in (False, True):
        with pytest.raises(ValueError, match=r"under DP from another run's private data.*composed into this run's"):
            resolve_tokenizer(str(folder), declared_public=declared)
    assert resolve_tokenizer(str(folder), private=False) == str(folder)
    # Its hf/ export (no marker) says so through the ledger's vocabulary event.
    hf = _hf_export(folder, tmp_path / "other_run" / "hf", {**LEDGER, "vocabulary": {"noise_multiplier": 1.0}})
    with pytest.raises(ValueError, match="would have to be composed into this run's ledger, which dpbert does not do"):
        resolve_tokenizer(str(hf), declared_public=True)


def test_tokenizer_file_hashes(tmp_path: Path) -> None:
    event = VocabularyEvent(
        noise_multiplier=0.5, words_per_unit=10, selection_delta=1e-3, epsilon_share=1.0, unit="test unit"
    )
    folder = tmp_path / "v"
    train_dp_wordpiece(
        TEXTS * 40, event=event, key=jax.random.key(0), vocab_size=120, out_dir=folder, window=30, origin="DP test"
    )
    hashes = tokenizer_file_hashes(folder)
    assert {"tokenizer.json", "vocab.txt", "tokenizer_config.json", VOCAB_ORIGIN_FILE} <= set(hashes)
    assert set(hashes) <= {"tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"} | {
        VOCAB_ORIGIN_FILE
    }
    for name, digest in hashes.items():
        assert digest == hashlib.sha256((folder / name).read_bytes()).hexdigest()
    vocabulary = vocabulary_files_sha256(folder)
    (folder / VOCAB_ORIGIN_FILE).write_text("{}")
    assert vocabulary_files_sha256(folder) == vocabulary  # the marker is not a vocabulary file
    (folder / "vocab.txt").write_text((folder / "vocab.txt").read_text() + "extra\n")
    assert vocabulary_files_sha256(folder) != vocabulary
    assert tokenizer_file_hashes(folder)["vocab.txt"] != hashes["vocab.txt"]


def test_a_missing_folder_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data\.tokenizer: tokenizer folder .*missing does not exist"):
        resolve_tokenizer(str(tmp_path / "missing"))
