"""Token stores: packed pretraining examples on disk, memory-mapped for random access.

A store is a folder with `manifest.json`, the train and held-out token arrays, each split's
document offsets and the tokenizer the ids belong to (layout: docs/INTERNALS.md). `prepare_store`
tokenizes and packs a corpus (`dpbert.data.packing`: never spanning two documents); the held-out
split holds out whole documents.

Guarantees: the output depends only on (corpus, tokenizer, seq_len, eval_fraction, seed); a store
appears at its final path complete or not at all (built in a temporary sibling, then renamed);
the vocabulary's origin is recorded without any machine path, and a folder with no record that
was not declared public is "unknown", never "public". Its per-document counts stay in the store.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import hashlib
import json
import multiprocessing
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpbert.atomic import replace_dir
from dpbert.data import packing
from dpbert.data.corpus import Corpus, resolve_corpus

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "eval")
DOCUMENTS_SUFFIX = ".documents.npy"
PUBLIC_TOKENIZERS = ("public", "bert-base-uncased")
# Documents per worker task is set by characters, so tasks have similar cost whatever the
# document lengths; the value does not change the output, only the load balance.
_CHUNK_CHARS = 1 << 20
_CHUNK_DOCS = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitInfo:
    """One split's file and counts (tokens = non-padding tokens, [CLS]/[SEP] included).

    `max_sequences_per_document` / `mean_sequences_per_document`: the most, and the mean number of,
    examples one document of the split was packed into (mean over documents with at least one
    example); None in stores written before they were counted.
    """

    file: str
    num_examples: int
    num_documents: int
    num_tokens: int
    max_sequences_per_document: int | None = None
    mean_sequences_per_document: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_examples", "num_documents", "num_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"SplitInfo.{name} must be >= 0; got {getattr(self, name)}")
        for name in ("max_sequences_per_document", "mean_sequences_per_document"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"SplitInfo.{name} must be None or >= 0; got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreManifest:
    """The contents of manifest.json. `request` holds the inputs that `prepare_store` matches on."""

    format_version: int
    seq_len: int
    dtype: str
    vocab_size: int
    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    special_token_ids: tuple[int, ...]
    tokenizer_fingerprint: str
    tokenizer_source: str
    vocab_origin: str
    vocab_covered_by_dp_guarantee: bool
    source: str
    corpus_spec: str
    corpus_sha256: str
    num_documents: int
    eval_fraction: float
    seed: int
    splits: Mapping[str, SplitInfo]
    packing: str
    request: Mapping[str, Any]
    # One of dpbert.data.tokenizer.VOCAB_ORIGIN_KINDS; None in a store written before it was recorded
    # (its origin is then unknown).
    vocab_origin_kind: str | None = None

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"manifest format_version {self.format_version} is not supported (this dpbert reads {FORMAT_VERSION})"
            )
        if self.seq_len < 3:
            raise ValueError(f"manifest seq_len must be >= 3; got {self.seq_len}")
        if self.dtype not in ("uint16", "int32"):
            raise ValueError(f"manifest dtype must be 'uint16' or 'int32'; got {self.dtype!r}")
        if self.dtype == "uint16" and self.vocab_size > 1 << 16:
            raise ValueError(f"manifest dtype uint16 cannot hold vocab_size {self.vocab_size}")
        if set(self.splits) != set(SPLITS):
            raise ValueError(f"manifest splits must be {list(SPLITS)}; got {sorted(self.splits)}")
        for name in ("pad_id", "cls_id", "sep_id", "mask_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"manifest {name} must be in [0, {self.vocab_size}); got {getattr(self, name)}")

    def num_examples(self, split: str) -> int:
        return self.splits[split].num_examples

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["special_token_ids"] = list(self.special_token_ids)
        out["request"] = dict(self.request)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "manifest") -> StoreManifest:
        """Validate a manifest dict; errors name `where` and the offending field."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(names - set(data) - {"vocab_origin_kind"})
        if unknown or missing:
            raise ValueError(f"{where}: unknown fields {unknown}, missing fields {missing}")
        fields = dict(data)
        try:
            fields["special_token_ids"] = tuple(int(i) for i in data["special_token_ids"])
            fields["splits"] = {name: SplitInfo(**info) for name, info in data["splits"].items()}
            return cls(**fields)
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{where}: {err}") from err


def read_manifest(store_dir: str | os.PathLike[str]) -> StoreManifest:
    """Read and validate STORE/manifest.json (FileNotFoundError / ValueError naming the file)."""
    path = Path(store_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"token store {Path(store_dir)} has no {MANIFEST}: not a token store (or not finished)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"token store manifest {path} is not valid JSON: {err}") from err
    return StoreManifest.from_dict(data, where=f"token store manifest {path}")


def attention_mask(input_ids: np.ndarray, pad_id: int) -> np.ndarray:
    """1 where a token is real, 0 at [PAD] (int32, input_ids' shape)."""
    return (np.asarray(input_ids) != pad_id).astype(np.int32)


class TokenStore:
    """One split of a token store, memory-mapped; `store[indices]` reads rows by random access.

    Padding rows of a Poisson-sampled batch may use any valid index (0 is customary); the caller
    masks them with its `is_padding` vector, the store does not know about padding rows.
    """

    def __init__(self, path: Path, split: str, manifest: StoreManifest, rows: np.ndarray) -> None:
        self.path = path
        self.split = split
        self.manifest = manifest
        self._rows = rows

    @classmethod
    def open(cls, path: str | os.PathLike[str], split: str = "train", *, tokenizer: Any = None) -> TokenStore:
        """Open one split read-only.

        With `tokenizer` (a transformers tokenizer), refuse a store whose ids were made by a
        different vocabulary: ValueError naming the store and both fingerprints.
        """
        path = Path(path)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}; got {split!r}")
        manifest = read_manifest(path)
        if tokenizer is not None:
            from dpbert.data.tokenizer import tokenizer_fingerprint  # deferred: imports transformers, 4.9 s

            fingerprint = tokenizer_fingerprint(tokenizer)
            if fingerprint != manifest.tokenizer_fingerprint:
                raise ValueError(
                    f"token store {path} was made with another tokenizer: its manifest has fingerprint "
                    f"{manifest.tokenizer_fingerprint}, the given tokenizer has {fingerprint}; "
                    "prepare a new store with this tokenizer"
                )
        info = manifest.splits[split]
        file = path / info.file
        dtype = np.dtype(manifest.dtype).newbyteorder("<")
        expected = info.num_examples * manifest.seq_len * dtype.itemsize
        size = file.stat().st_size if file.is_file() else None
        if size != expected:
            raise ValueError(
                f"token store file {file} is missing or corrupted: {size} bytes, the manifest says "
                f"{info.num_examples} x {manifest.seq_len} {manifest.dtype} = {expected} bytes"
            )
        if info.num_examples == 0:
            rows = np.zeros((0, manifest.seq_len), dtype=dtype)  # mmap cannot map an empty file
        else:
            rows = np.memmap(file, dtype=dtype, mode="r", shape=(info.num_examples, manifest.seq_len))
        return cls(path, split, manifest, rows)

    def __len__(self) -> int:
        return self._rows.shape[0]

    @property
    def seq_len(self) -> int:
        return self.manifest.seq_len

    @property
    def tokenizer_dir(self) -> Path:
        """The tokenizer folder saved with the store (load it with `dpbert.data.tokenizer.load_tokenizer`)."""
        return self.path / TOKENIZER_DIR

    def __getitem__(self, indices: int | Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows at `indices` (any integer array shape S) as int32 [*S, seq_len]; IndexError if out of range."""
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"token store indices must be integers; got dtype {idx.dtype}")
        flat = idx.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(
                f"token store {self.path} ({self.split}) has {len(self)} examples; "
                f"got indices in [{flat.min()}, {flat.max()}]"
            )
        # Read each distinct row once, in file order (sequential-ish I/O, repeated padding rows free).
        unique, inverse = np.unique(flat, return_inverse=True)
        rows = np.array(self._rows[unique], dtype=np.int32)
        return rows[inverse].reshape(*idx.shape, self.seq_len)

    def attention_mask(self, input_ids: np.ndarray) -> np.ndarray:
        return attention_mask(input_ids, self.manifest.pad_id)

    def document_offsets(self) -> np.ndarray:
        """int64 [D + 1]: document d of this split is rows offsets[d] .. offsets[d+1]-1 (packing never
        puts two documents in one row). ValueError for a store written before the offsets existed."""
        file = self.path / f"{self.split}{DOCUMENTS_SUFFIX}"
        if not file.is_file():
            raise ValueError(
                f"token store {self.path} has no document offsets ({file.name}): it predates document-level "
                "DP; prepare it again (delete the folder, or point data.store at a new one)"
            )
        offsets = np.load(file)
        if (
            offsets.ndim != 1
            or offsets.size < 1
            or offsets[0] != 0
            or offsets[-1] != len(self)
            or np.any(np.diff(offsets) < 0)
        ):
            raise ValueError(f"token store file {file} is corrupted: not offsets 0 .. {len(self)} of this split's rows")
        return offsets.astype(np.int64)


def eval_document_indices(num_documents: int, eval_fraction: float, seed: int) -> frozenset[int]:
    """The held-out document indices when the corpus size is known.

    round(eval_fraction * num_documents) documents, at least 1 (when eval_fraction > 0) and at
    most num_documents - 1, drawn without replacement by a generator seeded with `seed`.
    """
    if eval_fraction == 0.0:
        return frozenset()
    if num_documents < 2:
        raise ValueError(
            f"the corpus has {num_documents} document(s): an eval split of whole documents needs at least 2 "
            "(or eval_fraction=0)"
        )
    count = min(max(1, round(eval_fraction * num_documents)), num_documents - 1)
    chosen = np.random.default_rng([seed, num_documents]).choice(num_documents, size=count, replace=False)
    return frozenset(int(i) for i in chosen)


def _is_eval_streamed(index: int, eval_fraction: float, seed: int) -> bool:
    """Per-document held-out draw for corpora of unknown size: a keyed hash, uniform in [0, 1)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8, person=b"dpbert-eval").digest()
    return int.from_bytes(digest, "little") / 2.0**64 < eval_fraction


def _eval_assigner(corpus: Corpus, eval_fraction: float, seed: int) -> Callable[[int], bool]:
    """document index -> held out? (exact count when the corpus size is known, else a per-document draw)."""
    num_documents = corpus.count_documents()
    if num_documents is None:
        return lambda index: _is_eval_streamed(index, eval_fraction, seed)
    return eval_document_indices(num_documents, eval_fraction, seed).__contains__


def train_texts(corpus: str, *, eval_fraction: float, seed: int, text_field: str = "text") -> Iterator[str]:
    """The texts of the documents `prepare_store` puts in the train split (same corpus spec, same
    held-out draw): what a vocabulary learned from the corpus may read."""
    corpus_obj = resolve_corpus(corpus, text_field=text_field)
    is_eval = _eval_assigner(corpus_obj, eval_fraction, seed)
    return (text for index, text in corpus_obj.indexed_documents() if not is_eval(index))


def _chunks(documents: Iterable[tuple[int, str]]) -> Iterator[tuple[list[int], list[str]]]:
    indices: list[int] = []
    texts: list[str] = []
    chars = 0
    for index, text in documents:
        indices.append(index)
        texts.append(text)
        chars += len(text)
        if chars >= _CHUNK_CHARS or len(texts) >= _CHUNK_DOCS:
            yield indices, texts
            indices, texts, chars = [], [], 0
    if texts:
        yield indices, texts


def _packed_chunks(
    chunks: Iterable[tuple[list[int], list[str]]], packer_args: dict[str, Any], num_proc: int
) -> Iterator[tuple[list[int], list[str], list[np.ndarray]]]:
    """Tokenize and pack chunks on `num_proc` processes, yielding results in input order."""
    if num_proc == 1:
        packer = packing.Packer(**packer_args)
        for indices, texts in chunks:
            yield indices, texts, packer(texts)
        return
    # "spawn": the caller may hold jax's threads, which a fork would copy into a deadlock. A worker
    # that fails to start breaks the executor, which raises instead of hanging.
    init_args = tuple(packer_args[k] for k in ("tokenizer_json", "seq_len", "cls_id", "sep_id", "pad_id"))
    with concurrent.futures.ProcessPoolExecutor(
        num_proc, mp_context=multiprocessing.get_context("spawn"), initializer=packing.init_worker, initargs=init_args
    ) as executor:
        pending: deque[tuple[list[int], list[str], concurrent.futures.Future[list[np.ndarray]]]] = deque()
        # At most 2 tasks in flight per process: bounded memory on corpora of any size.
        for indices, texts in chunks:
            pending.append((indices, texts, executor.submit(packing.pack_in_worker, texts)))
            if len(pending) >= 2 * num_proc:
                indices_, texts_, future = pending.popleft()
                yield indices_, texts_, future.result()
        while pending:
            indices_, texts_, future = pending.popleft()
            yield indices_, texts_, future.result()


def _write_examples(file: Any, examples: np.ndarray, dtype: np.dtype) -> None:
    """Append one document's examples to a split file (the only place store bytes are written)."""
    if examples.size:
        file.write(examples.astype(dtype).tobytes())


def _special_ids(tokenizer: Any) -> dict[str, int]:
    ids = {
        "pad_id": tokenizer.pad_token_id,
        "cls_id": tokenizer.cls_token_id,
        "sep_id": tokenizer.sep_token_id,
        "mask_id": tokenizer.mask_token_id,
    }
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} lacks {missing}: a BERT tokenizer with "
            "[PAD], [CLS], [SEP] and [MASK] is needed"
        )
    return ids


def prepare(
    corpus: Corpus,
    tokenizer: Any,
    out_dir: str | os.PathLike[str],
    *,
    seq_len: int = 128,
    eval_fraction: float = 0.02,
    seed: int = 0,
    num_proc: int = 1,
    tokenizer_source: str,
    vocab_origin: str | None = None,
    vocab_origin_kind: str = "unknown",
    request: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> StoreManifest:
    """Tokenize `corpus`, pack it into `seq_len` examples, hold out eval documents, write a store.

    tokenizer: a fast transformers tokenizer (BERT special tokens required). vocab_origin_kind: one of
    `dpbert.data.tokenizer.VOCAB_ORIGIN_KINDS` ("unknown" unless the caller knows better: then the
    vocabulary is not covered), vocab_origin its sentence (default: the kind's own words); covered by
    the guarantee only for "packaged", "declared" and "dp". An existing `out_dir` is replaced only with
    overwrite=True, and only if it is a token store. Returns the manifest written (guarantees: module
    docstring).

    num_proc > 1 tokenizes on worker processes started with "spawn" (safe next to jax's
    threads); as with any spawn-based pool, a script calling this must guard its entry point
    with ``if __name__ == "__main__":``.
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3; got {seq_len}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1); got {eval_fraction}")
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1; got {num_proc}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {tokenizer_source!r} is not a fast tokenizer (tokenizer.json); prepare needs one")
    from dpbert.data.tokenizer import (  # deferred: as in TokenStore.open
        VOCAB_ORIGIN_FILE,
        VocabularyOrigin,
        tokenizer_fingerprint,
    )

    origin = VocabularyOrigin(
        kind=vocab_origin_kind,
        text=vocab_origin or f"{vocab_origin_kind} (tokenizer {tokenizer_source})",
        source=tokenizer_source,
    )

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"token store folder {out} already exists; choose another folder or overwrite it")
    if out.exists() and not (out / MANIFEST).is_file():
        raise ValueError(f"{out} exists and is not a token store (no {MANIFEST}); refusing to replace it")
    special = _special_ids(tokenizer)
    vocab_size = len(tokenizer)
    dtype = np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")
    is_eval = _eval_assigner(corpus, eval_fraction, seed)
    packer_args = dict(
        tokenizer_json=tokenizer.backend_tokenizer.to_str(),
        seq_len=seq_len,
        cls_id=special["cls_id"],
        sep_id=special["sep_id"],
        pad_id=special["pad_id"],
    )
    covered = origin.covered

    try:
        with replace_dir(out) as partial:
            tokenizer.save_pretrained(str(partial / TOKENIZER_DIR))
            (partial / TOKENIZER_DIR / VOCAB_ORIGIN_FILE).write_text(json.dumps(origin.marker(), indent=2) + "\n")
            counts = {split: {"num_examples": 0, "num_documents": 0, "num_tokens": 0} for split in SPLITS}
            # Sequences per document, for the card's statement of what one privacy unit is.
            max_per_document = dict.fromkeys(SPLITS, 0)
            # Sequences of each document, in order: the document offsets of the split.
            per_document: dict[str, list[int]] = {split: [] for split in SPLITS}
            contributing = dict.fromkeys(SPLITS, 0)
            corpus_hash = hashlib.sha256()
            seen_documents = 0
            files = {split: open(partial / f"{split}.bin", "wb") for split in SPLITS}  # noqa: SIM115 (closed below)
            try:
                for indices, texts, packed in _packed_chunks(
                    _chunks(corpus.indexed_documents()), packer_args, num_proc
                ):
                    for index, text, examples in zip(indices, texts, packed, strict=True):
                        seen_documents += 1
                        corpus_hash.update(text.encode("utf-8", errors="replace") + b"\0")
                        split = "eval" if is_eval(index) else "train"
                        _write_examples(files[split], examples, dtype)
                        counts[split]["num_examples"] += examples.shape[0]
                        counts[split]["num_documents"] += 1
                        per_document[split].append(int(examples.shape[0]))
                        counts[split]["num_tokens"] += int(np.count_nonzero(examples != special["pad_id"]))
                        if examples.shape[0]:
                            contributing[split] += 1
                            max_per_document[split] = max(max_per_document[split], int(examples.shape[0]))
                for f in files.values():
                    f.flush()
            finally:
                for f in files.values():
                    f.close()
            if counts["train"]["num_examples"] == 0:
                raise ValueError(f"corpus {corpus.spec!r} ({corpus.location}) gave no training example")
            if eval_fraction > 0 and counts["eval"]["num_examples"] == 0:
                raise ValueError(
                    f"corpus {corpus.spec!r}: no held-out document fell in the eval split (eval_fraction={eval_fraction}, "
                    f"seed={seed}, {seen_documents} documents); raise eval_fraction or change seed"
                )
            manifest = StoreManifest(
                format_version=FORMAT_VERSION,
                seq_len=seq_len,
                dtype=str(dtype.newbyteorder("=")),
                vocab_size=vocab_size,
                special_token_ids=tuple(sorted(set(tokenizer.all_special_ids))),
                tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                tokenizer_source=tokenizer_source,
                vocab_origin=origin.text,
                vocab_origin_kind=origin.kind,
                vocab_covered_by_dp_guarantee=covered,
                source=corpus.description,
                corpus_spec=corpus.spec,
                corpus_sha256=corpus_hash.hexdigest(),
                num_documents=seen_documents,
                eval_fraction=eval_fraction,
                seed=seed,
                splits={
                    split: SplitInfo(
                        file=f"{split}.bin",
                        **counts[split],
                        max_sequences_per_document=max_per_document[split],
                        mean_sequences_per_document=(
                            counts[split]["num_examples"] / contributing[split] if contributing[split] else 0.0
                        ),
                    )
                    for split in SPLITS
                },
                packing=f"[CLS] up to {seq_len - 2} consecutive tokens of one document [SEP], then [PAD]",
                request=dict(request or {}),
                **special,
            )
            for split in SPLITS:
                offsets = np.concatenate([[0], np.cumsum(np.asarray(per_document[split], dtype=np.int64))])
                np.save(partial / f"{split}{DOCUMENTS_SUFFIX}", offsets.astype(np.int64))
            (partial / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    except OSError as err:
        reason = "the disk is full" if err.errno == errno.ENOSPC else str(err)
        raise OSError(err.errno, f"writing token store {out} failed: {reason}; nothing was left behind") from err
    return manifest


def _tokenizer_request(spec: str) -> str:
    from dpbert.data.tokenizer import DECLARED_PREFIX  # deferred: as in TokenStore.open

    if spec in PUBLIC_TOKENIZERS:
        return "public"
    if spec == "train":
        return "train"
    if spec == "dp":
        raise ValueError(
            "tokenizer 'dp': a DP vocabulary is learned by `dpbert pretrain` (it draws its noise from the run's "
            "secret and enters the run's ledger); pass the run's vocabulary/ folder here instead"
        )
    declared = spec.startswith(DECLARED_PREFIX)
    path = Path(spec[len(DECLARED_PREFIX) :] if declared else spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer folder {path} does not exist; expected a folder, 'public' or 'train'")
    return (DECLARED_PREFIX if declared else "") + str(path.resolve())


def prepare_store(
    out_dir: str | os.PathLike[str],
    *,
    corpus: str = "sotu",
    tokenizer: str = "public",
    seq_len: int = 128,
    eval_fraction: float = 0.02,
    seed: int = 0,
    train_vocab_size: int = 8192,
    num_proc: int | None = None,
    text_field: str = "text",
    overwrite: bool = False,
) -> StoreManifest:
    """Make (or reuse) the token store at `out_dir` from specs, as a recipe's data section gives them.

    corpus: a spec for `dpbert.data.corpus.resolve_corpus` ("sotu", a path, "hf:NAME[:CONFIG]").
    tokenizer: "public" (alias "bert-base-uncased": the packaged bert-base-uncased vocabulary), a
    tokenizer folder, "declared:" + a folder the user declared public (what
    `dpbert.data.tokenizer.resolve_tokenizer` returns for one), or "train": a WordPiece of
    `train_vocab_size` learned from the corpus's train documents, recorded as NOT covered by the DP
    guarantee. A folder's origin is `dpbert.data.tokenizer.vocabulary_origin`'s: packaged (by
    content), what dpbert recorded in it, declared, or "unknown" (recorded as not covered; this
    function does not refuse it: `resolve_tokenizer` does, for a recipe).
    num_proc: tokenizing processes (default: CPU count, at most 8).

    An existing store whose recorded request matches is returned as is (not rebuilt); one that
    differs raises ValueError naming the differing fields unless overwrite=True.
    """
    from dpbert.data.tokenizer import (  # deferred: as in TokenStore.open
        DECLARED_PREFIX,
        load_tokenizer,
        packaged_origin,
        public_vocab_dir,
        tokenizer_fingerprint,
        train_wordpiece,
        trained_origin,
        vocabulary_origin,
    )

    if train_vocab_size < 10:
        raise ValueError(f"train_vocab_size must be >= 10; got {train_vocab_size}")
    corpus_obj = resolve_corpus(corpus, text_field=text_field)
    tokenizer_kind = _tokenizer_request(tokenizer)
    tok = None
    if tokenizer_kind == "public":
        tok = load_tokenizer(public_vocab_dir())
        origin = packaged_origin("bert-base-uncased", len(tok))
    elif tokenizer_kind == "train":
        origin = trained_origin(corpus, train_vocab_size)
    else:
        declared = tokenizer_kind.startswith(DECLARED_PREFIX)
        folder = Path(tokenizer_kind[len(DECLARED_PREFIX) :] if declared else tokenizer_kind)
        tok = load_tokenizer(folder)
        origin = vocabulary_origin(folder, declared_public=declared)
    request = {
        "format_version": FORMAT_VERSION,
        "corpus": corpus,
        "corpus_location": corpus_obj.location,
        "corpus_listing": corpus_obj.listing_fingerprint(),
        "text_field": text_field,
        "tokenizer": tokenizer_kind,
        "tokenizer_fingerprint": tokenizer_fingerprint(tok) if tok is not None else None,
        "train_vocab_size": train_vocab_size if tokenizer_kind == "train" else None,
        "seq_len": seq_len,
        "eval_fraction": eval_fraction,
        "seed": seed,
        "vocab_origin": origin.text,
        "vocab_origin_kind": origin.kind,
    }
    out = Path(out_dir)
    if out.exists() and not overwrite:
        existing = read_manifest(out)
        differing = sorted(k for k in request if existing.request.get(k) != request[k])
        if not differing:
            return existing
        raise ValueError(
            f"token store {out} exists but was prepared differently (fields {differing}: "
            f"{ {k: existing.request.get(k) for k in differing} } vs { {k: request[k] for k in differing} }); "
            "choose another folder or overwrite it"
        )
    if num_proc is None:
        num_proc = max(1, min(8, os.cpu_count() or 1))
    if tokenizer_kind == "train":
        # Learn the vocabulary from train documents only: the eval split stays unseen.
        is_eval = _eval_assigner(corpus_obj, eval_fraction, seed)
        train_texts = (text for index, text in corpus_obj.indexed_documents() if not is_eval(index))
        with tempfile.TemporaryDirectory(
            prefix=".dpbert-vocab-", dir=out.parent if out.parent.exists() else None
        ) as tmp:
            tok = train_wordpiece(train_texts, vocab_size=train_vocab_size, out_dir=tmp)
            return prepare(
                corpus_obj,
                tok,
                out,
                seq_len=seq_len,
                eval_fraction=eval_fraction,
                seed=seed,
                num_proc=num_proc,
                tokenizer_source=origin.source,
                vocab_origin=origin.text,
                vocab_origin_kind=origin.kind,
                request=request,
                overwrite=overwrite,
            )
    return prepare(
        corpus_obj,
        tok,
        out,
        seq_len=seq_len,
        eval_fraction=eval_fraction,
        seed=seed,
        num_proc=num_proc,
        tokenizer_source=origin.source,
        vocab_origin=origin.text,
        vocab_origin_kind=origin.kind,
        request=request,
        overwrite=overwrite,
    )


def prepare_main(args: Any) -> int:
    """`dpbert prepare`: build (or reuse) a store and print its summary. The tokenizer is named as
    in a recipe's `data.tokenizer` (a public subset such as "bert-base-uncased-8k" included) and its
    origin checked as for a recipe (`resolve_tokenizer`: an unknown folder must be declared public,
    `args.tokenizer_declared_public`); the store only records a vocabulary learned from a corpus, the
    private run that uses the store refuses it."""
    from dpbert.data.tokenizer import resolve_tokenizer  # deferred: as in TokenStore.open

    start = time.perf_counter()
    manifest = prepare_store(
        args.out,
        corpus=args.corpus,
        tokenizer=resolve_tokenizer(
            args.tokenizer, declared_public=bool(getattr(args, "tokenizer_declared_public", False)), private=False
        ),
        seq_len=args.seq_len,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
        train_vocab_size=args.train_vocab_size,
        num_proc=args.num_proc,
        text_field=args.text_field,
        overwrite=args.overwrite,
    )
    train, held = manifest.splits["train"], manifest.splits["eval"]
    print(f"token store {args.out} ({time.perf_counter() - start:.1f} s)")
    print(f"  source     {manifest.source}")
    print(
        f"  tokenizer  {manifest.tokenizer_source}, vocab {manifest.vocab_size}, fingerprint {manifest.tokenizer_fingerprint[:16]}"
    )
    print(
        f"  vocabulary {manifest.vocab_origin}"
        + ("" if manifest.vocab_covered_by_dp_guarantee else " (NOT covered by the DP guarantee)")
    )
    print(
        f"  train      {train.num_examples} examples x {manifest.seq_len} tokens from {train.num_documents} documents"
    )
    print(f"  eval       {held.num_examples} examples x {manifest.seq_len} tokens from {held.num_documents} documents")
    return 0
