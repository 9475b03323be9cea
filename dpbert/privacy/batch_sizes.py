"""Batch-size planning at a fixed privacy budget (`dpbert plan`): the paper's insight as a table.

At a fixed epsilon and a fixed number of examples, the noise DP-SGD adds to the averaged gradient,
sigma C / B, falls as the expected batch B grows (sigma grows much more slowly than B); the price
is fewer steps. `plan_batch_sizes(...)` calibrates, for each candidate B, the noise multiplier with
the very function a run's plan calls, so a recipe with the same N, B, T, delta and accountant
trains with exactly the sigma shown; it recommends the largest B that leaves `min_steps` steps
unless a smaller one is past diminishing returns. Columns and the document unit:
docs/INTERNALS.md ("dpbert.privacy.batch_sizes").
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

from dpbert.privacy.accounting import calibrate_noise_multiplier, compute_epsilon
from dpbert.privacy.schedule import BatchSchedule, Stage

DEFAULT_BATCH_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A BERT trained from scratch leaves the unigram plateau only after enough *steps*, private or not
# (about 1,000 on the tiny recipe: docs/RESULTS.md, "Steps, not examples"): a batch that leaves
# fewer steps than this is not recommended, however small its noise.
DEFAULT_MIN_STEPS = 1000
# Doubling B must cut sigma/sqrt(B) by at least this factor to be worth the halved steps.
DEFAULT_MIN_GAIN = 1.15


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRow:
    """One candidate expected batch size, calibrated to the target."""

    expected_batch_size: int
    steps: int
    examples: int
    epochs: float
    sampling_rate: float
    noise_multiplier: float
    epsilon: float
    noise_over_batch: float  # sigma / B: noise std of the averaged gradient, per unit of clip norm
    noise_over_sqrt_batch: float  # sigma / sqrt(B): noise-to-signal at a fixed example budget (relative)
    max_sequences_per_step: int | None = None  # document unit with a cap K: B x K, else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """The table and the recommendation, with what they were computed for."""

    dataset_size: int
    target_epsilon: float
    delta: float
    accountant: str
    budget: str  # "examples" (a fixed example budget) or "steps" (a fixed step count)
    rows: tuple[PlanRow, ...]
    recommended: int | None  # an expected batch size of `rows`, or None when none qualifies
    reason: str
    unit: str = "sequence"  # what N, B and the examples count: "sequence" or "document"
    max_sequences_per_document: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset_size": self.dataset_size,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "budget": self.budget,
            "unit": self.unit,
            "max_sequences_per_document": self.max_sequences_per_document,
            "recommended": self.recommended,
            "reason": self.reason,
            "rows": [r.to_dict() for r in self.rows],
        }


def calibrated_stage(
    *, dataset_size: int, expected_batch_size: int, steps: int, target_epsilon: float, delta: float, accountant: str
) -> Stage:
    """One stage of `steps` steps at `expected_batch_size`, its noise multiplier calibrated to the
    target exactly as a training run calibrates a one-stage schedule (`calibrate: shared`)."""
    base = BatchSchedule(stages=(Stage(steps=steps, expected_batch_size=expected_batch_size, noise_multiplier=1.0),))
    schedule = calibrate_noise_multiplier(
        base, dataset_size=dataset_size, target_epsilon=target_epsilon, delta=delta, accountant=accountant
    )
    return schedule.stages[0]


def steps_for(examples: int, expected_batch_size: int) -> int:
    """Steps that process `examples` examples in expectation at `expected_batch_size` (rounded, >= 1)."""
    return max(1, round(examples / expected_batch_size))


def plan_batch_sizes(
    *,
    dataset_size: int,
    target_epsilon: float,
    delta: float,
    examples: int | None = None,
    steps: int | None = None,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    accountant: str = "rdp",
    min_steps: int = DEFAULT_MIN_STEPS,
    min_gain: float = DEFAULT_MIN_GAIN,
    unit: str = "sequence",
    max_sequences_per_document: int | None = None,
) -> BatchPlan:
    """Calibrate each candidate batch size (see the module docstring). Give `examples` (a fixed
    budget of examples processed: steps = examples / B) or `steps` (a fixed step count: examples
    = steps * B). Candidates larger than `dataset_size` are left out. `unit` says what N, B and
    examples count; it changes labels, not sigma."""
    if unit not in ("sequence", "document"):
        raise ValueError(f"unit must be 'sequence' or 'document', got {unit!r}")
    if max_sequences_per_document is not None and unit != "document":
        raise ValueError(
            f"max_sequences_per_document ({max_sequences_per_document!r}) is only for unit 'document', got unit {unit!r}"
        )
    if max_sequences_per_document is not None and max_sequences_per_document < 1:
        raise ValueError(f"max_sequences_per_document must be >= 1, got {max_sequences_per_document!r}")
    if (examples is None) == (steps is None):
        raise ValueError("give exactly one of examples (an example budget) or steps (a step count)")
    if examples is not None and examples < 1:
        raise ValueError(f"examples must be >= 1, got {examples!r}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    if dataset_size < 1:
        raise ValueError(f"dataset_size must be >= 1, got {dataset_size!r}")
    if min_steps < 1 or min_gain <= 1:
        raise ValueError(f"min_steps must be >= 1 and min_gain > 1, got {min_steps!r} and {min_gain!r}")
    sizes = sorted({int(b) for b in batch_sizes if 1 <= int(b) <= dataset_size})
    if not sizes:
        raise ValueError(f"batch_sizes: no candidate in [1, dataset_size={dataset_size}], got {list(batch_sizes)}")
    rows = []
    for b in sizes:
        t = steps if steps is not None else steps_for(examples, b)
        stage = calibrated_stage(
            dataset_size=dataset_size,
            expected_batch_size=b,
            steps=t,
            target_epsilon=target_epsilon,
            delta=delta,
            accountant=accountant,
        )
        sigma = stage.noise_multiplier
        eps = compute_epsilon(
            BatchSchedule(stages=(stage,)), dataset_size=dataset_size, delta=delta, accountant=accountant
        )
        rows.append(
            PlanRow(
                expected_batch_size=b,
                steps=t,
                examples=t * b,
                epochs=t * b / dataset_size,
                sampling_rate=b / dataset_size,
                noise_multiplier=sigma,
                epsilon=eps,
                noise_over_batch=sigma / b,
                noise_over_sqrt_batch=sigma / math.sqrt(b),
                max_sequences_per_step=None if max_sequences_per_document is None else b * max_sequences_per_document,
            )
        )
    recommended, reason = _recommend(rows, min_steps=min_steps, min_gain=min_gain)
    return BatchPlan(
        dataset_size=dataset_size,
        target_epsilon=target_epsilon,
        delta=delta,
        accountant=accountant,
        budget="examples" if examples is not None else "steps",
        rows=tuple(rows),
        recommended=recommended,
        reason=reason,
        unit=unit,
        max_sequences_per_document=max_sequences_per_document,
    )


def _recommend(rows: Sequence[PlanRow], *, min_steps: int, min_gain: float) -> tuple[int | None, str]:
    allowed = [r for r in rows if r.steps >= min_steps]
    if not allowed:
        return None, f"no candidate leaves {min_steps} steps: raise the example budget or lower min_steps"
    for row, bigger in zip(allowed, allowed[1:]):
        ratio = bigger.expected_batch_size / row.expected_batch_size
        # Gain per doubling of B in noise-to-signal at a fixed example budget.
        gain = (row.noise_over_sqrt_batch / bigger.noise_over_sqrt_batch) ** (1 / math.log2(ratio))
        if gain < min_gain:
            return row.expected_batch_size, (
                f"doubling the batch beyond {row.expected_batch_size} cuts sigma/sqrt(B) by only {gain:.2f}x "
                f"(< {min_gain:g}x) while halving the steps"
            )
    best = allowed[-1]
    return best.expected_batch_size, (
        f"the largest batch that leaves at least {min_steps} steps ({best.steps}); sigma/B is "
        f"{allowed[0].noise_over_batch / best.noise_over_batch:.0f}x smaller than at {allowed[0].expected_batch_size}"
    )


def quiet_accountant_warnings() -> None:
    """Hide dp_accounting's RDP warnings ("failed to converge ... Excluding this order"): an
    order it cannot evaluate is left out of the minimum over orders, which can only make the
    reported epsilon larger (conservative); printed once per order and calibration probe, they
    bury the output of a command-line run."""
    logging.getLogger("absl").setLevel(logging.ERROR)


def format_plan(plan: BatchPlan) -> str:
    """The plan as a fixed-width table with the recommendation under it; with the document unit
    the labels say documents (and, given the cap K, a column of sequences per step, B x K)."""
    documents = plan.unit == "document"
    cap = plan.max_sequences_per_document
    if documents:
        unit = "one document" + (f", at most {cap:,} sequences each" if cap is not None else "")
        size = f"{plan.dataset_size:,} documents (privacy unit: {unit})"
        budget = "documents" if plan.budget == "examples" else plan.budget
    else:
        size, budget = f"{plan.dataset_size:,}", plan.budget
    lines = [
        f"dpbert plan: N = {size}, epsilon {plan.target_epsilon:g} at delta {plan.delta:g} "
        f"({plan.accountant}), fixed {budget}",
        f"{'docs B' if documents else 'batch B':>9} {'q = B/N':>9} {'steps':>7} {'epochs':>7} {'sigma':>8} "
        f"{'sigma/B':>10} {'sigma/sqrt(B)':>14}" + (f" {'seqs <= B*K':>12}" if cap is not None else ""),
    ]
    for r in plan.rows:
        mark = "  <- recommended" if r.expected_batch_size == plan.recommended else ""
        seqs = f" {r.max_sequences_per_step:>12,}" if r.max_sequences_per_step is not None else ""
        lines.append(
            f"{r.expected_batch_size:>9,} {r.sampling_rate:>9.4f} {r.steps:>7,} {r.epochs:>7.2f} "
            f"{r.noise_multiplier:>8.4f} {r.noise_over_batch:>10.2e} {r.noise_over_sqrt_batch:>14.4f}{seqs}{mark}"
        )
    lines.append(f"recommended expected batch size: {plan.recommended if plan.recommended else 'none'} ({plan.reason})")
    return "\n".join(lines)
