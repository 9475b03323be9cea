"""Model cards (README.md) rendered from the Jinja2 templates of the top-level `model_cards/` folder.

The front matter is built here as data (always valid YAML that `huggingface_hub.ModelCard.load`
parses); the body's guarantee sections sit between `<!-- dpbert:begin NAME -->` markers and are
re-rendered by `dpbert verify`; `with_audits` adds audited figures in a section labelled an
empirical lower bound, not a guarantee; `with_exposure` a memorization measurement, likewise.

Guarantees: every privacy claim of a card comes from privacy.json through the templates; the DP
tags appear exactly when every guarantee is private and the vocabulary was not learned from the
private data outside them. The card's contract field by field: model_cards/README.md.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import yaml

from dpbert.release.metadata import (
    DOCUMENT_UNIT,
    OS_CSPRNG,
    PRIVACY_UNIT,
    SUPPLIED_FILE,
    Guarantee,
    ReleaseMetadata,
    epsilon_from_json,
)

CARD_FILE = "README.md"
DEFAULT_TEMPLATE = "bert_mlm.md.j2"
DP_TAGS = ("differential-privacy", "dp-sgd")
NON_PRIVATE_TAG = "non-private"
NON_PRIVATE_VOCABULARY_TAG = "non-private-vocabulary"
# The templates: package `dpbert.model_cards` (the top-level model_cards/ folder, mapped in pyproject.toml).
TEMPLATE_PACKAGE = "dpbert.model_cards"
AUDIT_TEMPLATE = "audit_section.md.j2"
AUDIT_BEGIN = "<!-- dpbert:audit -->"
AUDIT_END = "<!-- /dpbert:audit -->"
EXPOSURE_TEMPLATE = "exposure_section.md.j2"
EXPOSURE_BEGIN = "<!-- dpbert:exposure -->"
EXPOSURE_END = "<!-- /dpbert:exposure -->"
_EVALUATION = re.compile(r"^## Evaluation", re.MULTILINE)
# The sections of a card that state its guarantee, each the rendering of a partial template from the
# privacy metadata alone, between markers that name the partial: `dpbert verify` renders them again
# from privacy.json and compares them with the card's body.
SECTION_BEGIN = "<!-- dpbert:begin {} -->"
SECTION_END = "<!-- dpbert:end {} -->"
GUARANTEE_SECTIONS = {
    "bert_mlm.md.j2": ("_claim_mlm.md.j2", "_privacy_mlm.md.j2"),
    "bert_glue.md.j2": ("_claim_glue.md.j2", "_privacy_glue.md.j2"),
}
_SECTION = re.compile(r"<!-- dpbert:begin (\S+) -->\n(.*?)<!-- dpbert:end \1 -->", re.DOTALL)
_FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*(?:\n|\Z)", re.DOTALL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CardInfo:
    """What the card says beyond the privacy metadata.

    `mlm_accuracy` is the held-out masked-LM accuracy in [0, 1] (None: not evaluated); `eval_metrics`
    are other held-out numbers shown as they are; `reproduce_command` is the shell command that reruns
    the recipe.
    """

    model_name: str
    architecture: str
    reproduce_command: str
    repo_id: str | None = None
    base_model: str | None = None
    language: str = "en"
    license: str = "apache-2.0"
    mlm_accuracy: float | None = None
    eval_dataset: str = "held-out split"
    eval_metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    limitations: tuple[str, ...] = ()
    template: str = DEFAULT_TEMPLATE
    pipeline_tag: str = "fill-mask"
    model_index_results: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("CardInfo.model_name: expected a non-empty name")
        if not self.reproduce_command:
            raise ValueError("CardInfo.reproduce_command: expected the command that reproduces the run")
        if self.mlm_accuracy is not None and not 0.0 <= self.mlm_accuracy <= 1.0:
            raise ValueError(f"CardInfo.mlm_accuracy: expected a fraction in [0, 1], got {self.mlm_accuracy}")


def front_matter(meta: ReleaseMetadata, info: CardInfo) -> dict[str, Any]:
    """The card's metadata as a dict (what `ModelCard.load(...).data.to_dict()` gives back)."""
    tags = ["bert", info.pipeline_tag, "dpbert"] + (list(DP_TAGS) if meta.fully_private else [NON_PRIVATE_TAG])
    if not meta.vocabulary_private:
        tags.append(NON_PRIVATE_VOCABULARY_TAG)
    data: dict[str, Any] = {
        "language": info.language,
        "license": info.license,
        "library_name": "transformers",
        "pipeline_tag": info.pipeline_tag,
        "tags": tags,
    }
    if info.base_model:
        data["base_model"] = info.base_model
    data["differential_privacy"] = {
        "private": meta.private,
        "guarantees": [g.summary() for g in meta.guarantees],
        "vocabulary": meta.vocabulary_copy(),
    }
    results: list[Mapping[str, Any]] = []
    if info.mlm_accuracy is not None:
        evaluation = meta.evaluation or {}
        public = evaluation.get("public") is True
        results.append(
            {
                "task": {"type": "fill-mask", "name": "Masked language modeling"},
                "dataset": {"type": str(evaluation.get("corpus")) if public else "held-out", "name": info.eval_dataset},
                "metrics": [
                    {
                        "type": "accuracy",
                        "value": float(info.mlm_accuracy),
                        "name": "masked-LM accuracy"
                        if public
                        else "held-out masked-LM accuracy"
                        + (
                            " (private data, no noise: not covered by the guarantee)"
                            if evaluation.get("included")
                            else ""
                        ),
                    }
                ],
            }
        )
    results += [dict(r) for r in info.model_index_results]
    if results:
        data["model-index"] = [{"name": info.model_name, "results": results}]
    return data


def _format_number(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "infinity" if math.isinf(value) else f"{value:.4g}"
    return str(value)


def _count(value: Any) -> str:
    """A count for prose: 37000 -> '37,000'; a float to 3 significant digits."""
    if isinstance(value, float):
        return f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


_DATASET_SIZE_SOURCES = {
    "declared": "declared in the recipe before the data was seen (`privacy.dataset_size`)",
    "rounded": "the true count rounded down to 2 significant digits; every stored sequence is sampled at q = B/N",
    "exact": "the true count, treated as public",
    "unrecorded": "source not recorded: it may be the exact count of the private data",
}


def dataset_size_text(g: Guarantee) -> str:
    """'37,000 (public: the true count rounded down ...)' for a guarantee with a ledger."""
    n = (g.ledger or {}).get("dataset_size")
    source = _DATASET_SIZE_SOURCES.get(str(g.dataset_size_source), str(g.dataset_size_source))
    if (g.ledger or {}).get("privacy_unit") == DOCUMENT_UNIT:
        return f"{_count(n)} documents (public: {source.replace('sequences', 'documents')})"
    return f"{_count(n)} (public: {source})"


def dataset_size_bound_text(g: Guarantee) -> str:
    """The ledger's public upper bound on the stored units, for the card."""
    ledger = g.ledger or {}
    noun = "documents" if ledger.get("privacy_unit") == DOCUMENT_UNIT else "sequences"
    return (
        f"at most {_count(ledger.get('dataset_size_bound'))} stored {noun} (a public bound, fixed without looking "
        "at the data): every stored unit is Poisson-sampled at q = B/N, and the truncation of the sample at the "
        "physical batch is accounted for a store of that size; a larger store is refused"
    )


def unit_text(g: Guarantee) -> str:
    """What one privacy unit is, in public figures only: sequence length; for a document-level
    guarantee the declared cap on sequences per document; for a sequence-level one what group privacy
    gives a document of a few public sizes (never the corpus' own document lengths)."""
    unit = g.unit or {}
    ledger = g.ledger or {}
    tokens = unit.get("sequence_tokens")
    cap = ledger.get("max_sequences_per_document")
    if ledger.get("privacy_unit") == DOCUMENT_UNIT:
        return (
            f"one document, all its sequences{'' if tokens is None else f' of {tokens} tokens'} together "
            f"(at most {_count(cap)} of them, chosen at random, enter a step; their summed gradient is clipped as "
            f"one; a longer document contributes at most {_count(cap)} sequences per step: a cap declared in the "
            "recipe, not a count of the data)"
        )
    if g.scope.startswith("fine-tuning"):
        return (
            f"{ledger.get('privacy_unit', PRIVACY_UNIT)}: one task example, which is a whole document here "
            "(a GLUE example is one sentence or sentence pair)"
        )
    if tokens is None:
        return str(ledger.get("privacy_unit", PRIVACY_UNIT))
    text = f"one sequence of {tokens} tokens"
    group = document_group_text(g)
    if group is None:
        return f"{text}; a document that spans several sequences is protected only as a group (not computed here)"
    return f"{text}; {group}"


def _group_entries(g: Guarantee) -> list[tuple[int, float]]:
    table = (g.unit or {}).get("group_epsilon")
    if not isinstance(table, list):
        return []
    return [
        (int(row["sequences"]), epsilon_from_json(row["epsilon"], "unit.group_epsilon"))
        for row in table
        if isinstance(row, Mapping) and "sequences" in row and "epsilon" in row
    ]


def document_group_text(g: Guarantee) -> str | None:
    """For a sequence-level guarantee: what group privacy gives a whole document of each public size
    of its `unit.group_epsilon` table (None when there is none)."""
    if (g.ledger or {}).get("privacy_unit") == DOCUMENT_UNIT:
        return None
    entries = _group_entries(g)
    if not entries:
        return None
    if all(math.isinf(eps) for _, eps in entries) and g.vocabulary is not None:
        return (
            "a whole document of 2 or more sequences has NO guarantee computed (the DP vocabulary's word selection "
            "is calibrated for the words of one unit, not of a document)"
        )
    parts = [
        f"{k} sequences: " + ("no meaningful guarantee (no epsilon below 100)" if math.isinf(eps) else f"{eps:.4g}")
        for k, eps in entries
    ]
    return (
        "a whole document is protected only by group privacy (computed by dp_accounting as a mixture of Gaussians, "
        f"same delta): epsilon for a document of {', '.join(parts)}; the documents of this corpus may be longer "
        "(their lengths are private and not published)"
    )


def evaluation_text(meta: ReleaseMetadata) -> str:
    """What the card's privacy section says about the held-out figures (from `meta.evaluation`)."""
    ev = meta.evaluation
    if ev is None:
        return "None is part of this release."
    not_covered = list(ev.get("not_covered") or ())
    if ev.get("public"):
        text = (
            f"The figures below are computed on {ev.get('corpus')}, a public evaluation corpus named in the recipe "
            "(`data.eval_corpus`), not on the private data."
        )
        if not_covered:
            text += (
                f" Except {', '.join(not_covered)}: computed with the private training data, without noise, and "
                "**not covered by the guarantee**; the exporter asked for it (`--include-private-metrics`)."
            )
        return text
    if ev.get("included"):
        return (
            "The figures below were computed without noise on the held-out split of the private corpus: they are "
            "**not covered by the guarantee** and reveal something about the private data; the exporter asked for "
            "them (`dpbert export --include-private-metrics`)."
        )
    return (
        "Held-out figures computed without noise on the held-out split of the private corpus are not covered by "
        "the guarantee, so they are left out of this release (`dpbert export --include-private-metrics` includes "
        "them, labelled)."
    )


def vocabulary_text(g: Guarantee) -> str:
    """How a DP vocabulary in `g`'s ledger was learned and what it spent (empty without one)."""
    v = g.vocabulary
    if v is None:
        return ""
    k, sigma = int(v["words_per_unit"]), float(v["noise_multiplier"])
    std = sigma * math.sqrt(k)
    return (
        f"learned from this data under DP (Gaussian partition selection): each unit ({v['unit']}) adds 1 to at "
        f"most {k} distinct words, every count gets Gaussian noise of std {std:.4g} (noise multiplier "
        f"{sigma:.4g} for L2 sensitivity sqrt({k})), only counts above the threshold are kept, and WordPiece is "
        f"trained on those noisy counts; the Gaussian alone spends epsilon {float(v['epsilon_share']):.4g} at "
        f"delta {_format_number(g.delta)}, composed into the epsilon above; a word that one unit alone uses "
        f"is kept with probability at most {_format_number(g.selection_delta)} (added to delta)"
    )


def randomness_text(g: Guarantee) -> str:
    source = g.randomness_source
    if source == OS_CSPRNG:
        return (
            "os-csprng: the DP noise and sampling come from a secret drawn from the operating system's CSPRNG, "
            "kept in the run folder and never released (the recipe's public seed does not determine them)"
        )
    if source == SUPPLIED_FILE:
        return (
            "supplied-file: the secret behind the DP noise and sampling was supplied by a file (an audit); "
            "whoever holds that file can regenerate the noise, and the guarantee holds only against others"
        )
    return "unknown: nothing records that the noise was secret; the guarantee cannot be relied on"


def noise_text(g: Guarantee) -> str:
    noise = g.noise or {}
    if not noise:
        return "not recorded"
    bound = noise.get("tail_bound")
    if bound is None:
        return f"{noise.get('sampler')}; no bound on its deviation from the exact Gaussian is recorded"
    below = g.delta is not None and bound <= 1e-3 * g.delta
    return (
        f"{noise.get('sampler')}; its finite tail can add at most {bound:.3g} to delta over the whole run "
        f"({noise.get('coordinates')} coordinates per step): "
        + ("below 1e-3 of delta, so not added" if below else "NOT below 1e-3 of delta (verify fails such a release)")
    )


def _checkout_templates() -> Path:
    """model_cards/ of the source tree this dpbert was imported from (a checkout run without an
    install, or an editable install made before the templates moved there)."""
    return Path(__file__).resolve().parents[2] / "model_cards"


def templates_dir() -> Path:
    """The folder the card templates are loaded from: the model_cards/ of the source checkout this
    dpbert was imported from, else the installed package `dpbert.model_cards` (inside the wheel).
    FileNotFoundError when neither holds them."""

    # The source tree this dpbert was imported from comes first: an editable install of another
    # checkout (a second git worktree on the same environment) maps the package to *its* templates.
    checkout = _checkout_templates()
    if (checkout / DEFAULT_TEMPLATE).is_file() and (checkout.parent / "pyproject.toml").is_file():
        return checkout
    try:
        found = importlib.resources.files(TEMPLATE_PACKAGE)
    except ModuleNotFoundError:
        found = None
    if found is not None and found.joinpath(DEFAULT_TEMPLATE).is_file():
        return Path(str(found))
    if (checkout / DEFAULT_TEMPLATE).is_file():
        return checkout
    raise FileNotFoundError(
        f"model card templates: neither the package {TEMPLATE_PACKAGE} nor {checkout} holds {DEFAULT_TEMPLATE} "
        "(reinstall dpbert: pip install -e .)"
    )


def _template_loader() -> Any:

    return jinja2.FileSystemLoader(str(templates_dir()))


def _cell(value: Any) -> str:
    """Text for a Markdown table cell: '|' escaped (a sampler's '|z| <= 16.36' would split the cell),
    line breaks as spaces."""
    return " ".join(str(value).splitlines()).replace("|", "\\|")


def _environment() -> Any:

    env = jinja2.Environment(
        loader=_template_loader(),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # Markdown, not HTML
    )
    env.filters["num"] = _format_number
    env.filters["eps"] = lambda e: "infinity" if math.isinf(e) else f"{e:.4g}"
    env.filters["count"] = _count
    env.filters["dataset_size_text"] = dataset_size_text
    env.filters["unit_text"] = unit_text
    env.filters["document_group_text"] = document_group_text
    env.filters["dataset_size_bound_text"] = dataset_size_bound_text
    env.filters["evaluation_text"] = evaluation_text
    env.filters["randomness_text"] = randomness_text
    env.filters["noise_text"] = noise_text
    env.filters["vocabulary_text"] = vocabulary_text
    env.filters["cell"] = _cell
    env.filters["log2"] = math.log2
    return env


def render_card(meta: ReleaseMetadata, info: CardInfo) -> str:
    """README.md text: YAML front matter plus the body rendered from the template `info.template`."""
    matter = yaml.safe_dump(front_matter(meta, info), sort_keys=False, allow_unicode=True)
    return _environment().get_template(info.template).render(front_matter=matter, meta=meta, info=info)


def render_section(name: str, meta: ReleaseMetadata) -> str:
    """The guarantee section rendered by the partial template `name` from `meta` alone (what the card
    holds between the section's markers)."""
    return _environment().get_template(name).render(meta=meta)


def card_sections(body: str) -> list[tuple[str, str]]:
    """[(partial template name, text)] of every marked guarantee section of a card body, in order."""
    return [(m.group(1), m.group(2)) for m in _SECTION.finditer(body)]


def render_audit_section(audits: Sequence[Mapping[str, Any]]) -> str:
    """The audit section between (and with) its markers, as `with_audits` writes it; it states per
    scope the private data's total loss with every audit's result (basic composition)."""
    totals: dict[str, list[float]] = {}
    for a in audits:
        total = totals.setdefault(a["scope"], [a["epsilon_release"], a["delta_release"]])
        if a["private_data_used"]:
            total[0] += a["epsilon_claimed"]
            total[1] += a["delta"]
    section = _environment().get_template(AUDIT_TEMPLATE).render(audits=list(audits), totals=totals)
    return f"{AUDIT_BEGIN}\n{section.rstrip()}\n{AUDIT_END}\n\n"


def render_exposure_section(exposure: Mapping[str, Any]) -> str:
    """The exposure section between (and with) its markers, as `with_exposure` writes it."""
    section = _environment().get_template(EXPOSURE_TEMPLATE).render(e=dict(exposure))
    return f"{EXPOSURE_BEGIN}\n{section.rstrip()}\n{EXPOSURE_END}\n\n"


def outside_sections(body: str) -> str:
    """`body` without its marked guarantee sections, its audit section and its exposure section: the
    free text of a card."""
    body = _without_marked(_SECTION.sub("", body), AUDIT_BEGIN, AUDIT_END)
    return _without_marked(body, EXPOSURE_BEGIN, EXPOSURE_END)


def card_body(card_text: str, *, where: str = CARD_FILE) -> str:
    """The Markdown body of a card (after its YAML front matter); ValueError without front matter."""
    match = _FRONT_MATTER.match(card_text)
    if match is None:
        raise ValueError(f"{where}: no YAML front matter (expected the card to start with '---')")
    return card_text[match.end() :]


def with_audits(card_text: str, audits: Sequence[Mapping[str, Any]], *, where: str = CARD_FILE) -> str:
    """`card_text` with its audited figures replaced by `audits` (dicts of `AuditedFigure.to_dict()`).

    The front matter gets `differential_privacy.audits` (the dicts as they are); the body gets the
    section rendered from the template `audit_section.md.j2` between `AUDIT_BEGIN`/`AUDIT_END`
    markers, replacing an earlier one, else inserted before `## Evaluation` (else appended). The rest
    of the body is kept as it is. With no audits, both are removed.
    """
    section = render_audit_section(audits) if audits else None
    value = [dict(a) for a in audits] if audits else None
    return _with_marked(card_text, "audits", value, (AUDIT_BEGIN, AUDIT_END), section, where=where)


def with_exposure(card_text: str, exposure: Mapping[str, Any] | None, *, where: str = CARD_FILE) -> str:
    """`card_text` with its exposure measurement replaced by `exposure` (`ExposureMeasurement.to_dict()`),
    as `with_audits` does: `differential_privacy.exposure` in the front matter and the section of
    `exposure_section.md.j2` between `EXPOSURE_BEGIN`/`EXPOSURE_END`; None removes both."""
    section = render_exposure_section(exposure) if exposure else None
    value = dict(exposure) if exposure else None
    return _with_marked(card_text, "exposure", value, (EXPOSURE_BEGIN, EXPOSURE_END), section, where=where)


def _with_marked(
    card_text: str, key: str, value: Any, markers: tuple[str, str], section: str | None, *, where: str
) -> str:
    """`card_text` with front-matter `differential_privacy.<key>` set to `value` (removed when None) and
    the body's section between `markers` replaced by `section` (removed when None; a new one goes
    before `## Evaluation`, else at the end)."""
    match = _FRONT_MATTER.match(card_text)
    if match is None:
        raise ValueError(f"{where}: no YAML front matter (expected the card to start with '---')")
    data = yaml.safe_load(match.group(1))
    block = data.get("differential_privacy") if isinstance(data, dict) else None
    if not isinstance(block, dict):
        raise ValueError(f"{where}: front matter has no 'differential_privacy' mapping to add the audit to")
    if value is not None:
        block[key] = value
    else:
        block.pop(key, None)
    matter = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    body = _without_marked(card_text[match.end() :], *markers, strip=True)
    if section is not None:
        at = _EVALUATION.search(body)
        body = body[: at.start()] + section + body[at.start() :] if at else body.rstrip("\n") + "\n\n" + section
    return f"---\n{matter}---\n{body}"


def _without_marked(body: str, begin: str, end: str, *, strip: bool = False) -> str:
    start, stop = body.find(begin), body.find(end)
    if start >= 0 and stop > start:
        rest = body[stop + len(end) :]
        body = body[:start] + (rest.lstrip("\n") if strip else rest)
    return body


def read_front_matter(card_path: Path) -> dict[str, Any]:
    """The YAML front matter of a card; ValueError names the file when it is missing or invalid."""
    text = Path(card_path).read_text(encoding="utf-8")
    match = _FRONT_MATTER.match(text)
    if match is None:
        raise ValueError(f"{card_path}: no YAML front matter (expected the card to start with '---')")
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError as err:
        raise ValueError(f"{card_path}: invalid YAML front matter ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{card_path}: YAML front matter is not a mapping")
    return data
