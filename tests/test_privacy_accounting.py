"""Accounting: agreement with dp_accounting, Opacus and the analytic Gaussian; calibration;
the ledger; the budget check; schedules; bad input."""

import json
import math

import dp_accounting
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from dpbert.privacy import (
    BatchSchedule,
    LedgerStage,
    PrivacyLedger,
    Stage,
    calibrate_noise_multiplier,
    compute_epsilon,
)

TWO_STAGES = BatchSchedule(
    stages=(
        Stage(steps=30, expected_batch_size=100, noise_multiplier=1.2),
        Stage(steps=20, expected_batch_size=400, noise_multiplier=1.5),
    )
)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_matches_direct_dp_accounting_composition(accountant):
    n, delta = 10_000, 1e-6
    if accountant == "pld":
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        acc = dp_accounting.rdp.RdpAccountant()
    for q, sigma, steps in ((0.01, 1.2, 30), (0.04, 1.5, 20)):
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count=steps)
    expected = acc.get_epsilon(delta)
    got = compute_epsilon(TWO_STAGES, dataset_size=n, delta=delta, accountant=accountant)
    assert got == pytest.approx(expected, rel=1e-9)
    assert 0 < got < math.inf


def analytic_gaussian_epsilon(sigma, delta):
    """Balle & Wang (2018), Thm 8: the exact epsilon of one Gaussian mechanism (sensitivity 1)."""

    def delta_of(eps):
        return norm.cdf(0.5 / sigma - eps * sigma) - math.exp(eps) * norm.cdf(-0.5 / sigma - eps * sigma)

    return brentq(lambda e: delta_of(e) - delta, 0.0, 100.0, xtol=1e-12)


@pytest.mark.parametrize("sigma", [0.8, 2.0])
def test_pld_matches_the_analytic_gaussian_mechanism(sigma):
    # q = 1, one step: the plain Gaussian mechanism, whose exact epsilon is published.
    schedule = BatchSchedule.constant(steps=1, expected_batch_size=50, noise_multiplier=sigma)
    got = compute_epsilon(schedule, dataset_size=50, delta=1e-5)
    exact = analytic_gaussian_epsilon(sigma, 1e-5)
    # PLD is pessimistic: never below the exact value, and within its discretization.
    assert exact - 1e-9 <= got <= exact + 2e-3


def test_rdp_matches_opacus_on_the_mnist_setting():
    from opacus.accountants.analysis import rdp as opacus_rdp
    from opacus.accountants.rdp import RDPAccountant

    # N = 60,000, B = 256, sigma = 1.1, 60 epochs, delta = 1e-5 (the TF-Privacy/Opacus tutorial).
    steps = 60 * 60_000 // 256
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = opacus_rdp.compute_rdp(q=256 / 60_000, noise_multiplier=1.1, steps=steps, orders=orders)
    opacus_eps, _ = opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    ours = compute_epsilon(
        BatchSchedule.constant(steps=steps, expected_batch_size=256, noise_multiplier=1.1),
        dataset_size=60_000,
        delta=1e-5,
        accountant="rdp",
    )
    assert ours == pytest.approx(opacus_eps, rel=1e-3)
    assert ours == pytest.approx(2.5966, abs=1e-3)


def test_calibration_round_trips_sigma_epsilon_sigma():
    sigma, n, delta = 1.3, 5000, 1e-5
    schedule = BatchSchedule.constant(steps=100, expected_batch_size=50, noise_multiplier=sigma)
    for accountant in ("rdp", "pld"):
        eps = compute_epsilon(schedule, dataset_size=n, delta=delta, accountant=accountant)
        back = calibrate_noise_multiplier(
            schedule.with_noise_multipliers([5.0]),
            dataset_size=n,
            target_epsilon=eps,
            delta=delta,
            accountant=accountant,
        )
        (recovered,) = back.noise_multipliers
        assert recovered == pytest.approx(sigma, rel=5e-3)
        assert compute_epsilon(back, dataset_size=n, delta=delta, accountant=accountant) <= eps


def test_per_stage_calibration_gives_equal_shares_within_the_target():
    n, delta, target = 10_000, 1e-5, 2.0
    out = calibrate_noise_multiplier(
        TWO_STAGES, dataset_size=n, target_epsilon=target, delta=delta, accountant="rdp", per_stage=True
    )
    sigmas = out.noise_multipliers
    assert sigmas[1] > sigmas[0]  # the larger sampling rate needs more noise for the same share
    alone = [
        compute_epsilon(BatchSchedule(stages=(s,)), dataset_size=n, delta=delta, accountant="rdp") for s in out.stages
    ]
    assert alone[0] == pytest.approx(alone[1], rel=0.01)
    total = compute_epsilon(out, dataset_size=n, delta=delta, accountant="rdp")
    assert target * 0.97 <= total <= target


def test_unreachable_target_is_refused_naming_the_field():
    schedule = BatchSchedule.constant(steps=10, expected_batch_size=100, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="target_epsilon"):
        # q = 1 and 10 steps: even sigma = 1000 spends more than 1e-4.
        calibrate_noise_multiplier(schedule, dataset_size=100, target_epsilon=1e-4, delta=1e-5, accountant="rdp")
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise_multiplier(schedule, dataset_size=100, target_epsilon=0.0, delta=1e-5)


def make_ledger(**kw):
    args = dict(dataset_size=10_000, delta=1e-6, clip_norm=1.0, accountant="rdp") | kw
    return PrivacyLedger.for_schedule(TWO_STAGES, **args)


def test_ledger_round_trips_through_json_and_recomputes_epsilon():
    ledger = make_ledger(physical_batch_sizes=[200, 600], target_epsilon=50.0)
    d = json.loads(ledger.to_json())
    assert d["sampling"] == "poisson" and d["privacy_unit"] == "one example sequence"
    assert d["stages"][1]["sampling_rate"] == pytest.approx(0.04)
    assert {"accountant", "delta", "dataset_size", "clip_norm"} <= set(d)
    again = PrivacyLedger.from_json(ledger.to_json())
    assert again == ledger
    assert again.epsilon() == compute_epsilon(TWO_STAGES, dataset_size=10_000, delta=1e-6, accountant="rdp")
    with pytest.raises(ValueError, match="unknown"):
        PrivacyLedger.from_dict(d | {"noise": 1})
    with pytest.raises(ValueError, match="sampling_rate"):
        PrivacyLedger.from_dict(d | {"stages": [d["stages"][0] | {"sampling_rate": 0.5}]})
    with pytest.raises(ValueError, match="sampling"):
        PrivacyLedger.from_dict(d | {"sampling": "shuffle"})


def test_spent_ledger_counts_only_completed_steps():
    ledger = make_ledger()
    assert ledger.spent(0).epsilon() == 0.0
    partial = ledger.spent(40)
    assert [s.steps for s in partial.stages] == [30, 10]
    expected = compute_epsilon(
        BatchSchedule(stages=(TWO_STAGES.stages[0], Stage(steps=10, expected_batch_size=400, noise_multiplier=1.5))),
        dataset_size=10_000,
        delta=1e-6,
        accountant="rdp",
    )
    assert partial.epsilon() == pytest.approx(expected)
    assert partial.epsilon() < ledger.epsilon()


def test_budget_check_refuses_configurations_and_continuations():
    ledger = make_ledger()
    eps = ledger.epsilon()
    assert ledger.check_budget(eps * 1.01) == eps
    with pytest.raises(ValueError, match="budget exceeded"):
        ledger.check_budget(eps * 0.99)
    capped = make_ledger(target_epsilon=eps * 1.01)
    more = LedgerStage(steps=50, expected_batch_size=400, noise_multiplier=1.5, sampling_rate=0.04)
    with pytest.raises(ValueError, match="budget exceeded"):
        capped.extended([more])
    small = LedgerStage(steps=1, expected_batch_size=1, noise_multiplier=50.0, sampling_rate=1e-4)
    assert capped.extended([small]).total_steps == 51


def test_truncation_is_accounted_and_a_too_small_cap_refused():
    safe = make_ledger(physical_batch_sizes=[200, 600])
    assert 0 <= safe.truncation_delta() < 1e-12
    tight = make_ledger(physical_batch_sizes=[110, 420])
    assert tight.truncation_probability() > 1e-3
    with pytest.raises(ValueError, match="physical_batch_size"):
        tight.check_budget()


def test_schedule_stage_lookup_and_increasing_batches():
    # The paper's shape: the batch grows over training.
    s = BatchSchedule(
        stages=(
            Stage(steps=10, expected_batch_size=1000, noise_multiplier=1.0),
            Stage(steps=5, expected_batch_size=4000, noise_multiplier=1.0),
        )
    )
    assert s.total_steps == 15
    assert s.stage_at(0).index == 0 and s.stage_at(9).index == 0
    pos = s.stage_at(10)
    assert pos.index == 1 and pos.step_in_stage == 0 and pos.stage.expected_batch_size == 4000
    with pytest.raises(ValueError, match="past the end"):
        s.stage_at(15)


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("noise_multiplier", lambda: Stage(steps=1, expected_batch_size=1, noise_multiplier=-0.5)),
        ("steps", lambda: Stage(steps=0, expected_batch_size=1, noise_multiplier=1.0)),
        ("expected_batch_size", lambda: Stage(steps=1, expected_batch_size=0, noise_multiplier=1.0)),
        ("stages", lambda: BatchSchedule(stages=())),
        ("delta", lambda: compute_epsilon(TWO_STAGES, dataset_size=10_000, delta=0.0)),
        ("delta", lambda: compute_epsilon(TWO_STAGES, dataset_size=10_000, delta=1.0)),
        ("sampling_rate", lambda: compute_epsilon(TWO_STAGES, dataset_size=300, delta=1e-5)),
        ("clip_norm", lambda: make_ledger(clip_norm=0.0)),
        ("accountant", lambda: make_ledger(accountant="moments")),
        ("dataset_size", lambda: make_ledger(dataset_size=0)),
    ],
)
def test_bad_input_names_the_field(field, make):
    with pytest.raises(ValueError, match=field):
        make()
