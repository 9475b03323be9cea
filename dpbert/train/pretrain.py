"""`dpbert pretrain`: masked-LM pretraining of BERT with DP-SGD (or without, for baselines).

One readable loop in sections: run folder, data, model, privacy plan, update step,
checkpoints, loop, end of run. `pretrain(...)` is the library entry point; the CLI only
parses flags and calls it.

Run folder (RUN_DIR): `recipe.yaml` (resolved recipe), `store/` (token store, unless the
recipe names one), `checkpoints/` (Orbax), `metrics.jsonl`, `privacy.json` (the ledger of
the steps taken so far; private runs only), `randomness.json` (where the secret came from;
private runs only), `hf/` (final Hugging Face folder with the tokenizer, and `privacy.json`
for private runs), `release/` (the export with privacy metadata and model card), `curves.png`.

Guarantees:
- a private run's randomness is secret: a 256-bit secret from the OS CSPRNG (or an auditor's
  `noise_seed_file`) is kept in `checkpoints/noise_secret` (0600) and nowhere else; stage i's
  key is `mechanism_key(secret, f"{mechanism}/stage/{i}")` and the masking key
  `mechanism_key(secret, f"{mechanism}/masking")`, so two runs of one recipe release different
  weights and nothing published regenerates the noise (`randomness.json` says only where the
  secret came from). The recipe's seed drives the initialisation, and every key of a
  non-private run;
- all randomness of step t (Poisson sample, masking, dropout, noise) derives from
  `fold_in(stage_key, t)` (masking from `dpbert.data.masking.example_mask_key(masking_key, t,
  store index)`); a resumed run therefore replays exactly the steps an uninterrupted run
  takes, and the ledger counts each completed step once;
- the dataset size N of q = B/N is public (`privacy.dataset_size`, or the store's count
  rounded down to 2 significant digits): the run samples from the first N sequences only;
- a run, or a resume, whose full schedule would spend more than `privacy.target_epsilon`
  is refused before any step (`PrivacyLedger.check_budget`); on resume the recipe must
  agree with the checkpoint's ledger on every step already taken;
- SIGTERM finishes the current step, writes a checkpoint and returns cleanly (exit 0);
- a non-finite training loss stops the run with an error naming the step;
- the non-private mode runs the same loop (same sampling, masking and dropout) with the DP
  core's non-private step: no clipping, no noise, and the gradient is the mean over the
  realized batch (ordinary training; there is no privacy to protect). Its ledger in the
  checkpoint says non-private and no privacy.json is written.

Devices and hosts: the step runs on the recipe's `data` x `fsdp` mesh over every device of
every process (one device is the trivial mesh, same code). Parameters and optimizer state
are created sharded (`jax.jit(..., out_shardings=...)` from `jax.eval_shape`; no full copy
on one device) or restored by Orbax straight into those shardings. Each stage's compiled
batch is its ledger's physical batch padded up to a multiple of devices x micro-batch; the
padding rows are never sampled, so the sample, the ledger (which records the truncation
size) and the update are the same on any number of devices and processes (float
tolerance). Each process reads only its share of a step's rows (`distributed.local_batch`);
only process 0 writes metrics.jsonl, privacy.json, recipe.yaml, hf/, release/ and prints;
every process takes part in the Orbax checkpoint. With several processes, start
`jax.distributed` first (`dpbert pretrain --coordinator-address ...` or `--distributed`).

Masked positions: the MLM head decodes only `max_predictions` positions per example (the
vocabulary projection dominates the cost). It is mean + 4 standard deviations of the
number of selected tokens, so an example with more selected tokens (probability < 1e-4)
has its surplus corrupted in the input but not scored, as in BERT's
`max_predictions_per_seq`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from dpbert.atomic import replace_dir, write_json
from dpbert.data.masking import example_mask_key, mask_tokens
from dpbert.data.store import TokenStore, prepare_store, train_texts
from dpbert.data.tokenizer import load_tokenizer, resolve_tokenizer, train_dp_wordpiece
from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM
from dpbert.model.ghost import MLMGhostLoss
from dpbert.privacy import (
    BatchSchedule,
    PrivacyLedger,
    Stage,
    calibrate_noise_multiplier,
    default_optimizer,
    make_dp_train_step,
    make_train_step,
    physical_batch_size,
    step_key,
)
from dpbert.privacy.accounting import (
    DOCUMENT_UNIT,
    MAX_TRUNCATION_DELTA_FRACTION,
    PRIVACY_UNIT,
    VocabularyEvent,
    calibrate_vocabulary,
    round_down_significant,
)
from dpbert.privacy.documents import SEQUENCE_PADDING
from dpbert.privacy.dp_step import StepFn
from dpbert.privacy.randomness import SECRET_FILE, RunSecret, mechanism_key, read_secret, run_secret
from dpbert.privacy.sampling import check_document_offsets
from dpbert.train import distributed
from dpbert.train.checkpoint import CheckpointStore
from dpbert.train.device import device_settings
from dpbert.train.mesh import batch_axes, make_mesh, state_shardings
from dpbert.train.metrics import MetricsLog, truncate_after
from dpbert.train.recipe import Recipe, load_recipe, recipe_to_dict, save_recipe
from dpbert.train.state import TrainState, ledger_text

RANDOMNESS_FILE = "randomness.json"
NONPRIVATE_LEDGER = {"private": False, "note": "non-private baseline: no clipping, no noise, no guarantee"}
# Held-out masking uses its own fixed key, the same for every run and seed, so private and
# non-private runs are scored on identical masks.
EVAL_MASK_KEY_SEED = 0x65766C  # "evl"


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """What a finished (or stopped) run reports. `epsilon` is None for non-private runs."""

    run_dir: Path
    steps_done: int
    total_steps: int
    stopped_early: bool
    epsilon: float | None
    delta: float | None
    eval_mlm_accuracy: float | None
    eval_mlm_loss: float | None
    wall_time_s: float
    fill_mask: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    # The unigram baseline (the most frequent train token predicted at every held-out masked
    # position, same masks): its accuracy and the token. A non-private diagnostic.
    eval_unigram_accuracy: float | None = None
    unigram_token: str | None = None
    # The recipe header's "Non-private reference: X% ..." line (measured for the shipped recipe).
    reference: tuple[float, str] | None = None


# ---------------------------------------------------------------------------- masking / loss


def max_predictions(seq_len: int, mask_prob: float) -> int:
    """Decoded positions per example: mean + 4 sd of Binomial(seq_len - 2, mask_prob), capped."""
    n = seq_len - 2  # [CLS] and [SEP] are never selected
    return min(seq_len, math.ceil(n * mask_prob + 4 * math.sqrt(n * mask_prob * (1 - mask_prob))) + 1)


def make_masker(
    *,
    vocab_size: int,
    mask_token_id: int,
    special_token_ids: tuple[int, ...],
    pad_id: int,
    mask_prob: float,
    num_predictions: int,
) -> Callable[[jax.Array, jax.Array, jax.Array, jax.Array], dict[str, jax.Array]]:
    """`(run_key, step, store_index, input_ids [L]) -> model inputs and MLM targets` for ONE
    example, masked with `example_mask_key(run_key, step, store_index)`. Pure; vmap it."""

    def masker(run_key: jax.Array, step: jax.Array, index: jax.Array, ids: jax.Array) -> dict[str, jax.Array]:
        masked, labels, weights = mask_tokens(
            example_mask_key(run_key, step, index),
            ids,
            vocab_size=vocab_size,
            mask_token_id=mask_token_id,
            special_token_ids=special_token_ids,
            mask_prob=mask_prob,
        )
        (positions,) = jnp.nonzero(weights, size=num_predictions, fill_value=0)
        # Position 0 is [CLS], never selected: filler slots read weight 0 there.
        return {
            "input_ids": masked,
            "attention_mask": (ids != pad_id).astype(jnp.int32),
            "masked_positions": positions.astype(jnp.int32),
            "labels": labels[positions],
            "label_weights": weights[positions],
        }

    return masker


def make_loss_fn(
    graphdef: nnx.GraphDef, masker: Callable[..., dict[str, jax.Array]], run_key: jax.Array
) -> Callable[[Any, dict[str, jax.Array], jax.Array], jax.Array]:
    """Per-example loss for the DP core: `example` = {"input_ids" [L], "index", "step"} (store
    index and global step, which key the masking); `rng` (from the DP core) keys dropout.
    Returns the mean cross-entropy over the example's masked tokens (0 if none)."""

    def loss_fn(params: Any, example: dict[str, jax.Array], rng: jax.Array) -> jax.Array:
        x = masker(run_key, example["step"], example["index"], example["input_ids"])
        logits = functional.mlm_logits(
            graphdef,
            params,
            x["input_ids"],
            x["attention_mask"],
            None,
            rng,
            masked_positions=x["masked_positions"],
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), x["labels"])
        w = x["label_weights"]
        return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)

    return loss_fn


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class MaskedMLMGhostLoss(MLMGhostLoss):
    """`make_loss_fn`'s loss with layer taps, for ghost clipping: the same masking (keyed by
    run key, step and store index) and the same forward, so the clipped sum is unchanged."""

    masker: Callable[..., dict[str, jax.Array]]
    run_key: jax.Array

    def tapped(self, params: Any, example: dict[str, jax.Array], rng: jax.Array | None, z: dict | None):
        if SEQUENCE_PADDING not in example:
            x = self.masker(self.run_key, example["step"], example["index"], example["input_ids"])
            return super().tapped(params, x, rng, z)
        # A document ([K, L] sequences): each sequence masked with its own store index, as alone.
        x = jax.vmap(self.masker, in_axes=(None, 0, 0, 0))(
            self.run_key, example["step"], example["index"], example["input_ids"]
        )
        return super().tapped(params, {**x, SEQUENCE_PADDING: example[SEQUENCE_PADDING]}, rng, z)


def make_eval_fn(
    graphdef: nnx.GraphDef, masker: Callable[..., dict[str, jax.Array]]
) -> Callable[..., dict[str, jax.Array]]:
    """Jitted held-out scoring of a batch (rows with `valid` False count for nothing):
    sums of correct predictions, cross-entropy and masked tokens, and the correct predictions
    of the unigram baseline (`unigram_token` predicted everywhere) on the same masked positions.
    Masks with the fixed eval key, so every run and every call scores the same masks."""
    eval_key = jax.random.key(EVAL_MASK_KEY_SEED)

    @jax.jit
    def eval_fn(
        params: Any, indices: jax.Array, input_ids: jax.Array, valid: jax.Array, unigram_token: jax.Array
    ) -> dict[str, jax.Array]:
        x = jax.vmap(masker, in_axes=(None, None, 0, 0))(eval_key, 0, indices, input_ids)
        logits = functional.mlm_logits(
            graphdef,
            params,
            x["input_ids"],
            x["attention_mask"],
            None,
            None,
            masked_positions=x["masked_positions"],
        ).astype(jnp.float32)
        w = x["label_weights"] * valid[:, None]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, x["labels"])
        correct = (jnp.argmax(logits, -1) == x["labels"]).astype(jnp.float32)
        unigram = (x["labels"] == unigram_token).astype(jnp.float32)
        return {
            "correct": jnp.sum(correct * w),
            "loss": jnp.sum(ce * w),
            "count": jnp.sum(w),
            "unigram_correct": jnp.sum(unigram * w),
        }

    return eval_fn


# ---------------------------------------------------------------------------- privacy plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """The run's schedule with noise multipliers (0 when non-private) and physical batch sizes."""

    schedule: BatchSchedule
    physical_batch_sizes: tuple[int, ...]
    ledger: PrivacyLedger | None  # the full planned ledger; None when non-private
    _epsilons: dict[int, float] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def ledger_after(self, steps: int) -> dict[str, Any]:
        return NONPRIVATE_LEDGER if self.ledger is None else self.ledger.spent(steps).to_dict()

    def epsilon_after(self, steps: int) -> float | None:
        """Epsilon spent by the first `steps` steps (None when non-private); memoized."""
        if self.ledger is None:
            return None
        if steps not in self._epsilons:
            self._epsilons[steps] = self.ledger.spent(steps).epsilon()
        return self._epsilons[steps]


def ledger_physical_batch_sizes(recipe: Recipe, dataset_size: int) -> tuple[int, ...]:
    """Each stage's physical batch as the ledger records it (the Poisson sample is truncated
    there): a multiple of the micro-batch size whose overflow probability per step is small
    enough. Private runs give truncation, whose (1 + e^eps) * P[overflow] adds to delta, half
    of what the budget check allows, spread over all steps; non-private runs use the default
    bound. Independent of the devices: `device_batch_size` pads it for the mesh."""
    p, mb = recipe.privacy, recipe.train.microbatch_size
    if not p.enabled:
        return tuple(physical_batch_size(s.expected_batch_size, dataset_size, multiple=mb) for s in recipe.schedule)
    eps_bound = p.target_epsilon if p.target_epsilon is not None else 50.0
    per_step = (
        0.5 * MAX_TRUNCATION_DELTA_FRACTION * p.delta / ((1 + math.exp(min(eps_bound, 700.0))) * recipe.total_steps)
    )
    return tuple(
        physical_batch_size(s.expected_batch_size, dataset_size, overflow_probability_bound=per_step, multiple=mb)
        for s in recipe.schedule
    )


def device_batch_size(physical: int, devices: int, microbatch_size: int) -> int:
    """Rows of the compiled step: `physical` rounded up to a multiple of devices x micro-batch
    (the extra rows are padding, never sampled)."""
    multiple = devices * microbatch_size
    return -(-physical // multiple) * multiple


def public_dataset_size(recipe: Recipe, available: int) -> tuple[int, str]:
    """(N, source): the public number of training sequences a private run samples from, and
    whether it was "declared" (`privacy.dataset_size`) or "rounded" (the store's count rounded
    down to 2 significant digits). Non-private runs use every sequence ("exact")."""
    declared = recipe.privacy.dataset_size
    if not recipe.privacy.enabled:
        return available, "exact"
    if declared is None:
        return round_down_significant(available), "rounded"
    if declared > available:
        units = "documents" if recipe.privacy.unit == "document" else "sequences"
        raise ValueError(
            f"recipe field 'privacy.dataset_size': {declared} exceeds the {available} training "
            f"{units} of the token store"
        )
    return declared, "declared"


def make_plan(recipe: Recipe, dataset_size: int, *, dataset_size_source: str = "exact") -> Plan:
    """Noise multipliers (fixed or calibrated), physical batches, and the budget check.

    With `privacy.unit: document`, `dataset_size` and every batch size count documents. With
    `data.tokenizer: dp` the vocabulary's event is in the ledger and training is calibrated for
    what the vocabulary left of the target."""
    p = recipe.privacy
    for i, s in enumerate(recipe.schedule):
        if s.expected_batch_size > dataset_size:
            raise ValueError(
                f"recipe field 'schedule[{i}].expected_batch_size': {s.expected_batch_size} exceeds the "
                f"{dataset_size} training {'documents' if p.unit == 'document' else 'examples'} of the token store"
            )
    base = BatchSchedule(
        stages=tuple(
            Stage(steps=s.steps, expected_batch_size=s.expected_batch_size, noise_multiplier=p.noise_multiplier or 1.0)
            for s in recipe.schedule
        )
    )
    physical = ledger_physical_batch_sizes(recipe, dataset_size)
    if not p.enabled:
        return Plan(
            schedule=base.with_noise_multipliers([0.0] * len(base.stages)), physical_batch_sizes=physical, ledger=None
        )
    vocabulary = dp_vocabulary_event(recipe)
    if p.noise_multiplier is None:
        schedule = calibrate_noise_multiplier(
            base,
            dataset_size=dataset_size,
            target_epsilon=p.target_epsilon,
            delta=p.delta,
            accountant=p.accountant,
            per_stage=p.calibrate == "per_stage",
            extra_event=None if vocabulary is None else vocabulary.event(),
        )
    else:
        schedule = base
    document = p.unit == "document"
    ledger = PrivacyLedger.for_schedule(
        schedule,
        dataset_size=dataset_size,
        delta=p.delta,
        clip_norm=p.clip_norm,
        accountant=p.accountant,
        physical_batch_sizes=list(physical),
        target_epsilon=p.target_epsilon,
        dataset_size_source=dataset_size_source,
        privacy_unit=DOCUMENT_UNIT if document else PRIVACY_UNIT,
        max_sequences_per_document=p.max_sequences_per_document if document else None,
        vocabulary=vocabulary,
    )
    ledger.check_budget()
    return Plan(schedule=schedule, physical_batch_sizes=physical, ledger=ledger)


# ---------------------------------------------------------------------------- DP vocabulary (data.tokenizer: dp)


def dp_vocabulary_window(recipe: Recipe) -> int | None:
    """Words per counted unit of a DP vocabulary: None when the unit is a whole document, else
    seq_len - 2 (a training sequence holds at most that many words: [CLS], [SEP], >= 1 token a word)."""
    unit = recipe.data.vocab_unit or recipe.privacy.unit
    return None if unit == "document" else recipe.data.seq_len - 2


def dp_vocabulary_event(recipe: Recipe) -> VocabularyEvent | None:
    """The ledger event of the recipe's DP vocabulary (None unless `data.tokenizer: dp`): a Gaussian
    calibrated to `data.vocab_epsilon` alone at `privacy.delta`; a function of the recipe only."""
    d = recipe.data
    if d.tokenizer != "dp":
        return None
    window = dp_vocabulary_window(recipe)
    k = d.vocab_words_per_unit or d.seq_len - 2
    return calibrate_vocabulary(
        epsilon=d.vocab_epsilon,
        delta=recipe.privacy.delta,
        selection_delta=d.vocab_delta,
        words_per_unit=k if window is None else min(k, window),
        unit=DOCUMENT_UNIT if window is None else f"one window of {window} words",
        accountant=recipe.privacy.accountant,
    )


def dp_vocabulary_dir(
    recipe: Recipe, run_dir: Path, secret: RunSecret, mechanism: str, *, resume: bool, log: Callable[[str], None]
) -> Path:
    """The run's DP vocabulary folder (RUN_DIR/vocabulary), learned from the train documents with
    the key `mechanism_key(secret, mechanism + "/vocabulary")`, or reused by a resumed run (its
    secret is the same, so is the folder)."""
    out = run_dir / "vocabulary"
    if resume and (out / "tokenizer.json").is_file():
        return out
    d, event = recipe.data, dp_vocabulary_event(recipe)
    t0 = time.perf_counter()
    tokenizer = train_dp_wordpiece(
        train_texts(d.corpus, eval_fraction=d.eval_fraction, seed=d.split_seed),
        event=event,
        key=mechanism_key(secret, f"{mechanism}/vocabulary"),
        vocab_size=d.train_vocab_size,
        out_dir=out,
        window=dp_vocabulary_window(recipe),
        origin=(
            f"DP WordPiece learned from {d.corpus} (Gaussian partition selection, epsilon {event.epsilon_share:.3g} "
            f"alone, selection delta {event.selection_delta:g}, unit {event.unit}; in the run's ledger)"
        ),
    )
    log(
        f"vocabulary: DP WordPiece of {len(tokenizer)} tokens (noise std {event.noise_stddev:.1f} on word counts, "
        f"threshold {event.threshold:.1f}) [{time.perf_counter() - t0:.0f} s]"
    )
    return out


# ---------------------------------------------------------------------------- model, state and step


def bert_config(recipe: Recipe, tokenizer_vocab_size: int | None = None) -> Any:
    """The recipe's `transformers.BertConfig` (`init_from`'s own config when given);
    `model.vocab_size: null` takes `tokenizer_vocab_size`."""
    from transformers import BertConfig

    m = recipe.model
    if m.init_from is not None:
        return BertConfig.from_pretrained(m.init_from)
    if m.vocab_size is not None and tokenizer_vocab_size is not None and m.vocab_size < tokenizer_vocab_size:
        raise ValueError(
            f"recipe field 'model.vocab_size': {m.vocab_size} is smaller than the tokenizer's {tokenizer_vocab_size} tokens"
        )
    vocab_size = m.vocab_size or tokenizer_vocab_size
    if vocab_size is None:
        raise ValueError(
            "recipe field 'model.vocab_size': needed here (null means the tokenizer's size, which is "
            "only known once the data is prepared)"
        )
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings or recipe.data.seq_len,
        hidden_dropout_prob=m.hidden_dropout_prob,
        attention_probs_dropout_prob=m.attention_probs_dropout_prob,
    )


def make_optimizer(recipe: Recipe) -> optax.GradientTransformation:
    o = recipe.optimizer
    return default_optimizer(_learning_rate(recipe), weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AbstractState:
    """Shapes, dtypes and shardings of a run's params and optimizer state on `mesh` (no arrays)."""

    graphdef: nnx.GraphDef
    params: Any  # ShapeDtypeStructs with their shardings
    opt_state: Any
    build: Callable[[], BertForMaskedLM]

    @property
    def shardings(self) -> tuple[Any, Any]:
        """(params, opt_state) NamedSharding pytrees, as the step takes them."""
        return tuple(jax.tree_util.tree_map(lambda x: x.sharding, tree) for tree in (self.params, self.opt_state))


def abstract_state(recipe: Recipe, config: Any, optimizer: optax.GradientTransformation, mesh: Mesh) -> AbstractState:
    """The run's state as `jax.eval_shape` sees it, placed by `dpbert.train.mesh.state_shardings`."""
    dtype = jnp.bfloat16 if recipe.train.dtype == "bfloat16" else jnp.float32

    def build() -> BertForMaskedLM:
        return BertForMaskedLM(config, rngs=nnx.Rngs(recipe.train.seed), dtype=dtype, remat=recipe.model.remat)

    graphdef, params = functional.split_params(nnx.eval_shape(build))
    opt_state = jax.eval_shape(optimizer.init, params)

    def place(tree: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, state_shardings(tree, mesh)
        )

    return AbstractState(graphdef=graphdef, params=place(params), opt_state=place(opt_state), build=build)


def init_state(recipe: Recipe, abstract: AbstractState, optimizer: optax.GradientTransformation) -> tuple[Any, Any]:
    """Fresh params (random init, or `model.init_from`'s weights) and optimizer state, created
    directly in their shardings: each device computes or receives only its shards."""
    params_sh, opt_sh = abstract.shardings
    m = recipe.model
    if m.init_from is None:
        params = jax.jit(lambda: functional.split_params(abstract.build())[1], out_shardings=params_sh)()
    else:
        dtype = jnp.bfloat16 if recipe.train.dtype == "bfloat16" else jnp.float32
        loaded = BertForMaskedLM.from_pretrained(
            m.init_from,
            dtype=dtype,
            seed=recipe.train.seed,
            hidden_dropout_prob=m.hidden_dropout_prob,
            attention_probs_dropout_prob=m.attention_probs_dropout_prob,
        )
        host = jax.device_get(functional.split_params(loaded)[1])
        params = jax.tree_util.tree_map(distributed.from_host, host, params_sh)
    return params, jax.jit(optimizer.init, out_shardings=opt_sh)(params)


def make_mlm_loss(
    recipe: Recipe, graphdef: nnx.GraphDef, masker: Callable[..., dict[str, jax.Array]], run_key: jax.Array
) -> Any:
    """The per-example masked-LM loss the step clips: with layer taps (ghost clipping) unless
    the run is non-private or `train.clipping` is "vmap". With `privacy.unit: document` an
    example is a document (`dpbert.privacy.documents`) and the loss is always the tapped one,
    a plain loss too, so that both clipping paths clip the same function."""
    if recipe.privacy.enabled and (recipe.train.clipping != "vmap" or recipe.privacy.unit == "document"):
        return MaskedMLMGhostLoss(graphdef=graphdef, masker=masker, run_key=run_key, layer_mode=recipe.train.layer_mode)
    return make_loss_fn(graphdef, masker, run_key)


def make_step(
    recipe: Recipe,
    loss_fn: Any,
    optimizer: optax.GradientTransformation,
    *,
    noise_multiplier: float,
    expected_batch_size: int,
    mesh: Mesh,
    shardings: tuple[Any, Any],
) -> StepFn:
    """The jitted step of one schedule stage exactly as the trainer runs it (and as
    `dpbert pretrain --compile-only` compiles it): batch split over all mesh axes, state in
    `shardings`, params and optimizer state donated."""
    common: dict[str, Any] = {
        "microbatch_size": recipe.train.microbatch_size,
        "mesh": mesh,
        "data_axis": batch_axes(mesh),
        "state_shardings": shardings,
    }
    if not recipe.privacy.enabled:
        return make_train_step(loss_fn, optimizer, **common)
    if recipe.train.clipping == "auto" and jax.process_count() > 1:
        # "auto" times both methods on each host; hosts could pick different programs.
        raise ValueError("recipe field 'train.clipping': 'auto' is single-process only; choose ghost or vmap")
    return make_dp_train_step(
        loss_fn,
        optimizer,
        clip_norm=recipe.privacy.clip_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        clipping_method=recipe.train.clipping,
        **common,
    )


# ---------------------------------------------------------------------------- helpers


def _learning_rate(recipe: Recipe) -> optax.Schedule:
    o, total = recipe.optimizer, recipe.total_steps
    end = o.learning_rate * o.end_learning_rate_fraction
    decay_steps = max(total - o.warmup_steps, 1)
    if o.decay == "constant":
        decay = optax.constant_schedule(o.learning_rate)
    elif o.decay == "linear":
        decay = optax.linear_schedule(o.learning_rate, end, decay_steps)
    else:
        decay = optax.cosine_decay_schedule(o.learning_rate, decay_steps, alpha=o.end_learning_rate_fraction)
    if o.warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps)
    return optax.join_schedules([warmup, decay], [o.warmup_steps])


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class _StopFlag:
    """Set by SIGTERM; the loop checkpoints and returns at the next step boundary."""

    def __init__(self) -> None:
        self.stop = False
        self._previous: Any = None

    def __enter__(self) -> _StopFlag:
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no signal handling, nothing to restore
            self._previous = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.stop = True

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def unigram_token(store: TokenStore, dataset_size: int, special_token_ids: Iterable[int], *, chunk: int = 8192) -> int:
    """The most frequent non-special token among the first `dataset_size` train sequences: the
    unigram baseline predicts it at every masked position. NOT covered by the DP guarantee (a
    statistic of the private corpus, reported as a diagnostic beside the private accuracy)."""
    counts = np.zeros(store.manifest.vocab_size, np.int64)
    for start in range(0, dataset_size, chunk):
        rows = np.asarray(store[np.arange(start, min(start + chunk, dataset_size))])
        counts += np.bincount(rows.ravel(), minlength=counts.size)[: counts.size]
    counts[list(special_token_ids)] = 0
    return int(np.argmax(counts))


def evaluate(
    params: Any,
    eval_fn: Callable[..., Any],
    store: TokenStore,
    *,
    batches: int,
    batch_size: int,
    mesh: Mesh | None = None,
    unigram: int = 0,
) -> dict[str, float]:
    """Held-out MLM accuracy and loss on the first `batches * batch_size` eval examples (every
    process reads the same rows; with `mesh`, they enter the computation replicated on it), and
    the accuracy of always predicting token `unigram` on the same masked positions."""
    n = min(len(store), batches * batch_size)
    if n == 0:
        raise ValueError(f"token store {store.path}: the eval split is empty; raise data.eval_fraction")
    totals = {"correct": 0.0, "loss": 0.0, "count": 0.0, "unigram_correct": 0.0}
    for start in range(0, n, batch_size):
        # Fixed shapes (one compilation): the last batch is padded with row 0, marked invalid.
        idx = np.arange(start, start + batch_size)
        valid = idx < n
        idx = np.where(valid, idx, 0)
        args = (
            idx.astype(np.int32),
            np.asarray(store[idx], np.int32),
            valid.astype(np.float32),
            np.asarray(unigram, np.int32),
        )
        out = eval_fn(params, *(distributed.replicate(args, mesh) if mesh is not None else map(jnp.asarray, args)))
        for k in totals:
            totals[k] += float(out[k])
    count = max(totals["count"], 1.0)
    return {
        "eval_mlm_accuracy": totals["correct"] / count,
        "eval_mlm_loss": totals["loss"] / count,
        "eval_unigram_accuracy": totals["unigram_correct"] / count,
        "eval_masked_tokens": int(totals["count"]),
        "eval_examples": n,
    }


def fill_mask(
    graphdef: nnx.GraphDef, params: Any, tokenizer: Any, sentences: Iterable[str], top_k: int, seq_len: int
) -> tuple[tuple[str, tuple[tuple[str, float], ...]], ...]:
    """Top-k predictions (token, probability) for the one [MASK] of each sentence."""
    sentences = list(sentences)
    if not sentences:
        return ()
    enc = tokenizer(sentences, padding="max_length", truncation=True, max_length=seq_len, return_tensors="np")
    ids = enc["input_ids"]
    positions = []
    for sentence, row in zip(sentences, ids, strict=True):
        where = np.flatnonzero(row == tokenizer.mask_token_id)
        if where.size != 1:
            raise ValueError(
                f"fill-mask sentence {sentence!r}: expected exactly one {tokenizer.mask_token} "
                f"within the first {seq_len} tokens"
            )
        positions.append(where[:1])
    logits = jax.jit(functional.mlm_logits, static_argnums=0)(
        graphdef,
        params,
        jnp.asarray(ids),
        jnp.asarray(enc["attention_mask"]),
        None,
        None,
        masked_positions=jnp.asarray(np.stack(positions), jnp.int32),
    )
    probs = np.asarray(jax.nn.softmax(logits[:, 0].astype(jnp.float32), axis=-1))
    results = []
    for sentence, p in zip(sentences, probs, strict=True):
        top = np.argsort(-p)[:top_k]
        results.append((sentence, tuple((tokenizer.convert_ids_to_tokens(int(t)), float(p[t])) for t in top)))
    return tuple(results)


# ---------------------------------------------------------------------------- the run


def pretrain(
    recipe_path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    overrides: Iterable[str] = (),
    resume: bool = False,
    show_fill_mask: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    noise_seed_file: str | os.PathLike[str] | None = None,
    mechanism: str = "pretrain",
    release: bool = True,
) -> RunResult:
    """Run (or resume) the recipe in `output_dir`; see the module docstring for guarantees.

    `noise_seed_file`: an auditor's secret (hex) instead of a fresh OS CSPRNG draw, so that the
    run can be reproduced by whoever holds the file; the release says so. `mechanism` names the
    purpose the keys are derived for (an audit's training run passes its own). `release=False`
    skips the final `hf/` and `release/` folders (a sweep's arms: only the numbers are kept)."""
    started = time.perf_counter()
    primary = distributed.is_primary()
    if not primary:
        log = _silent
    recipe = load_recipe(recipe_path, overrides)
    run_dir = Path(output_dir)
    ckpt_dir = run_dir / "checkpoints"
    if not resume and _has_checkpoints(ckpt_dir):
        raise ValueError(
            f"run folder {run_dir} already holds checkpoints; pass --resume to continue it or choose another --output-dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not recipe.privacy.enabled and noise_seed_file is not None:
        raise ValueError(
            "--noise-seed-file: the recipe is non-private (privacy.enabled: false); there is no noise to seed"
        )

    # --- data
    store_dir = Path(recipe.data.store) if recipe.data.store else run_dir / "store"
    t0 = time.perf_counter()

    secret = None
    if recipe.data.tokenizer == "dp":  # the DP vocabulary is the run's first mechanism: it needs the secret now
        secret = _shared_secret(ckpt_dir, resume=resume, supplied=noise_seed_file, primary=primary)
        if primary:
            dp_vocabulary_dir(recipe, run_dir, secret, mechanism, resume=resume, log=log)
        distributed.barrier("dpbert pretrain: DP vocabulary ready")

    def prepare() -> Any:
        return prepare_store(
            store_dir,
            corpus=recipe.data.corpus,
            tokenizer=str(run_dir / "vocabulary")
            if recipe.data.tokenizer == "dp"
            else resolve_tokenizer(recipe.data.tokenizer),
            seq_len=recipe.data.seq_len,
            eval_fraction=recipe.data.eval_fraction,
            seed=recipe.data.split_seed,
            train_vocab_size=recipe.data.train_vocab_size,
            num_proc=recipe.data.num_proc,
        )

    # Process 0 builds the store (on storage every host sees); the others then find it ready.
    manifest = prepare() if primary else None
    distributed.barrier("dpbert pretrain: token store ready")
    manifest = manifest or prepare()
    train_store = TokenStore.open(store_dir, "train")
    eval_store = TokenStore.open(store_dir, "eval")
    tokenizer = load_tokenizer(train_store.tokenizer_dir)
    document_unit = recipe.privacy.enabled and recipe.privacy.unit == "document"
    offsets = train_store.document_offsets() if document_unit else None
    n_train, n_source = public_dataset_size(recipe, len(train_store) if offsets is None else offsets.size - 1)
    if offsets is not None:
        offsets = check_document_offsets(offsets[: n_train + 1])  # an empty document is refused here
    n_sequences = n_train if offsets is None else int(offsets[-1])
    unigram = unigram_token(train_store, n_sequences, manifest.special_token_ids)
    log(
        f"data: {len(train_store)} train / {len(eval_store)} held-out sequences of {manifest.seq_len} tokens "
        f"({manifest.source}; vocabulary {manifest.vocab_origin}, {manifest.vocab_size} tokens) "
        f"[{time.perf_counter() - t0:.0f} s]"
    )
    units = "sequences" if offsets is None else "documents"
    if n_source != "exact":
        log(
            f"data: sampling from the first {n_train} {units}, the public dataset size N of q = B/N "
            f"({'declared in the recipe' if n_source == 'declared' else 'rounded down to 2 significant digits'})"
        )
    if offsets is not None:
        log(
            f"privacy unit: one document ({n_train} documents, {n_sequences} sequences; at most "
            f"{recipe.privacy.max_sequences_per_document} sequences of a sampled document per step)"
        )

    # --- devices, model and optimizer
    mesh = make_mesh(data=recipe.mesh.data, fsdp=recipe.mesh.fsdp)
    devices = mesh.devices.size
    config = bert_config(recipe, manifest.vocab_size)
    vocab_size = config.vocab_size
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, vocab_size=vocab_size))
    # --- privacy plan (refuses a schedule that would pass the target epsilon, before anything is written),
    # from the recipe as written: the device's settings below never change the ledger
    plan = make_plan(recipe, n_train, dataset_size_source=n_source)
    written = recipe
    if recipe.train.tune_for_device and offsets is None:  # document batches keep the recipe's micro-batch
        settings = device_settings(
            recipe,
            config,
            num_predictions=max_predictions(manifest.seq_len, recipe.data.mask_prob),
            dataset_size=n_train,
            physical_batch_sizes=plan.physical_batch_sizes,
            devices=devices,
        )
        recipe = dataclasses.replace(recipe, train=settings.apply(recipe.train))
        log(settings.describe())
    optimizer = make_optimizer(recipe)
    abstract = abstract_state(recipe, config, optimizer, mesh)
    graphdef = abstract.graphdef
    if recipe.privacy.enabled and secret is None:
        secret = _shared_secret(ckpt_dir, resume=resume, supplied=noise_seed_file, primary=primary)
    masking_key, stage_keys = run_keys(recipe, secret, mechanism)
    masker = make_masker(
        vocab_size=vocab_size,
        mask_token_id=manifest.mask_id,
        special_token_ids=tuple(manifest.special_token_ids),
        pad_id=manifest.pad_id,
        mask_prob=recipe.data.mask_prob,
        num_predictions=max_predictions(manifest.seq_len, recipe.data.mask_prob),
    )
    loss_fn = make_mlm_loss(recipe, graphdef, masker, masking_key)
    eval_fn = make_eval_fn(graphdef, masker)
    mb = recipe.train.microbatch_size
    device_batches = tuple(device_batch_size(b, devices, mb) for b in plan.physical_batch_sizes)
    log(
        f"devices: mesh {' x '.join(f'{k}={v}' for k, v in mesh.shape.items())} over {jax.process_count()} "
        f"process(es); compiled batch per stage {', '.join(map(str, device_batches))}"
    )
    if plan.ledger is not None:
        sigmas = ", ".join(f"{s.noise_multiplier:.4g}" for s in plan.schedule.stages)
        log(
            f"privacy: DP-SGD, clip norm {recipe.privacy.clip_norm}, noise multiplier(s) {sigmas}, "
            f"planned epsilon {plan.ledger.epsilon():.3f} at delta {recipe.privacy.delta:g} ({recipe.privacy.accountant})"
        )
    else:
        log("privacy: NOT private (baseline: no clipping, no noise)")

    # --- state: restored into its shardings, or created in them
    fingerprints = {
        # remat trades memory for compute and changes no result: a resume may switch it.
        "model": _fingerprint({k: v for k, v in recipe_to_dict(recipe)["model"].items() if k != "remat"}),
        "data": f"{manifest.tokenizer_fingerprint[:16]}/{manifest.corpus_sha256[:16]}/{n_train}/{manifest.seq_len}",
        "optimizer": _fingerprint(recipe_to_dict(recipe)["optimizer"]),
        "seed": str(recipe.train.seed),
        "private": str(recipe.privacy.enabled),
    }
    checkpoints = CheckpointStore(ckpt_dir, keep=recipe.train.keep_checkpoints)
    metrics_path = run_dir / "metrics.jsonl"
    if resume and checkpoints.latest_step() is not None:
        like = TrainState(
            params=abstract.params, opt_state=abstract.opt_state, step=0, ledger_json=ledger_text(plan.ledger_after(0))
        )
        state = checkpoints.restore(like, fingerprints)
        if state.step > recipe.total_steps:
            raise ValueError(
                f"checkpoint at step {state.step} is past the recipe's {recipe.total_steps} steps; "
                "the schedule cannot shrink below the steps already taken"
            )
        if state.ledger != plan.ledger_after(state.step):
            raise ValueError(
                f"checkpoint {ckpt_dir / str(state.step)}: its privacy ledger does not match this recipe's plan "
                "for the steps already taken (noise multiplier, batch sizes, delta or dataset changed); "
                "a resumed run must replay the same steps"
            )
        if primary:
            truncate_after(metrics_path, state.step)
        log(f"resumed from step {state.step}")
    else:
        params, opt_state = init_state(recipe, abstract, optimizer)
        state = TrainState(params=params, opt_state=opt_state, step=0, ledger_json=ledger_text(plan.ledger_after(0)))
        if primary and metrics_path.exists():
            metrics_path.unlink()
    if primary:
        save_recipe(written, run_dir / "recipe.yaml")
        if secret is not None:
            write_json(run_dir / RANDOMNESS_FILE, {"source": secret.source})

    # --- loop
    step_fns: dict[int, Callable[..., Any]] = {}
    metrics = MetricsLog(metrics_path) if primary else None
    total = recipe.total_steps
    stopped = False
    last_eval: dict[str, float] | None = None
    bar = _progress_bar(total, state.step, enabled=progress and primary)

    def save_checkpoint(state: TrainState) -> None:
        checkpoints.save(state, fingerprints)  # collective: every process writes its shards
        if primary and plan.ledger is not None:
            write_json(run_dir / "privacy.json", state.ledger)

    def run_eval(state: TrainState) -> dict[str, float]:
        result = evaluate(
            state.params,
            eval_fn,
            eval_store,
            batches=recipe.train.eval_batches,
            batch_size=recipe.train.eval_batch_size,
            mesh=mesh,
            unigram=unigram,
        )
        if metrics is not None:
            metrics.write({"kind": "eval", "step": state.step, **result})
        return {"step": state.step, **result}

    try:
        with _StopFlag() as flag:
            while state.step < total:
                t = state.step
                pos = plan.schedule.stage_at(t)
                stage = pos.stage
                if pos.index not in step_fns:
                    step_fns[pos.index] = make_step(
                        recipe,
                        loss_fn,
                        optimizer,
                        noise_multiplier=stage.noise_multiplier,
                        expected_batch_size=stage.expected_batch_size,
                        mesh=mesh,
                        shardings=abstract.shardings,
                    )
                tick = time.perf_counter()
                # This process's rows only; the ledger's truncation size, padded for the mesh.
                if offsets is None:
                    sample, rows = distributed.local_batch(
                        train_store,
                        stage_keys[pos.index],
                        t,
                        dataset_size=n_train,
                        expected_batch_size=stage.expected_batch_size,
                        physical_batch_size=plan.physical_batch_sizes[pos.index],
                        padded_batch_size=device_batches[pos.index],
                    )
                    extra = {}
                else:
                    sample, rows = distributed.local_document_batch(
                        train_store,
                        stage_keys[pos.index],
                        t,
                        document_offsets=offsets,
                        num_documents=n_train,
                        expected_batch_size=stage.expected_batch_size,
                        physical_batch_size=plan.physical_batch_sizes[pos.index],
                        max_sequences_per_document=recipe.privacy.max_sequences_per_document,
                        padded_batch_size=device_batches[pos.index],
                    )
                    extra = {SEQUENCE_PADDING: sample.sequence_padding}
                batch, is_padding = distributed.global_array(
                    (
                        {
                            "input_ids": rows.astype(np.int32),
                            "index": sample.indices.astype(np.int32),
                            "step": np.full(sample.indices.shape, t, np.int32),
                            **extra,
                        },
                        sample.is_padding,
                    ),
                    mesh,
                )
                params, opt_state, out = step_fns[pos.index](
                    state.params, state.opt_state, batch, is_padding, step_key(stage_keys[pos.index], t)
                )
                loss = float(out["nonprivate/loss"])
                if not math.isfinite(loss):
                    raise NonFiniteLossError(
                        f"non-finite training loss {loss} at step {t + 1} (learning rate too high, or bad data); "
                        f"the last good checkpoint is in {ckpt_dir}"
                    )
                state = state.replace(
                    params=params, opt_state=opt_state, step=t + 1, ledger_json=ledger_text(plan.ledger_after(t + 1))
                )
                elapsed = time.perf_counter() - tick
                if metrics is not None and (state.step % recipe.train.log_every == 0 or state.step == total):
                    epsilon = plan.epsilon_after(state.step)
                    metrics.write(
                        {
                            "kind": "train",
                            "step": state.step,
                            "expected_batch_size": stage.expected_batch_size,
                            "realized_batch_size": sample.realized_size,
                            "physical_batch_size": plan.physical_batch_sizes[pos.index],
                            "epsilon": epsilon,
                            "learning_rate": float(_learning_rate(recipe)(t)),
                            "examples_per_s": sample.realized_size / elapsed,
                            "step_time_s": elapsed,
                            "nonprivate_diagnostics": {
                                k.split("/", 1)[1]: float(v) for k, v in out.items() if k.startswith("nonprivate/")
                            },
                        }
                    )
                    bar.set_postfix_str(
                        f"loss {loss:.3f} (non-private diag.)" + ("" if epsilon is None else f", eps {epsilon:.2f}")
                    )
                bar.update(1)
                if recipe.train.eval_every and state.step % recipe.train.eval_every == 0 and state.step < total:
                    last_eval = run_eval(state)
                    bar.write(
                        f"step {state.step}: held-out MLM accuracy {last_eval['eval_mlm_accuracy']:.4f}, "
                        f"loss {last_eval['eval_mlm_loss']:.3f} (unigram baseline "
                        f"{last_eval['eval_unigram_accuracy']:.4f})"
                    )
                if state.step % recipe.train.checkpoint_every == 0 or state.step == total:
                    save_checkpoint(state)
                # Every process stops at the same step, whichever of them got the signal.
                if distributed.any_process(flag.stop) and state.step < total:
                    save_checkpoint(state)
                    stopped = True
                    bar.write(
                        f"SIGTERM: checkpoint written at step {state.step} in {ckpt_dir}; "
                        "rerun with --resume to continue"
                    )
                    break
            if not stopped:
                save_checkpoint(state)
                last_eval = run_eval(state)
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
        checkpoints.close()

    # --- end of run
    epsilon = plan.epsilon_after(state.step)
    delta = None if plan.ledger is None else recipe.privacy.delta
    if stopped:
        return RunResult(
            run_dir=run_dir,
            steps_done=state.step,
            total_steps=total,
            stopped_early=True,
            epsilon=epsilon,
            delta=delta,
            eval_mlm_accuracy=None,
            eval_mlm_loss=None,
            wall_time_s=time.perf_counter() - started,
        )
    host_params = distributed.host_copy(state.params)  # collective; then process 0 alone writes
    filled: tuple[Any, ...] = ()
    release_dir: Path | None = None
    if primary:
        if release:
            _write_hf(
                functional.merge(graphdef, jax.tree_util.tree_map(jnp.asarray, host_params)),
                tokenizer,
                run_dir / "hf",
                ledger=None if plan.ledger is None else state.ledger,
            )
            release_dir = _export_release(run_dir, private=plan.ledger is not None)
        if show_fill_mask:
            filled = fill_mask(
                graphdef, host_params, tokenizer, recipe.report.fill_mask, recipe.report.top_k, manifest.seq_len
            )
    distributed.barrier("dpbert pretrain: exports written")
    result = RunResult(
        run_dir=run_dir,
        steps_done=state.step,
        total_steps=total,
        stopped_early=False,
        epsilon=epsilon,
        delta=delta,
        eval_mlm_accuracy=last_eval["eval_mlm_accuracy"],
        eval_mlm_loss=last_eval["eval_mlm_loss"],
        wall_time_s=time.perf_counter() - started,
        fill_mask=filled,
        eval_unigram_accuracy=last_eval["eval_unigram_accuracy"],
        unigram_token=tokenizer.convert_ids_to_tokens(unigram),
        reference=recipe_reference(recipe_path),
    )
    if primary:
        _report(result, release_dir, log)
    return result


def _silent(_: str) -> None:
    """The log of processes other than 0: they print nothing."""


def _progress_bar(total: int, initial: int, *, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc="pretrain",
        unit="step",
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
    )


def _write_hf(model: BertForMaskedLM, tokenizer: Any, out: Path, *, ledger: dict[str, Any] | None) -> None:
    """The final model and its tokenizer as a Hugging Face folder (atomic: temp sibling, rename),
    with the run's privacy ledger beside the weights when the run was private."""
    with replace_dir(out) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if ledger is not None:
            write_json(tmp / "privacy.json", ledger)


def _has_checkpoints(ckpt_dir: Path) -> bool:
    """Whether `ckpt_dir` holds a step folder (the noise secret alone is not a checkpoint)."""
    return ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())


def _run_secret(ckpt_dir: Path, *, resume: bool, supplied: str | os.PathLike[str] | None) -> RunSecret:
    """The run's secret (see `dpbert.privacy.randomness.run_secret`); a resume whose
    checkpoints outlived their secret is refused, since it could not replay its steps."""
    path = ckpt_dir / SECRET_FILE
    if resume and _has_checkpoints(ckpt_dir) and not path.exists():
        raise ValueError(
            f"{path}: missing; the checkpoints of this private run cannot be resumed without the "
            "secret they were trained with (start a new run in another --output-dir)"
        )
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    return run_secret(path, reuse=resume, supplied=supplied)


def _shared_secret(
    ckpt_dir: Path, *, resume: bool, supplied: str | os.PathLike[str] | None, primary: bool
) -> RunSecret:
    """The run's secret on every process: process 0 draws (or reads) it, the others read process 0's."""
    secret = _run_secret(ckpt_dir, resume=resume, supplied=supplied) if primary else None
    distributed.barrier("dpbert pretrain: noise secret ready")
    return secret or read_secret(ckpt_dir / SECRET_FILE)


def run_keys(recipe: Recipe, secret: RunSecret | None, mechanism: str) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """(masking key, one key per stage): from the secret by domain separation when private,
    else all `jax.random.key(train.seed)` (a non-private run has nothing to hide)."""
    if secret is None:
        key = jax.random.key(recipe.train.seed)
        return key, (key,) * len(recipe.schedule)
    return mechanism_key(secret, f"{mechanism}/masking"), tuple(
        mechanism_key(secret, f"{mechanism}/stage/{i}") for i in range(len(recipe.schedule))
    )


def _export_release(run_dir: Path, *, private: bool) -> Path:
    from dpbert.release.export import export_run

    return export_run(run_dir, run_dir / "release", non_private=not private, overwrite=True)


REFERENCE_LINE = re.compile(r"^#\s*non-private reference:\s*([0-9]+(?:\.[0-9]+)?)%\s*(.*)$", re.IGNORECASE)


def recipe_reference(path: str | os.PathLike[str]) -> tuple[float, str] | None:
    """(accuracy, rest of the line) from the recipe header's comment line
    `# Non-private reference: 21.3% held-out MLM accuracy, measured ...`: the accuracy that the
    non-private twin of the shipped recipe reached with the same compute (examples and steps).
    None when the header has no such line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        if not line.startswith("#"):
            break
        match = REFERENCE_LINE.match(line.strip())
        if match:
            return float(match.group(1)) / 100, match.group(2).strip()
    return None


def _report(result: RunResult, release: Path | None, log: Callable[[str], None]) -> None:
    log("")
    log(f"run {result.run_dir}: {result.steps_done} steps in {result.wall_time_s:.0f} s")
    if result.epsilon is None:
        log("privacy: NOT private (baseline)")
    else:
        log(f"privacy: epsilon = {result.epsilon:.3f} at delta = {result.delta:g}")
    log(f"held-out MLM accuracy: {100 * result.eval_mlm_accuracy:.2f}%  (loss {result.eval_mlm_loss:.3f})")
    rows = [
        (
            "this run, " + ("NOT private" if result.epsilon is None else f"DP at epsilon {result.epsilon:.2f}"),
            result.eval_mlm_accuracy,
            "",
        )
    ]
    if result.eval_unigram_accuracy is not None:
        rows.append(
            (
                f"unigram baseline ('{result.unigram_token}' everywhere)",
                result.eval_unigram_accuracy,
                "the most frequent train token (non-private diagnostic)",
            )
        )
    if result.reference is not None:
        rows.append(
            ("non-private reference, same compute", result.reference[0], f"recipe header: {result.reference[1]}")
        )
    log("held-out masked-token accuracy, same masked positions:")
    for name, value, note in rows:
        log(f"  {name:<40}{100 * value:6.2f}%   {note}".rstrip())
    if release is not None:
        log(f"Hugging Face folder: {result.run_dir / 'hf'}; release with privacy metadata: {release}")
    for sentence, preds in result.fill_mask:
        log(f"  {sentence}")
        log("    -> " + ", ".join(f"{tok} ({p:.2f})" for tok, p in preds))


def pretrain_main(args: Any) -> int:
    """`dpbert pretrain` entry point (argparse namespace from dpbert.cli). Starts jax.distributed
    first when asked: explicitly (--coordinator-address/--num-processes/--process-id) or
    auto-detected from the cluster environment (--distributed)."""
    from dpbert.privacy.planner import quiet_accountant_warnings

    quiet_accountant_warnings()
    explicit = {
        "coordinator_address": args.coordinator_address,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    if any(v is not None for v in explicit.values()):
        if args.distributed:
            raise ValueError(
                "--distributed (auto-detect) and --coordinator-address/--num-processes/--process-id "
                "are alternatives; give one or the other"
            )
        distributed.initialize(**explicit)
    elif args.distributed:
        distributed.initialize()
    result = pretrain(
        args.recipe,
        args.output_dir,
        overrides=args.set or (),
        resume=args.resume,
        show_fill_mask=args.fill_mask,
        noise_seed_file=args.noise_seed_file,
    )
    return 0 if result.stopped_early or result.steps_done == result.total_steps else 1


def plot_main(args: Any) -> int:
    """`dpbert plot` entry point."""
    from dpbert.train.metrics import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0
