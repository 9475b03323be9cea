"""Ahead-of-time compile of a recipe's pretraining step at full shape, and a throughput model.

`compile_step(recipe, mesh)` compiles exactly the step the trainer runs (`dpbert.train.pretrain.
build_setup`, `Setup.stage_step`) at the trainer's compiled batch, from abstract arrays only: no
weight is materialized, so a pod-size step compiles on a laptop with fake devices. It reports
XLA's memory analysis and FLOP counts (per micro-batch and once per step, the layer scan counted
from 1- and 2-layer unrolled compiles).

The throughput model is an ESTIMATE, never a measurement: FLOPs per step / (devices x peak FLOP/s
x assumed MFU), from the recipe's `target` section or flags. How FLOPs are separated and counted:
docs/INTERNALS.md ("dpbert.train.compile").
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dpbert.config.plan import ledger_physical_batch_sizes, public_dataset_size
from dpbert.config.recipe import Recipe
from dpbert.model.bert import unrolled_layers
from dpbert.privacy import randomness
from dpbert.privacy.documents import SEQUENCE_PADDING
from dpbert.privacy.dp_step import apply_update, dp_update
from dpbert.privacy.schedule import BatchSchedule, Stage
from dpbert.train.engine import device_batch_size
from dpbert.train.mesh import batch_sharding, bytes_per_device, replicated
from dpbert.train.pretrain import build_setup
from dpbert.train.state import bert_config

# Shape-only stand-ins for token ids the masking code needs (values never matter to shapes).
_PLACEHOLDER_IDS = {"mask_token_id": 103, "special_token_ids": (0, 101, 102, 103), "pad_id": 0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """One schedule stage on the target: `steps` steps at `physical_batch_size` rows."""

    steps: int
    expected_batch_size: int
    physical_batch_size: int
    flops_per_step: float
    seconds_per_step: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileReport:
    """Memory (bytes, per device) and FLOPs of one compiled step, and the ESTIMATED time on
    the recipe's target hardware (None when the target's peak or devices are not stated)."""

    private: bool
    stage_index: int
    expected_batch_size: int
    physical_batch_size: int
    microbatch_size: int
    mesh_shape: dict[str, int]
    num_params: int
    state_bytes_per_device: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops_per_example: float
    update_flops_per_device: float
    flops_per_step: float
    compile_seconds: float
    target_hardware: str
    target_devices: int | None
    peak_tflops_per_device: float | None
    assumed_mfu: float
    stages: tuple[StageEstimate, ...]

    @property
    def microbatches_per_device(self) -> int:
        devices = math.prod(self.mesh_shape.values())
        return self.physical_batch_size // (devices * self.microbatch_size)

    @property
    def estimated_total_seconds(self) -> float | None:
        times = [s.seconds_per_step for s in self.stages]
        if any(t is None for t in times):
            return None
        return sum(s.steps * s.seconds_per_step for s in self.stages)  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["microbatches_per_device"] = self.microbatches_per_device
        d["estimated_total_seconds"] = self.estimated_total_seconds
        return d

    def summary(self) -> str:
        gib = 2.0**30
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        lines = [
            f"compiled the {'DP-SGD' if self.private else 'non-private'} step of schedule stage "
            f"{self.stage_index} (expected batch {self.expected_batch_size:,}, physical {self.physical_batch_size:,}) "
            f"on mesh {mesh}: {self.microbatches_per_device:,} micro-batches of {self.microbatch_size} per device "
            f"[{self.compile_seconds:.0f} s]",
            f"parameters: {self.num_params:,}; params + optimizer state per device: "
            f"{self.state_bytes_per_device / gib:.3f} GiB",
            "per-device memory (XLA memory_analysis): "
            f"arguments {self.argument_bytes / gib:.3f} GiB, outputs {self.output_bytes / gib:.3f} GiB "
            f"(aliased {self.alias_bytes / gib:.3f} GiB), temporaries {self.temp_bytes / gib:.3f} GiB",
            f"FLOPs (XLA cost_analysis): {self.flops_per_example:.4g} per example, "
            f"{self.flops_per_step:.4g} per step (all devices)",
        ]
        if self.peak_tflops_per_device is None or self.target_devices is None:
            lines.append(
                "ESTIMATE: none (set target.devices and target.peak_tflops_per_device, or pass "
                "--peak-tflops and --target-devices)"
            )
            return "\n".join(lines)
        lines.append(
            f"ESTIMATE (not a measurement) on {self.target_hardware}: {self.target_devices} devices x "
            f"{self.peak_tflops_per_device:g} TFLOP/s peak x assumed MFU {self.assumed_mfu:g}"
        )
        for i, s in enumerate(self.stages):
            lines.append(
                f"  stage {i}: {s.steps:,} steps x {s.expected_batch_size:,} expected "
                f"(physical {s.physical_batch_size:,}): {s.seconds_per_step:.2f} s/step, "
                f"{s.steps * s.seconds_per_step / 3600:.2f} h"
            )
        total = self.estimated_total_seconds or 0.0
        lines.append(f"  whole schedule: {total / 3600:.1f} h ({total / 86400:.2f} days)")
        return "\n".join(lines)


def _flops(compiled: Any) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax returned one dict per module
        cost = cost[0]
    return float(cost.get("flops", 0.0))


def _physical(recipe: Recipe, stage_index: int, devices: int) -> int:
    """The trainer's compiled batch for a stage on `devices` devices: the ledger's physical batch
    (public N and bound from the recipe, or `target.dataset_size` as the stored count) padded to
    devices x micro-batch; without a dataset size, the expected batch padded (no Poisson margin)."""

    mb = recipe.train.microbatch_size
    stored = recipe.target.dataset_size
    if stored is None and (recipe.privacy.dataset_size is None or not recipe.privacy.enabled):
        return device_batch_size(recipe.schedule[stage_index].expected_batch_size, devices, mb)
    size = public_dataset_size(recipe, stored)
    bound = size.bound if recipe.privacy.enabled else None
    return device_batch_size(ledger_physical_batch_sizes(recipe, size.n, bound)[stage_index], devices, mb)


def _compile_pair(
    r: Recipe, mesh: Mesh, expected_batch_size: int, rows: int, layers: int | None = None
) -> tuple[Any, Any, Any, Any]:
    """(compiled step at `rows` physical rows, compiled update, abstract state, shardings) of the
    stage with `expected_batch_size`, with the recipe's model or the same model with `layers`
    encoder layers; built by the trainer's own `build_setup`."""
    config = bert_config(r)
    if layers is not None:
        config.num_hidden_layers = layers
    # Keys typed as the trainer's (Threefry-4x32 from a secret when private); a throwaway secret,
    # since compiling depends on the key's type only.
    secret = randomness.draw_secret() if r.privacy.enabled else None
    # Placeholder noise multipliers, as the step's below (they are constants of the program only).
    schedule = BatchSchedule(
        stages=tuple(
            Stage(steps=s.steps, expected_batch_size=s.expected_batch_size, noise_multiplier=1.0) for s in r.schedule
        )
    )
    setup = build_setup(
        r,
        mesh,
        config=config,
        seq_len=r.data.seq_len,
        token_ids=_PLACEHOLDER_IDS,
        secret=secret,
        mechanism="pretrain",
        schedule=schedule,
    )
    abstract, optimizer = setup.abstract, setup.optimizer
    params_sh, opt_sh = abstract.shardings
    key_sds = jax.eval_shape(lambda: setup.stage_keys[0])
    sharded = batch_sharding(mesh)
    # With `privacy.unit: document` a row is a document of max_sequences_per_document slots.
    slots = (r.privacy.max_sequences_per_document,) if r.privacy.enabled and r.privacy.unit == "document" else ()
    batch = {
        "input_ids": jax.ShapeDtypeStruct((rows, *slots, r.data.seq_len), jnp.int32, sharding=sharded),
        "index": jax.ShapeDtypeStruct((rows, *slots), jnp.int32, sharding=sharded),
        "step": jax.ShapeDtypeStruct((rows, *slots), jnp.int32, sharding=sharded),
    }
    if slots:
        batch[SEQUENCE_PADDING] = jax.ShapeDtypeStruct((rows, *slots), jnp.bool_, sharding=sharded)
    padding = jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=sharded)
    step = setup.stage_step(noise_multiplier=1.0, expected_batch_size=expected_batch_size)
    args_state = (abstract.params, abstract.opt_state)
    key_arg = jax.ShapeDtypeStruct(key_sds.shape, key_sds.dtype, sharding=replicated(mesh))
    full = step.lower(*args_state, batch, padding, key_arg).compile()

    def update(params: Any, opt_state: Any, grads: Any, key: jax.Array) -> tuple[Any, Any]:
        """What the step runs once per step, after the clipped sum (the DP core's own code)."""
        if not r.privacy.enabled:
            return apply_update(optimizer, grads, opt_state, params)
        params, opt_state, _ = dp_update(
            optimizer,
            grads,
            opt_state,
            params,
            key,
            clip_norm=r.privacy.clip_norm,
            noise_multiplier=1.0,
            expected_batch_size=expected_batch_size,
        )
        return params, opt_state

    update_c = (
        jax.jit(
            update, in_shardings=(params_sh, opt_sh, params_sh, replicated(mesh)), out_shardings=(params_sh, opt_sh)
        )
        .lower(args_state[0], args_state[1], args_state[0], key_arg)
        .compile()
    )
    return full, update_c, abstract, (params_sh, opt_sh)


def compile_step(
    recipe: Recipe,
    mesh: Mesh,
    *,
    stage_index: int = -1,
    peak_tflops_per_device: float | None = None,
    target_devices: int | None = None,
    assumed_mfu: float | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> CompileReport:
    """Lower and compile the recipe's step at stage `stage_index` (default: the last, largest)
    on `mesh`; see the module docstring for what is measured and estimated."""
    n_stages = len(recipe.schedule)
    if not -n_stages <= stage_index < n_stages:
        raise ValueError(f"--stage {stage_index}: the schedule has {n_stages} stages")
    stage_index %= n_stages
    stage = recipe.schedule[stage_index]
    devices = mesh.devices.size
    mb = recipe.train.microbatch_size
    physical = _physical(recipe, stage_index, devices)

    started = time.perf_counter()
    log(f"compiling the full step: physical batch {physical:,} on {devices} devices ...")
    full, update_c, abstract, (params_sh, opt_sh) = _compile_pair(recipe, mesh, stage.expected_batch_size, physical)
    compile_seconds = time.perf_counter() - started
    memory = full.memory_analysis()
    num_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(abstract.params))
    update_flops = _flops(update_c)
    # The encoder's layers run under a scan, whose body XLA's cost analysis counts once (like the
    # micro-batch loop): per-example FLOPs come from the same step with 1 and 2 layers, unrolled,
    # at one micro-batch per device (small compiles, not counted in compile_seconds):
    # f(n) = step - update, per example = (f(1) + (L - 1) (f(2) - f(1))) / micro-batch.
    log("counting FLOPs: the step with 1 and 2 encoder layers, unrolled, one micro-batch per device ...")
    layer_flops = []
    for n in (1, 2):
        with unrolled_layers():
            step_n, update_n, _, _ = _compile_pair(recipe, mesh, stage.expected_batch_size, devices * mb, layers=n)
        layer_flops.append(_flops(step_n) - _flops(update_n))
    depth = bert_config(recipe).num_hidden_layers
    per_example = max(layer_flops[0] + (depth - 1) * (layer_flops[1] - layer_flops[0]), 0.0) / mb

    tgt = recipe.target
    peak = peak_tflops_per_device if peak_tflops_per_device is not None else tgt.peak_tflops_per_device
    tdev = target_devices if target_devices is not None else tgt.devices
    mfu = assumed_mfu if assumed_mfu is not None else tgt.assumed_mfu
    if not 0.0 < mfu <= 1.0:
        raise ValueError(f"--assumed-mfu: expected a fraction in (0, 1], got {mfu!r}")
    estimates = []
    for i, s in enumerate(recipe.schedule):
        rows = _physical(recipe, i, tdev or devices)
        flops = rows * per_example + (tdev or devices) * update_flops
        seconds = None if peak is None or tdev is None else flops / (tdev * peak * 1e12 * mfu)
        estimates.append(
            StageEstimate(
                steps=s.steps,
                expected_batch_size=s.expected_batch_size,
                physical_batch_size=rows,
                flops_per_step=flops,
                seconds_per_step=seconds,
            )
        )
    return CompileReport(
        private=recipe.privacy.enabled,
        stage_index=stage_index,
        expected_batch_size=stage.expected_batch_size,
        physical_batch_size=physical,
        microbatch_size=mb,
        mesh_shape=dict(mesh.shape),
        num_params=num_params,
        state_bytes_per_device=bytes_per_device(abstract.params, params_sh)
        + bytes_per_device(abstract.opt_state, opt_sh),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        flops_per_example=per_example,
        update_flops_per_device=update_flops,
        flops_per_step=physical * per_example + devices * update_flops,
        compile_seconds=compile_seconds,
        target_hardware=tgt.hardware,
        target_devices=tdev,
        peak_tflops_per_device=peak,
        assumed_mfu=mfu,
        stages=tuple(estimates),
    )
