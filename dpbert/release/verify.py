"""Verify a release: every published privacy claim agrees with every other and with the recipe it carries.

`verify_folder` recomputes each epsilon from its ledger, rebuilds each ledger from the published
recipe, checks the hashes of the weights and tokenizer, the vocabulary's origin, what is declared
public, the audited figures' composition, the exposure measurement's summary, and that the card
(front matter and marked sections) and config.json say exactly what privacy.json says; each
failure names its file and field.

What `verify` cannot prove: that the weights were really produced by this recipe on this data with
secret noise, or that the declared numbers (N, the bound on stored units, the per-document cap, a
declared-public tokenizer) are true of the data (docs/THREAT_MODEL.md). The nine checks in full:
model_cards/README.md ("What `dpbert verify` checks") and docs/INTERNALS.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dpbert.config.finetune import load_config, plan_dp
from dpbert.config.plan import plan_recipe
from dpbert.config.recipe import load_recipe_dict
from dpbert.privacy.accounting import (
    ACCOUNTANTS,
    DATASET_SIZE_SOURCES,
    DOCUMENT_UNIT,
    NEIGHBORING_RELATION,
    PRIVACY_UNITS,
    SAMPLING,
    round_down_significant,
)
from dpbert.release.card import (
    AUDIT_BEGIN,
    AUDIT_END,
    CARD_FILE,
    DP_TAGS,
    EXPOSURE_BEGIN,
    EXPOSURE_END,
    GUARANTEE_SECTIONS,
    card_body,
    card_sections,
    outside_sections,
    read_front_matter,
    render_audit_section,
    render_exposure_section,
    render_section,
)
from dpbert.release.metadata import (
    AUDITS_KEY,
    EXPOSURE_KEY,
    NEVER_RELEASED,
    PRIVACY_FILE,
    PRIVACY_UNIT,
    SUPPLIED_FILE,
    TOKENIZER_FILES,
    UNKNOWN,
    Guarantee,
    ReleaseMetadata,
    audit_problems,
    document_group_epsilon,
    epsilon_from_json,
    exposure_problems,
    guarantees_from_json,
    metadata_from_json,
    noise_record,
    packaged_vocabulary,
    read_privacy_json,
    recompute_epsilon,
    recompute_truncation_delta,
    sha256_file,
    weight_files,
)

DEFAULT_RTOL = 1e-3
# Rebuilt plans are deterministic and JSON keeps every bit of a float: anything beyond rounding differs.
REBUILD_RTOL = 1e-9
PRETRAINING = "pretraining"
FINE_TUNING = "fine-tuning"
# The trainer refuses a plan whose truncated Poisson samples cost more than this fraction of delta.
MAX_TRUNCATION_DELTA_FRACTION = 0.01
# The keys a guarantee's `unit` may hold: public figures only (a count of the private data is refused).
UNIT_KEYS = ("sequence_tokens", "max_sequences_per_document", "group_epsilon")
# A privacy claim in the free text of a card (outside the sections rendered from privacy.json).
_CLAIM = re.compile(r"differentially[\s-]+private|(?:\bepsilon\b|ε)\W{0,3}(?:=|:|of|at|is)?\s*\d", re.IGNORECASE)
NO_RECIPE = "has no recipe: a private release must publish its recipe so that the ledger can be rebuilt"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuaranteeCheck:
    """One guarantee: the epsilon privacy.json states and the one recomputed from its ledger."""

    scope: str
    stated_epsilon: float
    recomputed_epsilon: float
    delta: float | None
    accountant: str | None
    rebuilt: bool = False  # its ledger was rebuilt from the recipe and matched

    @property
    def private(self) -> bool:
        return math.isfinite(self.recomputed_epsilon)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerificationResult:
    """The outcome of `verify`. `ok` is true when `problems` is empty; `private` is the recomputed status
    of the guarantees. `warnings` are printed but do not fail; `not_checked` says what could not be
    checked (a ledger without a recipe to rebuild it from, an unbounded noise sampler);
    `vocabulary_from_private_data` is privacy.json's
    `vocabulary.learned_from_private_data` (None: unknown)."""

    path: Path
    checks: tuple[GuaranteeCheck, ...]
    problems: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    not_checked: tuple[str, ...] = ()
    vocabulary_from_private_data: bool | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def private(self) -> bool:
        return bool(self.checks) and all(c.private for c in self.checks)

    @property
    def status(self) -> str:
        if not self.ok:
            return "FAILED"
        if not self.private:
            return "non-private"
        return "private (except its vocabulary)" if self.vocabulary_from_private_data else "private"

    def summary(self) -> str:
        lines = [f"{self.path}: {self.status}"]
        for c in self.checks:
            if c.private:
                rebuilt = "; ledger rebuilt from the recipe" if c.rebuilt else ""
                lines.append(
                    f"  {c.scope}: epsilon = {c.recomputed_epsilon:.6g} at delta = {c.delta:g} ({c.accountant}){rebuilt}"
                )
            else:
                lines.append(f"  {c.scope}: NOT private (epsilon = infinity)")
        if self.vocabulary_from_private_data:
            lines.append("  vocabulary: learned from the private corpus without privacy; NOT covered by any guarantee")
        lines += [f"  not checked: {n}" for n in self.not_checked]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        """Raise ValueError listing every problem when the release does not verify."""
        if not self.ok:
            raise ValueError("privacy metadata does not verify:\n" + self.summary())


def _close(a: float, b: float, rtol: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return math.isinf(a) and math.isinf(b)
    return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


def _fmt(value: float) -> str:
    return "infinity" if math.isinf(value) else f"{value:.6g}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(a: Any, b: Any, rtol: float = REBUILD_RTOL) -> bool:
    if _is_number(a) and _is_number(b):
        return _close(float(a), float(b), rtol) if rtol else float(a) == float(b)
    return a == b


def _show(value: Any, other: Any = None) -> str:
    """A value for a message: floats to 6 significant digits (all of them when that hides a difference)."""
    if isinstance(value, float):
        short = f"{value:.6g}"
        return repr(value) if isinstance(other, float) and short == f"{other:.6g}" else short
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else str(value)


# ---- 1-2: the ledgers themselves


def _ledger_problems(field: str, ledger: Mapping[str, Any]) -> list[str]:
    """Structural problems of one ledger; `field` is e.g. '.../privacy.json: guarantees[0].ledger'."""
    problems = []
    if ledger.get("accountant") not in ACCOUNTANTS:
        problems.append(
            f"{field}.accountant: {ledger.get('accountant')!r} is not a known accountant "
            f"(expected one of {list(ACCOUNTANTS)})"
        )
    unit = ledger.get("privacy_unit", PRIVACY_UNIT)
    cap = ledger.get("max_sequences_per_document")
    if unit not in PRIVACY_UNITS:
        problems.append(
            f"{field}.privacy_unit: {ledger.get('privacy_unit')!r} is not a known privacy unit "
            f"(expected one of {list(PRIVACY_UNITS)})"
        )
    elif unit == DOCUMENT_UNIT and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        problems.append(
            f"{field}.max_sequences_per_document: {cap!r} (expected an integer >= 1: a document-level "
            "ledger states how many sequences of one document a step may take)"
        )
    elif unit != DOCUMENT_UNIT and cap is not None:
        problems.append(
            f"{field}.max_sequences_per_document: {cap!r} in a ledger whose unit is {unit!r} "
            f"(expected it only with {DOCUMENT_UNIT!r})"
        )
    if ledger.get("sampling", SAMPLING) != SAMPLING:
        problems.append(
            f"{field}.sampling: {ledger.get('sampling')!r} is not what the accountant models (expected {SAMPLING!r})"
        )
    if ledger.get("neighboring_relation", NEIGHBORING_RELATION) != NEIGHBORING_RELATION:
        problems.append(
            f"{field}.neighboring_relation: {ledger.get('neighboring_relation')!r} is not known "
            f"(expected {NEIGHBORING_RELATION!r})"
        )
    source = ledger.get("dataset_size_source")
    if source is not None and source not in DATASET_SIZE_SOURCES:
        problems.append(
            f"{field}.dataset_size_source: {source!r} is not known (expected one of {list(DATASET_SIZE_SOURCES)})"
        )
    n, delta = ledger.get("dataset_size"), ledger.get("delta")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        problems.append(f"{field}.dataset_size: {n!r} (expected an integer N >= 1)")
    else:
        if _is_number(delta) and delta >= 1 / n:
            problems.append(
                f"{field}.delta: {delta:g} >= 1/dataset_size = 1/{n} (expected delta < 1/N: a delta this large "
                "allows publishing an example outright)"
            )
        if source == "rounded" and round_down_significant(n) != n:
            problems.append(
                f"{field}.dataset_size: {n} is not a 2-significant-digit number, yet dataset_size_source is "
                f"'rounded' (the trainer rounds the count down to 2 significant digits, e.g. "
                f"{round_down_significant(n)}; any other N can be the exact private count)"
            )
        bound = ledger.get("dataset_size_bound")
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < n):
            problems.append(f"{field}.dataset_size_bound: {bound!r} (expected an integer >= dataset_size = {n})")
    stages = ledger.get("stages")
    if not isinstance(stages, list) or not stages:
        problems.append(
            f"{field}.stages: empty (expected at least one stage of DP-SGD; a ledger without steps "
            "is not the record of a training run)"
        )
    else:
        for j, stage in enumerate(stages):
            steps = stage.get("steps") if isinstance(stage, Mapping) else None
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                problems.append(f"{field}.stages[{j}].steps: {steps!r} (expected an integer >= 1)")
    return problems


def _unit_problems(field: str, g: Guarantee, rtol: float) -> list[str]:
    """The guarantee's `unit` states public figures only: no count of the private data; a
    document-level cap equal to the ledger's; a group-privacy table recomputed by
    `dpbert.privacy.accounting.group_epsilon` for each stated size. `field` is '...guarantees[i].unit'."""
    unit = g.unit or {}
    ledger = g.ledger or {}
    problems = []
    document_level = ledger.get("privacy_unit", PRIVACY_UNIT) == DOCUMENT_UNIT
    for key in unit:
        if key not in UNIT_KEYS or (key == "max_sequences_per_document" and not document_level):
            problems.append(
                f"{field}.{key}: a figure of the private data is published (a release states only public "
                "figures: N, its bound, the declared cap on sequences per document, the sequence length)"
            )
    if (
        document_level
        and "max_sequences_per_document" in unit
        and unit["max_sequences_per_document"] != ledger.get("max_sequences_per_document")
    ):
        problems.append(
            f"{field}.max_sequences_per_document: {unit['max_sequences_per_document']!r} stated, "
            f"{ledger.get('max_sequences_per_document')!r} in the ledger (the declared cap)"
        )
    table = unit.get("group_epsilon")
    if table is None:
        return problems
    if document_level or not isinstance(table, list):
        return problems + [f"{field}.group_epsilon: stated, but only a sequence-level ledger has a group-privacy table"]
    for j, row in enumerate(table):
        k = row.get("sequences") if isinstance(row, Mapping) else None
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            problems.append(f"{field}.group_epsilon[{j}].sequences: {k!r} (expected an integer >= 2)")
            continue
        try:
            stated = epsilon_from_json(row.get("epsilon"), f"{field}.group_epsilon[{j}].epsilon")
        except ValueError as err:
            problems.append(str(err))
            continue
        recomputed = document_group_epsilon(ledger, k)
        if not _close(stated, recomputed, max(rtol, 1e-3)):
            problems.append(
                f"{field}.group_epsilon[{j}]: {_fmt(stated)} stated, group privacy for {k} sequences gives "
                f"{_fmt(recomputed)}"
            )
    return problems


def _total_delta_problems(field: str, g: Guarantee) -> list[str]:
    """The whole delta of a guarantee (the ledger's, plus truncation, plus a DP vocabulary's selection,
    plus the noise's tail bound when it is added) must stay below 1/N."""
    ledger = g.ledger or {}
    n = ledger.get("dataset_size")
    if not isinstance(n, int) or n < 1:
        return []
    delta, truncation, selection = float(ledger["delta"]), g.truncation_delta, g.selection_delta
    total, tail = float(g.total_delta or 0.0), g.noise_tail_delta
    if total < 1 / n:
        return []
    parts = f"delta {delta:g} + truncation {truncation:.3g} + vocabulary selection {selection:g}"
    if tail:
        parts += f" + noise tail {tail:.3g}"
    return [
        f"{field}: total delta {total:.3g} ({parts}) is not below 1/N = 1/{n} (a delta this large allows "
        "publishing an example outright)"
    ]


# ---- 3-4: the recipe


class _NotRebuildable(Exception):
    """The recipe cannot say what this guarantee's ledger should be (a problem, named)."""


@functools.lru_cache(maxsize=32)
def _rebuilt_pretraining(content: str, dataset_size: int) -> tuple[str, int]:
    """(rebuilt ledger JSON, data.seq_len) for a pretraining recipe and the ledger's N; cached
    because calibrating noise takes seconds and verify runs more than once on a release."""

    try:
        raw = yaml.safe_load(content)
        recipe = load_recipe_dict(raw if isinstance(raw, Mapping) else {})
    except (ValueError, yaml.YAMLError) as err:
        raise _NotRebuildable(f"recipe.content: not a pretraining recipe ({err})") from None
    if not recipe.privacy.enabled:
        raise _NotRebuildable("recipe.content: privacy.enabled is false, yet the release carries a private ledger")
    declared = recipe.privacy.dataset_size
    if declared is not None and declared != dataset_size:
        raise _NotRebuildable(
            f"ledger.dataset_size: {dataset_size} but recipe.content declares privacy.dataset_size {declared}"
        )
    # Otherwise the ledger's N stands for the store's count: rounding it again gives it back
    # (plan_recipe is the builder the run used).
    try:
        plan = plan_recipe(recipe, dataset_size)
    except ValueError as err:
        raise _NotRebuildable(
            f"recipe.content: its privacy plan cannot be rebuilt for N = {dataset_size} ({err})"
        ) from None
    return json.dumps(plan.ledger.to_dict()), recipe.data.seq_len


@functools.lru_cache(maxsize=32)
def _rebuilt_finetuning(content: str, dataset_size: int) -> str:
    """Rebuilt ledger JSON of a DP fine-tuning config for the ledger's n (see `_rebuilt_pretraining`)."""
    with tempfile.TemporaryDirectory(prefix=".dpbert-verify-") as tmp:
        path = Path(tmp) / "finetune.yaml"
        path.write_text(content)
        try:
            config = load_config(path)
        except ValueError as err:
            raise _NotRebuildable(
                f"recipe.content: not a fine-tuning config ({str(err).replace(f' (in {path})', '')})"
            ) from None
    if not config.dp:
        raise _NotRebuildable("recipe.content: dp is false, yet the release carries a private fine-tuning ledger")
    try:
        plan = plan_dp(dataset_size, config)
    except ValueError as err:
        raise _NotRebuildable(f"recipe.content: its DP plan cannot be rebuilt for n = {dataset_size} ({err})") from None
    return json.dumps(plan.ledger.to_dict())


def _compare_rebuilt(field: str, stated: Any, rebuilt: Any) -> list[str]:
    """Every difference between a ledger (`stated`) and the one rebuilt from the recipe, by field."""
    if isinstance(stated, Mapping) and isinstance(rebuilt, Mapping):
        problems = []
        for key in [*rebuilt, *(k for k in stated if k not in rebuilt)]:
            if key not in stated:
                problems.append(f"{field}.{key}: missing in the ledger, {_show(rebuilt[key])} rebuilt from the recipe")
            elif key not in rebuilt:
                problems.append(
                    f"{field}.{key}: {_show(stated[key])} in the ledger, absent from the ledger rebuilt from the recipe"
                )
            else:
                problems += _compare_rebuilt(f"{field}.{key}", stated[key], rebuilt[key])
        return problems
    if isinstance(stated, list) and isinstance(rebuilt, list):
        problems = []
        if len(stated) != len(rebuilt):
            noun = "stage(s)" if field.endswith(".stages") else "entries"
            problems.append(f"{field}: {len(stated)} {noun} in the ledger, {len(rebuilt)} rebuilt from the recipe")
        for j, (a, b) in enumerate(zip(stated, rebuilt, strict=False)):
            problems += _compare_rebuilt(f"{field}[{j}]", a, b)
        return problems
    if _same(stated, rebuilt):
        return []
    return [f"{field}: {_show(stated, rebuilt)} in the ledger, {_show(rebuilt, stated)} rebuilt from the recipe"]


def _is_finetuning(scope: str) -> bool:
    return scope == FINE_TUNING or scope.startswith(FINE_TUNING + " ")


def _recipe_checks(
    privacy_path: str, data: Mapping[str, Any], guarantees: list[Guarantee], checks: dict[str, GuaranteeCheck]
) -> tuple[list[str], list[str], set[str]]:
    """(problems, not checked, scopes rebuilt) of checks 3 and 4 (module docstring)."""
    problems: list[str] = []
    notes: list[str] = []
    rebuilt: set[str] = set()
    recipe = data.get("recipe")
    content = recipe.get("content") if isinstance(recipe, Mapping) else None
    if recipe is not None:
        if not isinstance(content, str):
            return [f"{privacy_path}: recipe.content: expected the resolved recipe as a string"], notes, rebuilt
        digest = hashlib.sha256(content.encode()).hexdigest()
        if recipe.get("sha256") != digest:
            problems.append(
                f"{privacy_path}: recipe.sha256: {recipe.get('sha256')!r} but recipe.content hashes to {digest!r}"
            )
    finetuned = any(_is_finetuning(g.scope) for g in guarantees)
    if content is None and any(c.private for c in checks.values()):
        return [*problems, f"{privacy_path} {NO_RECIPE}"], notes, rebuilt
    for i, g in enumerate(guarantees):
        if g.ledger is None or not checks[g.scope].private:
            continue  # a non-private guarantee claims nothing to rebuild
        field = f"{privacy_path}: guarantees[{i}].ledger"
        if g.scope == PRETRAINING and finetuned:
            notes.append(
                f"{g.scope}: this fine-tuned release carries its fine-tuning recipe only; the pretraining "
                "ledger was copied from the source checkpoint, whose own release carries its recipe"
            )
            continue
        if g.scope != PRETRAINING and not _is_finetuning(g.scope):
            problems.append(
                f"{privacy_path}: guarantees[{i}].scope: {g.scope!r} has no recipe dpbert can rebuild "
                "(expected 'pretraining' or 'fine-tuning (TASK)')"
            )
            continue
        if content is None:
            continue
        n = int(g.ledger["dataset_size"])
        try:
            if g.scope == PRETRAINING:
                ledger_json, seq_len = _rebuilt_pretraining(content, n)
                tokens = (g.unit or {}).get("sequence_tokens")
                if tokens is not None and tokens != seq_len:
                    problems.append(
                        f"{privacy_path}: guarantees[{i}].unit.sequence_tokens: {tokens} stated, "
                        f"{seq_len} in the recipe (data.seq_len)"
                    )
            else:
                ledger_json = _rebuilt_finetuning(content, n)
        except _NotRebuildable as err:
            problems.append(f"{privacy_path}: {err}")
            continue
        found = _compare_rebuilt(field, g.ledger, json.loads(ledger_json))
        problems += found
        if not found:
            rebuilt.add(g.scope)
    return problems, notes, rebuilt


def _recipe_data(content: str | None) -> Mapping[str, Any] | None:
    """The `data` section of a pretraining recipe's content (None when it has none)."""
    try:
        raw = yaml.safe_load(content) if content is not None else None
    except yaml.YAMLError:
        return None
    data = raw.get("data") if isinstance(raw, Mapping) else None
    return data if isinstance(data, Mapping) else None


def _vocabulary_problems(privacy_path: str, meta: ReleaseMetadata) -> list[str]:
    """privacy.json's `vocabulary` against itself and against the pretraining recipe's `data.tokenizer`
    and `data.tokenizer_declared_public` (a fine-tuned release inherits its vocabulary: not checked)."""
    field = f"{privacy_path}: vocabulary"
    learned, kind = meta.vocabulary_learned_from_private_data, meta.vocabulary_kind
    problems = []
    has_event = meta.dp_vocabulary is not None
    if kind == "dp" and learned is not True:
        problems.append(f"{field}.learned_from_private_data: {learned!r}, yet its source is 'dp' (expected true)")
    if kind in ("packaged", "declared") and learned is not False:
        problems.append(f"{field}.learned_from_private_data: {learned!r}, yet its source is {kind!r} (expected false)")
    if kind in ("train", "unknown") and learned is not True:
        problems.append(
            f"{field}.learned_from_private_data: {learned!r}, yet its source is {kind!r} (expected true: such a "
            "vocabulary is not public)"
        )
    if has_event and kind not in (None, "dp"):
        problems.append(f"{field}.source: {kind!r}, yet a ledger holds a DP vocabulary event (expected 'dp')")
    if any(_is_finetuning(g.scope) for g in meta.guarantees) or not any(
        g.scope == PRETRAINING and g.private for g in meta.guarantees
    ):
        return problems
    data = _recipe_data(meta.recipe_content)
    if data is None:
        return problems
    spec = data.get("tokenizer", "bert-base-uncased")
    declared = data.get("tokenizer_declared_public") is True
    if learned is None:
        problems.append(
            f"{field}.learned_from_private_data: null (expected true or false: a private release states whether "
            "its vocabulary was learned from the private corpus)"
        )
    if spec == "dp":
        if learned is False:
            problems.append(
                f"{field}.learned_from_private_data: false, but the recipe's data.tokenizer is 'dp' (a vocabulary "
                "learned from the private corpus under DP: expected true, with its event in the ledger)"
            )
        if not has_event:
            problems.append(
                f"{field}: the recipe's data.tokenizer is 'dp', but no ledger holds the DP vocabulary's event"
            )
        if kind not in (None, "dp"):
            problems.append(f"{field}.source: {kind!r}, but the recipe's data.tokenizer is 'dp' (expected 'dp')")
    elif spec == "train":
        if learned is False:
            problems.append(
                f"{field}.learned_from_private_data: false, but the recipe's data.tokenizer is 'train' (a "
                "vocabulary learned from the private corpus without privacy: expected true, and no "
                "differential-privacy tags)"
            )
        if kind not in (None, "train"):
            problems.append(f"{field}.source: {kind!r}, but the recipe's data.tokenizer is 'train' (expected 'train')")
    else:
        if has_event:
            problems.append(
                f"{field}: a ledger holds a DP vocabulary event, but the recipe's data.tokenizer is {spec!r}, not 'dp'"
            )
        if packaged_vocabulary(spec) is not None:
            if kind not in (None, "packaged", "train"):
                problems.append(
                    f"{field}.source: {kind!r}, but the recipe's data.tokenizer {spec!r} is packaged with dpbert "
                    "(expected 'packaged')"
                )
        elif declared and kind not in (None, "declared", "train"):
            problems.append(
                f"{field}.source: {kind!r}, but the recipe declares its tokenizer folder public "
                "(data.tokenizer_declared_public: true; expected 'declared', and the card says so)"
            )
        elif not declared and kind == "declared":
            problems.append(
                f"{field}.source: 'declared', but the recipe does not declare its tokenizer public "
                "(data.tokenizer_declared_public is not true)"
            )
    evaluation = meta.evaluation or {}
    if evaluation.get("public") is True and data.get("eval_corpus") != evaluation.get("corpus"):
        problems.append(
            f"{privacy_path}: evaluation.corpus: {evaluation.get('corpus')!r} is called public, but the recipe's "
            f"data.eval_corpus is {data.get('eval_corpus')!r}"
        )
    return problems


# ---- 5-6: weights, tokenizer, secrets, randomness and noise


def _weight_problems(folder: Path, privacy_path: str, recorded: Any) -> list[str]:
    problems = [
        f"{folder / name}: a noise secret is in the release; it must never be published"
        for name in NEVER_RELEASED
        if (folder / name).exists()
    ]
    if not isinstance(recorded, Mapping) or not recorded:
        return problems + [
            f"{privacy_path}: weights: missing (expected the sha256 of every weight file, which "
            "`dpbert export` records; re-export the release)"
        ]
    present = weight_files(folder)
    for name in present:
        if name not in recorded:
            problems.append(f"{privacy_path}: weights: {name} is in the release but its sha256 is not recorded")
    for name, expected in recorded.items():
        path = folder / str(name)
        if Path(str(name)).name != name:
            problems.append(f"{privacy_path}: weights: {name!r} is not a file name of the release folder")
            continue
        if not path.is_file():
            problems.append(f"{privacy_path}: weights.{name}: recorded, but {path} is missing")
            continue
        actual = sha256_file(path)
        if actual != expected:
            problems.append(
                f"{privacy_path}: weights.{name}: sha256 {str(expected)[:16]}... in privacy.json, "
                f"{actual[:16]}... for the file (the weights are not the ones released)"
            )
    return problems


def _tokenizer_problems(folder: Path, privacy_path: str, recorded: Any) -> list[str]:
    """privacy.json's `tokenizer` ({file: sha256}) against the tokenizer files of the folder."""
    if not isinstance(recorded, Mapping) or not recorded:
        return [
            f"{privacy_path}: tokenizer: missing (expected the sha256 of every tokenizer file, which "
            "`dpbert export` records; re-export the release)"
        ]
    problems = []
    for name in TOKENIZER_FILES:
        if (folder / name).is_file() and name not in recorded:
            problems.append(f"{privacy_path}: tokenizer: {name} is in the release but its sha256 is not recorded")
    for name, expected in recorded.items():
        path = folder / str(name)
        if Path(str(name)).name != name:
            problems.append(f"{privacy_path}: tokenizer: {name!r} is not a file name of the release folder")
            continue
        if not path.is_file():
            problems.append(f"{privacy_path}: tokenizer.{name}: recorded, but {path} is missing")
            continue
        actual = sha256_file(path)
        if actual != expected:
            problems.append(
                f"{privacy_path}: tokenizer.{name}: sha256 {str(expected)[:16]}... in privacy.json, "
                f"{actual[:16]}... for the file (the tokenizer is not the one released)"
            )
    return problems


def _card_body_problems(
    card_path: Path, meta: ReleaseMetadata, audits: list[Any], exposure: Mapping[str, Any] | None = None
) -> list[str]:
    """The card's guarantee sections, rendered again from privacy.json by the same templates, must be
    the card's own, word for word; so must its audit and exposure sections; and no privacy claim may
    stand outside them."""
    try:
        body = card_body(card_path.read_text(encoding="utf-8"), where=str(card_path))
    except ValueError as err:
        return [str(err)]
    problems = []
    sections = card_sections(body)
    names = tuple(name for name, _ in sections)
    if names not in GUARANTEE_SECTIONS.values():
        expected = " or ".join(str(list(v)) for v in GUARANTEE_SECTIONS.values())
        return [
            f"{card_path}: body: its guarantee sections are {list(names)} (expected {expected}, each between "
            "<!-- dpbert:begin NAME --> and <!-- dpbert:end NAME -->, as `dpbert export` writes them)"
        ]
    for name, text in sections:
        expected = render_section(name, meta)
        if text == expected:
            continue
        for got, want in itertools.zip_longest(text.splitlines(), expected.splitlines()):
            if got != want:
                problems.append(f"{card_path}: body ({name}): {got!r} differs from what privacy.json states: {want!r}")
                break
    start, end = body.find(AUDIT_BEGIN), body.find(AUDIT_END)
    if audits:
        written = body[start : end + len(AUDIT_END)] + "\n\n" if 0 <= start < end else ""
        if written != render_audit_section(audits):
            problems.append(f"{card_path}: body: the audit section differs from the audits in {PRIVACY_FILE}")
    elif start >= 0 or end >= 0:
        problems.append(f"{card_path}: body: an audit section, but {PRIVACY_FILE} records no audit")
    start, end = body.find(EXPOSURE_BEGIN), body.find(EXPOSURE_END)
    if exposure:
        written = body[start : end + len(EXPOSURE_END)] + "\n\n" if 0 <= start < end else ""
        if written != render_exposure_section(exposure):
            problems.append(
                f"{card_path}: body: the exposure section differs from the exposure measurement in {PRIVACY_FILE}"
            )
    elif start >= 0 or end >= 0:
        problems.append(f"{card_path}: body: an exposure section, but {PRIVACY_FILE} records no exposure measurement")
    for line in outside_sections(body).splitlines():
        if _CLAIM.search(line):
            problems.append(
                f"{card_path}: body: a privacy claim outside the sections rendered from privacy.json: {line.strip()!r}"
            )
    return problems


def _randomness_and_noise(
    privacy_path: str, guarantees: list[Guarantee], checks: dict[str, GuaranteeCheck]
) -> tuple[list[str], list[str], list[str]]:
    """(problems, warnings, not checked) of check 6."""
    problems, warnings, notes = [], [], []
    for i, g in enumerate(guarantees):
        if g.ledger is None or not checks[g.scope].private:
            continue
        source = g.randomness_source
        if source == UNKNOWN:
            problems.append(
                f"{privacy_path}: randomness of '{g.scope}' (guarantees[{i}].randomness) is unknown: nothing records "
                "that its noise came from a secret (expected source 'os-csprng' or 'supplied-file'), so the "
                "guarantee cannot be relied on"
            )
        elif source == SUPPLIED_FILE:
            warnings.append(
                f"{g.scope}: the noise secret was supplied from a file (randomness 'supplied-file'): whoever holds "
                "that file can regenerate the noise; the guarantee holds against everyone else"
            )
        noise = g.noise
        if not noise:
            notes.append(f"{g.scope}: no exact-Gaussian note (noise) is recorded")
            continue
        stated = noise.get("tail_bound")
        again = noise_record(g.ledger, coordinates=noise.get("coordinates"))
        if stated is None or again.get("tail_bound") is None:
            notes.append(
                f"{g.scope}: no bound on the noise's deviation from the exact Gaussian is recorded "
                f"(sampler: {noise.get('sampler')})"
            )
            continue
        if not (_is_number(stated) and _close(float(stated), float(again["tail_bound"]), 1e-6)):
            problems.append(
                f"{privacy_path}: guarantees[{i}].noise.tail_bound: {_show(stated)} stated, "
                f"{_show(again['tail_bound'])} recomputed from the ledger"
            )
        elif float(again["tail_bound"]) > 1e-3 * float(g.ledger["delta"]):
            problems.append(
                f"{privacy_path}: guarantees[{i}].noise.tail_bound: {_show(stated)} exceeds 1e-3 of "
                f"delta ({float(g.ledger['delta']):g}); the noise is not the Gaussian the accountant assumes"
            )
    return problems, warnings, notes


# ---- 8-9: the copies in the card and config.json


def _compare_copy(
    where: str,
    block: Any,
    checks: Mapping[str, GuaranteeCheck],
    guarantees: Mapping[str, Guarantee],
    rtol: float,
) -> list[str]:
    """Problems of one copy (card front matter or config.json) of the `differential_privacy` block."""
    if not isinstance(block, Mapping):
        return [f"{where}: 'differential_privacy' missing or not a mapping"]
    problems = []
    expected_private = all(c.private for c in checks.values())
    if block.get("private") is not expected_private:
        problems.append(
            f"{where}: differential_privacy.private is {block.get('private')!r} but the recomputed ledgers say "
            f"{expected_private}"
        )
    entries = block.get("guarantees")
    if not isinstance(entries, list):
        return problems + [f"{where}: differential_privacy.guarantees missing or not a list"]
    by_scope = {str(e.get("scope")): e for e in entries if isinstance(e, Mapping)}
    if set(by_scope) != set(checks):
        problems.append(f"{where}: guarantees for {sorted(by_scope)} but privacy.json has {sorted(checks)}")
    for scope, check in checks.items():
        entry = by_scope.get(scope)
        if entry is None:
            continue
        try:
            stated = epsilon_from_json(entry.get("epsilon"), f"{where}: {scope}.epsilon")
        except ValueError as err:
            problems.append(str(err))
            continue
        if not _close(stated, check.recomputed_epsilon, rtol):
            problems.append(
                f"{where}: epsilon for '{scope}' is {_fmt(stated)} but the ledger in {PRIVACY_FILE} gives "
                f"{_fmt(check.recomputed_epsilon)} (recomputed with {check.accountant} at delta={check.delta})"
            )
        g = guarantees[scope]
        if g.ledger is None:
            continue
        expected = dataclasses.replace(g, epsilon=check.recomputed_epsilon).summary()
        for key, value in expected.items():
            if key in ("scope", "epsilon", "truncation_delta"):
                continue
            if not _same(entry.get(key), value, 1e-9):
                problems.append(f"{where}: {key} for '{scope}' is {entry.get(key)!r} but {PRIVACY_FILE} has {value!r}")
        truncation = recompute_truncation_delta(g.ledger) if check.private else 0.0
        stated_truncation = entry.get("truncation_delta", 0.0)
        if not (_is_number(stated_truncation) and math.isclose(float(stated_truncation), truncation, rel_tol=rtol)):
            problems.append(
                f"{where}: truncation_delta for '{scope}' is {stated_truncation!r} but the ledger gives {truncation:g}"
            )
    return problems


def verify_folder(folder: str | Path, *, rtol: float = DEFAULT_RTOL) -> VerificationResult:
    """Verify a local release folder: the nine checks of the module docstring.

    Args:
      folder: the release (privacy.json, README.md, config.json, weights, tokenizer).
      rtol: relative tolerance between a stated and a recomputed epsilon.
    Returns:
      `VerificationResult`: `ok`, the per-guarantee checks, every problem found (each naming its
      file and field), warnings and what could not be checked."""
    folder = Path(folder)
    privacy_path, card_path, config_path = folder / PRIVACY_FILE, folder / CARD_FILE, folder / "config.json"
    where = str(privacy_path)
    try:
        data = read_privacy_json(folder)
        guarantees = guarantees_from_json(data, where)
    except (FileNotFoundError, ValueError) as err:
        return VerificationResult(path=folder, checks=(), problems=(str(err),))

    # 1-2: each ledger, and epsilon recomputed from it
    problems: list[str] = []
    checks: dict[str, GuaranteeCheck] = {}
    by_scope: dict[str, Guarantee] = {}
    for i, g in enumerate(guarantees):
        by_scope[g.scope] = g
        if g.ledger is not None:
            found = _ledger_problems(f"{where}: guarantees[{i}].ledger", g.ledger)
            if found:
                problems += found
                continue
        try:
            recomputed = recompute_epsilon(g.ledger) if g.ledger is not None else math.inf
        except (KeyError, TypeError, ValueError) as err:
            problems.append(f"{where}: ledger of '{g.scope}' cannot be recomputed ({err!r})")
            continue
        checks[g.scope] = GuaranteeCheck(
            scope=g.scope,
            stated_epsilon=g.epsilon,
            recomputed_epsilon=recomputed,
            delta=g.delta,
            accountant=g.accountant,
        )
        if not _close(g.epsilon, recomputed, rtol):
            problems.append(
                f"{where}: epsilon for '{g.scope}' is {_fmt(g.epsilon)} but its ledger gives "
                f"{_fmt(recomputed)} (recomputed with {g.accountant} at delta={g.delta})"
            )
        stated_private = (data["guarantees"][i] or {}).get("private")
        if stated_private is not None and stated_private is not math.isfinite(recomputed):
            problems.append(
                f"{where}: guarantees[{i}].private is {stated_private!r} but its recomputed epsilon is "
                f"{_fmt(recomputed)}"
            )
        if g.ledger is not None and math.isfinite(recomputed):
            target = g.ledger.get("target_epsilon")
            if _is_number(target) and recomputed > target * (1 + rtol):
                problems.append(
                    f"{where}: guarantees[{i}].ledger.target_epsilon: the ledger spends epsilon "
                    f"{_fmt(recomputed)} > its target {target:g} (the trainer refuses such a plan)"
                )
            problems += _unit_problems(f"{where}: guarantees[{i}].unit", g, rtol)
            problems += _total_delta_problems(f"{where}: guarantees[{i}]", g)
            truncation = recompute_truncation_delta(g.ledger)
            if truncation > MAX_TRUNCATION_DELTA_FRACTION * g.ledger["delta"]:
                problems.append(
                    f"{where}: guarantees[{i}].ledger.stages: truncated Poisson samples add delta "
                    f"{truncation:.3g} > {MAX_TRUNCATION_DELTA_FRACTION:g} * delta (physical_batch_size "
                    "too small; the trainer refuses such a plan)"
                )
    if problems:
        return VerificationResult(path=folder, checks=tuple(checks.values()), problems=tuple(problems))

    private = all(c.private for c in checks.values())
    if data.get("private") is not private:
        problems.append(f"{where}: 'private' is {data.get('private')!r} but the recomputed ledgers say {private}")
    try:
        meta = metadata_from_json(data, where)
    except ValueError as err:
        return VerificationResult(path=folder, checks=tuple(checks.values()), problems=(*problems, str(err)))

    # 3-4: the recipe; 5: the weights; 6: randomness and noise
    found, not_checked, rebuilt = _recipe_checks(where, data, guarantees, checks)
    problems += found
    checks = {s: dataclasses.replace(c, rebuilt=s in rebuilt) for s, c in checks.items()}
    problems += _weight_problems(folder, where, data.get("weights"))
    problems += _tokenizer_problems(folder, where, data.get("tokenizer"))
    problems += _vocabulary_problems(where, meta)
    found, warnings, notes = _randomness_and_noise(where, guarantees, checks)
    problems += found
    not_checked += notes

    # 7: what is public
    if data.get("public_inputs") != meta.public_inputs():
        problems.append(
            f"{where}: public_inputs: {data.get('public_inputs')!r} but the rest of {PRIVACY_FILE} states "
            f"{meta.public_inputs()!r}"
        )

    problems += audit_problems(data.get(AUDITS_KEY), guarantees, where, rtol)
    problems += exposure_problems(data.get(EXPOSURE_KEY), guarantees, where, rtol)

    # 8-9: the card and config.json
    if not card_path.is_file():
        problems.append(f"{card_path}: missing (the model card must state the guarantee)")
    else:
        try:
            matter = read_front_matter(card_path)
        except ValueError as err:
            problems.append(str(err))
        else:
            block = matter.get("differential_privacy")
            problems += _compare_copy(str(card_path), block, checks, by_scope, rtol)
            card_vocabulary = block.get("vocabulary") if isinstance(block, Mapping) else None
            if card_vocabulary != meta.vocabulary_copy():
                problems.append(
                    f"{card_path}: differential_privacy.vocabulary is {card_vocabulary!r} but "
                    f"{PRIVACY_FILE} states {meta.vocabulary_copy()!r}"
                )
            card_audits = (block.get("audits") if isinstance(block, Mapping) else None) or []
            if card_audits != (data.get("audits") or []):
                problems.append(f"{card_path}: differential_privacy.audits differs from the audits in {privacy_path}")
            card_exposure = block.get(EXPOSURE_KEY) if isinstance(block, Mapping) else None
            if card_exposure != data.get(EXPOSURE_KEY):
                problems.append(
                    f"{card_path}: differential_privacy.exposure differs from the exposure measurement in {privacy_path}"
                )
            # A malformed measurement is reported above; its card section is compared only once it parses.
            exposure = data.get(EXPOSURE_KEY)
            parses = isinstance(exposure, Mapping) and not exposure_problems(exposure, guarantees, where, rtol)
            problems += _card_body_problems(
                card_path, meta, list(data.get("audits") or []), exposure if parses else None
            )
            claimed = sorted(set(matter.get("tags") or ()) & set(DP_TAGS))
            if not private and claimed:
                problems.append(f"{card_path}: a non-private release carries the tags {claimed}")
            elif not meta.vocabulary_private and claimed:
                problems.append(
                    f"{card_path}: the vocabulary was learned from the private corpus without privacy "
                    f"({PRIVACY_FILE}: vocabulary.learned_from_private_data), so the release must not carry the tags "
                    f"{claimed}"
                )
            elif private and meta.vocabulary_private and len(claimed) != len(DP_TAGS):
                problems.append(f"{card_path}: a private release must carry the tags {list(DP_TAGS)}")

    if not config_path.is_file():
        problems.append(f"{config_path}: missing")
    else:
        config = json.loads(config_path.read_text())
        if "differential_privacy" in config:
            problems += _compare_copy(str(config_path), config["differential_privacy"], checks, by_scope, rtol)
        else:
            problems.append(
                f"{config_path}: differential_privacy: missing (a release states its guarantee in config.json too)"
            )
    return VerificationResult(
        path=folder,
        checks=tuple(checks.values()),
        problems=tuple(problems),
        warnings=tuple(warnings),
        not_checked=tuple(not_checked),
        vocabulary_from_private_data=not meta.vocabulary_private,
    )
