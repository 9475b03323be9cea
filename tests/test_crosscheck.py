"""A second opinion from jax-privacy (the optional extra `crosscheck`, installed by `make test`):
its accountant recomputes epsilon for the shipped recipes and for sampled ledgers, and its canary
auditor recomputes dpbert's audit figures. Skipped, with the reason, where jax-privacy is absent."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from dpbert.privacy.crosscheck import MISSING, jax_privacy_version

if jax_privacy_version() is None:  # not installed, or does not import
    pytest.skip(MISSING, allow_module_level=True)

from dpbert.privacy import audit_bounds as audit  # noqa: E402
from dpbert.privacy.accounting import PrivacyLedger  # noqa: E402
from dpbert.privacy.crosscheck import jax_privacy_audit_figures, jax_privacy_epsilon  # noqa: E402
from dpbert.privacy.schedule import BatchSchedule, Stage  # noqa: E402

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# Measured: the two agree to the last bit (relative difference 0.0) on every ledger below.
RTOL = 1e-12
# A stated N for a recipe that states none (its N is the size of its token store).
FALLBACK_N = 10_000
# GLUE training-set sizes for the fine-tuning recipe: SST-2 (large) and RTE (small).
GLUE_N = {"sst2": 67_349, "rte": 2_490}


def _compare(ledger: PrivacyLedger, what: str) -> float:
    ours, theirs = ledger.epsilon(), jax_privacy_epsilon(ledger)
    assert math.isfinite(ours) and ours > 0, what
    gap = abs(ours - theirs) / ours
    print(f"{what}: dpbert {ours!r} jax-privacy {theirs!r} relative difference {gap:.3g}")
    assert theirs == pytest.approx(ours, rel=RTOL), what
    return gap


def _recipe_ledger(name: str) -> PrivacyLedger:
    from dpbert.config.plan import make_plan
    from dpbert.config.recipe import load_recipe

    recipe = load_recipe(RECIPES / name)
    n = getattr(recipe.privacy, "dataset_size", None) or recipe.target.dataset_size or FALLBACK_N
    return make_plan(recipe, n).ledger


@pytest.mark.parametrize("name", ["bert_large_dp.yaml", "tiny.yaml"])
def test_shipped_pretraining_recipes(name):
    ledger = _recipe_ledger(name)
    _compare(ledger, name)
    # The same plan under the other accountant: both mappings agree whichever dp_accounting computes.
    import dataclasses

    other = dataclasses.replace(ledger, accountant="rdp" if ledger.accountant == "pld" else "pld")
    _compare(other, f"{name} ({other.accountant})")


@pytest.mark.parametrize("task", sorted(GLUE_N))
def test_shipped_finetuning_recipe(task):
    from dpbert.config.finetune import load_config, plan_dp

    plan = plan_dp(GLUE_N[task], load_config(RECIPES / "glue_finetune.yaml"))
    _compare(plan.ledger, f"glue_finetune.yaml ({task}, N={GLUE_N[task]})")


def _sampled_ledgers(count: int, seed: int = 0) -> list[PrivacyLedger]:
    """Random schedules: 1-4 stages of growing or shrinking batches, N from 1e3 to 1e9, both accountants."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        n = int(10 ** rng.uniform(3, 9))
        stages = []
        for _ in range(int(rng.integers(1, 5))):
            q = 10 ** rng.uniform(-4, -0.5)
            stages.append(
                Stage(
                    steps=int(rng.integers(1, 3000)),
                    expected_batch_size=max(1, int(q * n)),
                    noise_multiplier=float(rng.uniform(0.6, 6.0)),
                )
            )
        delta = float(10 ** rng.uniform(-10, -5)) / max(1.0, n / 1e5)
        ledger = PrivacyLedger.for_schedule(
            BatchSchedule(stages=tuple(stages)),
            dataset_size=n,
            delta=delta,
            clip_norm=1.0,
            accountant=("pld", "rdp")[len(out) % 2],
        )
        if 0.05 < ledger.epsilon() < 50:  # a regime where a guarantee means something
            out.append(ledger)
    return out


def test_sampled_ledgers():
    gaps = [
        _compare(
            ledger, f"sampled ledger {i} ({ledger.accountant}, {len(ledger.stages)} stages, N={ledger.dataset_size})"
        )
        for i, ledger in enumerate(_sampled_ledgers(12))
    ]
    print(f"max relative difference over {len(gaps)} sampled ledgers: {max(gaps):.3g}")


# ---------------------------------------------------------------- the canary auditor


def _scores(m: int, shift: float, seed: int, ties: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    scores = rng.normal(size=m) + shift * included
    return (np.round(scores, 1) if ties else scores), included


@pytest.mark.parametrize(
    "m, shift, ties", [(50, 0.0, False), (2000, 0.5, False), (2000, 2.0, True), (10000, 4.0, False)]
)
def test_audit_roc_figures_match_the_canary_auditor(m, shift, ties):
    scores, included = _scores(m, shift, seed=m, ties=ties)
    theirs = jax_privacy_audit_figures(scores, included, delta=1e-5, fprs=(0.0, 0.001, 0.01, 0.1, 1.0))
    assert audit.auroc(scores, included) == pytest.approx(theirs["auroc"], rel=RTOL, abs=1e-15)
    ours = audit.tpr_at_fpr(scores, included, [0.0, 0.001, 0.01, 0.1, 1.0])
    assert ours.tolist() == pytest.approx([r["tpr"] for r in theirs["tpr_at_fpr"]], rel=RTOL, abs=1e-15)
    # Empirical lower bounds, never above what the scores can support; the f-DP one is the tighter test.
    assert 0.0 <= theirs["epsilon_lower_bound"] <= theirs["epsilon_lower_bound_fdp"] + 1e-6


@pytest.mark.parametrize("guesses, correct", [(100, 90), (500, 400), (1000, 620)])
def test_one_run_bound_at_a_fixed_guess_count_matches(guesses, correct):
    """The same experiment (the top `guesses` scores guessed "in", `correct` of them right) through
    jax-privacy's one-run test and dpbert's: Theorem 3 of Steinke et al. in both."""
    from jax_privacy.auditing import CanaryScoreAuditor, Explicit

    m = 2000
    scores = np.arange(m, 0, -1, dtype=np.float64)  # distinct: the top `guesses` are the first ones
    included = np.zeros(m, bool)
    included[:correct] = True
    included[guesses : guesses + (m // 2 - correct)] = True
    auditor = CanaryScoreAuditor(scores[included], scores[~included])
    theirs = auditor.epsilon_one_run(0.05, 1e-5, threshold_strategy=Explicit(scores[guesses - 1]))
    ours = audit.epsilon_lower_bound(
        num_canaries=m, num_guesses=guesses, num_correct=correct, delta=1e-5, significance=0.05
    )
    assert ours > 0 and ours == pytest.approx(theirs, abs=1e-5)


def test_empirical_figures_put_jax_privacy_next_to_dpbert():
    scores, included = _scores(3000, 1.5, seed=7)
    figures = audit.empirical_figures(scores, included, delta=1e-6, confidence=0.95)
    jp = figures["jax_privacy"]
    assert jp["available"] is True and jp["version"]
    assert figures["auroc"] == pytest.approx(jp["auroc"], rel=RTOL)
    assert [r["fpr"] for r in figures["tpr_at_fpr"]] == [r["fpr"] for r in jp["tpr_at_fpr"]] == list(audit.LOW_FPRS)
    assert figures["empirical"].startswith("empirical") and "none is a privacy guarantee" in figures["empirical"]
    # Different guess rules and corrections, the same kind of figure: lower bounds on the epsilon of what
    # produced the scores. Scores N(1.5, 1) in, N(0, 1) out are a Gaussian mechanism at noise 1/1.5:
    # epsilon 7.81 at delta 1e-6 (dp_accounting PLD). Measured: dpbert 3.01, jax-privacy 2.59 / 3.65 (f-DP).
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    truth = pld_privacy_accountant.PLDAccountant().compose(dp_accounting.GaussianDpEvent(1 / 1.5)).get_epsilon(1e-6)
    ours = audit.audit_scores(scores, included, delta=1e-6).epsilon_lower_bound
    assert truth == pytest.approx(7.81, abs=0.01)
    assert 0 < ours < truth and 0 < jp["epsilon_lower_bound"] < truth and 0 < jp["epsilon_lower_bound_fdp"] < truth
    print(f"dpbert {ours:.3g}, jax-privacy {jp['epsilon_lower_bound']:.3g}, {jp['epsilon_lower_bound_fdp']:.3g} f-DP")


# Document-level DP and group privacy against jax-privacy's user-level DP-SGD accountant.
USER_LEVEL_RTOL = 0.01


def _document_ledger(stages, n, delta=1e-6, cap=16):
    return PrivacyLedger.for_schedule(
        BatchSchedule(stages=tuple(Stage(steps=t, expected_batch_size=b, noise_multiplier=s) for t, b, s in stages)),
        dataset_size=n,
        delta=delta,
        clip_norm=1.0,
        accountant="pld",
        privacy_unit="one document",
        max_sequences_per_document=cap,
    )


@pytest.mark.parametrize(
    "stages, n",
    [
        ([(256, 64, 3.097)], 240),  # recipes/tiny_document.yaml's plan (RDP-calibrated sigma), N = 240 speeches
        ([(64, 120, 2.9)], 240),  # fewer, larger steps: q = 0.5
        ([(100, 50, 1.2), (100, 200, 2.0)], 10_000),  # a two-stage schedule over 10k documents
        ([(1000, 1024, 0.9)], 1_000_000),  # many small documents, small q
    ],
    ids=["tiny_document", "q0.5", "two-stages", "1M-documents"],
)
def test_document_level_epsilon_matches_jax_privacy_user_level_accountant(stages, n):
    from dpbert.privacy.crosscheck import jax_privacy_user_level_epsilon

    ledger = _document_ledger(stages, n)
    ours, theirs = ledger.epsilon(), jax_privacy_user_level_epsilon(ledger)
    print(f"document-level {stages} N={n}: dpbert {ours:.6g} jax-privacy user-level {theirs:.6g}")
    assert math.isfinite(ours) and theirs == pytest.approx(ours, rel=USER_LEVEL_RTOL)


def test_the_shipped_document_recipe_matches_jax_privacy_user_level_accountant():
    import dataclasses

    from dpbert.privacy.crosscheck import jax_privacy_user_level_epsilon

    ledger = dataclasses.replace(_recipe_ledger("tiny_document.yaml"), accountant="pld")
    assert ledger.is_document_level and ledger.dataset_size == 240
    assert jax_privacy_user_level_epsilon(ledger) == pytest.approx(ledger.epsilon(), rel=USER_LEVEL_RTOL)


@pytest.mark.parametrize("group_size", [2, 4])
def test_group_privacy_matches_jax_privacy_examples_per_user(group_size):
    """The card's group privacy of a sequence-level ledger is jax-privacy's user-level epsilon with
    examples_per_user = the group size (the same mixture of Gaussians, computed independently)."""
    from dpbert.privacy.accounting import CALIBRATION_PLD_DISCRETIZATION, group_epsilon
    from dpbert.privacy.crosscheck import jax_privacy_user_level_epsilon

    ledger = PrivacyLedger.for_schedule(
        BatchSchedule(stages=(Stage(steps=200, expected_batch_size=256, noise_multiplier=1.0),)),
        dataset_size=50_000,
        delta=1e-6,
        clip_norm=1.0,
        accountant="pld",
    )
    ours = group_epsilon(ledger, group_size)
    theirs = jax_privacy_user_level_epsilon(ledger, group_size, discretization=CALIBRATION_PLD_DISCRETIZATION)
    print(f"group of {group_size}: dpbert {ours:.6g} jax-privacy {theirs:.6g}")
    assert ours == pytest.approx(theirs, rel=USER_LEVEL_RTOL) and ours >= theirs * (1 - 1e-6)
