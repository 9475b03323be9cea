"""The pretraining state: the frozen `TrainState` pytree, and how a recipe makes it.

`TrainState`: `params` and `opt_state` are the array leaves (what jit and Orbax see); `step` (the
number of completed steps) and `ledger_json` (the privacy ledger as canonical JSON text, or the
literal non-private record) are static metadata, so the ledger travels with the arrays it
describes. From a recipe: the `BertConfig`, the AdamW (or DP-AdamBC) optimizer on the recipe's schedule, the
abstract state placed in the mesh's shardings, the state created (or loaded) directly in them,
and the run's keys (from the secret by domain separation when private).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from transformers import BertConfig

from dpbert.config.recipe import Recipe
from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM
from dpbert.privacy.adam_bc import noise_variance_schedule
from dpbert.privacy.dp_step import default_optimizer
from dpbert.privacy.randomness import RunSecret, mechanism_key
from dpbert.privacy.schedule import BatchSchedule
from dpbert.train import distributed
from dpbert.train.mesh import state_shardings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    """Arrays of the run after `step` completed steps, and the privacy ledger that covers them."""

    params: Any
    opt_state: Any
    step: int = dataclasses.field(metadata={"static": True})
    ledger_json: str = dataclasses.field(metadata={"static": True})

    def __post_init__(self) -> None:
        if not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"TrainState.step: expected an integer >= 0, got {self.step!r}")
        try:
            json.loads(self.ledger_json)
        except (TypeError, ValueError):
            raise ValueError("TrainState.ledger_json: expected JSON text") from None

    @property
    def ledger(self) -> dict[str, Any]:
        return json.loads(self.ledger_json)

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)


def ledger_text(ledger: dict[str, Any]) -> str:
    """Canonical JSON for a ledger dict (sorted keys), so equal ledgers compare equal as text."""
    return json.dumps(ledger, sort_keys=True)


def bert_config(recipe: Recipe, tokenizer_vocab_size: int | None = None) -> Any:
    """The recipe's `transformers.BertConfig` (`init_from`'s own config when given);
    `model.vocab_size: null` takes `tokenizer_vocab_size`."""

    m = recipe.model
    if m.init_from is not None:
        return BertConfig.from_pretrained(m.init_from)
    if m.vocab_size is not None and tokenizer_vocab_size is not None and m.vocab_size < tokenizer_vocab_size:
        raise ValueError(
            f"recipe field 'model.vocab_size': {m.vocab_size} is smaller than the tokenizer's {tokenizer_vocab_size} tokens"
        )
    vocab_size = m.vocab_size or tokenizer_vocab_size
    if vocab_size is None:
        raise ValueError(
            "recipe field 'model.vocab_size': needed here (null means the tokenizer's size, which is "
            "only known once the data is prepared)"
        )
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings or recipe.data.seq_len,
        hidden_dropout_prob=m.hidden_dropout_prob,
        attention_probs_dropout_prob=m.attention_probs_dropout_prob,
    )


def make_optimizer(recipe: Recipe, schedule: BatchSchedule | None = None) -> optax.GradientTransformation:
    """The recipe's AdamW (`dpbert.privacy.dp_step.default_optimizer`) on its learning-rate schedule;
    with `optimizer.noise_variance_correction`, DP-AdamBC for the noise of `schedule` (the plan's:
    each stage's noise multiplier and expected batch size, with `privacy.clip_norm`)."""
    o = recipe.optimizer
    noise_variance = None
    if o.noise_variance_correction:
        if schedule is None:
            raise ValueError(
                "recipe field 'optimizer.noise_variance_correction': the optimizer needs the plan's schedule "
                "(each stage's noise multiplier)"
            )
        noise_variance = noise_variance_schedule(schedule, recipe.privacy.clip_norm)
    return default_optimizer(
        learning_rate(recipe),
        weight_decay=o.weight_decay,
        decay_matrices_only=o.decay_matrices_only,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        ema_decay=o.ema_decay,
        noise_variance=noise_variance,
        noise_variance_floor_ratio=o.noise_variance_floor_ratio,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AbstractState:
    """Shapes, dtypes and shardings of a run's params and optimizer state on `mesh` (no arrays)."""

    graphdef: nnx.GraphDef
    params: Any  # ShapeDtypeStructs with their shardings
    opt_state: Any
    build: Callable[[], BertForMaskedLM]

    @property
    def shardings(self) -> tuple[Any, Any]:
        """(params, opt_state) NamedSharding pytrees, as the step takes them."""
        return tuple(jax.tree_util.tree_map(lambda x: x.sharding, tree) for tree in (self.params, self.opt_state))


def abstract_state(recipe: Recipe, config: Any, optimizer: optax.GradientTransformation, mesh: Mesh) -> AbstractState:
    """The run's state as `jax.eval_shape` sees it, placed by `dpbert.train.mesh.state_shardings`."""
    dtype = jnp.bfloat16 if recipe.train.dtype == "bfloat16" else jnp.float32

    def build() -> BertForMaskedLM:
        return BertForMaskedLM(config, rngs=nnx.Rngs(recipe.train.seed), dtype=dtype, remat=recipe.model.remat)

    graphdef, params = functional.split_params(nnx.eval_shape(build))
    opt_state = jax.eval_shape(optimizer.init, params)

    def place(tree: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, state_shardings(tree, mesh)
        )

    return AbstractState(graphdef=graphdef, params=place(params), opt_state=place(opt_state), build=build)


def init_state(recipe: Recipe, abstract: AbstractState, optimizer: optax.GradientTransformation) -> tuple[Any, Any]:
    """Fresh params (random init, or `model.init_from`'s weights) and optimizer state, created
    directly in their shardings: each device computes or receives only its shards."""
    params_sh, opt_sh = abstract.shardings
    m = recipe.model
    if m.init_from is None:
        params = jax.jit(lambda: functional.split_params(abstract.build())[1], out_shardings=params_sh)()
    else:
        dtype = jnp.bfloat16 if recipe.train.dtype == "bfloat16" else jnp.float32
        loaded = BertForMaskedLM.from_pretrained(
            m.init_from,
            dtype=dtype,
            seed=recipe.train.seed,
            hidden_dropout_prob=m.hidden_dropout_prob,
            attention_probs_dropout_prob=m.attention_probs_dropout_prob,
        )
        host = jax.device_get(functional.split_params(loaded)[1])
        params = jax.tree_util.tree_map(distributed.from_host, host, params_sh)
    return params, jax.jit(optimizer.init, out_shardings=opt_sh)(params)


def learning_rate(recipe: Recipe) -> optax.Schedule:
    o, total = recipe.optimizer, recipe.total_steps
    end = o.learning_rate * o.end_learning_rate_fraction
    decay_steps = max(total - o.warmup_steps, 1)
    if o.decay == "constant" and o.cooldown_steps:
        stable = max(decay_steps - o.cooldown_steps, 0)
        cooldown = optax.linear_schedule(o.learning_rate, end, min(o.cooldown_steps, decay_steps))
        decay = optax.join_schedules([optax.constant_schedule(o.learning_rate), cooldown], [stable])
    elif o.decay == "constant":
        decay = optax.constant_schedule(o.learning_rate)
    elif o.decay == "linear":
        decay = optax.linear_schedule(o.learning_rate, end, decay_steps)
    else:
        decay = optax.cosine_decay_schedule(o.learning_rate, decay_steps, alpha=o.end_learning_rate_fraction)
    if o.warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps)
    return optax.join_schedules([warmup, decay], [o.warmup_steps])


def run_keys(recipe: Recipe, secret: RunSecret | None, mechanism: str) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """(masking key, one key per stage): from the secret by domain separation when private,
    else all `jax.random.key(train.seed)` (a non-private run has nothing to hide)."""
    if secret is None:
        key = jax.random.key(recipe.train.seed)
        return key, (key,) * len(recipe.schedule)
    return mechanism_key(secret, f"{mechanism}/masking"), tuple(
        mechanism_key(secret, f"{mechanism}/stage/{i}") for i in range(len(recipe.schedule))
    )
