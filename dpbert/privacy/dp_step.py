"""The DP-SGD train step (and its non-private twin) as jitted pure functions.

`make_dp_train_step(...)` returns `step(params, opt_state, batch, is_padding, step_key)
-> (params, opt_state, metrics)`:
  1. per-example keys come from fold_in(step_key, EXAMPLE) and the global row position;
  2. the clipped gradient sum over the physical batch (micro-batches scanned on each device;
     with a mesh, each device sums its shard and one `psum` makes the global sum);
  3. noise N(0, (sigma*C)^2) once on the global sum with fold_in(step_key, NOISE), then
     division by the expected batch size;
  4. an optax update (any GradientTransformation; `default_optimizer` is AdamW with decoupled
     weight decay, which Anil et al. found to work well under DP).

`make_train_step(...)` is the non-private baseline with the same signature: plain gradient
of the mean loss over the real examples (divided by the realized batch size), no clipping,
no noise.

Devices: with `mesh`, the batch (leading axis) is sharded over `data_axis` (one mesh axis, or
a tuple of axes the batch is split over together) and params and optimizer state are
replicated, or placed as `state_shardings` says (e.g. FSDP: sharded at rest, gathered for
the per-example gradients); the physical batch must divide evenly over the devices.
params and opt_state are donated (pass fresh references each step).

Guarantees: only `private/*` metrics are functions of the noised gradient; `nonprivate/*`
metrics (loss, clipped fraction, non-finite count, realized batch size) are computed on the
private batch and are NOT covered by the guarantee: log them knowingly. The update is the
same, to float tolerance, for any micro-batch size and any number of devices, and replaying
a step with the same inputs and key gives bit-identical results on the same setup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dpbert.privacy.clipping import ClipStats, LossFn, grad_sum
from dpbert.privacy.noise import check_dp_params, privatize
from dpbert.privacy.randomness import example_key, noise_key
from dpbert.privacy.tuning import clipped_sum_for

StepFn = Callable[[Any, Any, Any, jax.Array, jax.Array], tuple[Any, Any, dict[str, jax.Array]]]


def default_optimizer(
    learning_rate: float | optax.Schedule,
    *,
    weight_decay: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay (optax.adamw)."""
    return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)


DataAxis = str | tuple[str, ...]


def _global_sum_fn(
    sum_fn: Callable[..., tuple[Any, ClipStats]], mesh: Mesh | None, data_axis: DataAxis
) -> Callable[[Any, Any, jax.Array, jax.Array], tuple[Any, ClipStats]]:
    """sum_fn over the whole batch: directly, or per device shard followed by one psum."""
    if mesh is None:
        return lambda params, batch, is_padding, key: sum_fn(params, batch, is_padding, key)
    axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
    if not axes or any(a not in mesh.axis_names for a in axes):
        raise ValueError(f"data_axis={data_axis!r} is not an axis of the mesh {mesh.axis_names}")

    def local(params: Any, batch: Any, is_padding: jax.Array, key: jax.Array):
        # Global row position = shard index * shard length + local position.
        offset = jax.lax.axis_index(data_axis) * is_padding.shape[0]
        # Mark the replicated params as per-device: otherwise the gradient with respect to an
        # unvarying input is transposed into an implicit psum inside every per-example grad.
        params = jax.lax.pcast(params, axes, to="varying")
        total, stats = sum_fn(params, batch, is_padding, key, position_offset=offset)
        return jax.lax.psum((total, stats), data_axis)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(data_axis), P(data_axis), P()), out_specs=P())


def _jit(
    step: Callable[..., Any],
    mesh: Mesh | None,
    data_axis: DataAxis,
    donate: bool,
    state_shardings: tuple[Any, Any] | None,
) -> StepFn:
    donate_argnums = (0, 1) if donate else ()
    if mesh is None:
        return jax.jit(step, donate_argnums=donate_argnums)
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P(data_axis))
    params_sh, opt_sh = state_shardings if state_shardings is not None else (replicated, replicated)
    return jax.jit(
        step,
        in_shardings=(params_sh, opt_sh, sharded, sharded, replicated),
        out_shardings=(params_sh, opt_sh, replicated),
        donate_argnums=donate_argnums,
    )


def _apply(optimizer: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _nonprivate_metrics(stats: ClipStats) -> dict[str, jax.Array]:
    n = stats.num_examples
    finite = jnp.maximum(n - stats.num_nonfinite, 1.0)
    return {
        "nonprivate/loss": stats.loss_sum / finite,
        "nonprivate/clipped_fraction": stats.num_clipped / finite,
        "nonprivate/nonfinite_examples": stats.num_nonfinite,
        "nonprivate/batch_size": n,
    }


def make_dp_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: int,
    microbatch_size: int,
    mesh: Mesh | None = None,
    data_axis: DataAxis = "data",
    donate: bool = True,
    state_shardings: tuple[Any, Any] | None = None,
    clipping_method: str = "vmap",
) -> StepFn:
    """A jitted DP-SGD step for one schedule stage (see the module docstring).

    `clipping_method`: "vmap" (per-example gradients, any loss), "ghost" or "auto" (see
    `dpbert.privacy.tuning.clipped_sum_for`); it changes speed only, never the noise,
    the sensitivity or the accounting.

    `loss_fn(params, example, rng) -> scalar` sees one example. The physical batch size is
    fixed by the arrays passed in and must be a multiple of microbatch_size (times the
    number of devices on `data_axis`). `state_shardings` = (params, opt_state) shardings
    (pytrees or one sharding each) under `mesh`; default replicated."""
    check_dp_params(clip_norm=clip_norm, noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size)
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ValueError(f"microbatch_size must be an integer >= 1, got {microbatch_size!r}")

    sum_impl = clipped_sum_for(clipping_method, loss_fn)

    def sum_fn(params, batch, is_padding, key, position_offset=0):
        return sum_impl(
            loss_fn,
            params,
            batch,
            is_padding,
            key,
            clip_norm=clip_norm,
            microbatch_size=microbatch_size,
            position_offset=position_offset,
        )

    global_sum = _global_sum_fn(sum_fn, mesh, data_axis)

    def step(params, opt_state, batch, is_padding, step_key):
        total, stats = global_sum(params, batch, is_padding, example_key(step_key))
        grads = privatize(
            total,
            noise_key(step_key),
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
        )
        params, opt_state = _apply(optimizer, grads, opt_state, params)
        metrics = {"private/noisy_grad_norm": optax.tree.norm(grads), **_nonprivate_metrics(stats)}
        return params, opt_state, metrics

    return _jit(step, mesh, data_axis, donate, state_shardings)


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    microbatch_size: int,
    mesh: Mesh | None = None,
    data_axis: DataAxis = "data",
    donate: bool = True,
    state_shardings: tuple[Any, Any] | None = None,
) -> StepFn:
    """The non-private step with the DP step's signature: the plain gradient of the mean loss
    over the real (non-padding) examples, i.e. divided by the realized batch size, not the
    expected one. No per-example gradients; one batched pass when microbatch_size is the
    physical batch, gradient accumulation over micro-batches otherwise."""
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ValueError(f"microbatch_size must be an integer >= 1, got {microbatch_size!r}")

    def sum_fn(params, batch, is_padding, key, position_offset=0):
        return grad_sum(
            loss_fn,
            params,
            batch,
            is_padding,
            key,
            microbatch_size=microbatch_size,
            position_offset=position_offset,
        )

    global_sum = _global_sum_fn(sum_fn, mesh, data_axis)

    def step(params, opt_state, batch, is_padding, step_key):
        total, stats = global_sum(params, batch, is_padding, example_key(step_key))
        count = jnp.maximum(stats.num_examples, 1.0)
        grads = jax.tree_util.tree_map(lambda g: g / count, total)
        params, opt_state = _apply(optimizer, grads, opt_state, params)
        metrics = {
            "nonprivate/loss": stats.loss_sum / count,
            "nonprivate/grad_norm": optax.tree.norm(grads),
            "nonprivate/batch_size": stats.num_examples,
        }
        return params, opt_state, metrics

    return _jit(step, mesh, data_axis, donate, state_shardings)


def data_mesh(devices: Any = None, data_axis: str = "data") -> Mesh:
    """A 1-D mesh over `devices` (default: all) for data parallelism."""
    devs = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devs), (data_axis,))
