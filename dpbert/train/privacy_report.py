"""`dpbert account`: epsilon (or a calibrated noise multiplier) for a schedule, with its ledger.

From flags: `--dataset-size N --batch-size B --steps T --noise-multiplier S --delta D`, where
B, T and S may be comma-separated lists (one value per stage); `--target-epsilon E` instead of
`--noise-multiplier` calibrates sigma (shared, or `--per-stage` for equal per-stage shares).
From a recipe: `dpbert account RECIPE [--set k=v] [--dataset-size N]` builds the same plan
the trainer builds (`dpbert.config.plan.make_plan`: calibration, physical batch sizes,
budget check); N defaults to the size of the recipe's token store (`data.store`), else to the
recipe's planned `target.dataset_size`.

Guarantees: the printed epsilon is `PrivacyLedger.epsilon()` of the printed ledger, so the
report and the ledger cannot disagree; `--json` prints one JSON object with at least
`epsilon`, `delta`, `noise_multiplier` (a list when there are several stages), `accountant`.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from dpbert.config.plan import make_plan
from dpbert.config.recipe import load_recipe
from dpbert.data.store import TokenStore
from dpbert.privacy.accounting import PrivacyLedger, calibrate_noise_multiplier
from dpbert.privacy.schedule import BatchSchedule, Stage


def _ints(text: str, field: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise ValueError(f"--{field} must be an integer or a comma-separated list, got {text!r}") from None
    return values


def _floats(text: str, field: str) -> list[float]:
    try:
        return [float(v) for v in str(text).split(",")]
    except ValueError:
        raise ValueError(f"--{field} must be a number or a comma-separated list, got {text!r}") from None


def _broadcast(values: list[Any], n: int, field: str) -> list[Any]:
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"--{field} has {len(values)} values but the schedule has {n} stages")
    return values


def ledger_from_flags(args: argparse.Namespace) -> PrivacyLedger:
    """The ledger described by the command-line flags (calibrating sigma if asked)."""
    for name in ("dataset_size", "batch_size", "steps", "delta"):
        if getattr(args, name) is None:
            raise ValueError(f"--{name.replace('_', '-')} is required without a RECIPE")
    if (args.noise_multiplier is None) == (args.target_epsilon is None):
        raise ValueError("give exactly one of --noise-multiplier and --target-epsilon")
    batches = _ints(args.batch_size, "batch-size")
    steps = _ints(args.steps, "steps")
    n = max(len(batches), len(steps))
    sigmas = _floats(args.noise_multiplier, "noise-multiplier") if args.noise_multiplier is not None else [1.0]
    n = max(n, len(sigmas))
    schedule = BatchSchedule(
        stages=tuple(
            Stage(steps=t, expected_batch_size=b, noise_multiplier=s)
            for t, b, s in zip(
                _broadcast(steps, n, "steps"),
                _broadcast(batches, n, "batch-size"),
                _broadcast(sigmas, n, "noise-multiplier"),
                strict=True,
            )
        )
    )
    if args.target_epsilon is not None:
        schedule = calibrate_noise_multiplier(
            schedule,
            dataset_size=args.dataset_size,
            target_epsilon=args.target_epsilon,
            delta=args.delta,
            accountant=args.accountant,
            per_stage=args.per_stage,
        )
    return PrivacyLedger.for_schedule(
        schedule,
        dataset_size=args.dataset_size,
        delta=args.delta,
        clip_norm=args.clip_norm,
        accountant=args.accountant,
        target_epsilon=args.target_epsilon,
    )


def ledger_from_recipe(args: argparse.Namespace) -> PrivacyLedger:
    """The ledger the trainer would plan for the recipe (same code path as `dpbert pretrain`)."""

    recipe = load_recipe(args.recipe, args.set or ())
    if not recipe.privacy.enabled:
        raise ValueError(f"{args.recipe}: privacy.enabled is false; a non-private recipe has no epsilon")
    dataset_size = args.dataset_size
    if dataset_size is None and recipe.data.store is None:
        # A recipe written for data not at hand states its planned N (recipe field target.dataset_size).
        dataset_size = recipe.target.dataset_size
    if dataset_size is None:
        if recipe.data.store is None:
            raise ValueError(
                f"{args.recipe}: give --dataset-size (the recipe has no data.store to count examples in, nor target.dataset_size)"
            )
        dataset_size = len(TokenStore.open(recipe.data.store, split="train"))
    plan = make_plan(recipe, dataset_size)
    assert plan.ledger is not None
    return plan.ledger


def summary(ledger: PrivacyLedger) -> dict[str, Any]:
    """epsilon, delta (and with truncation), noise multipliers, per-stage breakdown, ledger."""
    eps = ledger.epsilon()
    sigmas = [s.noise_multiplier for s in ledger.stages]
    extra = ledger.truncation_delta(eps) if math.isfinite(eps) else 0.0
    return {
        "epsilon": eps,
        "delta": ledger.delta,
        "delta_with_truncation": ledger.delta + extra,
        "noise_multiplier": sigmas[0] if len(sigmas) == 1 else sigmas,
        "accountant": ledger.accountant,
        "total_steps": ledger.total_steps,
        "stages": [
            {
                "steps": s.steps,
                "expected_batch_size": s.expected_batch_size,
                "sampling_rate": s.sampling_rate,
                "noise_multiplier": s.noise_multiplier,
                "noise_std_of_mean_gradient": s.noise_multiplier * ledger.clip_norm / s.expected_batch_size,
                "epsilon_alone": e,
            }
            for s, e in zip(ledger.stages, ledger.stage_epsilons(), strict=True)
        ],
        "ledger": ledger.to_dict(),
    }


def format_summary(info: dict[str, Any]) -> str:
    lines = [
        f"epsilon = {info['epsilon']:.4f} at delta = {info['delta']:g} "
        f"({info['accountant']} accountant, Poisson sampling, add/remove one example sequence)",
    ]
    if info["delta_with_truncation"] != info["delta"]:
        lines.append(f"with truncation of overflowing batches: delta = {info['delta_with_truncation']:.6g}")
    lines.append("stage  steps  expected_batch  sampling_rate  noise_multiplier  noise_std(mean grad)  epsilon_alone")
    for i, s in enumerate(info["stages"]):
        lines.append(
            f"{i:>5}  {s['steps']:>5}  {s['expected_batch_size']:>14}  {s['sampling_rate']:>13.4g}  "
            f"{s['noise_multiplier']:>16.4f}  {s['noise_std_of_mean_gradient']:>20.4g}  {s['epsilon_alone']:>13.4f}"
        )
    lines.append("(stage epsilons do not add up: the total composes them)")
    lines.append("ledger:")
    lines.append(json.dumps(info["ledger"], indent=2, sort_keys=True))
    return "\n".join(lines)


def run_account(args: argparse.Namespace) -> int:
    """The `dpbert account` command: print the report (or one JSON object with --json)."""
    ledger = ledger_from_recipe(args) if args.recipe else ledger_from_flags(args)
    if ledger.target_epsilon is not None:
        ledger.check_budget()
    info = summary(ledger)
    print(json.dumps(info, sort_keys=True) if args.json else format_summary(info))
    return 0
