"""Batch-size schedule: consecutive stages of (steps, expected batch size, noise multiplier).

Anil et al. (2021) grow the batch during training because the gradient signal-to-noise ratio
falls; a schedule is therefore a tuple of stages, each a constant DP-SGD configuration.

Guarantees: a `BatchSchedule` is immutable and validated (at least one stage, every stage with
steps >= 1, expected_batch_size >= 1, noise_multiplier >= 0); `stage_at(step)` maps a global
step (0-based) to exactly one stage, so the trainer and the accountant read the same numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """`steps` DP-SGD steps with Poisson sampling of `expected_batch_size` examples per step
    (the public divisor) and Gaussian noise of std `noise_multiplier * clip_norm` on the sum."""

    steps: int
    expected_batch_size: int
    noise_multiplier: float

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"Stage.steps must be an integer >= 1, got {self.steps!r}")
        if (
            isinstance(self.expected_batch_size, bool)
            or not isinstance(self.expected_batch_size, int)
            or self.expected_batch_size < 1
        ):
            raise ValueError(f"Stage.expected_batch_size must be an integer >= 1, got {self.expected_batch_size!r}")
        sigma = self.noise_multiplier
        if isinstance(sigma, bool) or not isinstance(sigma, int | float) or not sigma >= 0:
            raise ValueError(f"Stage.noise_multiplier must be a number >= 0, got {sigma!r}")
        object.__setattr__(self, "noise_multiplier", float(sigma))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePosition:
    """Where a global step falls: the stage, its index, and the step index inside the stage."""

    index: int
    stage: Stage
    step_in_stage: int
    first_step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchSchedule:
    """Stages run in order; global step t (0-based) belongs to the stage whose span covers it.

    The paper's increasing schedule is e.g.
    `BatchSchedule(stages=(Stage(steps=a, expected_batch_size=b1, noise_multiplier=s),
    Stage(steps=c, expected_batch_size=b2, noise_multiplier=s)))` with b1 < b2.
    """

    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        stages = tuple(self.stages) if isinstance(self.stages, Iterable) else self.stages
        if not isinstance(stages, tuple) or not stages:
            raise ValueError("BatchSchedule.stages must contain at least one Stage, got none")
        for i, stage in enumerate(stages):
            if not isinstance(stage, Stage):
                raise ValueError(f"BatchSchedule.stages[{i}] must be a Stage, got {stage!r}")
        object.__setattr__(self, "stages", stages)

    @classmethod
    def constant(cls, *, steps: int, expected_batch_size: int, noise_multiplier: float) -> BatchSchedule:
        """A single-stage schedule (classic DP-SGD)."""
        return cls(
            stages=(
                Stage(
                    steps=steps,
                    expected_batch_size=expected_batch_size,
                    noise_multiplier=noise_multiplier,
                ),
            )
        )

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)

    @property
    def noise_multipliers(self) -> tuple[float, ...]:
        return tuple(s.noise_multiplier for s in self.stages)

    def stage_at(self, step: int) -> StagePosition:
        """The stage that runs global step `step` (0-based); ValueError past the end."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        first = 0
        for index, stage in enumerate(self.stages):
            if step < first + stage.steps:
                return StagePosition(index=index, stage=stage, step_in_stage=step - first, first_step=first)
            first += stage.steps
        raise ValueError(f"step {step} is past the end of the schedule ({self.total_steps} steps in total)")

    def truncated(self, steps: int) -> BatchSchedule | None:
        """The first `steps` steps as a schedule (None when steps == 0): what has been spent."""
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= self.total_steps:
            raise ValueError(f"steps must be an integer in [0, {self.total_steps}], got {steps!r}")
        kept: list[Stage] = []
        left = steps
        for stage in self.stages:
            if left == 0:
                break
            take = min(left, stage.steps)
            kept.append(dataclasses.replace(stage, steps=take))
            left -= take
        return BatchSchedule(stages=tuple(kept)) if kept else None

    def with_noise_multipliers(self, noise_multipliers: Sequence[float]) -> BatchSchedule:
        """A copy with one noise multiplier per stage replaced."""
        if len(noise_multipliers) != len(self.stages):
            raise ValueError(
                f"noise_multipliers must have one value per stage ({len(self.stages)}), got {len(noise_multipliers)}"
            )
        return BatchSchedule(
            stages=tuple(
                dataclasses.replace(s, noise_multiplier=float(n))
                for s, n in zip(self.stages, noise_multipliers, strict=True)
            )
        )
