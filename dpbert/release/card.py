"""Model cards (README.md) rendered from the templates in `model_cards/`.

The YAML front matter is built here as data (so it is always valid YAML that
`huggingface_hub.ModelCard.load` parses): `library_name: transformers`, `pipeline_tag` (`fill-mask`
unless `CardInfo.pipeline_tag` says otherwise, e.g. `text-classification` for a fine-tuned classifier),
tags, a `differential_privacy` block with every guarantee (scope, data, private, epsilon (`.inf` when not
private), delta, accountant, privacy_unit, sampling, dataset_size, and truncation_delta when Poisson
samples were truncated) and a `model-index` entry with the
held-out masked-LM accuracy and any `CardInfo.model_index_results` (e.g. GLUE dev metrics). The body
comes from a Jinja2 template. A release that is not private gets no `differential-privacy`/`dp-sgd`
tags and says plainly that epsilon is infinity.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dpbert.release.metadata import ReleaseMetadata

CARD_FILE = "README.md"
DEFAULT_TEMPLATE = "bert_mlm.md.j2"
DP_TAGS = ("differential-privacy", "dp-sgd")
_FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*(?:\n|\Z)", re.DOTALL)


def templates_dir() -> Path:
    """The `model_cards/` folder at the top of the dpbert source tree."""
    return Path(__file__).resolve().parents[2] / "model_cards"


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


def render_card(meta: ReleaseMetadata, info: CardInfo) -> str:
    """README.md text: YAML front matter plus the body rendered from `model_cards/<info.template>`."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # Markdown, not HTML
    )
    env.filters["num"] = _format_number
    env.filters["eps"] = lambda e: "infinity" if math.isinf(e) else f"{e:.4g}"
    matter = yaml.safe_dump(front_matter(meta, info), sort_keys=False, allow_unicode=True)
    return env.get_template(info.template).render(front_matter=matter, meta=meta, info=info)


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
