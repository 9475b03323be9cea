"""DP fine-tuning defaults derived from n and epsilon, and the plan built from them."""

from __future__ import annotations

import math

import pytest

from dpbert.config import finetune_defaults as fp


@pytest.mark.parametrize("n", [100, 2_000, 67_349])
def test_derived_defaults_on_a_grid_of_sizes_and_epsilons(n: int) -> None:
    by_eps = {}
    for eps in (1.0, 3.0, 8.0):
        d = fp.derive_dp_defaults(dataset_size=n, epsilon=eps, delta=1 / n**1.1, trainable="bias")
        by_eps[eps] = d
        # epochs: ceil(10,000 / n) clamped to [3, 40]: 100 -> 40 (clamped), 2,000 -> 5, 67,349 -> 3.
        assert d.epochs == {100: 40.0, 2_000: 5.0, 67_349: 3.0}[n]
        b = d.expected_batch_size
        assert b & (b - 1) == 0 and 8 <= b <= max(8, n // 4)  # a power of two, q <= 1/4
        assert d.steps == math.ceil(d.epochs * n / b)
        # Enough steps whenever the example budget allows it at the smallest candidate.
        if d.epochs * n / 8 >= fp.MIN_STEPS:
            assert d.steps >= fp.MIN_STEPS
        assert d.clip_norm == 0.1 and d.learning_rate == 1e-2
        assert len(d.lines()) == 4 and all("(" in line for line in d.lines())
    # A larger budget never asks for a smaller batch: noise per step matters less as epsilon grows
    # only through sigma, and the planner's pick is monotone in the gain it sees.
    assert by_eps[1.0].expected_batch_size <= by_eps[8.0].expected_batch_size * 2


def test_learning_rate_follows_the_trained_subset_and_epochs_can_be_given() -> None:
    lrs = {t: fp.derive_dp_defaults(dataset_size=2_000, epsilon=8, delta=1e-4, trainable=t, epochs=3).learning_rate
           for t in ("all", "bias", "lora", "head")}  # fmt: skip
    assert lrs == {"all": 5e-4, "bias": 1e-2, "lora": 1e-2, "head": 1e-2}
    d = fp.derive_dp_defaults(dataset_size=2_000, epsilon=8, delta=1e-4, trainable="lora", epochs=3)
    assert d.epochs == 3.0 and d.reasons["epochs"] == "given"
    with pytest.raises(ValueError, match="trainable"):
        fp.derive_dp_defaults(dataset_size=2_000, epsilon=8, delta=1e-4, trainable="adapters")


@pytest.mark.parametrize("eps", [3.0, 8.0])
def test_plan_for_derived_defaults_spends_at_most_the_target(eps: float) -> None:
    from dpbert.config.finetune import FinetuneConfig, PrivacyConfig, plan_dp, resolve_dp

    n = 2_000
    config = FinetuneConfig(dp=True, privacy=PrivacyConfig(epsilon=eps, accountant="pld"))
    resolved, derived = resolve_dp(n, config)
    assert derived is not None and resolved.private.batch_size == derived.expected_batch_size
    assert resolved.privacy.clip_norm == 0.1 and resolved.private.epochs == 5.0
    plan = plan_dp(n, config)
    assert plan.spent_epsilon <= eps and plan.spent_epsilon >= 0.97 * eps  # spends the budget, never more
    assert plan.ledger.epsilon() == pytest.approx(plan.spent_epsilon, rel=1e-6)
    assert plan.steps == derived.steps and plan.expected_batch_size == derived.expected_batch_size
    assert plan_dp(n, resolved).ledger == plan.ledger  # a resolved recipe rebuilds the same ledger


def test_a_sweep_composes_every_run_in_one_ledger() -> None:
    from dpbert.config.finetune import FinetuneConfig, OptimConfig, PrivacyConfig, SweepConfig, plan_dp

    optim = OptimConfig(trainable="bias", learning_rate=1e-3, batch_size=100, epochs=2, dropout=0.0)
    privacy = PrivacyConfig(epsilon=4.0, clip_norm=0.1, accountant="rdp")
    single = plan_dp(1_000, FinetuneConfig(dp=True, private=optim, privacy=privacy))
    sweep = plan_dp(1_000, FinetuneConfig(dp=True, private=optim, privacy=privacy,
                                          sweep=SweepConfig(enabled=True, learning_rate_factors=(0.5, 1, 2))))  # fmt: skip
    assert sweep.runs == 3 and len(sweep.ledger.stages) == 3 and sweep.steps == single.steps == 20
    assert sweep.spent_epsilon <= 4.0 and sweep.ledger.epsilon() <= 4.0
    assert sweep.noise_multiplier > 1.2 * single.noise_multiplier  # three runs share one budget
    with pytest.raises(ValueError, match="sweep.enabled"):
        FinetuneConfig(dp=False, sweep=SweepConfig(enabled=True))


def test_nonprivate_learning_rate_scales_with_the_width_and_epochs_with_n() -> None:
    lrs = {h: fp.nonprivate_learning_rate(h) for h in (1024, 768, 128, 16)}
    # BERT-Large's 2e-5 at width 1024, x 1024 / width below it, capped at 1e-3 (width 16 would give 1.28e-3).
    assert lrs == pytest.approx({1024: 2e-5, 768: 2.6667e-5, 128: 1.6e-4, 16: 1e-3}, rel=1e-4)
    d = fp.derive_nonprivate_defaults(dataset_size=2_000, hidden_size=128)
    assert d.epochs == 5.0 and d.learning_rate == pytest.approx(1.6e-4)
    assert fp.derive_nonprivate_defaults(dataset_size=67_349, hidden_size=1024).epochs == 3.0  # BERT's 3 on SST-2
    given = fp.derive_nonprivate_defaults(dataset_size=2_000, hidden_size=128, learning_rate=1e-3, epochs=2)
    assert (given.learning_rate, given.epochs, set(given.reasons.values())) == (1e-3, 2.0, {"given"})
    assert fp.describe(d) == {"epochs": 5.0, "learning_rate": d.learning_rate, "reasons": d.reasons}
    with pytest.raises(ValueError, match="hidden_size"):
        fp.nonprivate_learning_rate(0)
