"""The privacy plan of a run, built from its recipe alone: pure, so that `dpbert pretrain`,
`account`, `verify` and the audit build the same ledger.

`plan_recipe(recipe, stored_units)` finds the public N and the public bound on the stored units,
then `make_plan` calibrates (or takes) the noise multipliers, sizes each stage's physical batch
(the Poisson sample's truncation) and refuses a schedule that would pass the target epsilon; `Plan` answers "which ledger covers the first t steps" for checkpoints and exports.

Guarantees: the truncation of a private run's Poisson sample at the physical batch adds
(1 + e^eps) * P[overflow] per step to delta; `truncation_overflow_bound` keeps the sum over
every step at half of what the budget check allows (`MAX_TRUNCATION_DELTA_FRACTION` of delta),
for pretraining and fine-tuning alike.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dpbert.config.recipe import Recipe
from dpbert.privacy import BatchSchedule, PrivacyLedger, Stage, calibrate_noise_multiplier, physical_batch_size
from dpbert.privacy.accounting import (
    DOCUMENT_UNIT,
    MAX_TRUNCATION_DELTA_FRACTION,
    PRIVACY_UNIT,
    VocabularyEvent,
    calibrate_vocabulary,
    round_down_significant,
)

NONPRIVATE_LEDGER = {"private": False, "note": "non-private baseline: no clipping, no noise, no guarantee"}
# A private run refuses a store with more units than this factor times the public N, unless the
# recipe declares its own bound (`privacy.dataset_size_bound`): the truncation term is accounted
# for a store of that size. 1.25 covers N rounded down to 2 significant digits (at most 1.1x).
MAX_STORE_FACTOR = 1.25
# The epsilon the truncation bound assumes when a run fixes its noise multiplier instead of a target.
UNTARGETED_EPSILON_BOUND = 50.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A run's schedule with noise multipliers (0 when non-private) and physical batch sizes.

    `ledger` is the full planned ledger (None when non-private). `steps_before`: steps of
    earlier runs composed in the same ledger (a fine-tuning sweep's earlier runs), so that the
    ledger after this run's t steps is `ledger.spent(steps_before + t)`."""

    schedule: BatchSchedule
    physical_batch_sizes: tuple[int, ...]
    ledger: PrivacyLedger | None
    steps_before: int = 0
    _epsilons: dict[int, float] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def ledger_after(self, steps: int) -> dict[str, Any]:
        """The ledger of the first `steps` steps of this run, as a dict."""
        return NONPRIVATE_LEDGER if self.ledger is None else self.ledger.spent(self.steps_before + steps).to_dict()

    def epsilon_after(self, steps: int) -> float | None:
        """Epsilon spent by the first `steps` steps (None when non-private); memoized."""
        if self.ledger is None:
            return None
        if steps not in self._epsilons:
            self._epsilons[steps] = self.ledger.spent(self.steps_before + steps).epsilon()
        return self._epsilons[steps]


def truncation_overflow_bound(*, delta: float, target_epsilon: float | None, total_steps: int) -> float:
    """P[Poisson sample > physical batch] allowed per step: (1 + e^eps) * bound * steps is half of
    `MAX_TRUNCATION_DELTA_FRACTION * delta` (the share of delta the budget check allows)."""
    eps = target_epsilon if target_epsilon is not None else UNTARGETED_EPSILON_BOUND
    return 0.5 * MAX_TRUNCATION_DELTA_FRACTION * delta / ((1 + math.exp(min(eps, 700.0))) * total_steps)


def ledger_physical_batch_sizes(
    recipe: Recipe, dataset_size: int, dataset_size_bound: int | None = None
) -> tuple[int, ...]:
    """Each stage's physical batch as the ledger records it (the Poisson sample is truncated
    there): a multiple of the micro-batch size whose overflow probability per step, for any store
    of at most `dataset_size_bound` units (default N), is small enough (`truncation_overflow_bound`
    for private runs; the default bound otherwise).
    Independent of the devices: `dpbert.train.engine.device_batch_size` pads it for the mesh."""
    p, mb = recipe.privacy, recipe.train.microbatch_size
    if not p.enabled:
        return tuple(physical_batch_size(s.expected_batch_size, dataset_size, multiple=mb) for s in recipe.schedule)
    per_step = truncation_overflow_bound(delta=p.delta, target_epsilon=p.target_epsilon, total_steps=recipe.total_steps)
    return tuple(
        physical_batch_size(
            s.expected_batch_size,
            dataset_size,
            overflow_probability_bound=per_step,
            multiple=mb,
            dataset_size_bound=dataset_size_bound,
        )
        for s in recipe.schedule
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublicSize:
    """The public N of q = B/N, where it came from ("declared", "rounded" or "exact"), and the
    public upper bound on the stored units that the truncation term is computed for."""

    n: int
    source: str
    bound: int


def public_dataset_size(recipe: Recipe, stored_units: int | None) -> PublicSize:
    """The public dataset size of a run, from the recipe and (when it declares no N) the count of
    stored units (sequences, or documents with `privacy.unit: document`).

    Private runs: N is `privacy.dataset_size` ("declared") or the stored count rounded down to 2
    significant digits ("rounded"); the bound is `privacy.dataset_size_bound` or
    `MAX_STORE_FACTOR` x N. A store above the bound, or below a declared N, is refused. Every
    stored unit is sampled at q = B/N. Non-private runs: N is the stored count ("exact")."""
    p = recipe.privacy
    units = "documents" if p.enabled and p.unit == "document" else "sequences"
    if stored_units is None and (not p.enabled or p.dataset_size is None):
        raise ValueError(
            "the dataset size N is unknown: declare it (recipe field 'privacy.dataset_size', the public N of "
            "q = B/N) or give the token store (`data.store`) whose count is rounded down to 2 significant digits"
        )
    if not p.enabled:
        return PublicSize(n=stored_units, source="exact", bound=stored_units)
    if p.dataset_size is None:
        n, source = round_down_significant(stored_units), "rounded"
    else:
        n, source = p.dataset_size, "declared"
    bound = p.dataset_size_bound if p.dataset_size_bound is not None else int(MAX_STORE_FACTOR * n)
    if stored_units is not None and stored_units > bound:
        raise ValueError(
            f"the token store holds more training {units} than the public bound {bound} "
            f"({'privacy.dataset_size_bound' if p.dataset_size_bound is not None else f'{MAX_STORE_FACTOR:g} x N'}) "
            "for which the truncation of the Poisson sample is accounted; declare a larger "
            "'privacy.dataset_size' or 'privacy.dataset_size_bound'"
        )
    if stored_units is not None and n > stored_units:
        raise ValueError(
            f"recipe field 'privacy.dataset_size': {n} exceeds the {stored_units} training {units} of the token store"
        )
    return PublicSize(n=n, source=source, bound=bound)


def plan_recipe(recipe: Recipe, stored_units: int | None = None) -> Plan:
    """The privacy plan of a run of `recipe` on a store of `stored_units` units: the one builder
    that `pretrain`, `account`, `verify` and the audit call, so that they agree field by field.
    With a declared `privacy.dataset_size`, `stored_units` may be None (the plan does not depend
    on the data).

    Args:
      recipe: the validated recipe (its schedule, privacy section and model).
      stored_units: how many units (sequences or documents) the token store holds.
    Returns:
      `Plan`: the schedule with each stage's noise multiplier, the ledger (None for a non-private
      recipe) and the physical batch sizes; a schedule that would pass the target is refused.
    """
    size = public_dataset_size(recipe, stored_units)
    return make_plan(
        recipe,
        size.n,
        dataset_size_source=size.source,
        dataset_size_bound=size.bound if recipe.privacy.enabled else None,
    )


def make_plan(
    recipe: Recipe, dataset_size: int, *, dataset_size_source: str = "exact", dataset_size_bound: int | None = None
) -> Plan:
    """Noise multipliers (fixed or calibrated), physical batches, and the budget check, for the
    public N `dataset_size` and the public bound on stored units (`plan_recipe` derives both).

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
    physical = ledger_physical_batch_sizes(recipe, dataset_size, dataset_size_bound)
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
        dataset_size_bound=dataset_size_bound,
        privacy_unit=DOCUMENT_UNIT if document else PRIVACY_UNIT,
        max_sequences_per_document=p.max_sequences_per_document if document else None,
        vocabulary=vocabulary,
    )
    ledger.check_budget()
    return Plan(schedule=schedule, physical_batch_sizes=physical, ledger=ledger)


def dp_vocabulary_window(recipe: Recipe) -> int | None:
    """Words per counted unit of a DP vocabulary: None when the unit is a whole document, else
    seq_len - 2 (a training sequence holds at most that many words: [CLS], [SEP], >= 1 token a word).
    The windows are counted from each document's start (the vocabulary is learned before the text is
    tokenized), so a training sequence can meet two of them: `dp_vocabulary_event` accounts for that."""
    unit = recipe.data.vocab_unit or recipe.privacy.unit
    return None if unit == "document" else recipe.data.seq_len - 2


def dp_vocabulary_event(recipe: Recipe) -> VocabularyEvent | None:
    """The ledger event of the recipe's DP vocabulary (None unless `data.tokenizer: dp`): a Gaussian
    calibrated to `data.vocab_epsilon` alone at `privacy.delta`; a function of the recipe only.

    Its unit is the ledger's (`privacy.unit`), so the composed epsilon is for one unit:
    - document-level DP (documents counted): one document added or removed, L2 sqrt(k);
    - sequence-level DP, documents counted (`vocab_unit: document`): a sequence lies in one document
      (packing never spans two), and changes its k words for others: L2 sqrt(2k);
    - sequence-level DP, windows counted: a sequence can meet two windows: L2 from
      `dpbert.privacy.accounting.window_sequence_sensitivity` (sqrt(2k + 4) for k = w even)."""
    d = recipe.data
    if d.tokenizer != "dp":
        return None
    window = dp_vocabulary_window(recipe)
    k = d.vocab_words_per_unit or d.seq_len - 2
    if recipe.privacy.unit == "document":
        if window is not None:  # the recipe refuses this (data.vocab_unit); never a window per document
            raise ValueError("data.vocab_unit: 'sequence' windows cannot be accounted for privacy.unit 'document'")
        relation, unit = "add_or_remove_unit", DOCUMENT_UNIT
    else:
        relation, unit = ("sequence_in_document" if window is None else "sequence_in_windows"), PRIVACY_UNIT
    return calibrate_vocabulary(
        epsilon=d.vocab_epsilon,
        delta=recipe.privacy.delta,
        selection_delta=d.vocab_delta,
        words_per_unit=k if window is None else min(k, window),
        unit=unit,
        accountant=recipe.privacy.accountant,
        relation=relation,
        window=window,
    )
