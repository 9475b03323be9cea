"""Per-example clipped gradient *sum*, computed in micro-batches (`vmap` inside `lax.scan`, so
memory is set by the micro-batch, not by the batch).

Guarantees:
- Sensitivity: adding or removing one example changes the sum by at most `clip_norm` in L2 norm
  (up to float rounding). The sum is never divided here; the caller divides by the public
  expected batch size after adding noise.
- Padding rows (`is_padding`) and examples with a non-finite loss or gradient contribute exactly
  zero (the latter counted in `ClipStats.num_nonfinite`, which is NOT covered by the guarantee).
- Example i of the batch gets the key `fold_in(rng, position_offset + i)`, so the result does not
  depend on `microbatch_size` or on the device split (up to float summation order).
- Norms, clip factors and the sum are float32 at HIGHEST precision whatever the compute dtype, so
  no clipped example exceeds clip_norm on an accelerator (TF32/bfloat16 rounding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST

LossFn = Callable[[Any, Any, jax.Array], jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ClipStats:
    """Non-private counts of one clipped sum (float32 scalars, so they psum and average)."""

    num_examples: jax.Array  # real (non-padding) examples
    num_clipped: jax.Array  # real, finite examples whose norm exceeded clip_norm
    num_nonfinite: jax.Array  # real examples dropped for a non-finite loss or gradient
    loss_sum: jax.Array  # sum of the finite losses of real examples


def _global_norm(tree: Any) -> jax.Array:
    """L2 norm of all leaves together, without overflow for huge finite gradients."""
    leaves = [x.astype(jnp.float32) for x in jax.tree_util.tree_leaves(tree)]
    # Scaling by the largest entry keeps the sum of squares finite for entries up to float max;
    # inf and NaN entries still give a non-finite norm.
    biggest = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in leaves]))
    safe = jnp.where(biggest > 0, biggest, 1.0)
    return safe * jnp.sqrt(sum(jnp.sum(jnp.square(x / safe)) for x in leaves))


def _check_batch(batch: Any, is_padding: jax.Array, microbatch_size: int) -> int:
    size = is_padding.shape[0]
    for leaf in jax.tree_util.tree_leaves(batch):
        if leaf.shape[:1] != (size,):
            raise ValueError(
                f"every batch leaf must have leading dimension {size} (is_padding's length), got shape {leaf.shape}"
            )
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ValueError(f"microbatch_size must be an integer >= 1, got {microbatch_size!r}")
    if size % microbatch_size:
        raise ValueError(f"batch size {size} must be a multiple of microbatch_size={microbatch_size}")
    return size // microbatch_size


def _zero_like_batch(is_padding: jax.Array) -> jax.Array:
    """A float32 zero that varies over the same mesh axes as the batch.

    Inside shard_map the scan carry must have the same per-device variance as the per-example
    sums added to it; deriving the zero from the batch gives it that, on or off a mesh."""
    return jnp.sum(is_padding[:0], dtype=jnp.float32)


def _split_microbatches(tree: Any, num: int, size: int) -> Any:
    return jax.tree_util.tree_map(lambda x: x.reshape((num, size) + x.shape[1:]), tree)


def example_keys(rng: jax.Array, position_offset: int | jax.Array, index: jax.Array, microbatch_size: int) -> jax.Array:
    """Keys fold_in(rng, global position) of micro-batch `index`'s examples."""
    positions = position_offset + index * microbatch_size + jnp.arange(microbatch_size)
    return jax.vmap(lambda p: jax.random.fold_in(rng, p))(positions)


def clip_scale(
    stats: ClipStats, norms: jax.Array, losses: jax.Array, padding: jax.Array, clip_norm: float
) -> tuple[jax.Array, jax.Array, ClipStats]:
    """(keep [M], clip factor [M], updated stats) of one micro-batch from per-example norms.

    keep = real and finite (loss and norm); factor = min(1, C / norm) for kept examples and
    exactly 0 otherwise (a zero gradient's C / 0 = inf maps to 1), in float32. Both clipping
    paths use this one rule, so they clip and count alike."""
    norms = norms.astype(_F32)
    finite = jnp.isfinite(norms) & jnp.isfinite(losses)
    real = ~padding
    keep = real & finite
    scale = jnp.where(keep, jnp.minimum(1.0, jnp.asarray(clip_norm, _F32) / norms), 0.0).astype(_F32)
    f32 = jnp.float32
    stats = ClipStats(
        num_examples=stats.num_examples + jnp.sum(real, dtype=f32),
        num_clipped=stats.num_clipped + jnp.sum(keep & (norms > clip_norm), dtype=f32),
        num_nonfinite=stats.num_nonfinite + jnp.sum(real & ~finite, dtype=f32),
        loss_sum=stats.loss_sum + jnp.sum(jnp.where(keep, losses, 0.0), dtype=f32),
    )
    return keep, scale, stats


def scan_microbatches(
    one_microbatch: Callable[[Any, tuple[Any, jax.Array, jax.Array]], tuple[Any, None]],
    init_total: Any,
    batch: Any,
    is_padding: jax.Array,
    microbatch_size: int,
) -> tuple[Any, ClipStats]:
    """Scan `one_microbatch((total, stats), (examples, padding, index))` over the micro-batches,
    from `init_total` and zero stats; a single micro-batch runs without a loop.

    A micro-batch made only of padding rows is skipped (`lax.cond`): it would add exact zeros
    to the sum and to every count, so the result is bit-identical, and the cost of a step
    follows the realized batch (rounded up to whole micro-batches) instead of the physical cap
    that a Poisson sample is padded to. The step's duration therefore depends on
    ceil(realized size / microbatch_size), like the `nonprivate/batch_size` diagnostic: a
    timing side channel outside the guarantee, as any diagnostic on the private batch."""
    num_micro = _check_batch(batch, is_padding, microbatch_size)
    zero = _zero_like_batch(is_padding)
    init_total = jax.tree_util.tree_map(lambda x: x + zero, init_total)
    init = (init_total, ClipStats(num_examples=zero, num_clipped=zero, num_nonfinite=zero, loss_sum=zero))
    xs = (
        _split_microbatches(batch, num_micro, microbatch_size),
        is_padding.reshape(num_micro, microbatch_size),
        jnp.arange(num_micro),
    )
    if num_micro == 1:
        return one_microbatch(init, jax.tree_util.tree_map(lambda x: x[0], xs))[0]

    def skip_padding(carry: Any, mb: tuple[Any, jax.Array, jax.Array]) -> tuple[Any, None]:
        return jax.lax.cond(jnp.all(mb[1]), lambda c: c, lambda c: one_microbatch(c, mb)[0], carry), None

    return jax.lax.scan(skip_padding, init, xs)[0]


def _zeros_f32(params: Any) -> Any:
    return jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)


def clipped_grad_sum(
    loss_fn: LossFn,
    params: Any,
    batch: Any,
    is_padding: jax.Array,
    rng: jax.Array,
    *,
    clip_norm: float,
    microbatch_size: int,
    position_offset: int | jax.Array = 0,
) -> tuple[Any, ClipStats]:
    """Sum over real examples of clip(grad loss_fn(params, example, key_i), clip_norm).

    Args:
      loss_fn: loss_fn(params, example, key) of one example; params: the trained pytree.
      batch: a pytree of arrays with leading dimension P (a multiple of microbatch_size).
      is_padding: bool [P], True for rows that contribute nothing.
      rng: the step's key; example i gets fold_in(rng, position_offset + i).
      clip_norm: C; microbatch_size: examples per vectorized slice (memory only).
    Returns:
      (float32 pytree shaped like params, ClipStats); the sum has sensitivity C.
    """
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
    _check_batch(batch, is_padding, microbatch_size)
    value_and_grad = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0, 0))

    def one_microbatch(carry: tuple[Any, ClipStats], xs: tuple[Any, jax.Array, jax.Array]):
        total, stats = carry
        examples, padding, index = xs
        keys = example_keys(rng, position_offset, index, microbatch_size)
        losses, grads = value_and_grad(params, examples, keys)
        norms = jax.vmap(_global_norm)(grads)
        keep, scale, stats = clip_scale(stats, norms, losses, padding, clip_norm)

        def add(acc: jax.Array, g: jax.Array) -> jax.Array:
            bshape = (microbatch_size,) + (1,) * (g.ndim - 1)
            # where() before multiplying: 0 * NaN would still be NaN.
            g = jnp.where(keep.reshape(bshape), g.astype(_F32), 0.0)
            # A contraction over the example axis, not a broadcast-multiply + reduce: XLA CPU
            # runs the latter ~10x slower on large leaves such as a [M, V, H] embedding. HIGHEST:
            # an accelerator's default precision would round the clip factors and gradients.
            return acc + jnp.tensordot(scale, g, axes=1, precision=_HIGHEST, preferred_element_type=_F32)

        return (jax.tree_util.tree_map(add, total, grads), stats), None

    return scan_microbatches(one_microbatch, _zeros_f32(params), batch, is_padding, microbatch_size)


def grad_sum(
    loss_fn: LossFn,
    params: Any,
    batch: Any,
    is_padding: jax.Array,
    rng: jax.Array,
    *,
    microbatch_size: int,
    position_offset: int | jax.Array = 0,
) -> tuple[Any, ClipStats]:
    """Non-private counterpart: gradient of the summed loss of real examples, no per-example
    gradients and no clipping (the cost of ordinary training: one batched forward and backward
    per micro-batch, and no loop when microbatch_size is the whole batch). Same keys per
    example as `clipped_grad_sum`; `num_clipped` and `num_nonfinite` are zero."""
    per_example_loss = jax.vmap(loss_fn, in_axes=(None, 0, 0))

    def one_microbatch(carry: tuple[Any, ClipStats], xs: tuple[Any, jax.Array, jax.Array]):
        total, stats = carry
        examples, padding, index = xs
        keys = example_keys(rng, position_offset, index, microbatch_size)

        def summed(p: Any) -> jax.Array:
            return jnp.sum(jnp.where(padding, 0.0, per_example_loss(p, examples, keys)))

        loss, grads = jax.value_and_grad(summed)(params)
        total = jax.tree_util.tree_map(lambda a, g: a + g.astype(jnp.float32), total, grads)
        stats = dataclasses.replace(
            stats,
            num_examples=stats.num_examples + jnp.sum(~padding, dtype=jnp.float32),
            loss_sum=stats.loss_sum + loss.astype(jnp.float32),
        )
        return (total, stats), None

    return scan_microbatches(one_microbatch, _zeros_f32(params), batch, is_padding, microbatch_size)
