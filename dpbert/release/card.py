"""Model cards (README.md) rendered from the Jinja2 templates in `dpbert/release/templates/` (package data).

The YAML front matter is built here as data (so it is always valid YAML that
`huggingface_hub.ModelCard.load` parses): `library_name: transformers`, `pipeline_tag` (`fill-mask`
unless `CardInfo.pipeline_tag` says otherwise, e.g. `text-classification` for a fine-tuned classifier),
tags, a `differential_privacy` block with every guarantee (scope, data, private, epsilon (`.inf` when not
private), delta, accountant, privacy_unit, sampling, dataset_size, and truncation_delta when Poisson
samples were truncated) and a `model-index` entry with the
held-out masked-LM accuracy and any `CardInfo.model_index_results` (e.g. GLUE dev metrics). The body
comes from a Jinja2 template. A release that is not private gets no `differential-privacy`/`dp-sgd`
tags and says plainly that epsilon is infinity.

`with_audits` adds empirical audit figures (`dpbert.release.audited`) to an existing card: a
`differential_privacy.audits` list in the front matter and a section labelled as an empirical lower
bound, not a guarantee (template `audit_section.md.j2`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from dpbert.release.metadata import ReleaseMetadata

CARD_FILE = "README.md"
DEFAULT_TEMPLATE = "bert_mlm.md.j2"
DP_TAGS = ("differential-privacy", "dp-sgd")
TEMPLATES = "templates"  # package data folder of dpbert.release
AUDIT_TEMPLATE = "audit_section.md.j2"
AUDIT_BEGIN = "<!-- dpbert:audit -->"
AUDIT_END = "<!-- /dpbert:audit -->"
_EVALUATION = re.compile(r"^## Evaluation", re.MULTILINE)
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
    tags = ["bert", info.pipeline_tag, "dpbert"] + (list(DP_TAGS) if meta.private else ["non-private"])
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
    }
    results: list[Mapping[str, Any]] = []
    if info.mlm_accuracy is not None:
        results.append(
            {
                "task": {"type": "fill-mask", "name": "Masked language modeling"},
                "dataset": {"type": "held-out", "name": info.eval_dataset},
                "metrics": [
                    {
                        "type": "accuracy",
                        "value": float(info.mlm_accuracy),
                        "name": "held-out masked-LM accuracy",
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


def _environment() -> Any:
    import jinja2

    env = jinja2.Environment(
        # Package data, found through importlib.resources: works from a wheel, not only a checkout.
        loader=jinja2.PackageLoader("dpbert.release", TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # Markdown, not HTML
    )
    env.filters["num"] = _format_number
    env.filters["eps"] = lambda e: "infinity" if math.isinf(e) else f"{e:.4g}"
    return env


def render_card(meta: ReleaseMetadata, info: CardInfo) -> str:
    """README.md text: YAML front matter plus the body rendered from the template `info.template`."""
    matter = yaml.safe_dump(front_matter(meta, info), sort_keys=False, allow_unicode=True)
    return _environment().get_template(info.template).render(front_matter=matter, meta=meta, info=info)


def with_audits(card_text: str, audits: Sequence[Mapping[str, Any]], *, where: str = CARD_FILE) -> str:
    """`card_text` with its audited figures replaced by `audits` (dicts of `AuditedFigure.to_dict()`).

    The front matter gets `differential_privacy.audits` (the dicts as they are); the body gets the
    section rendered from the template `audit_section.md.j2` between `AUDIT_BEGIN`/`AUDIT_END`
    markers, replacing an earlier one, else inserted before `## Evaluation` (else appended). The rest
    of the body is kept as it is. With no audits, both are removed.
    """
    match = _FRONT_MATTER.match(card_text)
    if match is None:
        raise ValueError(f"{where}: no YAML front matter (expected the card to start with '---')")
    data = yaml.safe_load(match.group(1))
    block = data.get("differential_privacy") if isinstance(data, dict) else None
    if not isinstance(block, dict):
        raise ValueError(f"{where}: front matter has no 'differential_privacy' mapping to add the audit to")
    if audits:
        block["audits"] = [dict(a) for a in audits]
    else:
        block.pop("audits", None)
    matter = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    body = card_text[match.end() :]
    start, end = body.find(AUDIT_BEGIN), body.find(AUDIT_END)
    if start >= 0 and end > start:
        body = body[:start] + body[end + len(AUDIT_END) :].lstrip("\n")
    if audits:
        section = _environment().get_template(AUDIT_TEMPLATE).render(audits=list(audits))
        section = f"{AUDIT_BEGIN}\n{section.rstrip()}\n{AUDIT_END}\n\n"
        at = _EVALUATION.search(body)
        body = body[: at.start()] + section + body[at.start() :] if at else body.rstrip("\n") + "\n\n" + section
    return f"---\n{matter}---\n{body}"


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
