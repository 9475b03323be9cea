"""DP fine-tuning defaults derived from the task's size and the privacy budget.

`derive_dp_defaults(dataset_size=n, epsilon=eps, delta=delta, trainable=...)` returns the expected
batch size, epochs, clip norm and learning rate `dpbert finetune --dp` uses for every field the
recipe leaves null, each with the reason it was chosen (printed before training), following Li et
al. 2022, Yu et al. 2022 and Bu et al. 2022: an example budget sets the epochs; the batch is
`dpbert.privacy.batch_sizes`' recommendation for that budget; clip norm 0.1; the learning rate by
trained subset, the head's steps `head_lr_multiplier` times larger.

Guarantees: nothing here reads the private data except its size n (public, as in every DP run).
The reasons in full: docs/INTERNALS.md; the measurements: docs/RESULTS.md ("Design measurements").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dpbert.privacy.batch_sizes import plan_batch_sizes, quiet_accountant_warnings

EXAMPLE_BUDGET = 10_000  # examples processed by a default run (n * epochs), before clamping
MIN_EPOCHS = 3
MAX_EPOCHS = 40
MIN_STEPS = 30  # below this the optimizer, not the noise, limits the run (planner's finding)
DEFAULT_CLIP_NORM = 0.1
LEARNING_RATES = {"all": 5e-4, "bias": 1e-2, "lora": 1e-2, "head": 1e-2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DerivedDefaults:
    """DP hyper-parameters for one (n, epsilon, delta, trained subset), with a reason each."""

    dataset_size: int
    epsilon: float
    delta: float
    trainable: str
    expected_batch_size: int
    epochs: float
    steps: int
    clip_norm: float
    learning_rate: float
    reasons: dict[str, str]

    def lines(self) -> list[str]:
        """One printed line per derived value: `name = value  (reason)`."""
        values = {
            "expected_batch_size": f"{self.expected_batch_size} (q = {self.expected_batch_size / self.dataset_size:.4g})",
            "epochs": f"{self.epochs:g} ({self.steps} steps)",
            "clip_norm": f"{self.clip_norm:g}",
            "learning_rate": f"{self.learning_rate:g}",
        }
        return [f"{name} = {values[name]}  ({self.reasons[name]})" for name in values]


def default_epochs(dataset_size: int) -> float:
    """ceil(EXAMPLE_BUDGET / n) clamped to [MIN_EPOCHS, MAX_EPOCHS]."""
    if dataset_size < 1:
        raise ValueError(f"dataset_size must be >= 1, got {dataset_size!r}")
    return float(min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(EXAMPLE_BUDGET / dataset_size))))


def candidate_batch_sizes(dataset_size: int) -> tuple[int, ...]:
    """Powers of two from 8 up to n/2 (at least one candidate: the largest power of two <= n/2, or 1)."""
    top = max(1, dataset_size // 2)
    sizes = tuple(2**k for k in range(3, 15) if 2**k <= top)
    return sizes or (2 ** int(math.log2(top)),)


def derive_dp_defaults(
    *,
    dataset_size: int,
    epsilon: float,
    delta: float,
    trainable: str,
    epochs: float | None = None,
    accountant: str = "rdp",
) -> DerivedDefaults:
    """Defaults for a DP fine-tuning run on n examples at (epsilon, delta) (see the module
    docstring). `epochs` fixes the epoch budget (None: `default_epochs(n)`). The batch choice
    uses the RDP accountant for speed; the run's own plan recalibrates sigma with its accountant."""
    if trainable not in LEARNING_RATES:
        raise ValueError(f"trainable: expected one of {list(LEARNING_RATES)}, got {trainable!r}")
    n = dataset_size
    epochs_reason = (
        "given" if epochs is not None else
        f"ceil({EXAMPLE_BUDGET:,} examples / n = {n:,}) clamped to [{MIN_EPOCHS}, {MAX_EPOCHS}]: small tasks need "
        "many passes to get enough steps at a large batch"
    )  # fmt: skip
    epochs = default_epochs(n) if epochs is None else float(epochs)
    examples = max(1, round(epochs * n))
    quiet_accountant_warnings()
    plan = plan_batch_sizes(
        dataset_size=n, target_epsilon=epsilon, delta=delta, examples=examples,
        batch_sizes=candidate_batch_sizes(n), accountant=accountant, min_steps=MIN_STEPS,
    )  # fmt: skip
    if plan.recommended is not None:
        batch, why = plan.recommended, plan.reason
    else:  # too few examples for MIN_STEPS steps even at the smallest candidate
        batch = plan.rows[0].expected_batch_size
        why = f"the smallest candidate ({plan.reason})"
    steps = max(1, math.ceil(epochs * n / batch))
    return DerivedDefaults(
        dataset_size=n, epsilon=epsilon, delta=delta, trainable=trainable, expected_batch_size=batch,
        epochs=epochs, steps=steps, clip_norm=DEFAULT_CLIP_NORM, learning_rate=LEARNING_RATES[trainable],
        reasons={
            "expected_batch_size": f"dpbert plan at {examples:,} examples: {why}",
            "epochs": epochs_reason,
            "clip_norm": "small, so nearly every example is clipped to a unit direction (Li et al. 2022); "
                         "with Adam the scale itself does not matter",
            "learning_rate": f"for trainable={trainable}: fewer trained parameters take larger steps "
                             "(bias 1e-2, LoRA 1e-2, all 5e-4, head 1e-2; the head 3x)",
        },
    )  # fmt: skip


def describe(defaults: DerivedDefaults) -> dict[str, Any]:
    """JSON-ready record of the derivation (stored in metrics.json)."""
    return {
        "expected_batch_size": defaults.expected_batch_size, "epochs": defaults.epochs, "steps": defaults.steps,
        "clip_norm": defaults.clip_norm, "learning_rate": defaults.learning_rate, "reasons": dict(defaults.reasons),
    }  # fmt: skip
