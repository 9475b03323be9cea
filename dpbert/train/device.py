"""Device-aware training settings: micro-batch size, compute dtype and ghost layer mode.

`device_settings(recipe, config, ...)`: on a CPU the recipe's own settings (nothing measured); on a
GPU or TPU bfloat16 compute and the micro-batch size and layer mode with the least expected time
over the schedule, timed on placeholder inputs (never on private data); with several processes
nothing is timed (every host must run the same program).

Guarantees: the settings change speed, memory and (bfloat16) the rounding of the forward and
backward passes, never the clipping norm, the noise (float32), the sensitivity or the accounting;
the ledger's physical batches come from the recipe as written, so a run's ledger is the same on
every device. The expected-time model: docs/INTERNALS.md ("dpbert.train.device").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpbert.config.recipe import Recipe, TrainConfig
from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM
from dpbert.model.ghost import MLMGhostLoss
from dpbert.privacy.clipping import grad_sum
from dpbert.privacy.dp_step import clipped_sum_for
from dpbert.privacy.tuning import fastest_microbatch_size

ACCELERATOR_BACKENDS = frozenset({"gpu", "cuda", "rocm", "tpu"})
# Micro-batch sizes tried on an accelerator: large enough to fill one, small enough to compile
# quickly and to waste few rows after the realized batch.
ACCELERATOR_MICROBATCH_SIZES = (32, 64, 128, 256, 512, 1024)
LAYER_MODES = ("mixed", "ghost", "instantiate")
# Share of the device's memory one micro-batch's gradient sum may take (its compiled peak, the
# parameters included): the rest holds the optimizer state, the batch and the step's other buffers.
MEMORY_FRACTION = 0.5


def is_accelerator(backend: str | None = None) -> bool:
    """Whether `backend` (default: JAX's default backend) is a GPU or a TPU."""
    return (backend or jax.default_backend()) in ACCELERATOR_BACKENDS


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSettings:
    """The training settings chosen for one backend, and the measurements behind them (empty
    when nothing was measured: on a CPU, the recipe's own settings)."""

    backend: str
    microbatch_size: int
    dtype: str
    layer_mode: str
    # Expected seconds of the whole schedule per candidate micro-batch size.
    schedule_seconds: dict[int, float] = dataclasses.field(default_factory=dict)
    # Seconds of one micro-batch at `microbatch_size` per ghost layer mode.
    layer_mode_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def apply(self, train: TrainConfig) -> TrainConfig:
        """`train` with these settings; `train` itself when they are already its own."""
        chosen = {"microbatch_size": self.microbatch_size, "dtype": self.dtype, "layer_mode": self.layer_mode}
        if all(getattr(train, k) == v for k, v in chosen.items()):
            return train
        return dataclasses.replace(train, **chosen)

    def describe(self) -> str:
        """One line for the run's log."""
        head = (
            f"device: {self.backend}, micro-batch {self.microbatch_size}, {self.dtype} compute, "
            f"ghost layer mode {self.layer_mode}"
        )
        if not self.schedule_seconds:
            return f"{head} (the recipe's micro-batch and layer mode, not measured)"
        sizes = ", ".join(f"{m}: {s:.3g} s" for m, s in self.schedule_seconds.items())
        modes = ", ".join(f"{k}: {1e3 * s:.1f} ms" for k, s in self.layer_mode_seconds.items())
        return (
            f"{head} (measured on placeholder inputs; expected schedule time by micro-batch {sizes}"
            + (f"; one micro-batch by layer mode {modes}" if modes else "")
            + ")"
        )


def expected_microbatches(
    microbatch_size: int, *, expected_batch_size: int, dataset_size: int, compiled_rows: int
) -> float:
    """E[ceil(min(R, compiled_rows) / m)]: micro-batches a step runs when those holding only
    padding are skipped, R ~ Binomial(dataset_size, expected_batch_size / dataset_size) in its
    normal approximation (continuity-corrected), `compiled_rows` a multiple of m. A step of one
    micro-batch always runs it."""
    m = microbatch_size
    if compiled_rows % m:
        raise ValueError(f"compiled_rows={compiled_rows} must be a multiple of microbatch_size={m}")
    sd = math.sqrt(expected_batch_size * (1 - expected_batch_size / dataset_size))

    def more_than(rows: int) -> float:
        if sd == 0:  # q = 1: every example, every step
            return float(expected_batch_size > rows)
        return 0.5 * math.erfc((rows + 0.5 - expected_batch_size) / (sd * math.sqrt(2)))

    # sum over k < compiled_rows / m of P[R > k m]; P[R > 0] counts as 1 (the first always runs).
    return 1.0 + sum(more_than(k * m) for k in range(1, compiled_rows // m))


def compiled_rows_per_device(physical_batch_size: int, devices: int, microbatch_size: int) -> int:
    """Rows of the compiled step on each device: the physical batch padded to a multiple of
    devices x micro-batch (as `dpbert.train.engine.device_batch_size`), split evenly."""
    multiple = devices * microbatch_size
    return -(-physical_batch_size // multiple) * multiple // devices


def device_settings(
    recipe: Recipe,
    config: Any,
    *,
    num_predictions: int,
    dataset_size: int,
    physical_batch_sizes: Sequence[int],
    devices: int = 1,
    backend: str | None = None,
    candidates: Sequence[int] = ACCELERATOR_MICROBATCH_SIZES,
    layer_modes: Sequence[str] = LAYER_MODES,
    memory_budget_bytes: int | None = None,
) -> DeviceSettings:
    """The settings of `recipe` (BERT `config`, `num_predictions` decoded positions per example)
    on `backend` (default: JAX's default backend); see the module docstring. On an accelerator,
    `candidates` micro-batch sizes (those above the largest compiled batch per device dropped)
    are timed within `memory_budget_bytes` (default: MEMORY_FRACTION of the device's memory,
    no limit where the device does not say), then `layer_modes` at the fastest size (DP runs
    with ghost clipping only). `physical_batch_sizes`: the ledger's, one per schedule stage."""
    backend = backend or jax.default_backend()
    train = recipe.train
    if not is_accelerator(backend) or jax.process_count() > 1:
        return DeviceSettings(
            backend=backend,
            microbatch_size=train.microbatch_size,
            dtype="bfloat16" if is_accelerator(backend) else train.dtype,
            layer_mode=train.layer_mode,
        )
    if len(physical_batch_sizes) != len(recipe.schedule):
        raise ValueError(
            f"physical_batch_sizes: expected one per schedule stage ({len(recipe.schedule)}), "
            f"got {list(physical_batch_sizes)}"
        )
    largest = max(compiled_rows_per_device(p, devices, 1) for p in physical_batch_sizes)
    sizes = sorted({m for m in candidates if m <= largest} or {min(candidates)})
    budget = memory_budget_bytes if memory_budget_bytes is not None else _memory_budget()
    ghost = recipe.privacy.enabled and train.clipping != "vmap"
    params, example, loss = _placeholder_problem(recipe, config, num_predictions, train.layer_mode)
    seconds = _microbatch_seconds(recipe, loss, params, example, sizes, budget)

    def schedule_time(m: int) -> float:
        return sum(
            stage.steps
            * seconds[m]
            * expected_microbatches(
                m,
                expected_batch_size=stage.expected_batch_size,
                dataset_size=dataset_size,
                compiled_rows=compiled_rows_per_device(physical, devices, m),
            )
            for stage, physical in zip(recipe.schedule, physical_batch_sizes)
        )

    schedule_seconds = {m: schedule_time(m) for m in seconds}
    best = min(schedule_seconds, key=schedule_seconds.get)
    mode_seconds: dict[str, float] = {}
    if ghost and len(layer_modes) > 1:
        for mode in layer_modes:
            # The recipe's own mode was just timed at this size.
            mode_seconds[mode] = (
                seconds[best]
                if mode == train.layer_mode
                else _microbatch_seconds(
                    recipe, dataclasses.replace(loss, layer_mode=mode), params, example, [best], None
                )[best]
            )
    return DeviceSettings(
        backend=backend,
        microbatch_size=best,
        dtype="bfloat16",
        layer_mode=min(mode_seconds, key=mode_seconds.get) if mode_seconds else train.layer_mode,
        schedule_seconds=schedule_seconds,
        layer_mode_seconds=mode_seconds,
    )


def _memory_budget() -> int | None:
    """MEMORY_FRACTION of the first device's memory, or None where it does not report it."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(MEMORY_FRACTION * limit) if limit else None


def _placeholder_problem(recipe: Recipe, config: Any, num_predictions: int, layer_mode: str) -> tuple[Any, Any, Any]:
    """(parameter shapes, one example's shapes, ghost-capable masked-LM loss) of the recipe's
    model in bfloat16 compute: shapes only, no weights and no data."""

    build = lambda: BertForMaskedLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, remat=recipe.model.remat)  # noqa: E731
    graphdef, params = functional.split_params(nnx.eval_shape(build))
    seq, pred = recipe.data.seq_len, num_predictions
    i32 = jnp.int32
    example = {
        "input_ids": jax.ShapeDtypeStruct((seq,), i32),
        "attention_mask": jax.ShapeDtypeStruct((seq,), i32),
        "masked_positions": jax.ShapeDtypeStruct((pred,), i32),
        "labels": jax.ShapeDtypeStruct((pred,), i32),
        "label_weights": jax.ShapeDtypeStruct((pred,), jnp.float32),
    }
    return params, example, MLMGhostLoss(graphdef=graphdef, layer_mode=layer_mode)


def _microbatch_seconds(
    recipe: Recipe, loss: Any, params: Any, example: Any, sizes: Sequence[int], budget: int | None
) -> dict[int, float]:
    """Seconds of one micro-batch of each size that fits `budget`, for the gradient sum the
    recipe's step runs (clipped when private, plain otherwise), on placeholder inputs."""

    if recipe.privacy.enabled:
        # "auto" times vmap against ghost on its own when traced; the size is chosen for ghost.
        impl = clipped_sum_for("vmap" if recipe.train.clipping == "vmap" else "ghost", loss)
        sum_fn = functools.partial(impl, loss, clip_norm=recipe.privacy.clip_norm)
    else:
        sum_fn = functools.partial(grad_sum, loss)
    per_example = fastest_microbatch_size(sum_fn, params, example, candidates=sizes, memory_budget_bytes=budget)[1]
    return {m: s * m for m, s in per_example.items()}
