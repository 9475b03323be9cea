"""dpbert.privacy.batch_sizes and `dpbert plan`: the planner's sigma is the calibration training uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpbert.cli import main
from dpbert.config.plan import make_plan
from dpbert.config.recipe import load_recipe
from dpbert.privacy.batch_sizes import PlanRow, _recommend, plan_batch_sizes

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
N, EPSILON, DELTA = 45_000, 8.0, 1e-6


def test_planner_sigma_equals_the_calibration_training_uses():
    plan = plan_batch_sizes(
        dataset_size=N, target_epsilon=EPSILON, delta=DELTA, examples=40_960, batch_sizes=(256, 2048), accountant="rdp"
    )
    assert [r.expected_batch_size for r in plan.rows] == [256, 2048]
    for row in plan.rows:
        recipe = load_recipe(
            RECIPES / "tiny.yaml",
            [
                f"schedule=[{{steps: {row.steps}, expected_batch_size: {row.expected_batch_size}}}]",
                "optimizer.warmup_steps=0",
                "privacy.noise_multiplier=null",
                f"privacy.target_epsilon={EPSILON}",
                f"privacy.delta={DELTA}",
                "privacy.accountant=rdp",
                "privacy.calibrate=shared",
            ],
        )
        trained = make_plan(recipe, N, dataset_size_source="declared")
        assert trained.schedule.stages[0].noise_multiplier == row.noise_multiplier
        assert trained.ledger.epsilon() == pytest.approx(row.epsilon, rel=1e-9)
        assert row.epsilon <= EPSILON
        assert row.noise_over_batch == pytest.approx(row.noise_multiplier / row.expected_batch_size)
        assert row.examples == row.steps * row.expected_batch_size
    # The paper's point: at the same epsilon and examples, sigma grows far slower than B.
    small, large = plan.rows
    assert large.noise_multiplier < 2 * small.noise_multiplier
    assert large.noise_over_batch < small.noise_over_batch / 4


def _row(b: int, steps: int, sigma: float) -> PlanRow:
    return PlanRow(
        expected_batch_size=b,
        steps=steps,
        examples=b * steps,
        epochs=1.0,
        sampling_rate=0.01,
        noise_multiplier=sigma,
        epsilon=8.0,
        noise_over_batch=sigma / b,
        noise_over_sqrt_batch=sigma / b**0.5,
    )


def test_recommendation_respects_min_steps_and_diminishing_returns():
    # sigma nearly flat in B: doubling pays (~1.4x per doubling) until the steps run out.
    rows = [_row(256, 400, 0.5), _row(512, 200, 0.52), _row(1024, 100, 0.55), _row(2048, 50, 0.6)]
    assert _recommend(rows, min_steps=100, min_gain=1.15)[0] == 1024
    assert _recommend(rows, min_steps=10, min_gain=1.15)[0] == 2048
    # sigma ~ sqrt(B) beyond 512 (small q regime): no gain from larger batches, keep the steps.
    rows = [_row(256, 400, 0.5), _row(512, 200, 0.55), _row(1024, 100, 0.78), _row(2048, 50, 1.1)]
    assert _recommend(rows, min_steps=10, min_gain=1.15)[0] == 512
    assert _recommend(rows, min_steps=1000, min_gain=1.15)[0] is None


def test_plan_needs_exactly_one_budget():
    with pytest.raises(ValueError, match="exactly one of examples"):
        plan_batch_sizes(dataset_size=N, target_epsilon=EPSILON, delta=DELTA)
    with pytest.raises(ValueError, match="exactly one of examples"):
        plan_batch_sizes(dataset_size=N, target_epsilon=EPSILON, delta=DELTA, examples=10, steps=10)


def test_plan_cli_prints_a_table_and_json(capsys):
    args = [
        "plan",
        "--dataset-size",
        str(N),
        "--target-epsilon",
        "8",
        "--delta",
        "1e-6",
        "--steps",
        "40",
        "--batch-sizes",
        "512,1024",
        "--min-steps",
        "10",
    ]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "sigma/B" in table and "recommended" in table and "1,024" in table
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budget"] == "steps" and [r["steps"] for r in out["rows"]] == [40, 40]
    assert out["recommended"] in (512, 1024)


def test_document_unit_labels_documents_and_keeps_the_sequence_sigma(capsys):
    base = ["plan", "--dataset-size", "4000", "--target-epsilon", "8", "--delta", "1e-6", "--examples", "8192"]
    base += ["--batch-sizes", "128,256"]
    document = [*base, "--unit", "document", "--max-sequences-per-document", "16"]
    assert main(base) == 0
    sequence_table = capsys.readouterr().out
    assert main(document) == 0
    document_table = capsys.readouterr().out
    assert "document" not in sequence_table and "batch B" in sequence_table
    assert "N = 4,000 documents (privacy unit: one document, at most 16 sequences each)" in document_table
    assert "fixed documents" in document_table and "docs B" in document_table and "batch B" not in document_table
    assert "seqs <= B*K" in document_table and "2,048" in document_table and "4,096" in document_table

    assert main([*base, "--json"]) == 0
    sequence = json.loads(capsys.readouterr().out)
    assert main([*document, "--json"]) == 0
    documents = json.loads(capsys.readouterr().out)
    assert documents["unit"] == "document" and documents["max_sequences_per_document"] == 16
    assert [r["noise_multiplier"] for r in documents["rows"]] == [r["noise_multiplier"] for r in sequence["rows"]]
    assert [r["steps"] for r in documents["rows"]] == [64, 32]
    assert [r["max_sequences_per_step"] for r in documents["rows"]] == [128 * 16, 256 * 16]
    assert sequence["unit"] == "sequence" and [r["max_sequences_per_step"] for r in sequence["rows"]] == [None, None]


def test_a_document_cap_without_the_document_unit_is_refused(capsys):
    argv = ["plan", "--dataset-size", "4000", "--target-epsilon", "8", "--delta", "1e-6", "--steps", "40"]
    assert main([*argv, "--max-sequences-per-document", "16"]) == 1
    err = capsys.readouterr().err
    assert "--max-sequences-per-document" in err and "--unit document" in err
    with pytest.raises(ValueError, match="max_sequences_per_document"):
        plan_batch_sizes(dataset_size=4000, target_epsilon=8.0, delta=1e-6, steps=40, max_sequences_per_document=16)
    with pytest.raises(ValueError, match="max_sequences_per_document must be >= 1"):
        plan_batch_sizes(
            dataset_size=4000, target_epsilon=8.0, delta=1e-6, steps=40, unit="document", max_sequences_per_document=0
        )
