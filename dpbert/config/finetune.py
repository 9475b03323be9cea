"""The fine-tuning recipe (`recipes/glue*.yaml`) and its DP plan: pure functions of the recipe and
the task's size n, shared by `dpbert finetune` and `dpbert verify`.

Recipes load through the recipe loader's machinery (`dpbert.config.recipe`: frozen dataclasses,
`--set key.path=value` overrides, errors naming the dotted field and the file); a section given
in a recipe overrides that section's defaults field by field.

`plan_dp(n, config)` calibrates the noise multiplier so that DP-SGD, Poisson-sampling each of
the n examples at q = B/N (N public: declared, or n rounded down to 2 significant digits),
spends the target epsilon at delta (default 1/N^1.1), composes a sweep's runs in one
ledger, and truncates the Poisson sample where pretraining does: at the physical batch whose
overflow probability keeps the truncation's share of delta within budget
(`dpbert.config.plan.truncation_overflow_bound`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from typing import Any, Literal

from dpbert.config.finetune_defaults import derive_dp_defaults, derive_nonprivate_defaults
from dpbert.config.plan import MAX_STORE_FACTOR, truncation_overflow_bound
from dpbert.config.recipe import RecipeError, _check, apply_overrides, parse_section, read_yaml
from dpbert.model.lora import LoRAConfig
from dpbert.privacy.accounting import PrivacyLedger, calibrate_noise_multiplier, round_down_significant
from dpbert.privacy.sampling import physical_batch_size
from dpbert.privacy.schedule import BatchSchedule, Stage

Trainable = Literal["all", "bias", "lora", "head"]
TRAINABLE = ("all", "bias", "lora", "head")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """One training mode's hyper-parameters. For DP, `batch_size` is the *expected* batch size
    of Poisson sampling, capped at n // 4 so a small task still gets >= 4 steps per epoch;
    `learning_rate`, `batch_size` and `epochs` may be null in the DP section: derived from n
    and epsilon; `learning_rate` and `epochs` may be null in the non-private section: derived
    from n and the model's width (`dpbert.config.finetune_defaults`). `dropout: null` keeps the checkpoint's dropout
    rates; a number sets the hidden and attention dropout (DP fine-tuning works better without
    dropout, Li et al. 2021)."""

    trainable: Trainable
    learning_rate: float | None
    batch_size: int | None
    epochs: float | None
    dropout: float | None = None
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    head_lr_multiplier: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check(self.trainable in TRAINABLE, "trainable", "one of 'all', 'bias', 'lora', 'head'", self.trainable)
        _check(
            self.learning_rate is None or self.learning_rate > 0,
            "learning_rate",
            "a positive number",
            self.learning_rate,
        )
        _check(self.batch_size is None or self.batch_size > 0, "batch_size", "a positive integer", self.batch_size)
        _check(self.epochs is None or self.epochs > 0, "epochs", "a positive number", self.epochs)
        _check(self.dropout is None or 0.0 <= self.dropout < 1.0, "dropout", "null or a rate in [0, 1)", self.dropout)
        _check(0.0 <= self.warmup_fraction < 1.0, "warmup_fraction", "a fraction in [0, 1)", self.warmup_fraction)
        _check(self.weight_decay >= 0, "weight_decay", "a number >= 0", self.weight_decay)
        _check(self.head_lr_multiplier > 0, "head_lr_multiplier", "a positive number", self.head_lr_multiplier)
        _check(0.0 <= self.b1 < 1.0, "b1", "a number in [0, 1)", self.b1)
        _check(0.0 <= self.b2 < 1.0, "b2", "a number in [0, 1)", self.b2)
        _check(self.eps > 0, "eps", "a positive number", self.eps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """DP settings for the task data. `dataset_size`: the public N of q = B/N (null: the task's
    count rounded down to 2 significant digits); every training example is sampled at q, and a
    task with more examples than `dataset_size_bound` (null: 1.25 N) is refused, as in
    pretraining. `delta: null` means 1/N^1.1; `clip_norm: null` is derived
    (`dpbert.config.finetune_defaults`)."""

    epsilon: float = 8.0
    delta: float | None = None
    clip_norm: float | None = None
    accountant: Literal["pld", "rdp"] = "pld"
    dataset_size: int | None = None
    dataset_size_bound: int | None = None

    def __post_init__(self) -> None:
        for name in ("dataset_size", "dataset_size_bound"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and v >= 8), name, "an integer >= 8 or null", v)
        _check(
            self.dataset_size_bound is None or (self.dataset_size or 0) <= self.dataset_size_bound,
            "dataset_size_bound",
            "null or >= dataset_size",
            self.dataset_size_bound,
        )
        _check(self.epsilon > 0, "epsilon", "a positive number", self.epsilon)
        _check(self.delta is None or 0.0 < self.delta < 1.0, "delta", "a probability in (0, 1) or null", self.delta)
        _check(self.clip_norm is None or self.clip_norm > 0, "clip_norm", "a positive number or null", self.clip_norm)
        _check(self.accountant in ("pld", "rdp"), "accountant", "'pld' or 'rdp'", self.accountant)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """`enabled`: one DP run per factor of the learning rate, the best kept by its dev metric;
    the task ledger composes all runs (see the module docstring)."""

    enabled: bool = False
    learning_rate_factors: tuple[float, ...] = (0.3, 1.0, 3.0)

    def __post_init__(self) -> None:
        factors = self.learning_rate_factors
        _check(isinstance(factors, list | tuple) and len(factors) >= 1 and all(
            isinstance(f, int | float) and not isinstance(f, bool) and f > 0 for f in factors),
            "learning_rate_factors", "a non-empty list of positive numbers", factors)  # fmt: skip
        object.__setattr__(self, "learning_rate_factors", tuple(float(f) for f in factors))

    @property
    def runs(self) -> int:
        return len(self.learning_rate_factors) if self.enabled else 1


# `rescale_std: null` rescales a checkpoint whose encoder kernels average more than this many times
# its initializer_range: between dpbert's tiny releases (DP and non-private) and public BERTs (the
# scales measured in docs/RESULTS.md, "Rescaling a release before fine-tuning").
RESCALE_ABOVE = 4.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """A fine-tuning recipe: shared settings, one `OptimConfig` per mode, the DP settings.

    `dp` selects the mode: `private` + `privacy` when true, `nonprivate` otherwise.
    `tokenizer: null` loads the tokenizer from the model folder. `microbatch_size` only trades
    memory for speed (DP results do not depend on it), and so does `clipping` ("auto": ghost
    clipping through the model's taps when every parameter is trained, vmap per-example gradients
    for a subset, where the two tie in speed; "ghost" (taps on the trained parameters only, LoRA
    factors included) or "vmap" to choose; the same clipped sum either way). `lora` applies when a mode trains
    `lora`; `eval_every_epochs`: evaluate after every k-th epoch (and always at the end).
    `train_pooler`: whether the head includes the pooler's kernel under `bias`, `lora` and
    `head` (null: only when the checkpoint has no pretrained pooler). Default true: a pretrained
    pooler was trained for another objective, if at all (see `dpbert.config.finetune_defaults`).
    `extend_positions`: when `max_seq_len` exceeds the model's position table, grow the table by
    repeating its rows (row i takes row i mod n, Beltagy et al. 2020), said in the log and in
    `metrics.json`; false refuses such a `max_seq_len`. Post-processing of the pretrained
    weights: a DP checkpoint's guarantee is unchanged.
    `rescale_std`: before training, multiply each encoder dense layer (kernel and bias) by
    rescale_std / the std of its kernel, and the three embedding tables together by rescale_std /
    the std of the word table (a LayerNorm follows them): each layer keeps the direction of what
    it computes and loses the scale a DP noise walk gave it. Null derives it: the model's
    `initializer_range` when the encoder's kernels average more than `RESCALE_ABOVE` times it,
    else no change; 0 never rescales. Post-processing, said in the log and in `metrics.json`.
    """

    dp: bool = False
    max_seq_len: int = 128
    seed: int = 0
    tokenizer: str | None = None
    eval_batch_size: int = 128
    microbatch_size: int = 64
    clipping: Literal["auto", "ghost", "vmap"] = "auto"
    nonprivate: OptimConfig = OptimConfig(trainable="all", learning_rate=None, batch_size=32, epochs=None)
    private: OptimConfig = OptimConfig(
        trainable="bias",
        learning_rate=None,
        batch_size=None,
        epochs=None,
        dropout=0.0,
        warmup_fraction=0.0,
        weight_decay=0.0,
        head_lr_multiplier=3.0,
    )
    privacy: PrivacyConfig = PrivacyConfig()
    lora: LoRAConfig = LoRAConfig()
    sweep: SweepConfig = SweepConfig()
    eval_every_epochs: int = 1
    train_pooler: bool | None = True
    extend_positions: bool = True
    rescale_std: float | None = None

    def __post_init__(self) -> None:
        _check(
            self.rescale_std is None or self.rescale_std >= 0,
            "rescale_std",
            "a number >= 0 (0: keep the weights) or null (derived)",
            self.rescale_std,
        )
        _check(self.max_seq_len >= 8, "max_seq_len", "an integer >= 8", self.max_seq_len)
        _check(self.seed >= 0, "seed", "an integer >= 0", self.seed)
        _check(self.eval_batch_size > 0, "eval_batch_size", "a positive integer", self.eval_batch_size)
        _check(self.microbatch_size > 0, "microbatch_size", "a positive integer", self.microbatch_size)
        _check(self.eval_every_epochs >= 1, "eval_every_epochs", "an integer >= 1", self.eval_every_epochs)
        _check(
            self.nonprivate.batch_size is not None,
            "nonprivate.batch_size",
            "a positive integer (only the learning rate and epochs are derived)",
            self.nonprivate.batch_size,
        )
        _check(
            not self.sweep.enabled or self.dp,
            "sweep.enabled",
            "false without dp (the sweep is a DP sweep)",
            self.sweep.enabled,
        )

    @property
    def optim(self) -> OptimConfig:
        return self.private if self.dp else self.nonprivate


DEFAULT_CONFIG = FinetuneConfig()


def load_config(path: str | os.PathLike[str] | None = None, overrides: Iterable[str] = ()) -> FinetuneConfig:
    """A `FinetuneConfig` from a YAML recipe (or the defaults) plus `key.path=value` overrides
    (values parsed as YAML). Errors name the dotted field and, for a file, the file."""
    raw = apply_overrides(read_yaml(path) if path is not None else {}, overrides)
    try:
        return parse_section(FinetuneConfig, raw, "")
    except RecipeError as err:
        raise RecipeError(err.field, f"{err.message} (in {path})" if path is not None else err.message) from None


# ----------------------------------------------------------------------------- DP plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPPlan:
    """The public numbers of a DP fine-tuning run, fixed before it starts; `ledger` is the
    task-data ledger (its `epsilon()` recomputes the guarantee)."""

    epsilon: float
    delta: float
    delta_rule: str
    noise_multiplier: float
    expected_batch_size: int
    physical_batch_size: int
    steps: int
    steps_per_epoch: int
    ledger: Any
    spent_epsilon: float  # ledger.epsilon(), computed once: a PLD recomputation takes seconds
    truncation_delta: float
    runs: int = 1  # sweep runs composed in the ledger (one stage each); `steps` is per run

    def summary(self) -> dict[str, Any]:
        stage = self.ledger.stages[0]
        return {
            "epsilon": self.spent_epsilon,
            "target_epsilon": self.epsilon,
            "delta": self.delta,
            "delta_rule": self.delta_rule,
            "truncation_delta": self.truncation_delta,
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.ledger.clip_norm,
            "expected_batch_size": self.expected_batch_size,
            "physical_batch_size": self.physical_batch_size,
            "sampling_rate": stage.sampling_rate,
            "steps": self.steps,
            "runs": self.runs,
            "accountant": self.ledger.accountant,
            "dataset_size": self.ledger.dataset_size,
            "privacy_unit": self.ledger.privacy_unit,
            "sampling": self.ledger.sampling,
        }


def _delta(n: int, privacy: PrivacyConfig) -> tuple[float, str]:
    return (privacy.delta, "given") if privacy.delta is not None else (1.0 / n**1.1, "1/N^1.1")


def public_task_size(stored: int, privacy: PrivacyConfig) -> tuple[int, str, int]:
    """(N, "declared" | "rounded", bound) for a task of `stored` training examples: the declared
    N or the count rounded down to 2 significant digits, and the public bound on the stored
    examples (declared, or `MAX_STORE_FACTOR` x N); ValueError when the task exceeds the bound."""
    if privacy.dataset_size is None:
        n, source = round_down_significant(stored), "rounded"
    else:
        n, source = privacy.dataset_size, "declared"
    bound = privacy.dataset_size_bound if privacy.dataset_size_bound is not None else int(MAX_STORE_FACTOR * n)
    if stored > bound:
        raise ValueError(
            f"the task has more training examples than the public bound {bound} for which the truncation is "
            "accounted; declare a larger 'privacy.dataset_size' or 'privacy.dataset_size_bound'"
        )
    return n, source, bound


def resolve_nonprivate(n: int, hidden_size: int, config: FinetuneConfig) -> tuple[FinetuneConfig, Any]:
    """(config with a null non-private learning rate and epochs filled in, the `NonPrivateDefaults`
    used or None when the recipe set both), from n and the model's width."""
    optim = config.nonprivate
    if optim.learning_rate is not None and optim.epochs is not None:
        return config, None
    derived = derive_nonprivate_defaults(
        dataset_size=n, hidden_size=hidden_size, learning_rate=optim.learning_rate, epochs=optim.epochs
    )
    optim = dataclasses.replace(optim, learning_rate=derived.learning_rate, epochs=derived.epochs)
    return dataclasses.replace(config, nonprivate=optim), derived


def resolve_dp(n: int, config: FinetuneConfig) -> tuple[FinetuneConfig, Any]:
    """(config with every null DP hyper-parameter filled in, the `DerivedDefaults` used or None
    when the recipe set them all). Depends only on the public N of the task (n: its stored count),
    epsilon, delta and the trained subset."""
    n = public_task_size(n, config.privacy)[0]
    optim, priv = config.private, config.privacy
    if None not in (optim.learning_rate, optim.batch_size, optim.epochs, priv.clip_norm):
        return config, None
    if n < 8:
        raise ValueError(f"DP fine-tuning needs at least 8 training examples, got n={n}")
    derived = derive_dp_defaults(
        dataset_size=n, epsilon=priv.epsilon, delta=_delta(n, priv)[0], trainable=optim.trainable, epochs=optim.epochs
    )
    optim = dataclasses.replace(
        optim,
        learning_rate=optim.learning_rate if optim.learning_rate is not None else derived.learning_rate,
        batch_size=optim.batch_size if optim.batch_size is not None else derived.expected_batch_size,
        epochs=optim.epochs if optim.epochs is not None else derived.epochs,
    )
    priv = dataclasses.replace(priv, clip_norm=priv.clip_norm if priv.clip_norm is not None else derived.clip_norm)
    return dataclasses.replace(config, private=optim, privacy=priv), derived


def plan_dp(stored: int, config: FinetuneConfig) -> DPPlan:
    """Calibrate the noise so that DP-SGD, Poisson-sampling each of the `stored` training examples
    at q = B/N (N public: `public_task_size`), spends exactly `config.privacy.epsilon` at delta
    (default 1/N^1.1); refuse a plan that breaks the budget. Null hyper-parameters are derived
    first (`resolve_dp`); a sweep of k runs is k stages of the one ledger, all at the same noise
    multiplier. Verify rebuilds it from the ledger's N (rounding is idempotent)."""
    if stored < 8:
        raise ValueError(f"DP fine-tuning needs at least 8 training examples, got n={stored}")
    config, _ = resolve_dp(stored, config)
    n, source, size_bound = public_task_size(stored, config.privacy)
    optim, priv = config.private, config.privacy
    delta, rule = _delta(n, priv)
    batch = min(optim.batch_size, n // 4)
    steps_per_epoch = max(1, round(n / batch))
    steps = max(1, math.ceil(optim.epochs * n / batch))
    runs = config.sweep.runs
    stage = Stage(steps=steps, expected_batch_size=batch, noise_multiplier=1.0)
    schedule = calibrate_noise_multiplier(
        BatchSchedule(stages=(stage,) * runs),
        dataset_size=n, target_epsilon=priv.epsilon, delta=delta, accountant=priv.accountant,
    )  # fmt: skip
    bound = truncation_overflow_bound(delta=delta, target_epsilon=priv.epsilon, total_steps=steps * runs)
    physical = physical_batch_size(
        batch, n, overflow_probability_bound=bound, multiple=min(config.microbatch_size, batch),
        dataset_size_bound=size_bound,
    )  # fmt: skip
    ledger = PrivacyLedger.for_schedule(
        schedule, dataset_size=n, delta=delta, clip_norm=priv.clip_norm, accountant=priv.accountant,
        physical_batch_sizes=[physical] * runs, target_epsilon=priv.epsilon, dataset_size_source=source,
        dataset_size_bound=size_bound,
    )  # fmt: skip
    spent = ledger.check_budget()
    return DPPlan(
        epsilon=priv.epsilon, delta=delta, delta_rule=rule, noise_multiplier=schedule.stages[0].noise_multiplier,
        expected_batch_size=batch, physical_batch_size=physical, steps=steps, steps_per_epoch=steps_per_epoch,
        ledger=ledger, spent_epsilon=spent, truncation_delta=ledger.truncation_delta(spent), runs=runs,
    )  # fmt: skip
