"""Packing tokenized documents into fixed-length BERT examples, and the tokenizing workers.

Layout of one example (length `seq_len`)::

    [CLS] t_1 ... t_k [SEP] [PAD] ... [PAD]        with k <= seq_len - 2

A document's tokens are cut, in order, into consecutive windows of `seq_len - 2` tokens; each
window becomes one example, so consecutive sentences and paragraphs of a document share an
example, every token of the document appears exactly once, and only the document's last example
carries padding. Guarantee: an example never holds tokens of two documents.

This module imports only numpy and (inside the workers) `tokenizers`, so that worker processes
started with "spawn" come up fast and never import jax or transformers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import tokenizers

# Set in each worker by `init_worker`; the in-process path passes a `Packer` explicitly.
_WORKER: Packer | None = None


def pack_document(
    token_ids: Sequence[int] | np.ndarray, *, seq_len: int, cls_id: int, sep_id: int, pad_id: int
) -> np.ndarray:
    """Pack one document's token ids (no special tokens) into int32 examples [n, seq_len].

    n = ceil(len(token_ids) / (seq_len - 2)); a document without tokens gives n = 0.
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 to hold [CLS], one token and [SEP]; got {seq_len}")
    tokens = np.asarray(token_ids, dtype=np.int32)
    body = seq_len - 2
    n = -(-tokens.size // body)
    out = np.full((n, seq_len), pad_id, dtype=np.int32)
    if n == 0:
        return out
    padded = np.full(n * body, pad_id, dtype=np.int32)
    padded[: tokens.size] = tokens
    out[:, 0] = cls_id
    out[:, 1 : body + 1] = padded.reshape(n, body)
    out[:, body + 1] = sep_id
    # The last window may be short: its [SEP] follows its last real token.
    last = tokens.size - (n - 1) * body
    out[-1, last + 1] = sep_id
    out[-1, last + 2 :] = pad_id
    return out


class Packer:
    """Tokenizes a batch of documents with a fast (Rust) tokenizer and packs each one.

    Built from the tokenizer's JSON so it can be shipped to worker processes; truncation and
    padding that a tokenizer.json may carry are switched off (a document is tokenized whole).
    """

    def __init__(self, tokenizer_json: str, *, seq_len: int, cls_id: int, sep_id: int, pad_id: int) -> None:
        self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._ids = dict(seq_len=seq_len, cls_id=cls_id, sep_id=sep_id, pad_id=pad_id)

    def __call__(self, documents: Sequence[str]) -> list[np.ndarray]:
        """Examples [n_i, seq_len] for each document, in input order."""
        encodings = self._tokenizer.encode_batch(list(documents), add_special_tokens=False)
        return [pack_document(enc.ids, **self._ids) for enc in encodings]


def init_worker(tokenizer_json: str, seq_len: int, cls_id: int, sep_id: int, pad_id: int) -> None:
    """Pool initializer: one Packer per process, single-threaded (the processes are the parallelism)."""
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = Packer(tokenizer_json, seq_len=seq_len, cls_id=cls_id, sep_id=sep_id, pad_id=pad_id)


def pack_in_worker(documents: Sequence[str]) -> list[np.ndarray]:
    """Pool task: tokenize and pack one chunk of documents with this process's Packer."""
    if _WORKER is None:
        raise RuntimeError("pack_in_worker runs only in a pool started with init_worker")
    return _WORKER(documents)
