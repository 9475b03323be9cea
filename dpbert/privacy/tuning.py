"""Automatic micro-batch size: the largest that fits a memory budget, from XLA's compiled
memory analysis (nothing is executed, no private data is read).

`auto_microbatch_size(loss_fn, params, example, *, memory_budget_bytes, clip_norm,
clipping_method="vmap")` compiles the clipped sum of ONE micro-batch for power-of-two sizes
and returns the largest whose peak (arguments + outputs + temporaries) fits the budget.
Micro-batching is a performance knob only: the clipped sum, the noise and the accounting do
not depend on the size chosen (see `dpbert.privacy.clipping`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def microbatch_peak_bytes(
    loss_fn: Any, params: Any, example: Any, *, microbatch_size: int, clip_norm: float, clipping_method: str = "vmap"
) -> int:
    """Compiled peak bytes of the clipped sum over one micro-batch of `microbatch_size` examples
    shaped like `example` (one example: arrays or ShapeDtypeStructs without a batch axis)."""
    from dpbert.privacy.ghost_clipping import clipped_sum_for

    impl = clipped_sum_for("vmap" if clipping_method == "auto" else clipping_method, loss_fn)
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((microbatch_size,) + x.shape, x.dtype), example)
    padding = jax.ShapeDtypeStruct((microbatch_size,), jnp.bool_)

    def run(p, b, pad):
        return impl(loss_fn, p, b, pad, jax.random.key(0), clip_norm=clip_norm, microbatch_size=microbatch_size)

    stats = jax.jit(run).lower(jax.tree_util.tree_map(shape, params), batch, padding).compile().memory_analysis()
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
               - stats.alias_size_in_bytes)


def auto_microbatch_size(
    loss_fn: Any,
    params: Any,
    example: Any,
    *,
    memory_budget_bytes: int,
    clip_norm: float,
    clipping_method: str = "vmap",
    max_size: int = 1024,
) -> int:
    """Largest power of two <= max_size whose micro-batch peak fits `memory_budget_bytes`.

    Raises ValueError when even one example does not fit."""
    if memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes: expected > 0, got {memory_budget_bytes}")
    if max_size < 1:
        raise ValueError(f"max_size: expected >= 1, got {max_size}")
    best = 0
    size = 1
    while size <= max_size:
        peak = microbatch_peak_bytes(
            loss_fn, params, example, microbatch_size=size, clip_norm=clip_norm, clipping_method=clipping_method
        )
        if peak > memory_budget_bytes:
            break
        best, size = size, size * 2
    if not best:
        raise ValueError(
            f"memory_budget_bytes={memory_budget_bytes}: one example needs {peak} bytes; raise the budget"
        )
    return best
