"""Audited figures on a release: a `dpbert audit` result added to its privacy.json and model card.

An audited figure is an *empirical lower bound* on epsilon, measured on a separate, never-released
audit run of the release's recipe, and stored next to the guarantees (`audits` in privacy.json and
the card's front matter, plus a card section), never in place of one. `add_exposure` stores an
exposure audit's memorization measurement the same way (`exposure`), labelled not a guarantee.
Layout: docs/INTERNALS.md.

Guarantees: the release folder changes atomically (a hard-linked copy is edited in a temporary
sibling, verified, then renamed into place); a release that does not verify before, or would not
verify after, is refused; so is an audit of a scope the release lacks, of a non-private guarantee,
or of a run whose claimed epsilon differs from the release's by more than `EPSILON_RTOL`. An input
audit's figure states the audit run's own guarantee and its composition with the release's; the
release's stated guarantee does not change (the audit model is never released); an exposure
measurement states that its non-private twin spent unbounded privacy, so nothing covers the table.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dpbert.atomic import replace_dir, write_json, write_text
from dpbert.release.card import CARD_FILE, with_audits, with_exposure
from dpbert.release.metadata import (
    AUDIT_KINDS_ON_PRIVATE_DATA,
    AUDITS_KEY,
    EXPOSURE_KEY,
    PRIVACY_FILE,
    AuditedFigure,
    ExposureMeasurement,
    Guarantee,
    guarantees_from_json,
    read_privacy_json,
    redact_paths,
)
from dpbert.release.verify import verify_folder

# Canaries join the audit run's dataset, so its claimed epsilon differs slightly from the release's;
# more than this means the audit measured a different privacy plan.
EPSILON_RTOL = 0.1


def figure_from_report(report: Mapping[str, Any], *, guarantee: Guarantee, where: str) -> AuditedFigure:
    """An `AuditedFigure` from an audit.json object (`dpbert.train.audit.AuditReport.to_dict()`)."""
    if report.get("audit") is not True:
        raise ValueError(f"{where}: not a dpbert audit result (expected 'audit': true)")
    missing = [
        k
        for k in (
            "kind",
            "epsilon_claimed",
            "delta",
            "epsilon_lower_bound",
            "confidence",
            "num_canaries",
            "num_guesses",
            "num_correct",
            "date",
            "recipe",
        )
        if k not in report
    ]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (rerun `dpbert audit` to write a complete audit.json)")
    used = report["kind"] in AUDIT_KINDS_ON_PRIVATE_DATA
    release_delta = guarantee.total_delta or 0.0
    try:
        epsilon_claimed, delta = float(report["epsilon_claimed"]), float(report["delta"])
        return AuditedFigure(
            scope=guarantee.scope,
            kind=report["kind"],
            epsilon_claimed=epsilon_claimed,
            delta=delta,
            epsilon_release=guarantee.epsilon,
            delta_release=release_delta,
            private_data_used=used,
            epsilon_with_audit=guarantee.epsilon + (epsilon_claimed if used else 0.0),
            delta_with_audit=release_delta + (delta if used else 0.0),
            epsilon_lower_bound=float(report["epsilon_lower_bound"]),
            confidence=float(report["confidence"]),
            num_canaries=int(report["num_canaries"]),
            num_guesses=int(report["num_guesses"]),
            num_correct=int(report["num_correct"]),
            date=str(report["date"]),
            recipe=redact_paths(str(report["recipe"])),
        )
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


def add_audit(
    release_dir: str | os.PathLike[str],
    report: Mapping[str, Any] | str | os.PathLike[str],
    *,
    scope: str = "pretraining",
) -> AuditedFigure:
    """Add an audit result (an audit.json path or its object) to the release at `release_dir` as an
    audited figure for the guarantee `scope` (see the module docstring); returns the figure."""
    folder = Path(release_dir)
    report, where = _read_report(report)
    if report.get("kind") == "exposure":
        raise ValueError(f"{where}: an exposure measurement, not a lower bound: add it with `add_exposure`")
    data, guarantee = _audited_guarantee(folder, scope)
    figure = figure_from_report(report, guarantee=guarantee, where=where)
    if not math.isclose(figure.epsilon_claimed, guarantee.epsilon, rel_tol=EPSILON_RTOL):
        raise ValueError(
            f"{where}: epsilon_claimed {figure.epsilon_claimed:.6g} is not within {EPSILON_RTOL:.0%} of the "
            f"release's '{scope}' epsilon {guarantee.epsilon:.6g}: the audit ran a different privacy plan"
        )
    audits = [a for a in data.get(AUDITS_KEY) or () if (a.get("scope"), a.get("kind")) != (scope, figure.kind)]
    audits.append(figure.to_dict())
    _rewrite_atomically(
        folder, {**data, AUDITS_KEY: audits}, lambda card: with_audits(card, audits, where=str(folder / CARD_FILE))
    )
    return figure


def add_exposure(
    release_dir: str | os.PathLike[str],
    report: Mapping[str, Any] | str | os.PathLike[str],
    *,
    scope: str = "pretraining",
) -> ExposureMeasurement:
    """Add a `dpbert audit --kind exposure` result (an audit.json path or its object) to the release at
    `release_dir` as its exposure measurement for the guarantee `scope` (replacing an earlier one),
    with the same refusals as `add_audit`; returns the measurement."""
    folder = Path(release_dir)
    report, where = _read_report(report)
    if report.get("audit") is not True or report.get("kind") != "exposure":
        raise ValueError(f"{where}: not a dpbert exposure audit result (expected 'audit': true, 'kind': 'exposure')")
    data, guarantee = _audited_guarantee(folder, scope)
    fields = ("date", "prefix", "num_candidates", "repetitions", "steps", "steps_nonprivate")
    missing = [k for k in (*fields, "recipe", "epsilon", "delta", "secrets", "summary", "ties") if k not in report]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (rerun `dpbert audit --kind exposure`)")
    try:
        measurement = ExposureMeasurement(
            scope=scope,
            recipe=redact_paths(str(report["recipe"])),
            **{k: report[k] for k in fields},
            epsilon_audit_run=report["epsilon"],
            delta_audit_run=report["delta"],
            epsilon_release=guarantee.epsilon,
            delta_release=guarantee.total_delta or 0.0,
            secrets=[
                {k: s[k] for k in ("repetitions", "exposure_dp", "exposure_nonprivate")} for s in report["secrets"]
            ],
            summary=report["summary"],
            ties=report["ties"],
        )
    except (TypeError, KeyError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from err
    if not math.isclose(measurement.epsilon_audit_run, guarantee.epsilon, rel_tol=EPSILON_RTOL):
        raise ValueError(
            f"{where}: epsilon {measurement.epsilon_audit_run:.6g} of the audit's DP run is not within "
            f"{EPSILON_RTOL:.0%} of the release's '{scope}' epsilon {guarantee.epsilon:.6g}: the audit ran a "
            "different privacy plan"
        )
    entry = measurement.to_dict()
    _rewrite_atomically(
        folder, {**data, EXPOSURE_KEY: entry}, lambda card: with_exposure(card, entry, where=str(folder / CARD_FILE))
    )
    return measurement


def _read_report(report: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[Mapping[str, Any], str]:
    """(the audit.json object, how to name it in errors) from a path or an object."""
    if not isinstance(report, (str, os.PathLike)):
        return report, "audit result"
    where = str(report)
    try:
        data = json.loads(Path(report).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    return data, where


def _audited_guarantee(folder: Path, scope: str) -> tuple[dict[str, Any], Guarantee]:
    """(privacy.json, its private guarantee `scope`) of a release that verifies; ValueError otherwise."""
    before = verify_folder(folder)
    if not before.ok:
        raise ValueError(f"{folder}: the release does not verify, so no audit is added to it:\n{before.summary()}")
    data = read_privacy_json(folder)
    guarantees = {g.scope: g for g in guarantees_from_json(data, str(folder / PRIVACY_FILE))}
    if scope not in guarantees:
        raise ValueError(f"scope: the release has guarantees for {sorted(guarantees)}, not {scope!r}")
    if not guarantees[scope].private:
        raise ValueError(
            f"scope: the release's '{scope}' guarantee is not private (epsilon infinity): nothing to audit"
        )
    return data, guarantees[scope]


def _rewrite_atomically(folder: Path, privacy: dict[str, Any], edit_card: Callable[[str], str]) -> None:
    with replace_dir(folder) as tmp:
        # Hard links: weights are not copied; the two files changed are replaced by rename, never
        # written through a link, so the live release is untouched until the swap.
        shutil.copytree(folder, tmp, copy_function=_link_or_copy, dirs_exist_ok=True)
        write_json(tmp / PRIVACY_FILE, privacy, sort_keys=False)
        card = tmp / CARD_FILE
        write_text(card, edit_card(card.read_text(encoding="utf-8")))
        after = verify_folder(tmp)
        if not after.ok:
            raise ValueError(f"{folder}: adding the audit would break verification:\n{after.summary()}")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
