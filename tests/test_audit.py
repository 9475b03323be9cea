"""One-run privacy audit (Steinke, Nasr, Jagielski 2023): the bound, and the DP engine audited with it."""

import json
import math

import numpy as np
import pytest
import scipy.stats

from dpbert.privacy import audit_bounds as audit
from dpbert.privacy.randomness import SUPPLIED, RunSecret

# ---------------------------------------------------------------- the bound itself


def test_pure_dp_p_value_is_the_binomial_tail():
    # e^1 / (1 + e^1) = 0.7310586; P[Bin(10, 0.7310586) >= 9] computed by hand:
    # q^9 = exp(9 ln q) = exp(-2.8193) = 0.05963; 10 q^9 (1-q) + q^10 = 0.16037 + 0.04360 = 0.2040
    p = audit.p_value(num_canaries=100, num_guesses=10, num_correct=9, epsilon=1.0, delta=0.0)
    assert p == pytest.approx(0.2040, abs=1e-4)
    q = math.exp(1) / (1 + math.exp(1))
    assert p == pytest.approx(10 * q**9 * (1 - q) + q**10, rel=1e-12)


def test_perfect_guesser_gives_the_known_maximal_bound():
    # r correct out of r: p-value q^r = beta  =>  eps = logit(beta^(1/r)).
    for r in (10, 100, 1000):
        q = 0.05 ** (1 / r)
        expected = math.log(q / (1 - q))
        got = audit.epsilon_lower_bound(num_canaries=2 * r, num_guesses=r, num_correct=r, delta=0.0)
        assert got == pytest.approx(expected, rel=1e-7)
    # r = 100: logit(0.05^(1/100)) = 3.4930 (by hand)
    assert audit.epsilon_lower_bound(num_canaries=1000, num_guesses=100, num_correct=100, delta=0.0) == pytest.approx(
        3.4930, abs=1e-4
    )


def test_bound_is_where_the_p_value_crosses_the_significance():
    eps = audit.epsilon_lower_bound(num_canaries=1000, num_guesses=200, num_correct=170, delta=0.0)
    q = 1 / (1 + math.exp(-eps))
    assert scipy.stats.binom.sf(169, 200, q) == pytest.approx(0.05, rel=1e-6)


def test_monotone_in_correct_guesses_delta_and_confidence():
    kw = dict(num_canaries=2000, num_guesses=500)
    by_correct = [audit.epsilon_lower_bound(**kw, num_correct=v, delta=1e-5) for v in (300, 350, 400, 450, 500)]
    assert by_correct == sorted(by_correct) and by_correct[0] < by_correct[-1]
    by_delta = [audit.epsilon_lower_bound(**kw, num_correct=480, delta=d) for d in (0.0, 1e-6, 1e-5, 1e-4)]
    assert by_delta == sorted(by_delta, reverse=True) and by_delta[0] > by_delta[-1]
    by_level = [audit.epsilon_lower_bound(**kw, num_correct=480, delta=1e-5, significance=s) for s in (0.2, 0.05, 0.01)]
    assert by_level == sorted(by_level, reverse=True)


def test_delta_term_matches_theorem_3():
    # p = f(v) + 2 m delta max_i (f(v-i) - f(v)) / i, f(v) = P[Bin(r, q) >= v]; written out directly.
    m, r, v, eps, delta = 500, 60, 50, 1.5, 1e-4
    q = 1 / (1 + math.exp(-eps))
    f = lambda x: scipy.stats.binom.sf(x - 1, r, q)  # noqa: E731
    alpha = max((f(v - i) - f(v)) / i for i in range(1, v + 1))
    expected = f(v) + 2 * m * delta * alpha
    got = audit.p_value(num_canaries=m, num_guesses=r, num_correct=v, epsilon=eps, delta=delta)
    assert got == pytest.approx(expected, rel=1e-9)
    assert got > audit.p_value(num_canaries=m, num_guesses=r, num_correct=v, epsilon=eps, delta=0.0)


def test_correct_guesses_counts_top_in_and_bottom_out():
    scores = np.array([0.9, 0.1, 0.5, 0.8, 0.2, 0.3])
    included = np.array([True, False, True, False, True, False])
    # top 2: idx 0 (in, correct), 3 (out, wrong); bottom 2: idx 1 (out, correct), 4 (in, wrong)
    assert audit.correct_guesses(scores, included, k_plus=2, k_minus=2) == 2
    assert audit.correct_guesses(scores, included, k_plus=1, k_minus=1) == 2
    assert audit.correct_guesses(scores, included, k_plus=0, k_minus=0) == 0
    with pytest.raises(ValueError, match="k_plus"):
        audit.correct_guesses(scores, included, k_plus=4, k_minus=3)


def test_random_scores_give_a_bound_near_zero_and_separated_scores_a_large_one():
    rng = np.random.default_rng(0)
    included = rng.random(4000) < 0.5
    noise = audit.audit_scores(rng.normal(size=4000), included, delta=1e-6)
    assert noise.epsilon_lower_bound < 0.1
    assert noise.epsilon_lower_bound_max_over_k < 0.3
    perfect = audit.audit_scores(included.astype(float), included, delta=0.0)
    # 2048 perfect guesses at level 0.05 / num_candidates
    q = (0.05 / perfect.num_candidates) ** (1 / 2048)
    assert perfect.epsilon_lower_bound >= math.log(q / (1 - q)) - 1e-6
    assert perfect.num_correct == perfect.num_guesses


def test_guess_grid_drops_only_sizes_that_cannot_give_a_positive_bound():
    # m = 2000: the full doubling grid has 12 sizes (1..1024, 2000) = 23 candidates; at level
    # 0.05 / 23 even 8 perfect guesses reject nothing (2^-8 = 0.0039 > 0.0022), 16 do.
    grid = audit.guess_grid(2000)
    assert len(grid) == 16 and min(k + j for k, j in grid) == 16 and (2000, 0) in grid and (1000, 1000) in grid
    assert (
        audit.epsilon_lower_bound(num_canaries=2000, num_guesses=8, num_correct=8, delta=0.0, significance=0.05 / 23)
        == 0.0
    )
    assert (
        audit.epsilon_lower_bound(num_canaries=2000, num_guesses=16, num_correct=16, delta=0.0, significance=0.05 / 16)
        > 0.0
    )
    # A stricter confidence needs more guesses before any can help; a tiny audit keeps its largest size.
    assert min(k + j for k, j in audit.guess_grid(2000, confidence=0.99999)) == 32
    assert audit.guess_grid(2) == ((2, 0), (1, 1))


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="scores/included"):
        audit.audit_scores(np.zeros(3), np.zeros(4, bool), delta=0.0)
    with pytest.raises(ValueError, match="delta"):
        audit.p_value(num_canaries=10, num_guesses=5, num_correct=3, epsilon=1.0, delta=2.0)
    with pytest.raises(ValueError, match="confidence"):
        audit.audit_scores(np.zeros(3), np.zeros(3, bool), delta=0.0, confidence=1.0)


# ---------------------------------------------------------------- empirical ROC figures


def test_roc_figures_by_hand():
    # Scores 0.9 .. 0.4 with in/out = T F T T F F. ROC points (false, true positives): (0,0) (0,1) (1,1)
    # (1,2) (1,3) (2,3) (3,3); the concave majorant keeps (0,0) (0,1) (1,3) (3,3). Area with rates /3:
    # 1/3 * (1/3 + 1) / 2 + 2/3 * (1 + 1) / 2 = 8/9 (the plain AUROC, 7/9, pairs the guesses differently).
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    included = np.array([True, False, True, True, False, False])
    fp, tp = audit.roc_hull(scores, included)
    assert list(zip(fp.tolist(), tp.tolist())) == [(0, 0), (0, 1), (1, 3), (3, 3)]
    assert audit.auroc(scores, included) == pytest.approx(8 / 9, rel=1e-15)
    # At FPR 1/6 (half a false positive): halfway from (0, 1) to (1, 3), TPR 2/3; at FPR 0: 1/3.
    assert audit.tpr_at_fpr(scores, included, [0.0, 1 / 6, 1.0]).tolist() == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_roc_figures_bound_the_plain_auroc_and_know_the_extremes():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(3)
    included = rng.random(3000) < 0.5
    for shift in (0.0, 0.5, 2.0):
        scores = rng.normal(size=3000) + shift * included
        hull = audit.auroc(scores, included)
        assert roc_auc_score(included, scores) <= hull <= roc_auc_score(included, scores) + 0.02
        tprs = audit.tpr_at_fpr(scores, included, [0.001, 0.01, 0.1])
        assert np.all(np.diff(tprs) >= 0) and np.all((tprs >= 0) & (tprs <= 1))
    assert audit.auroc(included.astype(float), included) == 1.0
    assert audit.tpr_at_fpr(included.astype(float), included, 0.0).tolist() == [1.0]
    assert audit.auroc(np.zeros(3000), included) == 0.5  # one score for all: the diagonal
    with pytest.raises(ValueError, match="both in and out"):
        audit.auroc(np.zeros(4), np.ones(4, bool))
    with pytest.raises(ValueError, match="fpr"):
        audit.tpr_at_fpr(np.arange(4.0), np.array([True, False, True, False]), 1.5)


def test_empirical_figures_say_when_jax_privacy_is_absent(monkeypatch):
    from dpbert.privacy import crosscheck
    from dpbert.train.audit import AuditReport, format_table

    monkeypatch.setattr(crosscheck, "jax_privacy_version", lambda: None)
    rng = np.random.default_rng(0)
    included = rng.random(500) < 0.5
    scores = rng.normal(size=500) + included
    figures = audit.empirical_figures(scores, included, delta=1e-5)
    assert figures["jax_privacy"] == {"available": False, "note": crosscheck.MISSING}
    assert "dpbert[crosscheck]" in crosscheck.MISSING
    assert figures["auroc"] == audit.auroc(scores, included) and 0.6 < figures["auroc"] < 0.9
    assert [r["fpr"] for r in figures["tpr_at_fpr"]] == list(audit.LOW_FPRS)
    assert figures["empirical"] == audit.EMPIRICAL and "none is a privacy guarantee" in audit.EMPIRICAL
    report = AuditReport(
        kind="gradient",
        recipe="r.yaml",
        epsilon_claimed=8.0,
        delta=1e-5,
        epsilon_lower_bound=0.5,
        epsilon_lower_bound_max_over_k=0.7,
        confidence=0.95,
        num_canaries=500,
        num_included=250,
        num_guesses=64,
        num_correct=50,
        k_plus=32,
        k_minus=32,
        num_candidates=10,
        score="sum",
        date="2026-01-01T00:00:00+00:00",
        **figures,
    )
    table = format_table(report)
    assert "AUROC (empirical)" in table and "TPR at low FPR (empirical)" in table and crosscheck.MISSING in table
    assert report.to_dict()["jax_privacy"]["available"] is False
    # Every canary on one side (possible with a handful of canaries): no ROC, said so.
    assert audit.empirical_figures(np.zeros(3), np.ones(3, bool), delta=1e-5)["auroc"] is None


# ---------------------------------------------------------------- white box: gradient canaries
# m = 2000 canaries (about 1000 drawn in with the fixed audit secret below), Poisson rate about
# 0.5, 2 steps, delta 1e-5. Noise multipliers calibrated by the audit (PLD) to epsilon 1, 4, 8.
# The one-run bound for an (epsilon, delta) Gaussian-like mechanism is far from tight with
# this many canaries (Steinke et al., Fig. 1; at m -> inf it still stays below epsilon for
# delta > 0). Measured here (Bonferroni / paper's max over k): 0.06 / 0.21 at epsilon 1,
# 0.81 / 1.08 at 4, 1.76 / 2.26 at 8, so the stated factor is 6 for epsilon >= 4; at epsilon 1
# the method has little power with 2000 canaries and only validity is asserted.
_SECRET = RunSecret(bytes(range(32)), SUPPLIED)


def _included() -> int:
    from dpbert.privacy.gradient_canaries import audit_keys, canary_inclusion

    return int(canary_inclusion(audit_keys(_SECRET, "gradient")[1], 2000).sum())


def _gradient_audit(noise_multiplier: float, clip_norm: float = 1.0, target_epsilon: float | None = None):
    from dpbert.privacy import BatchSchedule
    from dpbert.privacy.gradient_canaries import GradientCanaryConfig, run_gradient_canary_audit

    schedule = BatchSchedule.constant(steps=2, expected_batch_size=500, noise_multiplier=noise_multiplier)
    config = GradientCanaryConfig(
        schedule=schedule,
        num_canaries=2000,
        num_other_examples=0,
        clip_norm=clip_norm,
        delta=1e-5,
        secret=_SECRET,
        microbatch_size=256,
        target_epsilon=target_epsilon,
    )
    return run_gradient_canary_audit(config)


def test_broken_engine_without_noise_is_caught():
    result = _gradient_audit(noise_multiplier=0.0, clip_norm=1e4)
    assert result.epsilon_claimed == math.inf
    assert result.score == "sum"
    # Every guess right: 512 "in" guesses at level 0.05 / 16 give logit((0.05/16)^(1/512)) = 4.48
    # before the delta term (measured 4.04 after it); far above 1: the audit catches the missing noise.
    assert result.audit.num_correct == result.audit.num_guesses >= 512
    assert result.audit.epsilon_lower_bound > 3.0


@pytest.mark.parametrize("target", [1.0, 4.0, 8.0])
def test_correct_engine_bound_is_below_the_claim_and_within_a_factor(target):
    result = _gradient_audit(noise_multiplier=1.0, target_epsilon=target)
    assert result.epsilon_claimed == pytest.approx(target, rel=0.01)
    assert result.score == "log_likelihood_ratio"
    assert result.ledger.dataset_size == int(result.included.sum()) == _included()
    bound = result.audit.epsilon_lower_bound
    assert bound <= result.epsilon_claimed
    assert result.audit.epsilon_lower_bound_max_over_k <= result.epsilon_claimed
    if target >= 4.0:
        # The stated factor: the white-box bound reaches at least 1/6 of the claim.
        assert bound >= target / 6


# Full batch (q = 1, one step): no sampling for the auditor to see through, so the bound is the
# tightest this method gives for a Gaussian mechanism. Sigmas calibrated by the audit (PLD, delta
# 1e-5); the figures below were measured at N = 980. Measured: 1.22 at claimed 4.00 and 2.46 at 7.99 (factor 3.3); an idealized
# simulation (exact Gaussian scores, m up to 50,000) gives 1.4-1.5 and 2.5-2.7: the gap left is the
# one-run theorem's, which bounds the Gaussian by randomized response, not the engine's.


@pytest.mark.parametrize("target", [4.0, 8.0])
def test_full_batch_engine_bound_is_within_a_factor_4_of_the_claim(target):
    from dpbert.privacy import BatchSchedule
    from dpbert.privacy.gradient_canaries import GradientCanaryConfig, run_gradient_canary_audit

    schedule = BatchSchedule.constant(steps=1, expected_batch_size=_included(), noise_multiplier=1.0)
    result = run_gradient_canary_audit(
        GradientCanaryConfig(
            schedule=schedule,
            num_canaries=2000,
            num_other_examples=0,
            clip_norm=1.0,
            delta=1e-5,
            secret=_SECRET,
            target_epsilon=target,
        )
    )
    assert result.ledger.stages[0].sampling_rate == 1.0
    assert result.epsilon_claimed == pytest.approx(target, rel=0.01)
    assert target / 4 <= result.audit.epsilon_lower_bound <= result.epsilon_claimed


# ---------------------------------------------------------------- `dpbert audit RECIPE` (real trainer)

_PHRASES = [
    "the president of the united states {w} the congress .",
    "we the people of the nation {w} our freedom .",
    "the secretary of the treasury {w} the public debt .",
]
_SLOTS = ["protect", "address", "serve", "defend"]


@pytest.fixture(scope="module")
def audit_recipe(tmp_path_factory):
    import random

    import yaml

    root = tmp_path_factory.mktemp("audit")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for d in range(40):
        (corpus / f"doc{d:03d}.txt").write_text(
            " ".join(rng.choice(_PHRASES).format(w=rng.choice(_SLOTS)) for _ in range(8))
        )
    recipe = {
        "model": {
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
        },
        "data": {
            "corpus": str(corpus),
            "store": str(root / "store"),
            "tokenizer": "train",
            "train_vocab_size": 120,
            "seq_len": 24,
            "eval_fraction": 0.1,
            "num_proc": 1,
        },
        "schedule": [{"steps": 4, "expected_batch_size": 32}],
        "privacy": {
            "enabled": True,
            "clip_norm": 1.0,
            "delta": 1.0e-4,
            "accountant": "rdp",
            "noise_multiplier": 1.0,
            "target_epsilon": 50.0,
        },
        "optimizer": {"learning_rate": 1.0e-2, "warmup_steps": 1},
        "train": {
            "microbatch_size": 16,
            "checkpoint_every": 4,
            "eval_every": 4,
            "eval_batches": 1,
            "eval_batch_size": 16,
            "log_every": 1,
        },
        "report": {"fill_mask": [], "top_k": 3},
    }
    path = root / "audit.yaml"
    path.write_text(yaml.safe_dump(recipe))
    from dpbert.data.store import prepare_store

    d = recipe["data"]
    prepare_store(
        root / "store",
        corpus=d["corpus"],
        tokenizer="train",
        seq_len=d["seq_len"],
        eval_fraction=d["eval_fraction"],
        seed=0,
        train_vocab_size=d["train_vocab_size"],
        num_proc=1,
    )
    return path, root


def test_rare_token_canaries_take_the_least_frequent_ordinary_tokens_one_each():
    import jax

    from dpbert.train.audit import rare_token_canaries

    counts = np.array([0, 0, 0, 0, 0, 9, 0, 3, 0, 1, 0, 7])  # ids 0-4 special (never chosen, even unseen)
    kw = {"counts": counts, "seq_len": 6, "cls_id": 2, "sep_id": 3, "special_token_ids": [0, 1, 4]}
    rows, tokens = rare_token_canaries(jax.random.key(0), 5, **kw)
    # The unseen ordinary ids (6, 8, 10) first, in a random order, then the rarest seen ones (9 once, 7 thrice).
    assert set(tokens[:3].tolist()) == {6, 8, 10} and tokens[3:].tolist() == [9, 7]
    assert rows.shape == (5, 6) and rows.dtype == np.int32
    assert (rows[:, 0] == 2).all() and (rows[:, -1] == 3).all() and (rows[:, 1:-1] == tokens[:, None]).all()
    orders = {tuple(rare_token_canaries(jax.random.key(k), 3, **kw)[1].tolist()) for k in range(12)}
    assert len(orders) > 1 and all(set(o) == {6, 8, 10} for o in orders)  # ties broken by the key
    again, _ = rare_token_canaries(jax.random.key(0), 5, **kw)
    assert np.array_equal(rows, again)
    with pytest.raises(
        ValueError,
        match="canaries: the rare-token design needs one ordinary token per canary; the vocabulary has 7, got 8",
    ):
        rare_token_canaries(jax.random.key(0), 8, **kw)


def test_token_counts_match_the_stored_rows(audit_recipe):
    from dpbert.data.store import TokenStore
    from dpbert.train.audit import token_counts

    _, root = audit_recipe
    store = TokenStore.open(root / "store")
    rows = store[np.arange(len(store))]
    expected = np.bincount(rows.ravel(), minlength=store.manifest.vocab_size)
    assert np.array_equal(token_counts(root / "store"), expected)
    assert np.array_equal(token_counts(root / "store", chunk_rows=7), expected)


@pytest.mark.slow  # a real (tiny) pretraining run: compilation dominates
def test_input_canary_audit_is_marked_and_never_touches_the_recipe_store(audit_recipe, tmp_path, capsys):
    import json

    from dpbert import cli
    from dpbert.data.store import TokenStore
    from dpbert.privacy import PrivacyLedger

    recipe, root = audit_recipe
    out = tmp_path / "audit"
    assert cli.main(["audit", str(recipe), "--output-dir", str(out), "--canaries", "40", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out / "audit.json").read_text())
    assert printed == written
    assert written["kind"] == "input" and written["audit"] is True and written["num_canaries"] == 40
    assert written["canary_design"] == "rare"
    assert written["confidence"] == 0.95 and written["delta"] >= 1e-4
    assert 0.0 <= written["epsilon_lower_bound"] <= written["epsilon_claimed"]

    # The canaries live only in the audit store: appended after the recipe's own rows.
    base, audited = TokenStore.open(root / "store"), TokenStore.open(out / "store")
    n = len(base)
    assert len(audited) == n + written["num_included"]
    assert np.array_equal(audited[np.arange(n)], base[np.arange(n)])
    canaries = audited[np.arange(n, len(audited))]
    base_rows = {r.tobytes() for r in base[np.arange(n)]}
    assert not any(c.tobytes() in base_rows for c in canaries)
    assert "audit canaries" in audited.manifest.source and "canaries" not in base.manifest.source
    # Rare-token design: each canary is one token of its own, among the base store's least frequent.
    from dpbert.train.audit import token_counts

    tokens = canaries[:, 1]
    assert (canaries[:, 1:-1] == tokens[:, None]).all() and len(set(tokens.tolist())) == len(tokens)
    counts = token_counts(root / "store")
    ordinary = np.setdiff1d(np.arange(counts.size), audited.manifest.special_token_ids)
    assert counts[tokens].max() <= np.sort(counts[ordinary])[written["num_canaries"] - 1]

    # The run says it is an audit everywhere a user would look, and is not releasable.
    run = out / "run"
    privacy = json.loads((run / "privacy.json").read_text())
    assert privacy["audit"] is True
    with pytest.raises(ValueError, match="audit"):
        PrivacyLedger.from_dict(privacy)
    # The release's public N (the base store's count rounded down), its bound widened for the canaries.
    from dpbert.privacy.accounting import round_down_significant

    assert privacy["dataset_size"] == round_down_significant(n) and privacy["dataset_size_bound"] >= len(audited)
    assert not (run / "release").exists()
    # ... and a later export of it is refused: canaries never reach a released checkpoint.
    from dpbert.release import export_run

    with pytest.raises(ValueError, match="audit"):
        export_run(run, tmp_path / "release")
    assert not (tmp_path / "release").exists()
    assert json.loads((run / "AUDIT_RUN.json").read_text())["audit"] is True
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "audit" and last["epsilon_lower_bound"] == written["epsilon_lower_bound"]


def test_gradient_canary_audit_of_a_recipe_uses_its_privacy_plan(audit_recipe, tmp_path, capsys):
    import json

    from dpbert import cli
    from dpbert.config.plan import plan_recipe
    from dpbert.config.recipe import load_recipe
    from dpbert.data.store import TokenStore

    recipe, root = audit_recipe
    out = tmp_path / "grad"
    assert (
        cli.main(
            [
                "audit",
                str(recipe),
                "--output-dir",
                str(out),
                "--canaries",
                "300",
                "--kind",
                "gradient",
                "--set",
                "privacy.noise_multiplier=0.8",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "claimed epsilon" in table and "lower bound (95% conf.)" in table
    assert "AUROC (empirical)" in table and "TPR at low FPR (empirical)" in table
    report = json.loads((out / "audit.json").read_text())
    assert report["kind"] == "gradient" and report["score"] == "log_likelihood_ratio" and report["audit"] is True
    # The empirical figures of the same scores, dpbert's and (where installed) jax-privacy's auditor's.
    assert 0.0 <= report["auroc"] <= 1.0 and [r["fpr"] for r in report["tpr_at_fpr"]] == [0.01, 0.001]
    assert "none is a privacy guarantee" in report["empirical"] and "available" in report["jax_privacy"]
    # The claim is the release's: the plan of the recipe's own data (its public N, q and sigma); the
    # canaries are stored rows beside the others, within the widened bound.
    plan = plan_recipe(load_recipe(recipe, ["privacy.noise_multiplier=0.8"]), len(TokenStore.open(root / "store")))
    assert report["epsilon_claimed"] == pytest.approx(plan.ledger.epsilon(), rel=1e-9)
    assert 0.0 <= report["epsilon_lower_bound"] <= report["epsilon_claimed"]
    assert not (out / "run").exists()


# ---------------------------------------------------------------- the audited figure on a release


@pytest.fixture()
def audited_release(audit_recipe, tmp_path):
    """A real release of the audit recipe's privacy plan: a tiny BERT, the store's tokenizer, the ledger
    the trainer would write for the recipe's own data (no canaries), the recipe published with it
    (its local paths redacted, as `dpbert export` publishes it), so that `dpbert verify` rebuilds it."""
    import yaml
    from transformers import BertConfig, BertForMaskedLM

    from dpbert.config.plan import plan_recipe
    from dpbert.config.recipe import load_recipe, recipe_to_dict
    from dpbert.data.store import TokenStore
    from dpbert.release import CardInfo, Guarantee, ReleaseMetadata, write_release
    from dpbert.release.export import _published_recipe

    recipe, root = audit_recipe
    store = TokenStore.open(root / "store")
    model = tmp_path / "hf"
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
    resolved = load_recipe(recipe, ["privacy.noise_multiplier=0.8"])
    ledger = plan_recipe(resolved, len(store)).ledger.to_dict()
    meta = ReleaseMetadata(
        guarantees=(
            Guarantee.from_ledger(
                scope="pretraining", data="test corpus", ledger=ledger, randomness={"source": "os-csprng"}
            ),
        ),
        vocabulary_origin="trained on the test corpus",
        vocabulary_covered=False,
        vocabulary_learned_from_private_data=True,  # the recipe's data.tokenizer is "train"
        vocabulary_kind="train",
        recipe_name="recipe.yaml",
        recipe_content=_published_recipe(yaml.safe_dump(recipe_to_dict(resolved), sort_keys=False)),
    )
    info = CardInfo(
        model_name="tiny-dp",
        architecture="BERT, 1 layer",
        reproduce_command="dpbert pretrain r.yaml",
        mlm_accuracy=0.25,
    )
    return write_release(
        tmp_path / "release", model=model, meta=meta, info=info, tokenizer_dir=root / "store" / "tokenizer"
    )


def test_audit_adds_a_labelled_lower_bound_to_a_release_that_still_verifies(
    audit_recipe, audited_release, tmp_path, capsys
):
    import hashlib
    import json

    from huggingface_hub import ModelCard

    from dpbert import cli
    from dpbert.release import verify_folder
    from dpbert.release.card import read_front_matter

    recipe, _ = audit_recipe
    release = audited_release
    weights = hashlib.sha256((release / "model.safetensors").read_bytes()).hexdigest()
    guarantees_before = json.loads((release / "privacy.json").read_text())["guarantees"]
    card_before = (release / "README.md").read_text()
    out = tmp_path / "grad"
    # Few canaries: the audit run's dataset (144 sequences + the included canaries) stays close to the
    # release's, as it does at any real scale.
    assert (
        cli.main(
            [
                "audit",
                str(recipe),
                "--output-dir",
                str(out),
                "--canaries",
                "10",
                "--kind",
                "gradient",
                "--set",
                "privacy.noise_multiplier=0.8",
                "--card",
                str(release),
            ]
        )
        == 0
    )
    assert "audited figure (gradient canaries" in capsys.readouterr().out
    report = json.loads((out / "audit.json").read_text())

    privacy = json.loads((release / "privacy.json").read_text())
    assert privacy["guarantees"] == guarantees_before  # the guarantee itself is untouched
    (figure,) = privacy["audits"]
    for key in (
        "kind",
        "epsilon_claimed",
        "delta",
        "epsilon_lower_bound",
        "confidence",
        "num_canaries",
        "num_guesses",
        "num_correct",
        "date",
    ):
        assert figure[key] == report[key], key
    # The audit ran an absolute recipe path; the release names only its file (no local path published).
    assert (
        report["recipe"].startswith("/") and figure["recipe"] == f"<local path: {report['recipe'].rsplit('/', 1)[-1]}>"
    )
    assert figure["scope"] == "pretraining" and figure["kind"] == "gradient" and figure["num_canaries"] == 10
    assert figure["epsilon_release"] == pytest.approx(guarantees_before[0]["epsilon"], rel=1e-12)
    # Gradient canaries read nothing of the private data: the release with the audit is the release.
    assert figure["private_data_used"] is False
    assert (figure["epsilon_with_audit"], figure["delta_with_audit"]) == (
        figure["epsilon_release"],
        figure["delta_release"],
    )
    assert "lower bound" in figure["meaning"] and "not a privacy guarantee" in figure["meaning"]
    assert figure["date"].endswith("+00:00")

    card = (release / "README.md").read_text()
    assert read_front_matter(release / "README.md")["differential_privacy"]["audits"] == [figure]
    assert ModelCard.load(release / "README.md").data.to_dict()["differential_privacy"]["audits"] == [figure]
    section = card[card.index("## Privacy audit") : card.index("## Evaluation")]
    assert "(empirical lower bound, not a guarantee)" in section
    assert "does **not** certify the guarantee" in section
    assert (
        f"| {figure['epsilon_lower_bound']:.4g} | 95% | {figure['num_guesses']} ({figure['num_correct']}) |" in section
    )
    # The rest of the body is as export wrote it.
    assert card_before.split("## Privacy guarantee")[1].split("## Evaluation")[0] in card
    assert card.split("## Evaluation")[1] == card_before.split("## Evaluation")[1]
    assert hashlib.sha256((release / "model.safetensors").read_bytes()).hexdigest() == weights
    assert verify_folder(release).ok
    assert not [p for p in release.parent.iterdir() if p.name.startswith(".")]  # no temporaries left

    # A newer audit of the same kind replaces the figure; the card keeps one section.
    from dpbert.release.audit_figures import add_audit

    newer = {**report, "date": "2030-01-01T00:00:00+00:00"}
    add_audit(release, newer)
    (figure2,) = json.loads((release / "privacy.json").read_text())["audits"]
    assert figure2["date"] == newer["date"]
    card = (release / "README.md").read_text()
    assert card.count("## Privacy audit") == 1 and "2030-01-01" in card and figure["date"] not in card
    assert verify_folder(release).ok

    # verify catches an edited audited figure in the card.
    edited = card.replace(f"epsilon_lower_bound: {figure2['epsilon_lower_bound']!r}", "epsilon_lower_bound: 9.0")
    assert edited != card
    (release / "README.md").write_text(edited)
    result = verify_folder(release)
    assert not result.ok and any("audits" in p for p in result.problems)


def test_audit_is_refused_for_another_privacy_plan_or_a_broken_release(audited_release, tmp_path):
    import json

    from dpbert.release.audit_figures import add_audit

    release = audited_release
    epsilon = json.loads((release / "privacy.json").read_text())["guarantees"][0]["epsilon"]
    report = {
        "audit": True,
        "kind": "gradient",
        "epsilon_claimed": epsilon,
        "delta": 1e-4,
        "epsilon_lower_bound": 0.1,
        "confidence": 0.95,
        "num_canaries": 100,
        "num_guesses": 10,
        "num_correct": 8,
        "date": "2026-01-01T00:00:00+00:00",
        "recipe": "r.yaml",
    }
    before = {p.name: p.read_bytes() for p in release.iterdir()}
    with pytest.raises(ValueError, match="different privacy plan"):
        add_audit(release, {**report, "epsilon_claimed": 2 * epsilon})
    with pytest.raises(ValueError, match="not a dpbert audit"):
        add_audit(release, {**report, "audit": False})
    with pytest.raises(ValueError, match="date"):
        add_audit(release, {k: v for k, v in report.items() if k != "date"})
    with pytest.raises(ValueError, match="scope"):
        add_audit(release, report, scope="fine-tuning")
    assert {p.name: p.read_bytes() for p in release.iterdir()} == before
    # A release whose metadata does not verify gets no audited figure.
    (release / "config.json").write_text(
        (release / "config.json").read_text().replace(f'"epsilon": {epsilon}', '"epsilon": 0.5')
    )
    with pytest.raises(ValueError, match="does not verify"):
        add_audit(release, report)
    assert "audits" not in json.loads((release / "privacy.json").read_text())
    path = tmp_path / "audit.json"
    path.write_text(json.dumps(report))
    with pytest.raises(ValueError, match="does not verify"):
        add_audit(release, path)


def test_an_input_audit_states_its_own_cost_and_a_forged_composition_fails_verify(audited_release):
    """An input audit is a second DP training on the private data: the figure states the audit run's
    guarantee and the release's composed with it (sums), the card says so, and verify refuses a
    figure whose composition or release figures were edited."""
    import json

    from huggingface_hub import ModelCard

    from dpbert.release import verify_folder
    from dpbert.release.audit_figures import add_audit
    from dpbert.release.card import render_audit_section, with_audits
    from dpbert.release.metadata import guarantees_from_json

    release = audited_release
    privacy = json.loads((release / "privacy.json").read_text())
    (guarantee,) = guarantees_from_json(privacy, "privacy.json")
    report = {
        "audit": True,
        "kind": "input",
        "epsilon_claimed": guarantee.epsilon * 1.02,  # canaries join the audit run's dataset
        "delta": 2e-5,
        "epsilon_lower_bound": 0.3,
        "confidence": 0.95,
        "num_canaries": 100,
        "num_guesses": 10,
        "num_correct": 7,
        "date": "2026-01-01T00:00:00+00:00",
        "recipe": "r.yaml",
    }
    figure = add_audit(release, report)
    assert figure.private_data_used is True
    assert figure.epsilon_release == guarantee.epsilon and figure.delta_release == guarantee.total_delta
    assert guarantee.total_delta >= guarantee.ledger["delta"]
    assert figure.epsilon_with_audit == pytest.approx(guarantee.epsilon * 2.02, rel=1e-12)
    assert figure.delta_with_audit == pytest.approx(guarantee.total_delta + 2e-5, rel=1e-12)
    after = json.loads((release / "privacy.json").read_text())
    assert after["guarantees"] == privacy["guarantees"]  # the release's own guarantee is unchanged
    card = (release / "README.md").read_text()
    total = f"({guarantee.epsilon * 2.02:.4g}, {guarantee.total_delta + 2e-5:.4g})"
    assert f"With every audit above, the pretraining data is {total}-DP." in card
    assert "yes: (" in card and "basic composition" in card
    assert verify_folder(release).ok

    def forge(**changes):
        audits = [{**after["audits"][0], **changes}]
        (release / "privacy.json").write_text(json.dumps({**after, "audits": audits}))
        (release / "README.md").write_text(with_audits(card, audits))
        return verify_folder(release)

    # A forger who edits the composition everywhere, card section included, still fails.
    result = forge(epsilon_with_audit=figure.epsilon_release)
    assert not result.ok
    assert any("audits[0]: epsilon_with_audit/delta_with_audit" in p and "compose to" in p for p in result.problems)
    # Hiding that the input audit trained on the private data.
    result = forge(
        private_data_used=False, epsilon_with_audit=figure.epsilon_release, delta_with_audit=figure.delta_release
    )
    assert any("audits[0]: private_data_used: a input audit trains on the private data" in p for p in result.problems)
    # A release figure that is not the guarantee's (composed consistently with it).
    result = forge(epsilon_release=1.0, epsilon_with_audit=1.0 + figure.epsilon_claimed)
    assert any(
        f"audits[0]: epsilon_release 1.0 but the 'pretraining' guarantee states {guarantee.epsilon!r}" in p
        for p in result.problems
    )
    result = forge(delta_release=1e-9, delta_with_audit=1e-9 + figure.delta)
    assert any("audits[0]: delta_release 1e-09 but the 'pretraining' guarantee states" in p for p in result.problems)
    # The card's audit section is re-rendered from privacy.json.
    (release / "privacy.json").write_text(json.dumps(after))
    (release / "README.md").write_text(card.replace(total, "(0.1, 1e-09)"))
    result = verify_folder(release)
    assert any("the audit section differs" in p for p in result.problems)
    assert render_audit_section(after["audits"]) in card
    assert ModelCard.load(release / "README.md").data.to_dict()["differential_privacy"]["audits"] == after["audits"]


# ---------------------------------------------------------------- the shipped default recipe, as a user runs it

_TINY = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml")


# A two-step run of the shipped recipe: an input audit end to end in seconds.
_TWO_STEPS = [
    f"--set={s}"
    for s in (
        "schedule=[{steps: 2, expected_batch_size: 64}]",
        "optimizer.warmup_steps=1",
        "train.eval_batches=1",
        "train.eval_batch_size=16",
        "report.fill_mask=[]",
    )
]


def _audit_json(out) -> dict:
    import json

    return json.loads((out / "audit.json").read_text())


def test_gradient_audit_runs_on_the_shipped_recipe(tmp_path, capsys):
    """The README's `dpbert audit recipes/tiny.yaml --kind gradient`, on a 20-step schedule: it resolves the
    recipe's public vocabulary as `pretrain` does and reports both bounds, each within the claim."""
    from dpbert import cli
    from dpbert.data.store import read_manifest

    out = tmp_path / "audit"
    argv = ["audit", _TINY, "--output-dir", str(out), "--kind", "gradient", "--canaries", "1000"]
    argv += ["--set", "schedule=[{steps: 20, expected_batch_size: 1024}]", "--set", "optimizer.warmup_steps=1"]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "lower bound (95% conf.)" in table and "f-DP lower bound (95% conf.)" in table
    report = _audit_json(out)
    assert report["kind"] == "gradient" and report["num_canaries"] == 1000 and report["noise_free"] is False
    assert report["steps"] == 20 and report["overrides"] == argv[-3::2]  # which run was audited
    assert f"{_TINY} --set schedule=[{{steps: 20" in table and "warmup_steps=1: 20 steps" in table
    assert report["epsilon_claimed"] == pytest.approx(8.0, abs=0.02) and report["delta"] >= 1e-6
    assert 0.0 <= report["epsilon_lower_bound"] <= report["epsilon_claimed"]
    assert 0.0 <= report["epsilon_lower_bound_fdp"] <= report["epsilon_claimed"]
    assert report["fdp_trade_off"] == "gaussian"
    assert read_manifest(out / "base_store").vocab_size == 8192  # bert-base-uncased-8k, the recipe's public list


@pytest.mark.slow  # a real (tiny) pretraining run of the shipped model: compilation dominates
def test_input_audit_runs_on_the_shipped_recipe(tmp_path):
    from dpbert import cli
    from dpbert.data.store import read_manifest

    out = tmp_path / "audit"
    argv = ["audit", _TINY, "--output-dir", str(out), "--kind", "input", "--canaries", "20", "--json", *_TWO_STEPS]
    assert cli.main(argv) == 0
    report = _audit_json(out)
    assert report["kind"] == "input" and report["num_canaries"] == 20 and report["score"] == "pseudo_log_likelihood"
    assert report["canary_design"] == "rare"
    assert 0.0 <= report["epsilon_lower_bound"] <= report["epsilon_claimed"]
    assert 0.0 <= report["epsilon_lower_bound_fdp"] <= report["epsilon_claimed"]
    assert read_manifest(out / "store").vocab_size == 8192
    assert not (out / "run" / "release").exists()


# ---------------------------------------------------------------- noise switched off: audited, never trained for release


def test_pretrain_still_refuses_a_private_recipe_without_noise_outside_an_audit(tmp_path, capsys):
    from dpbert import cli
    from dpbert.train.pretrain import pretrain

    no_noise = ["--set", "privacy.target_epsilon=null", "--set", "privacy.noise_multiplier=0"]
    assert cli.main(["pretrain", _TINY, "--output-dir", str(tmp_path / "run"), *no_noise]) == 1
    assert "privacy.noise_multiplier" in capsys.readouterr().err
    # The trainer's own switch needs the audit marker: such a model is never released.
    short = ["schedule=[{steps: 2, expected_batch_size: 64}]", "optimizer.warmup_steps=1"]
    with pytest.raises(ValueError, match=r"noise_free: only an audit's run .*AUDIT_RUN.json"):
        pretrain(_TINY, tmp_path / "plain", overrides=short, noise_free=True, progress=False, log=lambda _: None)
    # A target with no noise is a contradiction, named as such.
    argv = ["audit", _TINY, "--output-dir", str(tmp_path / "b"), "--kind", "gradient"]
    assert cli.main([*argv, "--set", "privacy.noise_multiplier=0"]) == 1
    assert "privacy.target_epsilon" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "plain" / "checkpoints").exists()


@pytest.mark.slow  # a real (tiny) pretraining run of the shipped model: compilation dominates
def test_input_audit_of_a_noise_free_run_claims_nothing_and_releases_nothing(tmp_path, capsys):
    from dpbert import cli

    out = tmp_path / "audit"
    no_noise = ["--set", "privacy.target_epsilon=null", "--set", "privacy.noise_multiplier=0"]
    argv = ["audit", _TINY, "--output-dir", str(out), "--kind", "input", "--canaries", "20", *no_noise, *_TWO_STEPS]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "with the noise switched off (an audit's run: no claim)" in captured.out + captured.err
    report = _audit_json(out)
    assert report["kind"] == "input" and report["noise_free"] is True and report["epsilon_claimed"] == "inf"
    assert report["epsilon_lower_bound"] >= 0.0 and report["delta"] == pytest.approx(1e-6)
    run = out / "run"
    assert json.loads((run / "AUDIT_RUN.json").read_text())["noise_free"] is True
    assert not (run / "privacy.json").exists() and not (run / "release").exists()  # no ledger, no release


@pytest.mark.slow  # two audits of a quarter of the tiny schedule (275 steps), XLA's default codegen
def test_noise_free_run_is_caught_and_the_correct_run_stays_below_its_claim(tmp_path):
    """White box, 10,000 canaries, the tiny recipe cut to its first 275 steps (each canary is
    sampled at least once with probability 0.93): without noise the audit must exceed 6 with both
    bounds; with the recipe's noise (recalibrated to epsilon 8 for 275 steps) both stay below the
    claim. docs/RESULTS.md ("Audits") gives the bounds of the full schedule."""
    import subprocess
    import sys

    from xla import default_codegen_env

    quarter = "schedule=[{steps: 275, expected_batch_size: 1728}]"

    def audit(*argv: str) -> None:  # XLA's default codegen: run time dominates
        command = [
            sys.executable,
            "-m",
            "dpbert.cli",
            "audit",
            _TINY,
            "--kind",
            "gradient",
            "--json",
            "--set",
            quarter,
            *argv,
        ]
        proc = subprocess.run(command, env=default_codegen_env(), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]

    free = tmp_path / "free"
    audit("--output-dir", str(free), "--set", "privacy.target_epsilon=null", "--set", "privacy.noise_multiplier=0")
    report = _audit_json(free)
    assert report["epsilon_claimed"] == "inf" and report["noise_free"] is True and report["score"] == "sum"
    assert report["num_canaries"] == 10_000
    assert report["epsilon_lower_bound"] > 6 and report["epsilon_lower_bound_fdp"] > 6
    print(f"no noise: {report['epsilon_lower_bound']:.3f} / f-DP {report['epsilon_lower_bound_fdp']:.3f}")

    correct = tmp_path / "correct"
    audit("--output-dir", str(correct))
    report = _audit_json(correct)
    assert report["noise_free"] is False and report["epsilon_claimed"] == pytest.approx(7.99, abs=0.01)
    assert 0 < report["epsilon_lower_bound"] <= report["epsilon_claimed"]
    assert 0 < report["epsilon_lower_bound_fdp"] <= report["epsilon_claimed"]
    print(
        f"claim {report['epsilon_claimed']:.3f}: {report['epsilon_lower_bound']:.3f} / f-DP {report['epsilon_lower_bound_fdp']:.3f}"
    )
