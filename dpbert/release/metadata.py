"""The privacy metadata of a release (`privacy.json`) and the copies of it in the card and config.

A release carries one or more *guarantees*, each for its own data: a pretrained checkpoint has one
("pretraining"), a model fine-tuned from it can add a second ("fine-tuning") for the task data. Each
guarantee holds the full privacy ledger of the run that consumed that data (the `PrivacyLedger.to_dict()`
of `dpbert.privacy.accounting`: accountant, delta, dataset size, clip norm, Poisson sampling, privacy unit
= one example sequence, and per stage the sampling rate, expected batch size, noise multiplier and
steps), so anyone can recompute epsilon from it. A guarantee without a ledger is a non-private use of
that data: epsilon is infinity, and the release as a whole is private only if every guarantee is.

`privacy.json` (format "dpbert-privacy/1"):

    {"format": "dpbert-privacy/1", "private": bool, "dpbert_version": str,
     "guarantees": [{"scope": str, "data": str, "private": bool, "epsilon": float | "inf",
                     "ledger": {...} | null}],
     "recipe": {"name": str, "sha256": str, "content": str} | null,
     "vocabulary": {"origin": str, "covered": bool},
     "non_private_diagnostics": [str, ...]}

JSON has no infinity, so an infinite epsilon is written as the string "inf" (YAML writes `.inf`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import dpbert

FORMAT = "dpbert-privacy/1"
PRIVACY_FILE = "privacy.json"
PRIVACY_UNIT = "one example sequence"


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
    from dpbert.privacy.accounting import PrivacyLedger

    ledger = PrivacyLedger.from_dict(json.loads(ledger_json))
    epsilon = float(ledger.epsilon())
    return epsilon, float(ledger.truncation_delta(epsilon)) if math.isfinite(epsilon) else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Guarantee:
    """What a release promises about one dataset it was trained on.

    `ledger` is `PrivacyLedger.to_dict()` of the run that used `data`, or None when `data` was used
    without DP. `epsilon` is the ledger's epsilon (use `from_ledger`, which computes it); it is
    infinity exactly when the use was not private.
    """

    scope: str
    data: str
    epsilon: float
    ledger: Mapping[str, Any] | None

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
    def from_ledger(cls, *, scope: str, data: str, ledger: Mapping[str, Any]) -> Guarantee:
        return cls(scope=scope, data=data, epsilon=recompute_epsilon(ledger), ledger=dict(ledger))

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "data": self.data,
            "private": self.private,
            "epsilon": epsilon_to_json(self.epsilon),
            "ledger": None if self.ledger is None else dict(self.ledger),
        }

    def summary(self) -> dict[str, Any]:
        """The machine-readable keys copied into the card front matter and config.json."""
        out: dict[str, Any] = {"scope": self.scope, "data": self.data, "private": self.private, "epsilon": self.epsilon}
        if self.ledger is not None:
            out.update(
                delta=self.delta,
                accountant=self.accountant,
                privacy_unit=self.ledger.get("privacy_unit", PRIVACY_UNIT),
                sampling=self.ledger.get("sampling", "poisson"),
                dataset_size=self.ledger.get("dataset_size"),
            )
            if self.truncation_delta > 0:
                out["truncation_delta"] = self.truncation_delta
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReleaseMetadata:
    """Everything `privacy.json` holds. `private` is true only if every guarantee is private."""

    guarantees: tuple[Guarantee, ...]
    vocabulary_origin: str
    vocabulary_covered: bool
    recipe_name: str | None = None
    recipe_content: str | None = None
    non_private_diagnostics: tuple[str, ...] = ()
    dpbert_version: str = dpbert.__version__

    def __post_init__(self) -> None:
        if not self.guarantees:
            raise ValueError("ReleaseMetadata.guarantees: expected at least one guarantee (use Guarantee.non_private)")
        scopes = [g.scope for g in self.guarantees]
        if len(set(scopes)) != len(scopes):
            raise ValueError(f"ReleaseMetadata.guarantees: scopes must be distinct, got {scopes}")
        if not self.vocabulary_origin:
            raise ValueError("ReleaseMetadata.vocabulary_origin: expected where the vocabulary came from")

    @property
    def private(self) -> bool:
        return all(g.private for g in self.guarantees)

    def to_dict(self) -> dict[str, Any]:
        recipe = None
        if self.recipe_content is not None:
            recipe = {
                "name": self.recipe_name,
                "sha256": hashlib.sha256(self.recipe_content.encode()).hexdigest(),
                "content": self.recipe_content,
            }
        return {
            "format": FORMAT,
            "private": self.private,
            "dpbert_version": self.dpbert_version,
            "guarantees": [g.to_dict() for g in self.guarantees],
            "recipe": recipe,
            "vocabulary": {"origin": self.vocabulary_origin, "covered": self.vocabulary_covered},
            "non_private_diagnostics": list(self.non_private_diagnostics),
        }

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
            )
        )
    return out
