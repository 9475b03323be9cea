"""The privacy metadata of a release (`privacy.json`) and the copies of it in the card and config.

A release carries one guarantee per dataset it was trained on ("pretraining", "fine-tuning (TASK)"),
each with the full privacy ledger of the run (anyone can recompute epsilon from it), where its
randomness came from, how exact its Gaussian noise is, and what its unit means (public figures
only). `AuditedFigure` states an audit beside a guarantee, with what the audit spent;
`ExposureMeasurement` a memorization measurement (planted secrets), labelled not a guarantee.

Guarantees: no count of the private data and no path of the building machine is ever part of a
release (`local_paths`, `redact_paths`); a vocabulary's origin is recorded, never assumed; data-
dependent figures are left out unless an export asks for them, and then labelled not covered.
The format, field by field: docs/INTERNALS.md ("dpbert.release.metadata") and model_cards/README.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import importlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import dpbert
from dpbert.privacy import accounting, noise
from dpbert.privacy.accounting import PrivacyLedger
from dpbert.privacy.exposure import exposure_summary

FORMAT = "dpbert-privacy/1"
PRIVACY_FILE = "privacy.json"
PRIVACY_UNIT = "one example sequence"
DOCUMENT_UNIT = "one document"
# Where the randomness of a DP mechanism came from (`dpbert.privacy.randomness`); anything else,
# a missing record included, is unknown.
OS_CSPRNG = "os-csprng"
SUPPLIED_FILE = "supplied-file"
RANDOMNESS_SOURCES = (OS_CSPRNG, SUPPLIED_FILE)
UNKNOWN = "unknown"
# A ledger written before `PrivacyLedger.dataset_size_source` existed does not say where its
# dataset size N came from: N may be the exact, private count.
UNRECORDED = "unrecorded"
# Weight files of a Hugging Face folder (single or sharded, any framework), hashed into privacy.json.
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "flax_model*.msgpack",
    "flax_model.msgpack.index.json",
    "tf_model*.h5",
    "tf_model.h5.index.json",
)
# Tokenizer files of a Hugging Face folder, copied into a release and hashed into privacy.json,
# with dpbert's vocabulary origin marker (`dpbert.data.tokenizer.VOCAB_ORIGIN_FILE`).
VOCAB_ORIGIN_FILE = "dpbert_vocab_origin.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    VOCAB_ORIGIN_FILE,
)
# Where a release's vocabulary came from (`vocabulary.source`): a vocabulary packaged with dpbert (or
# a folder dpbert marked as one), a folder the user declared public in the recipe
# (`data.tokenizer_declared_public`), one learned from the private corpus under DP (`data.tokenizer:
# dp`, in the ledger) or without privacy (`data.tokenizer: train`); "unknown" when nothing records it
# (treated as learned from the private corpus).
VOCABULARY_SOURCES = ("packaged", "declared", "dp", "train", "unknown")
# Group sizes (sequences of one document) whose group-privacy epsilon a sequence-level guarantee states:
# public numbers, never the corpus' own document lengths.
GROUP_SIZES = (2, 8, 32, 128)
# Discretization of the group-privacy table's PLD: pessimistic, so an upper bound on epsilon; on the
# tiny recipe's ledger 1e-2 gives 13.09 / 51.86 for 2 / 8 sequences against 13.08 / 51.85 at 1e-3,
# in 1.8 s instead of 12 s (2026-12-05, `accounting.group_epsilon` timed on recipes/tiny.yaml's plan).
GROUP_TABLE_DISCRETIZATION = 1e-2
# Files of a run folder that must never reach a release (whoever holds the noise secret can
# regenerate the noise and subtract it).
NEVER_RELEASED = ("noise_secret",)


def epsilon_to_json(epsilon: float) -> float | str:
    """An epsilon as JSON can hold it: a number, or "inf"."""
    return "inf" if math.isinf(epsilon) else float(epsilon)


def epsilon_from_json(value: Any, where: str) -> float:
    """Parse an epsilon written as a number or as "inf"/"infinity"; `where` names the field in errors."""
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity", ".inf"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number or 'inf', got {value!r}")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{where}: expected epsilon >= 0, got {value!r}")
    return float(value)


def recompute_epsilon(ledger: Mapping[str, Any]) -> float:
    """Epsilon of a ledger dict, recomputed by `PrivacyLedger.from_dict(ledger).epsilon()`: from its
    stages (Poisson sampling rate, noise multiplier, steps) with its own accountant at its own delta.
    """
    return _recompute(json.dumps(ledger, sort_keys=True))[0]


def recompute_truncation_delta(ledger: Mapping[str, Any]) -> float:
    """The delta that Poisson-sample truncation adds to the ledger's delta (0 when nothing truncates)."""
    return _recompute(json.dumps(ledger, sort_keys=True))[1]


@functools.lru_cache(maxsize=64)
def _recompute(ledger_json: str) -> tuple[float, float]:
    # Cached per ledger content: a PLD recomputation takes seconds and verify/push/pull repeat it.

    ledger = PrivacyLedger.from_dict(json.loads(ledger_json))
    epsilon = float(ledger.epsilon())
    return epsilon, float(ledger.truncation_delta(epsilon)) if math.isfinite(epsilon) else 0.0


# ---- weights


def weight_files(folder: str | os.PathLike[str]) -> list[str]:
    """Names of the weight files at the top level of `folder` (see `WEIGHT_PATTERNS`), sorted."""
    folder = Path(folder)
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and any(fnmatch.fnmatch(p.name, pattern) for pattern in WEIGHT_PATTERNS)
    )


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes (a symlink is followed, as in a Hugging Face cache snapshot)."""
    real = Path(path).resolve()
    st = real.stat()
    return _sha256_cached(str(real), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=256)
def _sha256_cached(path: str, size: int, mtime_ns: int, inode: int) -> str:
    # Keyed by the file's identity and stat: verify runs more than once on the same release
    # (push, pull, audit), and hashing a BERT-Large takes seconds.
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weight_hashes(folder: str | os.PathLike[str]) -> dict[str, str]:
    """{file name: sha256} of every weight file of `folder`."""
    return {name: sha256_file(Path(folder) / name) for name in weight_files(folder)}


def tokenizer_hashes(folder: str | os.PathLike[str]) -> dict[str, str]:
    """{file name: sha256} of every tokenizer file of `folder` (`TOKENIZER_FILES`, the vocabulary
    origin marker included), and of any file that `dpbert.data.tokenizer.tokenizer_file_hashes`
    hashes when that function exists."""
    folder = Path(folder)
    out: dict[str, str] = {}
    try:
        hashes = getattr(importlib.import_module("dpbert.data.tokenizer"), "tokenizer_file_hashes", None)
    except ImportError:
        hashes = None
    if hashes is not None:
        out.update({str(k): str(v) for k, v in hashes(folder).items()})
    for name in TOKENIZER_FILES:
        if name not in out and (folder / name).is_file():
            out[name] = sha256_file(folder / name)
    return dict(sorted(out.items()))


def packaged_vocabulary(spec: Any) -> str | None:
    """What a recipe's `data.tokenizer` names when it is a vocabulary packaged with dpbert ("public",
    "bert-base-uncased", or a public subset such as "bert-base-uncased-8k"); None for anything else
    ("train", "dp", a tokenizer folder)."""
    if not isinstance(spec, str):
        return None
    if spec in ("public", "bert-base-uncased"):
        return "bert-base-uncased's vocabulary"
    from dpbert.data.tokenizer import public_subset_size  # deferred: it imports transformers

    size = public_subset_size(spec)
    return None if size is None else f"the first {size:,} tokens of bert-base-uncased's vocabulary"


# ---- no machine path in a release

# An absolute path of at least two components (POSIX, home-relative or Windows), not part of a URL
# or of a relative path or a fraction such as B/N.
_LOCAL_PATH = re.compile(
    r"(?<![\w.:/\\-])(?:~|[A-Za-z]:)?[/\\](?![/\\])[\w.+@%~-]+(?:[/\\][\w.+@%~-]+)+[/\\]?"
    r"|(?<![\w.:/\\-])(?:~|[A-Za-z]:)?[/\\](?![/\\])[\w.+@%~-]+[/\\]"
)


def local_paths(text: str) -> list[str]:
    """Every absolute path (of at least two components, or ending in a separator) in `text`."""
    return [m.group(0) for m in _LOCAL_PATH.finditer(text)]


def redact_paths(text: str) -> str:
    """`text` with every absolute path replaced by `<local path: NAME>` (NAME: its last component)."""

    def name(match: re.Match[str]) -> str:
        parts = [p for p in re.split(r"[/\\]", match.group(0)) if p and p != "~" and not p.endswith(":")]
        return f"<local path: {parts[-1]}>" if parts else "<local path>"

    return _LOCAL_PATH.sub(name, text)


def redact_data(value: Any) -> Any:
    """`value` (parsed YAML/JSON) with `redact_paths` applied to every string in it."""
    if isinstance(value, str):
        return redact_paths(value)
    if isinstance(value, Mapping):
        return {k: redact_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_data(v) for v in value]
    return value


def count_parameters(folder: str | os.PathLike[str]) -> int | None:
    """Number of parameters stored in the safetensors files of `folder` (read from their headers
    only); None when the weights are not safetensors."""
    files = [name for name in weight_files(folder) if name.endswith(".safetensors")]
    if not files:
        return None
    total = 0
    for name in files:
        with open(Path(folder) / name, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for key, entry in header.items():
            if key != "__metadata__":
                total += math.prod(entry["shape"])
    return total


# ---- what a guarantee states besides its ledger


def noise_record(ledger: Mapping[str, Any], *, coordinates: int | None) -> dict[str, Any]:
    """The exact-Gaussian note of one guarantee: which sampler drew the noise and how far, at most,
    the run's noise deviates from the exact Gaussian the accountant assumes: `tail_bound` is
    `dpbert.privacy.noise.tail_deviation` over the run's noised steps at the ledger's epsilon, the
    delta that the sampler's finite tail could add. dpbert bounds it below 1e-3 of delta and does
    not add it (`tail_bound_below` states the comparison). `coordinates` is the number of noised
    coordinates per step (the trained parameters); None when unknown, which leaves the bound unset.
    """

    steps = sum(int(s["steps"]) for s in ledger.get("stages") or () if float(s["noise_multiplier"]) > 0)
    bound = None
    if coordinates is not None and steps:
        bound = float(noise.tail_deviation(coordinates=coordinates, steps=steps, epsilon=recompute_epsilon(ledger)))
    return {
        "sampler": f"Box-Muller on 32-bit words (float32), |z| <= {noise.MAX_ABS_Z:.4f}",
        "max_abs_z": float(noise.MAX_ABS_Z),
        "coordinates": coordinates,
        "tail_bound": bound,
        "tail_bound_below": None if bound is None else "1e-3 * delta (not added to delta)",
    }


def unit_record(*, sequence_tokens: int | None, ledger: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `unit` of a pretraining guarantee, public figures only: the sequence length; for a
    document-level `ledger` the declared cap on sequences per document (a longer document contributes
    at most that many per step); for a sequence-level `ledger`, `group_epsilon` (`group_epsilon_table`):
    the epsilon group privacy gives a document of each of `GROUP_SIZES` sequences. How many documents
    the corpus holds and how long they are are counts of the private data: never recorded here."""
    out: dict[str, Any] = {"sequence_tokens": sequence_tokens}
    if ledger is None:
        return out
    if ledger.get("privacy_unit", PRIVACY_UNIT) == DOCUMENT_UNIT:
        out["max_sequences_per_document"] = ledger.get("max_sequences_per_document")
    else:
        out["group_epsilon"] = group_epsilon_table(ledger)
    return out


def group_epsilon_table(ledger: Mapping[str, Any], sizes: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """[{"sequences": k, "epsilon": e}] for k in `sizes` (default `GROUP_SIZES`): the epsilon, at the
    ledger's delta, that group privacy gives k sequences of one document (`document_group_epsilon`,
    computed by dp_accounting; "inf" when it gives no epsilon below 100). Epsilon grows with the
    group, so the sizes after the first "inf" are "inf" without being computed."""
    out: list[dict[str, Any]] = []
    infinite = False
    for k in GROUP_SIZES if sizes is None else sizes:
        eps = math.inf if infinite else document_group_epsilon(ledger, int(k))
        infinite = infinite or math.isinf(eps)
        out.append({"sequences": int(k), "epsilon": epsilon_to_json(eps)})
    return out


@functools.lru_cache(maxsize=64)
def _group_epsilon(ledger_json: str, group_size: int) -> float:
    ledger = PrivacyLedger.from_dict(json.loads(ledger_json))
    return float(accounting.group_epsilon(ledger, group_size, discretization=GROUP_TABLE_DISCRETIZATION))


def document_group_epsilon(ledger: Mapping[str, Any], group_size: int) -> float:
    """Group privacy of a sequence-level ledger for `group_size` sequences (cached per ledger)."""
    return _group_epsilon(json.dumps(dict(ledger), sort_keys=True), group_size)


def _optional_mapping(item: Mapping[str, Any], key: str, field: str) -> Mapping[str, Any] | None:
    value = item.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"{field}.{key}: expected an object or null, got {value!r}")
    return None if value is None else dict(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Guarantee:
    """What a release promises about one dataset it was trained on.

    `ledger` is `PrivacyLedger.to_dict()` of the run that used `data`, or None when `data` was used
    without DP. `epsilon` is the ledger's epsilon (use `from_ledger`, which computes it); it is
    infinity exactly when the use was not private. `randomness` ({"source": ...}), `noise`
    (`noise_record`) and `unit` (`unit_record`) are what the run knows about its mechanism and its
    unit; None when not recorded.
    """

    scope: str
    data: str
    epsilon: float
    ledger: Mapping[str, Any] | None
    randomness: Mapping[str, Any] | None = None
    noise: Mapping[str, Any] | None = None
    unit: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.scope:
            raise ValueError("Guarantee.scope: expected a non-empty name such as 'pretraining'")
        if not self.data:
            raise ValueError("Guarantee.data: expected a description of the data the guarantee covers")
        if math.isnan(self.epsilon) or self.epsilon < 0:
            raise ValueError(f"Guarantee.epsilon: expected epsilon >= 0 or inf, got {self.epsilon!r}")
        if self.ledger is None and not math.isinf(self.epsilon):
            raise ValueError(f"Guarantee.epsilon: a guarantee without a ledger is non-private, got {self.epsilon}")

    @classmethod
    def from_ledger(
        cls,
        *,
        scope: str,
        data: str,
        ledger: Mapping[str, Any],
        randomness: Mapping[str, Any] | None = None,
        noise: Mapping[str, Any] | None = None,
        unit: Mapping[str, Any] | None = None,
    ) -> Guarantee:
        return cls(
            scope=scope,
            data=data,
            epsilon=recompute_epsilon(ledger),
            ledger=dict(ledger),
            randomness=None if randomness is None else dict(randomness),
            noise=None if noise is None else dict(noise),
            unit=None if unit is None else dict(unit),
        )

    @classmethod
    def non_private(cls, *, scope: str, data: str) -> Guarantee:
        return cls(scope=scope, data=data, epsilon=math.inf, ledger=None)

    @property
    def private(self) -> bool:
        return math.isfinite(self.epsilon)

    @property
    def delta(self) -> float | None:
        return None if self.ledger is None else float(self.ledger["delta"])

    @property
    def accountant(self) -> str | None:
        return None if self.ledger is None else str(self.ledger["accountant"])

    @property
    def truncation_delta(self) -> float:
        return 0.0 if self.ledger is None or not self.private else recompute_truncation_delta(self.ledger)

    @property
    def noise_tail_delta(self) -> float:
        """The noise record's tail bound when it says the bound is added to delta, else 0."""
        tail = (self.noise or {}).get("tail_bound")
        if not isinstance(tail, int | float) or "not added" in str((self.noise or {}).get("tail_bound_below") or ""):
            return 0.0
        return float(tail)

    @property
    def total_delta(self) -> float | None:
        """The delta the guarantee holds at: the ledger's, plus truncation, plus a DP vocabulary's
        selection, plus the noise's tail bound when added (`noise_tail_delta`)."""
        if self.ledger is None:
            return None
        return float(self.ledger["delta"]) + self.truncation_delta + self.selection_delta + self.noise_tail_delta

    @property
    def vocabulary(self) -> Mapping[str, Any] | None:
        """The ledger's DP vocabulary event (`VocabularyEvent` fields), or None."""
        return None if self.ledger is None else self.ledger.get("vocabulary")

    @property
    def selection_delta(self) -> float:
        """The delta a DP vocabulary's word selection adds to the ledger's delta (0 without one)."""
        return 0.0 if self.vocabulary is None else float(self.vocabulary["selection_delta"])

    @property
    def dataset_size_source(self) -> str | None:
        """ "declared", "rounded" or "exact" as the ledger says; "unrecorded" for an older ledger."""
        if self.ledger is None:
            return None
        return str(self.ledger.get("dataset_size_source") or UNRECORDED)

    @property
    def randomness_source(self) -> str:
        """ "os-csprng", "supplied-file", or "unknown" (not recorded, or not a known source)."""
        source = (self.randomness or {}).get("source")
        return str(source) if source in RANDOMNESS_SOURCES else UNKNOWN

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "data": self.data,
            "private": self.private,
            "epsilon": epsilon_to_json(self.epsilon),
            "ledger": None if self.ledger is None else dict(self.ledger),
            "randomness": None if self.randomness is None else dict(self.randomness),
            "noise": None if self.noise is None else dict(self.noise),
            "unit": None if self.unit is None else dict(self.unit),
        }

    def summary(self) -> dict[str, Any]:
        """The machine-readable keys copied into the card front matter and config.json."""
        out: dict[str, Any] = {"scope": self.scope, "data": self.data, "private": self.private, "epsilon": self.epsilon}
        if self.ledger is not None:
            out.update(
                delta=self.delta,
                accountant=self.accountant,
                privacy_unit=self.ledger.get("privacy_unit", PRIVACY_UNIT),
                **(
                    {"max_sequences_per_document": self.ledger["max_sequences_per_document"]}
                    if self.ledger.get("max_sequences_per_document") is not None
                    else {}
                ),
                sampling=self.ledger.get("sampling", "poisson"),
                dataset_size=self.ledger.get("dataset_size"),
                dataset_size_source=self.dataset_size_source,
                randomness=self.randomness_source,
            )
            if self.ledger.get("dataset_size_bound") is not None:
                out["dataset_size_bound"] = self.ledger["dataset_size_bound"]
            if self.truncation_delta > 0:
                out["truncation_delta"] = self.truncation_delta
            if self.vocabulary is not None:
                out["vocabulary_epsilon_share"] = float(self.vocabulary["epsilon_share"])
                out["vocabulary_selection_delta"] = self.selection_delta
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReleaseMetadata:
    """Everything `privacy.json` holds. `private` is true only if every guarantee is private.

    `vocabulary_learned_from_private_data`: True for a vocabulary learned from the private corpus
    (without privacy, `tokenizer: train`, or under DP, `tokenizer: dp`, then covered by the guarantee
    whose ledger holds its event), False for a public one (packaged with dpbert, or declared public by
    the user); `vocabulary_kind` names which ("packaged", "declared", "dp", "train", "unknown": see
    `VOCABULARY_SOURCES`). An export always states both; None is left to metadata written before them.
    `non_private_diagnostics` names the data-dependent figures the run logged; `diagnostics` holds
    their values only when the export was asked to include them. `evaluation` describes the held-out
    figures (see the module docstring). `weights` and `tokenizer` ({file: sha256}) are filled in by
    `write_release` from the files it writes.
    """

    guarantees: tuple[Guarantee, ...]
    vocabulary_origin: str
    vocabulary_covered: bool
    vocabulary_learned_from_private_data: bool | None = None
    vocabulary_kind: str | None = None
    recipe_name: str | None = None
    recipe_content: str | None = None
    non_private_diagnostics: tuple[str, ...] = ()
    diagnostics: Mapping[str, Any] | None = None
    evaluation: Mapping[str, Any] | None = None
    weights: Mapping[str, str] | None = None
    tokenizer: Mapping[str, str] | None = None
    dpbert_version: str = dpbert.__version__

    def __post_init__(self) -> None:
        if not self.guarantees:
            raise ValueError("ReleaseMetadata.guarantees: expected at least one guarantee (use Guarantee.non_private)")
        scopes = [g.scope for g in self.guarantees]
        if len(set(scopes)) != len(scopes):
            raise ValueError(f"ReleaseMetadata.guarantees: scopes must be distinct, got {scopes}")
        if not self.vocabulary_origin:
            raise ValueError("ReleaseMetadata.vocabulary_origin: expected where the vocabulary came from")
        if self.vocabulary_kind is not None and self.vocabulary_kind not in VOCABULARY_SOURCES:
            raise ValueError(
                f"ReleaseMetadata.vocabulary_kind: expected one of {list(VOCABULARY_SOURCES)}, got {self.vocabulary_kind!r}"
            )
        if self.vocabulary_learned_from_private_data is True and self.vocabulary_covered and self.dp_vocabulary is None:
            raise ValueError(
                "ReleaseMetadata.vocabulary_covered: a vocabulary learned from the private data without privacy "
                "is not covered by the guarantee"
            )

    @property
    def private(self) -> bool:
        return all(g.private for g in self.guarantees)

    @property
    def vocabulary_private(self) -> bool:
        """False when the vocabulary was learned from the private corpus outside every guarantee
        (without privacy, or under DP in a run whose ledger is not in this release)."""
        return self.vocabulary_learned_from_private_data is not True or self.dp_vocabulary is not None

    @property
    def fully_private(self) -> bool:
        """Every guarantee private, and no vocabulary learned from the private data outside them: what
        the differential-privacy tags of the card claim."""
        return self.private and self.vocabulary_private

    @property
    def recipe_sha256(self) -> str | None:
        return None if self.recipe_content is None else hashlib.sha256(self.recipe_content.encode()).hexdigest()

    @property
    def dp_vocabulary(self) -> Guarantee | None:
        """The guarantee whose ledger holds the DP vocabulary's event, or None."""
        return next((g for g in self.guarantees if g.vocabulary is not None), None)

    @property
    def vocabulary_source(self) -> str:
        if self.dp_vocabulary is not None:
            return f"private corpus, under differential privacy (the {self.dp_vocabulary.scope} guarantee)"
        if self.vocabulary_kind == "declared":
            return "declared public by the user (data.tokenizer_declared_public)"
        if self.vocabulary_kind == "unknown":
            return "unknown origin, treated as learned from the private corpus"
        if self.vocabulary_learned_from_private_data is True:
            return "private corpus, without privacy"
        if self.vocabulary_learned_from_private_data is False:
            return "public"
        return UNKNOWN

    def public_inputs(self) -> list[dict[str, Any]]:
        """What the guarantees treat as public, derived from the rest of the metadata."""
        items: list[dict[str, Any]] = []
        for g in self.guarantees:
            if g.ledger is None:
                continue
            items.append(
                {
                    "input": "dataset_size",
                    "scope": g.scope,
                    "value": g.ledger.get("dataset_size"),
                    "source": g.dataset_size_source,
                }
            )
            if g.ledger.get("dataset_size_bound") is not None:
                items.append(
                    {
                        "input": "dataset_size_bound",
                        "scope": g.scope,
                        "value": g.ledger["dataset_size_bound"],
                        "source": "a public upper bound on the stored units, fixed without looking at the data; "
                        "the truncation of the Poisson sample is accounted for a store of that size",
                    }
                )
            if g.ledger.get("max_sequences_per_document") is not None:
                items.append(
                    {
                        "input": "max_sequences_per_document",
                        "scope": g.scope,
                        "value": g.ledger["max_sequences_per_document"],
                        "source": "declared in the recipe (privacy.max_sequences_per_document); a longer "
                        "document contributes at most that many sequences per step",
                    }
                )
        items.append({"input": "vocabulary", "value": self.vocabulary_origin, "source": self.vocabulary_source})
        items.append(
            {
                "input": "recipe",
                "value": self.recipe_name if self.recipe_content is not None else None,
                "source": "recipe.content" if self.recipe_content is not None else "not included",
            }
        )
        for g in self.guarantees:
            if g.private:
                items.append(
                    {
                        "input": "randomness_source",
                        "scope": g.scope,
                        "value": g.randomness_source,
                        "source": "the run folder's randomness record (the secret itself is never released)",
                    }
                )
        return items

    def _vocabulary_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "origin": self.vocabulary_origin,
            "covered": self.vocabulary_covered,
            "learned_from_private_data": self.vocabulary_learned_from_private_data,
        }
        if self.vocabulary_kind is not None:
            out["source"] = self.vocabulary_kind
        return out

    def to_dict(self) -> dict[str, Any]:
        recipe = None
        if self.recipe_content is not None:
            recipe = {"name": self.recipe_name, "sha256": self.recipe_sha256, "content": self.recipe_content}
        return {
            "format": FORMAT,
            "private": self.private,
            "dpbert_version": self.dpbert_version,
            "guarantees": [g.to_dict() for g in self.guarantees],
            "recipe": recipe,
            "weights": None if self.weights is None else dict(self.weights),
            "tokenizer": None if self.tokenizer is None else dict(self.tokenizer),
            "vocabulary": self._vocabulary_dict(),
            "public_inputs": self.public_inputs(),
            "non_private_diagnostics": {
                "logged": list(self.non_private_diagnostics),
                "included": self.diagnostics is not None,
                "values": None if self.diagnostics is None else dict(self.diagnostics),
            },
            "evaluation": None if self.evaluation is None else dict(self.evaluation),
        }

    def vocabulary_copy(self) -> dict[str, Any]:
        """The vocabulary entry of the card's `differential_privacy` block (with `dp`: the scope of the
        guarantee that covers a DP vocabulary, its epsilon share and selection delta)."""
        out = self._vocabulary_dict()
        g = self.dp_vocabulary
        if g is not None:
            out["dp"] = {
                "scope": g.scope,
                "epsilon_share": float(g.vocabulary["epsilon_share"]),
                "selection_delta": g.selection_delta,
                "unit": str(g.vocabulary["unit"]),
            }
        return out

    def config_copy(self) -> dict[str, Any]:
        """The `differential_privacy` entry added to config.json (JSON-safe)."""
        return {
            "private": self.private,
            "guarantees": [
                {k: epsilon_to_json(v) if k == "epsilon" else v for k, v in g.summary().items()}
                for g in self.guarantees
            ],
        }


def read_privacy_json(folder: Path) -> dict[str, Any]:
    """The parsed `privacy.json` of a release folder; FileNotFoundError/ValueError name the file."""
    path = Path(folder) / PRIVACY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (a dpbert release carries its privacy ledger here)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: expected a JSON object with format {FORMAT!r}")
    return data


def guarantees_from_json(data: Mapping[str, Any], where: str) -> list[Guarantee]:
    """The guarantees stored in a `privacy.json` dict, with epsilon as *stated* (not recomputed)."""
    items = data.get("guarantees")
    if not isinstance(items, Sequence) or not items:
        raise ValueError(f"{where}: 'guarantees' must be a non-empty list")
    out = []
    for i, item in enumerate(items):
        field = f"{where}: guarantees[{i}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{field}: expected an object")
        for key in ("scope", "data", "epsilon", "ledger"):
            if key not in item:
                raise ValueError(f"{field}.{key}: missing")
        ledger = item["ledger"]
        if ledger is not None and not isinstance(ledger, Mapping):
            raise ValueError(f"{field}.ledger: expected an object or null")
        out.append(
            Guarantee(
                scope=str(item["scope"]),
                data=str(item["data"]),
                epsilon=epsilon_from_json(item["epsilon"], f"{field}.epsilon"),
                ledger=ledger,
                randomness=_optional_mapping(item, "randomness", field),
                noise=_optional_mapping(item, "noise", field),
                unit=_optional_mapping(item, "unit", field),
            )
        )
    return out


def metadata_from_json(data: Mapping[str, Any], where: str) -> ReleaseMetadata:
    """The `ReleaseMetadata` a `privacy.json` dict states (epsilon as stated, not recomputed);
    ValueError naming `where` and the field when it cannot be read."""
    guarantees = guarantees_from_json(data, where)
    vocabulary = data.get("vocabulary")
    if not isinstance(vocabulary, Mapping):
        raise ValueError(f"{where}: vocabulary: expected an object with 'origin' and 'covered'")
    learned = vocabulary.get("learned_from_private_data")
    if learned is not None and not isinstance(learned, bool):
        raise ValueError(
            f"{where}: vocabulary.learned_from_private_data: expected true, false or null, got {learned!r}"
        )
    recipe = data.get("recipe")
    if recipe is not None and (not isinstance(recipe, Mapping) or not isinstance(recipe.get("content"), str)):
        raise ValueError(f"{where}: recipe: expected null or an object with 'name', 'sha256' and 'content'")
    diagnostics = data.get("non_private_diagnostics")
    if isinstance(diagnostics, Mapping):
        logged, values = diagnostics.get("logged") or (), diagnostics.get("values")
    else:  # the list of names older releases wrote
        logged, values = diagnostics or (), None
    weights = data.get("weights")
    if weights is not None and not isinstance(weights, Mapping):
        raise ValueError(f"{where}: weights: expected an object {{file: sha256}}, got {weights!r}")
    tokenizer = data.get("tokenizer")
    if tokenizer is not None and not isinstance(tokenizer, Mapping):
        raise ValueError(f"{where}: tokenizer: expected an object {{file: sha256}}, got {tokenizer!r}")
    evaluation = data.get("evaluation")
    if evaluation is not None and not isinstance(evaluation, Mapping):
        raise ValueError(f"{where}: evaluation: expected an object or null, got {evaluation!r}")
    kind = vocabulary.get("source")
    if kind is not None and kind not in VOCABULARY_SOURCES:
        raise ValueError(f"{where}: vocabulary.source: expected one of {list(VOCABULARY_SOURCES)}, got {kind!r}")
    try:
        return ReleaseMetadata(
            guarantees=tuple(guarantees),
            vocabulary_origin=str(vocabulary.get("origin") or ""),
            vocabulary_covered=vocabulary.get("covered") is True,
            vocabulary_learned_from_private_data=learned,
            vocabulary_kind=kind,
            recipe_name=None if recipe is None else recipe.get("name"),
            recipe_content=None if recipe is None else recipe["content"],
            non_private_diagnostics=tuple(str(name) for name in logged),
            diagnostics=None if values is None else dict(values),
            evaluation=None if evaluation is None else dict(evaluation),
            weights=None if weights is None else dict(weights),
            tokenizer=None if tokenizer is None else dict(tokenizer),
            dpbert_version=str(data.get("dpbert_version", dpbert.__version__)),
        )
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


AUDITS_KEY = "audits"
AUDIT_METHOD = "one-run audit (Steinke, Nasr, Jagielski 2023)"
AUDIT_MEANING = "empirical lower bound on epsilon, valid at the stated confidence; not a privacy guarantee"
AUDIT_KINDS = ("input", "gradient")
# Canary kinds whose audit run trains on the private data (a second DP mechanism on it); gradient
# canaries are crafted gradients through the DP step and read nothing of the data but its public N.
AUDIT_KINDS_ON_PRIVATE_DATA = ("input",)
AUDIT_COMPOSITION = "basic composition: epsilons and deltas of the release and the audit run add up"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditedFigure:
    """One audit result as a release states it, with the privacy the audit itself spent.

    `epsilon_claimed` is the audit run's own guarantee at `delta`; `epsilon_lower_bound` holds with
    probability >= `confidence`. `epsilon_release`/`delta_release` are the release guarantee of
    `scope`. An audit run that trained on the private data (`private_data_used`, input canaries) is a
    second DP mechanism on it, and its published result is covered by its own guarantee: the release
    and its audited figure together are (`epsilon_with_audit`, `delta_with_audit`)-DP, the sums
    (basic composition); a gradient audit spends nothing, so they equal the release's. Construction
    refuses figures whose composition does not add up. `date` is the audit's UTC time (ISO 8601).
    """

    scope: str
    kind: str
    epsilon_claimed: float
    delta: float
    epsilon_release: float
    delta_release: float
    private_data_used: bool
    epsilon_with_audit: float
    delta_with_audit: float
    epsilon_lower_bound: float
    confidence: float
    num_canaries: int
    num_guesses: int
    num_correct: int
    date: str
    recipe: str
    composition: str = AUDIT_COMPOSITION
    method: str = AUDIT_METHOD
    meaning: str = AUDIT_MEANING

    def __post_init__(self) -> None:
        if self.kind not in AUDIT_KINDS:
            raise ValueError(f"kind: expected one of {list(AUDIT_KINDS)}, got {self.kind!r}")
        for name in ("epsilon_claimed", "epsilon_release", "epsilon_with_audit", "epsilon_lower_bound"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf:
                raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
        for name in ("delta", "delta_release", "delta_with_audit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1:
                raise ValueError(f"{name}: expected a probability in (0, 1), got {v!r}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence: expected a number in (0, 1), got {self.confidence!r}")
        if not 0 <= self.num_correct <= self.num_guesses <= self.num_canaries:
            raise ValueError(
                "num_correct/num_guesses/num_canaries: expected 0 <= num_correct <= num_guesses <= "
                f"num_canaries, got {self.num_correct}, {self.num_guesses}, {self.num_canaries}"
            )
        if not self.date:
            raise ValueError("date: expected the audit's UTC time (ISO 8601), got an empty string")
        used = self.kind in AUDIT_KINDS_ON_PRIVATE_DATA
        if self.private_data_used is not used:
            raise ValueError(
                f"private_data_used: a {self.kind} audit {'trains' if used else 'does not train'} on the "
                f"private data, so expected {used}, got {self.private_data_used!r}"
            )
        expected = self.composed(self.epsilon_release, self.delta_release)
        stated = (self.epsilon_with_audit, self.delta_with_audit)
        if not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(stated, expected, strict=True)):
            raise ValueError(
                f"epsilon_with_audit/delta_with_audit: {stated[0]!r}, {stated[1]!r} but the release "
                f"({self.epsilon_release!r}, {self.delta_release!r}) "
                + (f"and the audit run ({self.epsilon_claimed!r}, {self.delta!r}) " if used else "")
                + f"compose to {expected[0]!r}, {expected[1]!r} ({self.composition})"
            )

    def composed(self, epsilon_release: float, delta_release: float) -> tuple[float, float]:
        """(epsilon, delta) of a release at (`epsilon_release`, `delta_release`) together with this
        audit's published result."""
        if self.kind not in AUDIT_KINDS_ON_PRIVATE_DATA:
            return epsilon_release, delta_release
        return epsilon_release + self.epsilon_claimed, delta_release + self.delta

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def audit_problems(audits: Any, guarantees: Sequence[Guarantee], where: str, rtol: float) -> list[str]:
    """What is wrong with the `audits` list of a privacy.json, given its (recomputed) guarantees: each
    entry must parse as an `AuditedFigure` and state its scope's release epsilon and delta."""
    if audits is None:
        return []
    if not isinstance(audits, list):
        return [f"{where}: {AUDITS_KEY}: expected a list of audited figures, got {type(audits).__name__}"]
    by_scope = {g.scope: g for g in guarantees}
    problems = []
    for i, entry in enumerate(audits):
        field = f"{where}: {AUDITS_KEY}[{i}]"
        try:
            figure = AuditedFigure(**entry)
        except (TypeError, ValueError) as err:
            problems.append(f"{field}: {err}")
            continue
        g = by_scope.get(figure.scope)
        if g is None or not g.private:
            problems.append(f"{field}: scope {figure.scope!r} has no private guarantee to audit")
            continue
        for name, stated, actual in (
            ("epsilon_release", figure.epsilon_release, g.epsilon),
            ("delta_release", figure.delta_release, g.total_delta),
        ):
            if not math.isclose(stated, actual, rel_tol=rtol):
                problems.append(f"{field}: {name} {stated!r} but the '{figure.scope}' guarantee states {actual!r}")
    return problems


EXPOSURE_KEY = "exposure"
EXPOSURE_MEANING = "measurement, not a guarantee"
EXPOSURE_METHOD = "exposure of planted secrets (Carlini et al. 2019), exact rank among all candidates"
EXPOSURE_SPENT = (
    "both audit runs trained on the private data: the DP run spent its own (epsilon, delta); the non-private "
    "twin spent unbounded privacy (epsilon infinity); neither model is released, and a release's stated "
    "guarantee does not cover this measurement"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExposureMeasurement:
    """A `dpbert audit --kind exposure` result as a release states it (`exposure` in privacy.json and
    the card's front matter): per secret its repetitions and exposure under the DP audit run and its
    non-private twin, and per repetition count their mean and max (`summary`, which must equal the
    per-secret values summarized again). `epsilon_audit_run`/`delta_audit_run`: the DP audit run's
    own guarantee; `epsilon_release`/`delta_release`: the release guarantee of `scope`, unchanged.
    Construction refuses exposures outside [0, log2(num_candidates)] and a summary that does not add up.
    """

    scope: str
    recipe: str
    date: str
    prefix: str
    num_candidates: int
    repetitions: list[int]
    steps: int
    steps_nonprivate: int
    epsilon_audit_run: float
    delta_audit_run: float
    epsilon_release: float
    delta_release: float
    secrets: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    ties: str
    privacy_spent: str = EXPOSURE_SPENT
    method: str = EXPOSURE_METHOD
    meaning: str = EXPOSURE_MEANING

    def __post_init__(self) -> None:
        for name in ("num_candidates", "steps", "steps_nonprivate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")
        for name in ("epsilon_audit_run", "epsilon_release"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf:
                raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
        for name in ("delta_audit_run", "delta_release"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1:
                raise ValueError(f"{name}: expected a probability in (0, 1), got {v!r}")
        reps = self.repetitions
        if (
            not isinstance(reps, list)
            or not reps
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in reps)
            or reps != sorted(set(reps))
            or reps[0] != 0
        ):
            raise ValueError(
                f"repetitions: expected distinct increasing integers starting at 0 (control), got {reps!r}"
            )
        if not self.date:
            raise ValueError("date: expected the audit's UTC time (ISO 8601), got an empty string")
        if local_paths(self.recipe):
            raise ValueError(f"recipe: {self.recipe!r} holds a local path (a release publishes none)")
        top = math.log2(self.num_candidates)
        if not isinstance(self.secrets, list):
            raise ValueError(f"secrets: expected a list, got {type(self.secrets).__name__}")
        for i, s in enumerate(self.secrets):
            if not isinstance(s, Mapping) or set(s) != {"repetitions", "exposure_dp", "exposure_nonprivate"}:
                raise ValueError(f"secrets[{i}]: expected repetitions, exposure_dp and exposure_nonprivate, got {s!r}")
            if s["repetitions"] not in reps:
                raise ValueError(f"secrets[{i}].repetitions: {s['repetitions']!r} is not one of {reps}")
            for key in ("exposure_dp", "exposure_nonprivate"):
                v = s[key]
                if isinstance(v, bool) or not isinstance(v, int | float) or not -1e-9 <= v <= top + 1e-9:
                    raise ValueError(f"secrets[{i}].{key}: expected an exposure in [0, {top:.4g}] bits, got {v!r}")
        expected = exposure_summary(self.secrets, reps)
        if not isinstance(self.summary, list) or len(self.summary) != len(expected):
            raise ValueError(f"summary: expected one row per repetition count {reps}")
        for row, want in zip(self.summary, expected, strict=True):
            if not isinstance(row, Mapping) or set(row) != set(want):
                raise ValueError(f"summary: expected rows with {sorted(want)}, got {row!r}")
            for key, value in want.items():
                if not _same_number(row[key], value):
                    raise ValueError(
                        f"summary (repetitions {want['repetitions']}): {key} {row[key]!r} but the secrets give {value!r}"
                    )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _same_number(a: Any, b: float) -> bool:
    return not isinstance(a, bool) and isinstance(a, int | float) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def exposure_problems(entry: Any, guarantees: Sequence[Guarantee], where: str, rtol: float) -> list[str]:
    """What is wrong with the `exposure` entry of a privacy.json, given its (recomputed) guarantees: it
    must parse as an `ExposureMeasurement` and state its scope's release epsilon and delta."""
    if entry is None:
        return []
    field = f"{where}: {EXPOSURE_KEY}"
    if not isinstance(entry, Mapping):
        return [f"{field}: expected an exposure measurement, got {type(entry).__name__}"]
    try:
        m = ExposureMeasurement(**entry)
    except (TypeError, ValueError) as err:
        return [f"{field}: {err}"]
    g = {g.scope: g for g in guarantees}.get(m.scope)
    if g is None or not g.private:
        return [f"{field}: scope {m.scope!r} has no private guarantee"]
    return [
        f"{field}: {name} {stated!r} but the '{m.scope}' guarantee states {actual!r}"
        for name, stated, actual in (
            ("epsilon_release", m.epsilon_release, g.epsilon),
            ("delta_release", m.delta_release, g.total_delta),
        )
        if not math.isclose(stated, actual, rel_tol=rtol)
    ]
