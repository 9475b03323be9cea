"""dpbert.train.sweep: the arms of recipes/sweep_tiny.yaml differ only in their batch-size
schedule, spend the same epsilon and process the same examples (arm construction only: the
sweep itself is a benchmark, `dpbert sweep recipes/sweep_tiny.yaml --output-dir DIR`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpbert.config.plan import make_plan
from dpbert.config.recipe import NONPRIVATE_OVERRIDES, recipe_to_dict
from dpbert.train import sweep as sweep_lib
from dpbert.train.pretrain_report import RunResult
from dpbert.train.sweep import arm_recipe, build_arms, format_table, load_sweep, plot_sweep

SWEEP = Path(__file__).resolve().parents[1] / "recipes" / "sweep_tiny.yaml"


@pytest.fixture(scope="module")
def spec():
    return load_sweep(SWEEP)


def test_sweep_tiny_has_the_arms_the_paper_result_needs(spec):
    arms = build_arms(spec)
    fixed = [a for a in arms if a.private and len(a.stages) == 1 and a.unit == "sequence"]
    schedules = [a for a in arms if a.private and len(a.stages) > 1]
    nonprivate = [a for a in arms if not a.private]
    sizes = sorted(a.expected_batch_size for a in fixed)
    assert len(sizes) >= 4 and sizes[-1] >= 16 * sizes[0]
    assert len(schedules) == 1 and len(nonprivate) == 1
    documents = [a for a in arms if a.unit == "document"]
    assert len(documents) == 1 and documents[0].private and documents[0].sequences_per_unit > 1
    assert arm_recipe(spec, documents[0]).privacy.unit == "document"
    batch_sizes = [b for _, b in schedules[0].stages]
    assert batch_sizes == sorted(batch_sizes) and len(set(batch_sizes)) == len(batch_sizes) >= 2


def test_arms_process_the_same_examples_and_differ_only_in_the_schedule(spec):
    arms = build_arms(spec)
    examples = [a.examples for a in arms]
    assert max(examples) <= 1.05 * min(examples)
    assert all(abs(e - spec.examples) <= 0.05 * spec.examples for e in examples)
    recipes = [recipe_to_dict(arm_recipe(spec, a)) for a in arms]
    for arm, r in zip(arms, recipes, strict=True):
        assert [(s["steps"], s["expected_batch_size"]) for s in r["schedule"]] == list(arm.stages)
        assert r["privacy"]["enabled"] == arm.private

    def rest(r):
        r = json.loads(json.dumps(r))
        r.pop("schedule")
        r["optimizer"].pop("warmup_steps")
        r["privacy"].pop("enabled")
        return r

    first = rest(recipes[0])
    for arm, r in zip(arms, recipes, strict=True):
        if arm.unit == "document":  # the same model, data and optimizer; its privacy section is its unit's,
            mine, base = rest(r), json.loads(json.dumps(first))  # and its micro-batches count documents
            assert mine["train"].pop("microbatch_size") * arm.sequences_per_unit == base["train"].pop("microbatch_size")
            # `reference` is the report's non-private figure of each recipe file, not a setting.
            assert {k: v for k, v in mine.items() if k not in ("privacy", "reference")} == {
                k: v for k, v in base.items() if k not in ("privacy", "reference")
            }
            assert r["privacy"]["target_epsilon"] == first["privacy"]["target_epsilon"]
        elif arm.private:
            assert rest(r) == first, arm.name
        else:  # the non-private reference may carry its own tuning (nonprivate_set) and the twin's optimizer
            tuned = {o.partition("=")[0] for o in (*spec.nonprivate_set, *NONPRIVATE_OVERRIDES)}
            assert not r["optimizer"]["noise_variance_correction"] and r["optimizer"]["ema_decay"] is None
            mine, base = _flatten(rest(r)), _flatten(first)
            assert {k for k in mine if mine[k] != base.get(k)} <= tuned


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_private_arms_spend_the_same_epsilon(spec):
    """Each private arm, planned exactly as training plans it, spends the target within 1%."""
    n = load_recipe_dataset_size(spec)
    epsilons = []
    for arm in build_arms(spec):
        if not arm.private:
            continue
        recipe = arm_recipe(spec, arm)
        units = n if arm.unit == "sequence" else recipe.privacy.dataset_size  # documents, declared
        plan = make_plan(recipe, units, dataset_size_source="declared")
        epsilons.append(plan.ledger.epsilon())
        assert len({s.noise_multiplier for s in plan.schedule.stages}) == 1  # one sigma for a schedule too
    target = arm_recipe(spec, build_arms(spec)[0]).privacy.target_epsilon
    assert all(e <= target for e in epsilons)
    assert max(epsilons) <= 1.01 * min(epsilons)


def load_recipe_dataset_size(spec) -> int:
    n = arm_recipe(spec, build_arms(spec)[0]).privacy.dataset_size
    assert n is not None, "the sweep's recipe declares its public dataset size"
    return n


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"set": ["schedule.0.steps=3"]}, "differ in more than the batch size"),
        ({"set": ["privacy.target_epsilon=3"]}, "differ in more than the batch size"),
        ({"schedule": [512, 256]}, "strictly increasing"),
        ({"color": "red"}, "unknown field"),
    ],
)
def test_bad_sweep_files_name_the_field(tmp_path, bad, match):
    raw = {"recipe": str(SWEEP.parent / "tiny.yaml"), "examples": 1024, "batch_sizes": [64, 128]} | bad
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        load_sweep(path)


def test_run_sweep_writes_rows_table_and_figure(tmp_path, monkeypatch, capsys):
    """The orchestration with the training stubbed out: one row per arm with the issue's fields,
    sweep.json, sweep.png, a table; a second call reuses the finished arms."""
    path = tmp_path / "sweep.yaml"
    path.write_text(
        json.dumps(
            {
                "recipe": str(SWEEP.parent / "tiny.yaml"),
                "examples": 2048,
                "batch_sizes": [64, 256, 1024],
                "schedule": [256, 1024],
                "nonprivate_batch_size": 64,
                "set": ["train.eval_every=0"],
            }
        )
    )
    calls = []

    def fake_pretrain(recipe, run_dir, *, overrides, **kw):
        calls.append(list(overrides))
        private = "privacy.enabled=true" in overrides
        return RunResult(
            run_dir=Path(run_dir),
            steps_done=1,
            total_steps=1,
            stopped_early=False,
            epsilon=7.99 if private else None,
            delta=1e-6 if private else None,
            eval_mlm_accuracy=0.12 if private else 0.2,
            eval_mlm_loss=5.0,
            wall_time_s=1.0,
            eval_unigram_accuracy=0.07,
            unigram_token="the",
        )

    monkeypatch.setattr(sweep_lib, "pretrain", fake_pretrain)
    rows = sweep_lib.run_sweep(path, tmp_path / "out", log=print)
    assert len(calls) == 5 and all(any(o.startswith("data.store=") for o in c) for c in calls)
    saved = json.loads((tmp_path / "out" / "sweep.json").read_text())["arms"]
    assert saved == rows and len(rows) == 5
    for row in rows:
        assert {
            "name",
            "expected_batch_size",
            "epsilon",
            "examples",
            "steps",
            "mlm_accuracy",
            "unigram_accuracy",
            "private",
            "mlm_loss",
        } <= set(row)
    assert rows[3]["expected_batch_size"] == 1024 and rows[3]["steps"] == 4 + 1
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "non-private B=64" in out and "schedule 256->1024" in out
    sweep_lib.run_sweep(path, tmp_path / "out", log=print)
    assert len(calls) == 5  # nothing retrained


def test_table_and_plot_from_rows(tmp_path):
    rows = [
        {
            "name": f"B={b}",
            "expected_batch_size": b,
            "epsilon": 8.0,
            "examples": 4096,
            "steps": 4096 // b,
            "mlm_accuracy": acc,
            "unigram_accuracy": 0.07,
            "private": True,
            "noise_multiplier": 0.6,
            "stages": [[4096 // b, b]],
            "mlm_loss": 7.0 - 10 * acc,
        }
        for b, acc in ((64, 0.08), (256, 0.1), (1024, 0.12))
    ] + [
        {
            "name": "non-private B=64",
            "expected_batch_size": 64,
            "epsilon": None,
            "examples": 4096,
            "steps": 64,
            "mlm_accuracy": 0.2,
            "unigram_accuracy": 0.07,
            "private": False,
            "stages": [[64, 64]],
            "mlm_loss": 5.0,
        }
    ]
    table = format_table(rows)
    assert "B=1024" in table and "+5.00" in table and "5.800" in table
    assert plot_sweep(rows, tmp_path / "s.png").stat().st_size > 0
