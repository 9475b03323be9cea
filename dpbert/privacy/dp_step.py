"""The DP-SGD train step (and its non-private twin) as jitted pure functions.

`make_dp_train_step(...)` returns `step(params, opt_state, batch, is_padding, step_key)`: per-example
keys from the step key and the global row position; the clipped gradient sum over the Poisson
sample padded to the compiled batch (`clipped_sum_for`: vmap or ghost clipping, micro-batches
scanned, one `psum` over devices); then `dp_update`: noise once on the global sum, division by
the expected batch size, and the optimizer update (`default_optimizer`: AdamW). `make_train_step`
is the non-private baseline with the same signature (mean loss over the real examples).

Guarantees (rules 1, 2 and 5 of `dpbert.privacy`): the update is the same, to float tolerance,
for any micro-batch size and any number of devices, and replaying a step with the same inputs and
key is bit-identical on the same setup; only `private/*` metrics depend on the noised gradient,
`nonprivate/*` metrics are computed on the private batch and labelled so. params and opt_state
are donated. Devices and shardings: docs/INTERNALS.md ("dpbert.privacy.dp_step").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dpbert.privacy.adam_bc import adam_bc
from dpbert.privacy.clipping import ClipStats, LossFn, clipped_grad_sum, grad_sum
from dpbert.privacy.ghost_clipping import GhostLoss, ghost_clipped_grad_sum
from dpbert.privacy.noise import check_dp_params, privatize
from dpbert.privacy.randomness import example_key, noise_key
from dpbert.privacy.tuning import time_clipping_methods

StepFn = Callable[[Any, Any, Any, jax.Array, jax.Array], tuple[Any, Any, dict[str, jax.Array]]]


CLIPPING_METHODS = ("vmap", "ghost", "auto")
_AUTO_CHOICES: dict[Any, str] = {}
DataAxis = str | tuple[str, ...]


class EmaState(NamedTuple):
    """Optimizer state with an exponential moving average of the parameters (`default_optimizer`)."""

    inner: Any
    ema: Any
    count: jax.Array


DECAYED_NAMES = ("kernel", "embedding")


def _matrices(params: Any) -> Any:
    """Weight-decay mask: True for kernels and embedding tables, by name (scanned layers stack
    LayerNorm gains and biases into arrays of two dimensions, so their shape cannot tell)."""

    def decayed(path: tuple[Any, ...], _: Any) -> bool:
        return any(getattr(k, "key", None) in DECAYED_NAMES for k in path[-2:])

    return jax.tree_util.tree_map_with_path(decayed, params)


def default_optimizer(
    learning_rate: float | optax.Schedule,
    *,
    weight_decay: float = 0.01,
    decay_matrices_only: bool = False,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    ema_decay: float | None = None,
    noise_variance: optax.Schedule | None = None,
    noise_variance_floor_ratio: float = 1.0,
) -> optax.GradientTransformation:
    """The optimizer of every dpbert task: AdamW with decoupled weight decay on every trained
    parameter (optax.adamw; Anil et al. found a large decay helps under DP); with
    `decay_matrices_only`, only on kernels and embedding tables (`DECAYED_NAMES`), not on LayerNorm
    gains and biases, as BERT excludes them.

    With `noise_variance` (step -> per-coordinate variance of the noise in that step's averaged
    gradient, `dpbert.privacy.adam_bc.noise_variance_schedule`), DP-AdamBC instead: the second
    moment less the noise variance, floored at `noise_variance_floor_ratio` times that variance
    (post-processing: no privacy cost).

    With `ema_decay`, the state also keeps the debiased exponential moving average of the
    parameters after each update (`ema_params`): post-processing of the noisy iterates, so it
    costs no privacy (De et al. 2022 report a large gain under DP)."""
    mask = _matrices if decay_matrices_only else None
    if noise_variance is None:
        tx = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)
    else:
        tx = adam_bc(
            learning_rate,
            noise_variance,
            b1=b1,
            b2=b2,
            eps=eps,
            weight_decay=weight_decay,
            mask=mask,
            floor=noise_variance_floor_ratio,
        )
    if ema_decay is None:
        return tx
    if not 0.0 < ema_decay < 1.0:
        raise ValueError(f"ema_decay: expected a number in (0, 1) or None, got {ema_decay!r}")

    def init(params: Any) -> EmaState:
        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return EmaState(inner=tx.init(params), ema=zeros, count=jnp.zeros((), jnp.int32))

    def update(updates: Any, state: EmaState, params: Any = None) -> tuple[Any, EmaState]:
        updates, inner = tx.update(updates, state.inner, params)
        new = optax.apply_updates(params, updates)
        ema = jax.tree_util.tree_map(
            lambda e, p: ema_decay * e + (1.0 - ema_decay) * p.astype(jnp.float32), state.ema, new
        )
        return updates, EmaState(inner=inner, ema=ema, count=state.count + 1)

    return optax.GradientTransformation(init, update)


def ema_params(opt_state: Any, params: Any, ema_decay: float) -> Any:
    """The debiased moving average of the parameters kept by `default_optimizer(ema_decay=...)`,
    in the parameters' dtypes: ema / (1 - decay^t) after t updates (the parameters themselves
    before the first update)."""
    if not isinstance(opt_state, EmaState):
        raise ValueError("ema_params: the optimizer state holds no parameter average (ema_decay was None)")
    correction = 1.0 - jnp.asarray(ema_decay, jnp.float32) ** opt_state.count.astype(jnp.float32)
    return jax.tree_util.tree_map(
        lambda e, p: jnp.where(opt_state.count > 0, e / jnp.maximum(correction, 1e-12), p).astype(p.dtype),
        opt_state.ema,
        params,
    )


def clipped_sum_for(method: str, loss_fn: Any) -> Callable[..., tuple[Any, ClipStats]]:
    """The clipped-sum function (signature of `clipping.clipped_grad_sum`) of a clipping method.

    Args:
      method: "vmap" (per-example gradients, any loss), "ghost" (ghost norms and book-keeping;
        needs a `GhostLoss`, `dpbert.privacy.ghost_clipping`) or "auto" (for a `GhostLoss`, the
        faster of the two, timed once per shape on placeholders by
        `dpbert.privacy.tuning.time_clipping_methods`, never on data; else "vmap").
      loss_fn: the per-example loss.
    Returns:
      `sum(loss, params, batch, is_padding, rng, *, clip_norm, microbatch_size, position_offset=0)`.
      Every method clips each example to `clip_norm`: the noise and the accounting are the same.
    """
    if method not in CLIPPING_METHODS:
        raise ValueError(f"clipping_method: expected one of {CLIPPING_METHODS}, got {method!r}")
    ghost_capable = isinstance(loss_fn, GhostLoss)
    if method == "vmap" or (method == "auto" and not ghost_capable):
        return clipped_grad_sum
    if not ghost_capable:
        raise ValueError(
            f"clipping_method='ghost' needs a loss with taps (a GhostLoss, dpbert.privacy.ghost_clipping), "
            f"got {type(loss_fn).__name__}"
        )
    if method == "ghost":
        return ghost_clipped_grad_sum

    def auto(loss, params, batch, is_padding, rng, *, clip_norm, microbatch_size, position_offset=0):
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
        signature = (loss, str(shapes), microbatch_size)
        if signature not in _AUTO_CHOICES:
            seconds = time_clipping_methods(loss, *shapes, clip_norm=clip_norm, microbatch_size=microbatch_size)
            _AUTO_CHOICES[signature] = min(seconds, key=seconds.get)
        impl = ghost_clipped_grad_sum if _AUTO_CHOICES[signature] == "ghost" else clipped_grad_sum
        return impl(
            loss,
            params,
            batch,
            is_padding,
            rng,
            clip_norm=clip_norm,
            microbatch_size=microbatch_size,
            position_offset=position_offset,
        )

    return auto


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


def apply_update(optimizer: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    """(params, opt_state) after one optimizer update with `grads` (cast to the params' dtypes)."""
    grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def dp_update(
    optimizer: optax.GradientTransformation,
    clipped_sum: Any,
    opt_state: Any,
    params: Any,
    step_key: jax.Array,
    *,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: int,
) -> tuple[Any, Any, Any]:
    """What a DP step does once per step, after the clipped sum: Gaussian noise N(0, (sigma C)^2)
    on the global `clipped_sum` from `noise_key(step_key)`, division by the public expected batch
    size, then the optimizer update.

    Args:
      optimizer: the update rule (post-processing of the noisy gradient).
      clipped_sum: the global clipped gradient sum; opt_state, params: the current state.
      step_key: the step's mechanism key; clip_norm, noise_multiplier, expected_batch_size: C,
        sigma and the public B of the step's stage.
    Returns:
      (params, opt_state, noisy gradient)."""
    grads = privatize(
        clipped_sum,
        noise_key(step_key),
        clip_norm=clip_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
    )
    params, opt_state = apply_update(optimizer, grads, opt_state, params)
    return params, opt_state, grads


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

    Args:
      loss_fn: `loss_fn(params, example, rng) -> scalar` on one example.
      optimizer: any optax transformation (`default_optimizer`).
      clip_norm, noise_multiplier, expected_batch_size: C, sigma and the public B of the stage.
      microbatch_size: examples per scanned micro-batch; the physical batch (fixed by the arrays
        passed in) must be a multiple of it times the devices on `data_axis`.
      mesh, data_axis: shard the batch over these mesh axes (None: one device).
      state_shardings: (params, opt_state) shardings under `mesh`; default replicated.
      clipping_method: "vmap", "ghost" or "auto" (`clipped_sum_for`): speed only, never the
        noise, the sensitivity or the accounting. "auto" is single-process only (hosts could
        time differently and compile different programs).
    Returns:
      `step(params, opt_state, batch, is_padding, step_key) -> (params, opt_state, metrics)`,
      jitted, params and opt_state donated when `donate`."""
    check_dp_params(clip_norm=clip_norm, noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size)
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ValueError(f"microbatch_size must be an integer >= 1, got {microbatch_size!r}")
    if clipping_method == "auto" and jax.process_count() > 1:
        raise ValueError("clipping 'auto' is single-process only; choose ghost or vmap")

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
        params, opt_state, grads = dp_update(
            optimizer,
            total,
            opt_state,
            params,
            step_key,
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
        )
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
    physical batch, gradient accumulation over micro-batches otherwise.

    Args:
      loss_fn: the per-example loss; optimizer: the update rule; microbatch_size, mesh,
        data_axis, donate, state_shardings: as for `make_dp_train_step`.
    Returns:
      A jitted `StepFn` (params, opt_state, batch, is_padding, step_key) -> (params, opt_state,
      metrics), interchangeable with the DP step."""
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
        params, opt_state = apply_update(optimizer, grads, opt_state, params)
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
