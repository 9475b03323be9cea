"""What a fine-tuned model carries: the source checkpoint's guarantees (verified), the task's own,
and the dpbert release (Hugging Face folder, `privacy.json`, model card) written from them.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dpbert.config.finetune import (
    DPPlan,
    FinetuneConfig,
)
from dpbert.data import glue
from dpbert.release import CardInfo, Guarantee, ReleaseMetadata, write_release
from dpbert.release.metadata import (
    PRIVACY_FILE,
    guarantees_from_json,
    noise_record,
    read_privacy_json,
)


def config_record(config: FinetuneConfig) -> dict[str, Any]:
    """`config` as plain YAML/JSON data (tuples as lists)."""

    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return [plain(v) for v in x] if isinstance(x, list | tuple) else x

    return plain(dataclasses.asdict(config))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourcePrivacy:
    """What the fine-tuned model inherits from its source checkpoint: guarantees and vocabulary."""

    guarantees: tuple[Any, ...]  # dpbert.release.Guarantee
    vocabulary_origin: str
    vocabulary_covered: bool
    vocabulary_learned_from_private_data: bool | None = None
    vocabulary_kind: str | None = None  # the source's `vocabulary.source` (packaged/declared/dp/train/unknown)


def source_privacy(model_dir: Path, model: str) -> SourcePrivacy:
    """The source checkpoint's guarantees (its verified `privacy.json`), or, for a checkpoint
    without dpbert privacy metadata, one "pretraining" guarantee marked NOT private."""

    if not (model_dir / PRIVACY_FILE).is_file():
        # Nothing is known about how its pretraining data was used, so nothing is claimed.
        unknown = f"unknown (the source checkpoint {model_name(model)} has no dpbert privacy metadata)"
        return SourcePrivacy(
            guarantees=(Guarantee.non_private(scope="pretraining", data=unknown),),
            vocabulary_origin=f"Its origin is not recorded (the source checkpoint {model_name(model)} has no "
            "dpbert privacy metadata)",
            vocabulary_covered=False,
        )
    # resolve_pretrained has verified this file: every stated epsilon is its ledger's.
    data = read_privacy_json(model_dir)
    vocabulary = data.get("vocabulary") or {}
    return SourcePrivacy(
        guarantees=tuple(guarantees_from_json(data, str(model_dir / PRIVACY_FILE))),
        vocabulary_origin=str(vocabulary.get("origin") or "Its origin is not recorded"),
        vocabulary_covered=vocabulary.get("covered") is True,
        vocabulary_learned_from_private_data=vocabulary.get("learned_from_private_data"),
        vocabulary_kind=vocabulary.get("source"),
    )


def model_name(model: str) -> str:
    """A local folder's name, or a Hub id as is (local paths stay out of cards)."""
    return Path(model).name if Path(model).exists() else model


def task_scope(task: glue.GlueTask) -> str:
    return f"fine-tuning ({task.name})"


def export_model(
    out: Path,
    *,
    net: Any,
    tokenizer: Any,
    task: glue.GlueTask,
    model: str,
    config: FinetuneConfig,
    source: SourcePrivacy,
    n: int,
    plan: DPPlan | None,
    dev: Mapping[str, Mapping[str, float]],
    randomness: str | None,
    trained_parameters: int,
    trained: Mapping[str, Any] | None = None,
    sweep: Mapping[str, Any] | None = None,
) -> Any:
    """Write OUT/model with `write_release`; returns its `ReleaseMetadata`. `randomness`: where
    the DP secret came from (None when non-private); `trained_parameters`: the noised coordinates."""

    data = f"GLUE {task.glue_dir} training set ({n} examples)"
    scope = task_scope(task)
    task_guarantee = (
        Guarantee.from_ledger(
            scope=scope,
            data=data,
            ledger=plan.ledger.to_dict(),
            randomness={"source": randomness},
            noise=noise_record(plan.ledger.to_dict(), coordinates=trained_parameters),
        )
        if plan is not None
        else Guarantee.non_private(scope=scope, data=data)
    )
    vocabulary_origin, vocabulary_covered = source.vocabulary_origin, source.vocabulary_covered
    learned, kind = source.vocabulary_learned_from_private_data, source.vocabulary_kind
    if config.tokenizer is not None:
        # Its origin is not recorded: it may have been learned from private data, so it is not public.
        vocabulary_origin = "A tokenizer given for fine-tuning (config.tokenizer); its origin is not recorded"
        vocabulary_covered, learned, kind = False, True, "unknown"
    meta = ReleaseMetadata(
        guarantees=(*source.guarantees, task_guarantee),
        vocabulary_origin=vocabulary_origin,
        vocabulary_covered=vocabulary_covered,
        vocabulary_learned_from_private_data=learned,
        vocabulary_kind=kind,
        recipe_name="finetune.yaml",
        recipe_content=yaml.safe_dump(config_record(config), sort_keys=False),
    )
    cfg = net.config
    labels = ", ".join(task.label_names) if task.label_names else "one regression output (score 0-5)"
    is_hub_id = not Path(model).exists()
    info = CardInfo(
        model_name=f"{model_name(model).split('/')[-1]}-{task.name}" + ("-dp" if plan is not None else ""),
        base_model=model if is_hub_id else None,
        architecture=(
            f"Architecture: BERT, {cfg.num_hidden_layers} layers, hidden size {cfg.hidden_size}, "
            f"{cfg.num_attention_heads} attention heads, vocabulary {cfg.vocab_size}; classification head for "
            f"GLUE {task.glue_dir} ({labels}), inputs up to {config.max_seq_len} tokens." + trained_text(trained, sweep)
        ),
        reproduce_command=(
            f"dpbert finetune --task {task.name} --model {model if is_hub_id else 'SOURCE_MODEL_DIR'} "
            f"--data-dir {task.glue_dir.upper()}_DIR --recipe finetune.yaml --output-dir OUT"
        ),
        eval_dataset=f"GLUE {task.glue_dir} dev set" + ("s" if len(dev) > 1 else ""),
        eval_metrics={f"{split} {name}": value for split, metrics in dev.items() for name, value in metrics.items()},
        template="bert_glue.md.j2",
        pipeline_tag="text-classification",
        model_index_results=tuple(
            {
                "task": {"type": "text-classification", "name": "Text Classification"},
                "dataset": {
                    "type": "nyu-mll/glue",
                    "name": f"GLUE {task.glue_dir}",
                    "config": task.name,
                    "split": split,
                },
                "metrics": [
                    {"type": name, "value": float(value), "name": f"{split} {name}"} for name, value in metrics.items()
                ],
            }
            for split, metrics in dev.items()
        ),
    )
    with tempfile.TemporaryDirectory(dir=out, prefix=".tokenizer-") as tok_dir:
        tokenizer.save_pretrained(tok_dir)
        write_release(out / "model", model=net, meta=meta, info=info, tokenizer_dir=tok_dir, overwrite=True)
    return meta


def trained_text(trained: Mapping[str, Any] | None, sweep: Mapping[str, Any] | None) -> str:
    """What the card says was trained (and, after a sweep, how the model was chosen)."""
    text = ""
    if trained is not None:
        merged = "; LoRA merged into the weights" if trained["subset"] == "lora" else ""
        text += (f" Fine-tuned: {trained['description']} ({trained['parameters']:,} of "
                 f"{trained['total_parameters']:,} parameters{merged}).")  # fmt: skip
    if sweep:
        rates = ", ".join(format(r["learning_rate"], "g") for r in sweep["runs"])
        text += (f" Chosen from {len(sweep['runs'])} DP runs (learning rates {rates}) by {sweep['selected_by']}; "
                 "the task guarantee composes all of them (Papernot and Steinke 2022).")  # fmt: skip
    return text
