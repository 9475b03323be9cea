"""`dpbert account`: flags, calibration, JSON output, recipe, and clear errors."""

import json
from pathlib import Path

import pytest

from dpbert.cli import main
from dpbert.privacy import BatchSchedule, Stage, compute_epsilon


def run_json(capsys, *argv):
    assert main(["account", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_epsilon_from_flags_matches_the_library(capsys):
    out = run_json(
        capsys,
        "--dataset-size",
        "10000",
        "--batch-size",
        "100,400",
        "--steps",
        "30,20",
        "--noise-multiplier",
        "1.2,1.5",
        "--delta",
        "1e-6",
        "--accountant",
        "rdp",
    )
    schedule = BatchSchedule(
        stages=(
            Stage(steps=30, expected_batch_size=100, noise_multiplier=1.2),
            Stage(steps=20, expected_batch_size=400, noise_multiplier=1.5),
        )
    )
    assert out["epsilon"] == pytest.approx(compute_epsilon(schedule, dataset_size=10_000, delta=1e-6, accountant="rdp"))
    assert out["noise_multiplier"] == [1.2, 1.5] and out["accountant"] == "rdp" and out["delta"] == 1e-6
    assert [s["sampling_rate"] for s in out["stages"]] == pytest.approx([0.01, 0.04])
    assert out["ledger"]["sampling"] == "poisson"


def test_target_epsilon_calibrates_sigma(capsys):
    out = run_json(
        capsys,
        "--dataset-size",
        "5000",
        "--batch-size",
        "50",
        "--steps",
        "100",
        "--target-epsilon",
        "1.0",
        "--delta",
        "1e-5",
        "--accountant",
        "rdp",
    )
    assert isinstance(out["noise_multiplier"], float) and out["noise_multiplier"] > 0.5
    assert 0.99 <= out["epsilon"] <= 1.0


def test_text_report_has_breakdown_and_ledger(capsys):
    assert (
        main(
            [
                "account",
                "--dataset-size",
                "1000",
                "--batch-size",
                "10",
                "--steps",
                "5",
                "--noise-multiplier",
                "1.0",
                "--delta",
                "1e-5",
                "--accountant",
                "rdp",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("epsilon = ") and "expected_batch" in text and '"privacy_unit"' in text


def test_recipe_path_uses_the_trainers_plan(capsys):
    tiny = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")
    # A declared N needs no store: the ledger is the run's (N 180,000 declared, bound 1.25 N).
    out = run_json(capsys, tiny)
    assert out["ledger"]["dataset_size"] == 180_000 and out["ledger"]["dataset_size_source"] == "declared"
    assert out["ledger"]["dataset_size_bound"] == 225_000 and 7.9 < out["epsilon"] <= 8.0
    # Without a declared N, the stored count given is rounded down to 2 significant digits.
    out = run_json(capsys, tiny, "--set", "privacy.dataset_size=null", "--dataset-size", "202033")
    assert (out["ledger"]["dataset_size"], out["ledger"]["dataset_size_source"]) == (200_000, "rounded")
    # A store above the public bound is refused, as pretrain refuses it.
    assert main(["account", tiny, "--dataset-size", "230000"]) == 1
    assert "more training sequences than the public bound 225000" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (
            [
                "--dataset-size",
                "100",
                "--batch-size",
                "200",
                "--steps",
                "3",
                "--noise-multiplier",
                "1",
                "--delta",
                "1e-5",
            ],
            "sampling_rate",
        ),
        (
            [
                "--dataset-size",
                "100",
                "--batch-size",
                "10",
                "--steps",
                "3",
                "--noise-multiplier",
                "-1",
                "--delta",
                "1e-5",
            ],
            "noise_multiplier",
        ),
        (
            ["--dataset-size", "100", "--batch-size", "10", "--steps", "3", "--noise-multiplier", "1", "--delta", "2"],
            "delta",
        ),
        (["--dataset-size", "100", "--batch-size", "10", "--steps", "3", "--delta", "1e-5"], "--noise-multiplier"),
        (["--batch-size", "10", "--steps", "3", "--noise-multiplier", "1", "--delta", "1e-5"], "--dataset-size"),
    ],
)
def test_bad_flags_exit_1_naming_the_field(capsys, argv, field):
    assert main(["account", *argv]) == 1
    assert field in capsys.readouterr().err
