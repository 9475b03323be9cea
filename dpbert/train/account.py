"""`dpbert account`: epsilon (or a calibrated noise multiplier) for a schedule, with its ledger.

`ledger_for_schedule(schedule, ...)` is the ledger of a schedule given stage by stage (`dpbert
account --dataset-size N --batch-size B --steps T --noise-multiplier S --delta D`, the lists
parsed in `dpbert.cli`); with `target_epsilon` instead of the schedule's multipliers it
calibrates sigma (shared, or `per_stage` for equal per-stage shares). `ledger_from_recipe(path,
...)` (`dpbert account RECIPE [--set k=v] [--dataset-size STORED]`) builds the plan the trainer
builds (`dpbert.config.plan.plan_recipe`: public N and bound, calibration, physical batch sizes,
budget check): N is the recipe's declared `privacy.dataset_size`, else the stored count (the
token store's, `--dataset-size`, or `target.dataset_size`) rounded down to 2 significant digits. `account_report(ledger)` is the text the command prints.

Guarantees: the printed epsilon is `PrivacyLedger.epsilon()` of the printed ledger, so the
report and the ledger cannot disagree; `as_json` (`--json`) gives one JSON object with at least
`epsilon`, `delta`, `noise_multiplier` (a list when there are several stages), `accountant`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpbert.config.plan import plan_recipe
from dpbert.config.recipe import load_recipe
from dpbert.data.store import TokenStore
from dpbert.privacy.accounting import PrivacyLedger, calibrate_noise_multiplier
from dpbert.privacy.schedule import BatchSchedule


def ledger_for_schedule(
    schedule: BatchSchedule,
    *,
    dataset_size: int,
    delta: float,
    accountant: str = "pld",
    clip_norm: float = 1.0,
    target_epsilon: float | None = None,
    per_stage: bool = False,
) -> PrivacyLedger:
    """The ledger of `schedule` on `dataset_size` examples; with `target_epsilon`, its noise
    multipliers are first calibrated to it (shared, or equal per-stage shares with `per_stage`)."""
    if target_epsilon is not None:
        schedule = calibrate_noise_multiplier(
            schedule,
            dataset_size=dataset_size,
            target_epsilon=target_epsilon,
            delta=delta,
            accountant=accountant,
            per_stage=per_stage,
        )
    return PrivacyLedger.for_schedule(
        schedule,
        dataset_size=dataset_size,
        delta=delta,
        clip_norm=clip_norm,
        accountant=accountant,
        target_epsilon=target_epsilon,
    )


def ledger_from_recipe(
    recipe_path: str | Path, *, overrides: Sequence[str] = (), dataset_size: int | None = None
) -> PrivacyLedger:
    """The ledger the trainer plans for the recipe (`dpbert.config.plan.plan_recipe`, the builder
    `dpbert pretrain` calls). `dataset_size`: the count of stored training units; None: counted in
    the recipe's token store (`data.store`), else its `target.dataset_size`. Only a recipe that
    declares no `privacy.dataset_size` takes N from that count (rounded down)."""
    recipe = load_recipe(recipe_path, overrides)
    if not recipe.privacy.enabled:
        raise ValueError(f"{recipe_path}: privacy.enabled is false; a non-private recipe has no epsilon")
    stored = dataset_size
    if stored is None and recipe.data.store is not None:
        store = TokenStore.open(recipe.data.store, split="train")
        stored = store.document_offsets().size - 1 if recipe.privacy.unit == "document" else len(store)
    if stored is None:
        stored = recipe.target.dataset_size
    plan = plan_recipe(recipe, stored)
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


def account_report(ledger: PrivacyLedger, *, as_json: bool = False) -> str:
    """The `dpbert account` report of `ledger` (one JSON object with `as_json`); raises
    ValueError when the ledger spends more than its target epsilon."""
    if ledger.target_epsilon is not None:
        ledger.check_budget()
    info = summary(ledger)
    return json.dumps(info, sort_keys=True) if as_json else format_summary(info)
