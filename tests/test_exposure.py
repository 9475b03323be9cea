"""`dpbert audit --kind exposure`: the exact rank and exposure (dpbert.privacy.exposure), and the audit end to end."""

import itertools
import math

import numpy as np
import pytest

from dpbert.privacy.exposure import candidate_scores, exposure, exposure_from_rank, ranks


def _brute_force(table: np.ndarray, secret: tuple[int, ...]) -> tuple[int, int]:
    """(rank, ties) by scoring every candidate in plain Python, position 0 first."""

    def score(c):
        total = 0.0
        for p, d in enumerate(c):
            total += float(table[p, d])
        return total

    own = score(secret)
    scores = [score(c) for c in itertools.product(range(10), repeat=table.shape[0])]
    return 1 + sum(s > own for s in scores), sum(s == own for s in scores) - 1


@pytest.mark.parametrize("ties", [False, True])
def test_rank_equals_brute_force(ties):
    rng = np.random.default_rng(0)
    for _ in range(20):
        # With ties: small integers, so that many candidates share a score exactly.
        table = rng.integers(-3, 1, (3, 10)).astype(float) if ties else np.log(rng.dirichlet(np.ones(10), 3))
        secrets = rng.integers(0, 10, (5, 3))
        rank, tied = ranks(table, secrets)
        expected = [_brute_force(table, tuple(s)) for s in secrets]
        assert rank.tolist() == [r for r, _ in expected] and tied.tolist() == [t for _, t in expected]
        assert np.allclose(exposure(table, secrets), np.log2(1000) - np.log2(rank))
        if ties:
            assert tied.max() > 0  # the case is exercised
    # Candidates are indexed as base-10 numbers, position 0 most significant.
    table = np.zeros((2, 10))
    table[0, 3], table[1, 7] = 1.0, 0.5
    assert candidate_scores(table)[37] == 1.5 and candidate_scores(table).argmax() == 37


def test_all_ties_give_rank_one_and_report_the_ties():
    rank, tied = ranks(np.zeros((2, 10)), np.array([[4, 2]]))
    assert rank.tolist() == [1] and tied.tolist() == [99]


def test_unseen_secret_has_the_exposure_of_a_uniform_rank():
    """A secret drawn uniformly and independently of the model's scores has a uniform rank on 1..N, whose
    mean exposure is log2 N - log2(N!)/N (about log2 e = 1.44). 4,000 random tables of 4 positions
    (N = 10^4), seed 0: the standard error of the mean is about 1.44 / sqrt(4000) = 0.023; tolerance 0.1."""
    rng = np.random.default_rng(0)
    n = 10**4
    values = []
    for _ in range(4000):
        table = rng.normal(size=(4, 10))
        values.append(exposure(table, rng.integers(0, 10, (1, 4)))[0])
    expected = math.log2(n) - math.lgamma(n + 1) / math.log(2) / n
    assert expected == pytest.approx(math.log2(math.e), abs=0.01)
    assert np.mean(values) == pytest.approx(expected, abs=0.1)


def test_a_memorized_secret_has_the_full_exposure():
    rng = np.random.default_rng(1)
    table = np.log(rng.dirichlet(np.ones(10), 6))
    secret = table.argmax(axis=1)
    assert exposure(table, secret[None, :])[0] == pytest.approx(math.log2(10**6), abs=1e-12)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="log_probs"):
        exposure(np.zeros((3, 9)), np.zeros((1, 3), int))
    with pytest.raises(ValueError, match="secrets"):
        exposure(np.zeros((3, 10)), np.zeros((1, 4), int))
    with pytest.raises(ValueError, match="secrets"):
        exposure(np.zeros((3, 10)), np.full((1, 3), 10))
    with pytest.raises(ValueError, match="rank"):
        exposure_from_rank(0, 10)


# ---------------------------------------------------------------- the secrets' tokens


def _tokenizer_dir(tmp_path, vocab):
    """A store-like folder whose tokenizer/tokenizer.json is a WordPiece over `vocab`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    (tmp_path / "tokenizer").mkdir(parents=True)
    tok.save(str(tmp_path / "tokenizer" / "tokenizer.json"))
    return tmp_path


def test_a_digit_that_is_not_one_token_is_refused_naming_the_tokenizer(tmp_path):
    from types import SimpleNamespace

    from dpbert.train.exposure_audit import secret_rows, secret_token_ids

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "my", "id", "is"]
    manifest = SimpleNamespace(tokenizer_source="toy-wordpiece", seq_len=16, pad_id=0, cls_id=2, sep_id=3)
    good = _tokenizer_dir(tmp_path / "good", [*words, *"0123456789"])
    prefix, digits = secret_token_ids(good, manifest)
    assert prefix == [5, 6, 7] and digits == list(range(8, 18))
    row = secret_rows(manifest, prefix, digits, np.array([[1, 2, 3, 4, 5, 6]]))[0]
    assert row.tolist() == [2, 5, 6, 7, 9, 10, 11, 12, 13, 14, 3, 0, 0, 0, 0, 0]

    bad = _tokenizer_dir(tmp_path / "bad", [*words, *"012345678"])  # no 9: it becomes [UNK]
    with pytest.raises(ValueError, match=r"tokenizer 'toy-wordpiece': the digit 9 is tokenized as \['\[UNK\]'\]"):
        secret_token_ids(bad, manifest)
    with pytest.raises(ValueError, match="data.seq_len"):
        secret_token_ids(good, SimpleNamespace(**{**vars(manifest), "seq_len": 10}))


def test_the_twin_is_the_recipes_reference_recipe_or_the_recipe_itself(tmp_path):
    from pathlib import Path

    from dpbert.config.recipe import load_recipe
    from dpbert.train.exposure_audit import nonprivate_twin

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
    assert nonprivate_twin(tiny, load_recipe(tiny)) == tiny.parent / "tiny_nonprivate.yaml"
    unnamed = load_recipe(tiny, ["reference.recipe=null"])
    assert nonprivate_twin(tiny, unnamed) == tiny
    copy = tmp_path / "tiny.yaml"
    copy.write_text(tiny.read_text())
    with pytest.raises(FileNotFoundError, match=r"'reference.recipe': .*tiny_nonprivate.yaml does not exist"):
        nonprivate_twin(copy, load_recipe(copy))


def test_bad_flags_are_named(tmp_path, capsys):
    from dpbert import cli
    from dpbert.train.exposure_audit import parse_repetitions

    assert parse_repetitions("16, 1,4") == (1, 4, 16)
    for bad in ("0", "1,-4", "a", "", "1.5"):
        with pytest.raises(ValueError, match="--repetitions: expected positive integers"):
            parse_repetitions(bad)
    out = str(tmp_path / "a")
    base = ["audit", _TINY, "--output-dir", out, "--kind", "exposure"]
    for argv, message in (
        ([*base, "--repetitions", "1,0"], "--repetitions: expected positive integers"),
        ([*base, "--secrets", "0"], "--secrets: expected a positive integer"),
        ([*base, "--set", "privacy.enabled=false"], "privacy.enabled"),
        ([*base, "--canaries", "10"], "--canaries: not used by --kind exposure"),
        (["audit", _TINY, "--output-dir", out, "--secrets", "3"], "--secrets: only meaningful with --kind exposure"),
        (
            [*base, "--canary-design", "rare"],
            "--canary-design: only meaningful with --kind input (got --kind exposure)",
        ),
        (
            ["audit", _TINY, "--output-dir", out, "--kind", "gradient", "--canary-design", "random"],
            "--canary-design: only meaningful with --kind input (got --kind gradient)",
        ),
    ):
        assert cli.main(argv) == 1
        assert message in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------- `dpbert audit --kind exposure` end to end

_TINY = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml")
# A very short run of the shipped recipe (its model shrunk: compilation dominates on CPU).
_SHORT = [
    "schedule=[{steps: 3, expected_batch_size: 64}]",
    "optimizer.warmup_steps=1",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "train.microbatch_size=64",
    "train.eval_batches=1",
    "train.eval_batch_size=16",
    "report.fill_mask=[]",
]


def _release(recipe, overrides, store_dir, out):
    """A release of the recipe's privacy plan on `store_dir` (a tiny BERT, the store's tokenizer, the
    recipe published with it), built as tests/test_audit.py builds one, so that `verify` rebuilds it."""
    import yaml
    from transformers import BertConfig, BertForMaskedLM

    from dpbert.config.plan import plan_recipe
    from dpbert.config.recipe import load_recipe, recipe_to_dict
    from dpbert.data.store import TokenStore
    from dpbert.release import CardInfo, Guarantee, ReleaseMetadata, write_release
    from dpbert.release.export import _published_recipe

    store = TokenStore.open(store_dir)
    model = out.parent / "hf"
    BertForMaskedLM(
        BertConfig(
            vocab_size=store.manifest.vocab_size,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
        )
    ).save_pretrained(model)
    resolved = load_recipe(recipe, overrides)
    ledger = plan_recipe(resolved, len(store)).ledger.to_dict()
    meta = ReleaseMetadata(
        guarantees=(
            Guarantee.from_ledger(scope="pretraining", data="sotu", ledger=ledger, randomness={"source": "os-csprng"}),
        ),
        vocabulary_origin="public, packaged with dpbert (bert-base-uncased-8k)",
        vocabulary_covered=True,
        vocabulary_learned_from_private_data=False,
        vocabulary_kind="packaged",
        recipe_name="recipe.yaml",
        recipe_content=_published_recipe(yaml.safe_dump(recipe_to_dict(resolved), sort_keys=False)),
    )
    info = CardInfo(model_name="tiny-dp", architecture="BERT, 1 layer", reproduce_command="dpbert pretrain r.yaml")
    return write_release(out, model=model, meta=meta, info=info, tokenizer_dir=store_dir / "tokenizer")


@pytest.mark.slow  # two real (tiny) pretraining runs: compilation dominates
def test_exposure_audit_end_to_end_and_on_a_release_that_still_verifies(tmp_path, capsys):
    import json

    from dpbert import cli
    from dpbert.config.recipe import load_recipe
    from dpbert.release import verify_folder
    from dpbert.release.card import read_front_matter, with_exposure
    from dpbert.train.audit import base_store

    overrides = [*_SHORT, f"data.store={tmp_path / 'store'}"]
    store = base_store(load_recipe(_TINY, overrides), tmp_path)
    release = _release(_TINY, overrides, store, tmp_path / "release")
    guarantees_before = json.loads((release / "privacy.json").read_text())["guarantees"]
    out = tmp_path / "exposure"
    argv = ["audit", _TINY, "--output-dir", str(out), "--kind", "exposure", "--secrets", "2"]
    argv += ["--repetitions", "1,8", "--card", str(release)]
    for s in overrides:
        argv += ["--set", s]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "non-private mean" in printed and "exposure table (measurement, not a guarantee) added" in printed

    report = json.loads((out / "audit.json").read_text())
    assert report["kind"] == "exposure" and report["audit"] is True and report["num_candidates"] == 10**6
    assert report["repetitions"] == [0, 1, 8] and report["steps"] == 3 == report["steps_nonprivate"]
    assert report["twin_recipe"].endswith("tiny_nonprivate.yaml")  # the recipe's own reference twin
    assert report["epsilon"] == pytest.approx(8.0, rel=0.01) and "unbounded privacy" in report["privacy_spent"]
    secrets = report["secrets"]
    assert len(secrets) == 6 and len({s["secret"] for s in secrets}) == 6
    assert [s["repetitions"] for s in secrets] == [0, 0, 1, 1, 8, 8]
    for s in secrets:
        for m in ("dp", "nonprivate"):
            assert 0 <= s[f"exposure_{m}"] <= math.log2(10**6)
            assert s[f"exposure_{m}"] == pytest.approx(math.log2(10**6) - math.log2(s[f"rank_{m}"]))
    assert [r["num_secrets"] for r in report["summary"]] == [2, 2, 2]
    assert report["summary"][2]["max_nonprivate"] == max(s["exposure_nonprivate"] for s in secrets[4:])

    # The planted store: the recipe's rows, then each planted secret as often as it was planted, its six
    # digits as six tokens of the store's tokenizer.
    from tokenizers import Tokenizer

    from dpbert.data.store import TokenStore

    base, planted = TokenStore.open(store), TokenStore.open(out / "store")
    assert len(planted) == len(base) + 2 * 1 + 2 * 8
    tok = Tokenizer.from_file(str(store / "tokenizer" / "tokenizer.json"))
    texts = [tok.decode(r.tolist()) for r in planted[np.arange(len(base), len(planted))]]
    expected = [f"my id is {' '.join(s['secret'])}" for s in secrets for _ in range(s["repetitions"])]
    assert texts == expected
    assert planted.manifest.source.endswith("+ 18 rows of audit secrets ('my id is d d d d d d', exposure audit)")
    # Neither audit model is releasable.
    from dpbert.release import export_run

    for run in ("run", "run_nonprivate"):
        assert json.loads((out / run / "AUDIT_RUN.json").read_text())["kind"] == "exposure"
        assert not (out / run / "release").exists()
        with pytest.raises(ValueError, match="audit"):
            export_run(out / run, tmp_path / f"release_{run}", non_private=True)

    # On the release: the guarantee is unchanged, the table is labelled, and verify accepts it.
    privacy = json.loads((release / "privacy.json").read_text())
    assert privacy["guarantees"] == guarantees_before
    entry = privacy["exposure"]
    assert entry["meaning"] == "measurement, not a guarantee" and entry["repetitions"] == [0, 1, 8]
    assert entry["summary"] == report["summary"] and entry["epsilon_audit_run"] == report["epsilon"]
    assert entry["recipe"] == "<local path: tiny.yaml>"  # no path of this machine is published
    assert read_front_matter(release / "README.md")["differential_privacy"]["exposure"] == entry
    card = (release / "README.md").read_text()
    assert "## Memorization: exposure of planted secrets (measurement, not a guarantee)" in card
    row = report["summary"][2]
    assert f"| 8 | 2 | {row['mean_dp']:.2f} | {row['max_dp']:.2f} | {row['mean_nonprivate']:.2f} |" in card
    assert "twin spent unbounded privacy (epsilon infinity) on the same data" in " ".join(card.split())
    result = verify_folder(release)
    assert result.ok, result.summary()

    # An edited exposure fails verify: in the card's table, in privacy.json (the summary no longer adds
    # up), and in both consistently with the card re-rendered (one secret's value changed).
    edited = card.replace(f"| 8 | 2 | {row['mean_dp']:.2f} |", "| 8 | 2 | 0.00 |")
    assert edited != card
    (release / "README.md").write_text(edited)
    result = verify_folder(release)
    assert not result.ok and any("exposure section differs" in p for p in result.problems)
    (release / "README.md").write_text(card)
    forged = {**entry, "summary": [{**r, "max_dp": 0.0} for r in entry["summary"]]}
    (release / "privacy.json").write_text(json.dumps({**privacy, "exposure": forged}))
    result = verify_folder(release)
    assert not result.ok and any("exposure: summary" in p for p in result.problems)
    forged = {**entry, "secrets": [{**entry["secrets"][0], "exposure_dp": 19.0}, *entry["secrets"][1:]]}
    (release / "privacy.json").write_text(json.dumps({**privacy, "exposure": forged}))
    (release / "README.md").write_text(with_exposure(card, forged))
    result = verify_folder(release)
    assert not result.ok and any("exposure: summary (repetitions 0)" in p for p in result.problems)
    (release / "privacy.json").write_text(json.dumps(privacy))
    (release / "README.md").write_text(card)
    assert verify_folder(release).ok

    # A release of another privacy plan is refused, and left as it was.
    from dpbert.release.audit_figures import add_exposure

    before = {p.name: p.read_bytes() for p in release.iterdir()}
    with pytest.raises(ValueError, match="different privacy plan"):
        add_exposure(release, {**report, "epsilon": 2 * report["epsilon"]})
    with pytest.raises(ValueError, match="add it with `add_exposure`"):
        from dpbert.release.audit_figures import add_audit

        add_audit(release, report)
    assert {p.name: p.read_bytes() for p in release.iterdir()} == before


@pytest.mark.slow  # one real (tiny) pretraining run, stopped in its loop
def test_a_stopped_audit_stops_whole(tmp_path, capsys):
    """SIGTERM during the DP run: the run checkpoints, then the audit stops (exit 1, named), training no
    twin and writing no audit.json."""
    import os
    import signal
    import threading
    import time

    from dpbert import cli
    from dpbert.train.metrics import read_metrics

    out = tmp_path / "exposure"
    metrics = out / "run" / "metrics.jsonl"
    # Thousands of steps, logged at each: the signal lands long before the end, once the loop (and its
    # SIGTERM handler) runs.
    long = [s for s in _SHORT if not s.startswith("schedule")]
    long += ["schedule=[{steps: 5000, expected_batch_size: 64}]", "train.log_every=1", f"data.store={tmp_path / 's'}"]

    def stop_once_training() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if metrics.is_file() and any(r["kind"] == "train" for r in read_metrics(metrics)):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=stop_once_training, daemon=True)
    killer.start()
    argv = ["audit", _TINY, "--output-dir", str(out), "--kind", "exposure", "--secrets", "1", "--repetitions", "2"]
    for s in long:
        argv += ["--set", s]
    assert cli.main(argv) == 1
    killer.join()
    err = capsys.readouterr().err
    assert "dpbert audit: stopped: the audit's training run" in err and "no audit.json written" in err
    steps = max(r["step"] for r in read_metrics(metrics) if r["kind"] == "train")
    assert 1 <= steps < 5000 and f"at step {steps} of 5000" in err
    assert (out / "run" / "checkpoints").is_dir() and not (out / "run_nonprivate").exists()
    assert not (out / "audit.json").exists()
