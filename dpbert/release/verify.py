"""Verify a release's privacy metadata: recompute epsilon and compare every copy of it.

For every guarantee in `privacy.json`, epsilon is recomputed from its ledger (stages of Poisson sampling
rate, noise multiplier and steps, at the ledger's delta, with the ledger's accountant; see
`dpbert.release.metadata.recompute_epsilon`) and compared, with relative tolerance `rtol`, against

- the epsilon `privacy.json` states for that guarantee,
- the card's front matter (`README.md`: `differential_privacy.guarantees`, matched by scope; delta,
  accountant and privacy unit must equal the ledger's too, and `truncation_delta`, the delta that
  truncating Poisson samples adds, must match its recomputation),
- `config.json`'s `differential_privacy` copy.

A guarantee without a ledger is non-private: epsilon must be infinity everywhere. The release-level
`private` flag must equal "every guarantee is private" in all three files, and a non-private release
must not carry the `differential-privacy`/`dp-sgd` tags. Missing metadata is a failure, named by file.
Audited figures (empirical lower bounds, `dpbert.release.audited`) are not guarantees and are not
recomputed, but the card's `differential_privacy.audits` must equal privacy.json's `audits`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpbert.release.card import CARD_FILE, DP_TAGS, read_front_matter
from dpbert.release.metadata import (
    PRIVACY_FILE,
    PRIVACY_UNIT,
    epsilon_from_json,
    guarantees_from_json,
    read_privacy_json,
    recompute_epsilon,
    recompute_truncation_delta,
)

DEFAULT_RTOL = 1e-3


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuaranteeCheck:
    """One guarantee: the epsilon privacy.json states and the one recomputed from its ledger."""

    scope: str
    stated_epsilon: float
    recomputed_epsilon: float
    delta: float | None
    accountant: str | None

    @property
    def private(self) -> bool:
        return math.isfinite(self.recomputed_epsilon)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerificationResult:
    """The outcome of `verify`. `ok` is true when `problems` is empty; `private` is the recomputed status."""

    path: Path
    checks: tuple[GuaranteeCheck, ...]
    problems: tuple[str, ...]

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
        return "private" if self.private else "non-private"

    def summary(self) -> str:
        lines = [f"{self.path}: {self.status}"]
        for c in self.checks:
            if c.private:
                lines.append(f"  {c.scope}: epsilon = {c.recomputed_epsilon:.6g} at delta = {c.delta:g} ({c.accountant})")
            else:
                lines.append(f"  {c.scope}: NOT private (epsilon = infinity)")
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


def _compare_copy(
    where: str,
    block: Any,
    checks: Mapping[str, GuaranteeCheck],
    ledgers: Mapping[str, Mapping[str, Any] | None],
    rtol: float,
    *,
    strict_fields: bool,
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
        ledger = ledgers[scope]
        if ledger is None:
            continue
        fields = {"delta": float(ledger["delta"]), "accountant": str(ledger["accountant"])}
        if strict_fields:
            fields["privacy_unit"] = str(ledger.get("privacy_unit", PRIVACY_UNIT))
        for key, expected in fields.items():
            value = entry.get(key)
            same = (
                isinstance(value, (int, float)) and math.isclose(float(value), expected, rel_tol=1e-9)
                if isinstance(expected, float)
                else value == expected
            )
            if not same:
                problems.append(f"{where}: {key} for '{scope}' is {value!r} but {PRIVACY_FILE} has {expected!r}")
        truncation = recompute_truncation_delta(ledger) if check.private else 0.0
        stated_truncation = entry.get("truncation_delta", 0.0)
        if not (
            isinstance(stated_truncation, (int, float))
            and math.isclose(float(stated_truncation), truncation, rel_tol=rtol)
        ):
            problems.append(
                f"{where}: truncation_delta for '{scope}' is {stated_truncation!r} but the ledger gives {truncation:g}"
            )
    return problems


def verify_folder(folder: str | Path, *, rtol: float = DEFAULT_RTOL) -> VerificationResult:
    """Verify a local release folder (see the module docstring)."""
    folder = Path(folder)
    privacy_path, card_path, config_path = folder / PRIVACY_FILE, folder / CARD_FILE, folder / "config.json"
    try:
        data = read_privacy_json(folder)
        guarantees = guarantees_from_json(data, str(privacy_path))
    except (FileNotFoundError, ValueError) as err:
        return VerificationResult(path=folder, checks=(), problems=(str(err),))

    problems: list[str] = []
    checks: dict[str, GuaranteeCheck] = {}
    ledgers: dict[str, Mapping[str, Any] | None] = {}
    for g in guarantees:
        ledgers[g.scope] = g.ledger
        try:
            recomputed = recompute_epsilon(g.ledger) if g.ledger is not None else math.inf
        except (KeyError, TypeError, ValueError) as err:
            problems.append(f"{privacy_path}: ledger of '{g.scope}' cannot be recomputed ({err!r})")
            continue
        checks[g.scope] = GuaranteeCheck(
            scope=g.scope, stated_epsilon=g.epsilon, recomputed_epsilon=recomputed, delta=g.delta, accountant=g.accountant
        )
        if not _close(g.epsilon, recomputed, rtol):
            problems.append(
                f"{privacy_path}: epsilon for '{g.scope}' is {_fmt(g.epsilon)} but its ledger gives "
                f"{_fmt(recomputed)} (recomputed with {g.accountant} at delta={g.delta})"
            )
    if problems:
        return VerificationResult(path=folder, checks=tuple(checks.values()), problems=tuple(problems))

    private = all(c.private for c in checks.values())
    if data.get("private") is not private:
        problems.append(f"{privacy_path}: 'private' is {data.get('private')!r} but the recomputed ledgers say {private}")

    if not card_path.is_file():
        problems.append(f"{card_path}: missing (the model card must state the guarantee)")
    else:
        try:
            matter = read_front_matter(card_path)
        except ValueError as err:
            problems.append(str(err))
        else:
            problems += _compare_copy(
                str(card_path), matter.get("differential_privacy"), checks, ledgers, rtol, strict_fields=True
            )
            block = matter.get("differential_privacy")
            card_audits = (block.get("audits") if isinstance(block, Mapping) else None) or []
            if card_audits != (data.get("audits") or []):
                problems.append(
                    f"{card_path}: differential_privacy.audits differs from the audits in {privacy_path}"
                )
            claimed = sorted(set(matter.get("tags") or ()) & set(DP_TAGS))
            if not private and claimed:
                problems.append(f"{card_path}: a non-private release carries the tags {claimed}")
            if private and len(claimed) != len(DP_TAGS):
                problems.append(f"{card_path}: a private release must carry the tags {list(DP_TAGS)}")

    if not config_path.is_file():
        problems.append(f"{config_path}: missing")
    else:
        config = json.loads(config_path.read_text())
        if "differential_privacy" in config:
            problems += _compare_copy(
                str(config_path), config["differential_privacy"], checks, ledgers, rtol, strict_fields=False
            )
    return VerificationResult(path=folder, checks=tuple(checks.values()), problems=tuple(problems))


def verify(path_or_repo_id: str | Path, *, revision: str | None = None, rtol: float = DEFAULT_RTOL) -> VerificationResult:
    """Verify a local release folder, or a Hub repo downloaded through the Hugging Face cache."""
    from dpbert.release.hub import pull

    return verify_folder(pull(path_or_repo_id, revision=revision, verify=False), rtol=rtol)
