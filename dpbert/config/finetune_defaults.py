"""Fine-tuning defaults derived from the task's size, the model's width and the privacy budget.

`derive_dp_defaults(dataset_size=n, epsilon=eps, delta=delta, trainable=...)` returns the expected
batch size, epochs, clip norm and learning rate `dpbert finetune --dp` uses for every field the
recipe leaves null, each with the reason it was chosen (printed before training), following Li et
al. 2022, Yu et al. 2022 and Bu et al. 2022: an example budget sets the epochs; the batch is
`dpbert.privacy.batch_sizes`' recommendation for that budget; clip norm 0.1; the learning rate by
trained subset, the head's steps `head_lr_multiplier` times larger.

`derive_nonprivate_defaults(dataset_size=n, hidden_size=h)` does the same for non-private
fine-tuning of every parameter: the learning rate from the model's width, the epochs from n.

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
# Non-private, all parameters: BERT-Large's fine-tuning rate (Devlin et al. 2019), scaled as 1/width
# for narrower models (Adam's per-coordinate step moves a width-h layer's output ~h times one step).
REFERENCE_WIDTH, REFERENCE_LEARNING_RATE = 1024, 2e-5
MAX_NONPRIVATE_LEARNING_RATE = 1e-3


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class NonPrivateDefaults:
    """Non-private hyper-parameters for one (n, model width), with a reason each."""

    dataset_size: int
    hidden_size: int
    epochs: float
    learning_rate: float
    reasons: dict[str, str]

    def lines(self) -> list[str]:
        """One printed line per derived value: `name = value  (reason)`."""
        return [f"{name} = {getattr(self, name):g}  ({self.reasons[name]})" for name in ("learning_rate", "epochs")]


def nonprivate_learning_rate(hidden_size: int) -> float:
    """REFERENCE_LEARNING_RATE * REFERENCE_WIDTH / hidden_size, at most MAX_NONPRIVATE_LEARNING_RATE."""
    if hidden_size < 1:
        raise ValueError(f"hidden_size must be >= 1, got {hidden_size!r}")
    return min(MAX_NONPRIVATE_LEARNING_RATE, REFERENCE_LEARNING_RATE * REFERENCE_WIDTH / hidden_size)


def derive_nonprivate_defaults(
    *, dataset_size: int, hidden_size: int, learning_rate: float | None = None, epochs: float | None = None
) -> NonPrivateDefaults:
    """Defaults for non-private fine-tuning of all parameters of a width-`hidden_size` model on n
    examples; a given `learning_rate` or `epochs` is kept (reason "given")."""
    lr_reason = (
        f"{REFERENCE_LEARNING_RATE:g} (BERT-Large's, width {REFERENCE_WIDTH}) x {REFERENCE_WIDTH} / width "
        f"{hidden_size}, at most {MAX_NONPRIVATE_LEARNING_RATE:g}: a narrow model trained from scratch needs larger steps"
    )
    epochs_reason = (
        f"ceil({EXAMPLE_BUDGET:,} examples / n = {dataset_size:,}) clamped to [{MIN_EPOCHS}, {MAX_EPOCHS}]: "
        "BERT's 3 epochs on large tasks, more passes on small ones"
    )
    return NonPrivateDefaults(
        dataset_size=dataset_size, hidden_size=hidden_size,
        epochs=default_epochs(dataset_size) if epochs is None else float(epochs),
        learning_rate=nonprivate_learning_rate(hidden_size) if learning_rate is None else float(learning_rate),
        reasons={"learning_rate": "given" if learning_rate is not None else lr_reason,
                 "epochs": "given" if epochs is not None else epochs_reason},
    )  # fmt: skip


def describe(defaults: DerivedDefaults | NonPrivateDefaults) -> dict[str, Any]:
    """JSON-ready record of the derivation (stored in metrics.json): the derived values and reasons."""
    record = dataclasses.asdict(defaults)
    for given in ("dataset_size", "hidden_size", "epsilon", "delta", "trainable"):
        record.pop(given, None)
    return record
