"""The sequence-classification side of fine-tuning: which parameters a subset trains, the
optimizer on the engine's rule, the per-example loss, the forward pass over (trainable, frozen)
parameters, and dev-set metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpbert.config.finetune import (
    TRAINABLE,
    FinetuneConfig,
    OptimConfig,
    Trainable,
)
from dpbert.data import glue
from dpbert.data.glue_metrics import compute_metrics, predictions_from_logits
from dpbert.model.functional import classifier_logits
from dpbert.model.lora import is_lora_path
from dpbert.privacy.dp_step import default_optimizer


def _is_bias(path: tuple[Any, ...]) -> bool:
    return str(path[-1]) == "bias"


def _is_pooler(path: tuple[Any, ...]) -> bool:
    return len(path) > 1 and path[1] == "pooler"


def trainable_filter(subset: Trainable, *, fresh_pooler: bool = True) -> Callable[[tuple[Any, ...], Any], bool]:
    """nnx filter `(path, value) -> bool` selecting the parameters `subset` trains. The head is
    the classifier, plus the whole pooler when it is `fresh_pooler` (not in the checkpoint)."""

    def head(path: tuple[Any, ...]) -> bool:
        return path[0] == "classifier" or (fresh_pooler and _is_pooler(path))

    if subset == "all":
        return lambda path, value: True
    if subset == "bias":
        return lambda path, value: _is_bias(path) or head(path)
    if subset == "lora":
        return lambda path, value: is_lora_path(path) or head(path)
    if subset == "head":
        return lambda path, value: head(path)
    raise ValueError(f"trainable: expected one of {', '.join(TRAINABLE)}, got {subset!r}")


def describe_trainable(subset: Trainable, config: FinetuneConfig, train_pooler: bool, fresh_pooler: bool) -> str:
    """What `subset` trains, in words (printed and stored in metrics.json)."""
    pooler = "not in the checkpoint" if fresh_pooler else "pretrained"
    head = "classifier" + (f" + pooler ({pooler})" if train_pooler else f" (the {pooler} pooler stays frozen)")
    if subset == "all":
        return "all parameters"
    if subset == "bias":
        return f"bias terms (attention, feed-forward, LayerNorm, pooler) + {head}"
    if subset == "lora":
        lora = config.lora
        return f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)} of every layer + {head}"
    return head


def auto_clipping(subset: Trainable) -> str:
    """The clipping path `clipping: auto` takes for `subset` (speed only: ghost and vmap give the
    same clipped sum, tested): ghost for "all" (no per-example gradient of 22.7M parameters), vmap
    for the subsets, where the two tie within run-to-run spread (docs/RESULTS.md, "Design
    measurements"), so the subsets keep vmap, whose per-example gradients are small."""
    if subset not in TRAINABLE:
        raise ValueError(f"trainable: expected one of {', '.join(TRAINABLE)}, got {subset!r}")
    return "ghost" if subset == "all" else "vmap"


def count_params(params: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


def learning_rate_schedule(optim: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up over `warmup_fraction` of `total_steps`, then linear decay to 0."""
    warmup = int(round(optim.warmup_fraction * total_steps))
    if warmup == 0:
        return optax.linear_schedule(optim.learning_rate, 0.0, max(total_steps, 1))
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, optim.learning_rate, max(warmup, 1)),
            optax.linear_schedule(optim.learning_rate, 0.0, max(total_steps - warmup, 1)),
        ],
        boundaries=[warmup],
    )


def make_optimizer(optim: OptimConfig, total_steps: int, params: nnx.State) -> optax.GradientTransformation:
    """dpbert's AdamW (`dpbert.privacy.dp_step.default_optimizer`: decay on every trained parameter)
    on `learning_rate_schedule`; the head (classifier, pooler) takes `head_lr_multiplier` times
    larger steps than the pretrained body."""
    tx = default_optimizer(
        learning_rate_schedule(optim, total_steps),
        weight_decay=optim.weight_decay,
        b1=optim.b1,
        b2=optim.b2,
        eps=optim.eps,
    )
    if optim.head_lr_multiplier == 1.0:
        return tx
    head = jax.tree_util.tree_map_with_path(
        lambda path, _: (
            getattr(path[0], "key", None) == "classifier" or getattr(path[1], "key", None) == "pooler"
            if len(path) > 1
            else getattr(path[0], "key", None) == "classifier"
        ),
        params,
    )
    return optax.chain(tx, optax.masked(optax.scale(optim.head_lr_multiplier), head))


# ----------------------------------------------------------------------------- loss / eval


def example_loss(task: glue.GlueTask, logits: jax.Array, label: jax.Array) -> jax.Array:
    """Per-example loss: cross-entropy, or squared error for STS-B (as transformers' heads)."""
    if task.is_regression:
        return jnp.square(logits[..., 0].astype(jnp.float32) - label)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), label)


class Forward:
    """Logits as a pure function of (trainable, frozen) params; `graphdef` is static."""

    def __init__(self, graphdef: nnx.GraphDef, frozen: nnx.State) -> None:
        self.graphdef = graphdef
        self.frozen = frozen
        self.inference = jax.jit(lambda trainable, frozen, batch: self(trainable, frozen, batch, None))

    def __call__(self, trainable: nnx.State, frozen: nnx.State, batch: Mapping[str, jax.Array], rng: jax.Array | None):
        params = nnx.merge_state(trainable, frozen)
        return classifier_logits(
            self.graphdef, params, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], rng
        )


def evaluate(
    forward: Forward, trainable: nnx.State, task: glue.GlueTask, data: Mapping[str, np.ndarray], batch_size: int
) -> dict[str, float]:
    """Task metrics of the model on one encoded split (inference mode, no dropout)."""
    n = len(data["labels"])
    batch_size = min(batch_size, n)
    outputs = []
    for start in range(0, n, batch_size):
        idx = np.arange(start, start + batch_size) % n  # pad the last batch to a static shape
        batch = {k: data[k][idx] for k in ("input_ids", "attention_mask", "token_type_ids")}
        outputs.append(np.asarray(forward.inference(trainable, forward.frozen, batch))[: min(batch_size, n - start)])
    preds = predictions_from_logits(task, np.concatenate(outputs))
    return compute_metrics(task, preds, data["labels"])
