"""Automatic micro-batch size, chosen without private data.

- `auto_microbatch_size(loss_fn, params, example, *, memory_budget_bytes, clip_norm,
  clipping_method="vmap")`: the largest power of two whose compiled clipped sum over ONE
  micro-batch fits the budget (XLA's memory analysis: nothing is executed).
- `fastest_microbatch_size(sum_fn, params, example, *, candidates, memory_budget_bytes=None)`:
  the candidate with the most examples/s, timed on placeholder inputs (never on private data)
  among those that fit the budget; `sum_fn` is any clipped or plain gradient sum with the
  signature of `dpbert.privacy.clipping.clipped_grad_sum` minus the loss.
- `time_clipping_methods(loss, params, batch, ...)`: seconds per micro-batch of vmap and ghost
  clipping on placeholders (what `dpbert.privacy.dp_step.clipped_sum_for("auto", ...)` picks by).

Micro-batching and the clipping method are performance knobs only: the clipped sum, the noise
and the accounting do not depend on the choice (see `dpbert.privacy.clipping`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpbert.privacy.clipping import clipped_grad_sum
from dpbert.privacy.ghost_clipping import GhostLoss, ghost_clipped_grad_sum


def microbatch_peak_bytes(
    loss_fn: Any, params: Any, example: Any, *, microbatch_size: int, clip_norm: float, clipping_method: str = "vmap"
) -> int:
    """Compiled peak bytes of the clipped sum over one micro-batch of `microbatch_size` examples
    shaped like `example` (one example: arrays or ShapeDtypeStructs without a batch axis)."""
    impl = ghost_clipped_grad_sum if clipping_method == "ghost" else clipped_grad_sum
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((microbatch_size,) + x.shape, x.dtype), example)
    padding = jax.ShapeDtypeStruct((microbatch_size,), jnp.bool_)

    def run(p, b, pad):
        return impl(loss_fn, p, b, pad, jax.random.key(0), clip_norm=clip_norm, microbatch_size=microbatch_size)

    return peak_bytes(jax.jit(run).lower(jax.tree_util.tree_map(shape, params), batch, padding).compile())


def peak_bytes(compiled: Any) -> int:
    """Peak bytes of a compiled function from XLA's memory analysis: arguments, outputs and
    temporaries, donated (aliased) buffers counted once."""
    stats = compiled.memory_analysis()
    return int(
        stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    )


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
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes}: one example needs {peak} bytes; raise the budget")
    return best


def placeholder(x: Any, batch: int | None = None) -> np.ndarray:
    """An input shaped like `x` (array or ShapeDtypeStruct; `batch` rows in front when given),
    small non-zero floats (softmax and norms stay in their normal regime) and zero integers
    (valid token ids and positions)."""
    shape = tuple(x.shape) if batch is None else (batch, *x.shape)
    return np.full(shape, 0.02 if jnp.issubdtype(x.dtype, jnp.floating) else 0, x.dtype)


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall-clock seconds of `repeats` calls of `fn` after one warm-up call."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def fastest_microbatch_size(
    sum_fn: Callable[..., Any],
    params: Any,
    example: Any,
    *,
    candidates: Sequence[int] = (1, 2, 4, 8, 16, 32),
    memory_budget_bytes: int | None = None,
    repeats: int = 3,
) -> tuple[int, dict[int, float]]:
    """(fastest size, seconds per example of each candidate timed) for
    `sum_fn(params, batch, is_padding, rng, microbatch_size=m)` over one micro-batch of m
    placeholder examples shaped like `example` (one example, no batch axis). Candidates are
    tried in increasing order and stop at the first whose compiled peak exceeds
    `memory_budget_bytes` (None: no limit). Raises ValueError when none fits."""
    sizes = sorted(set(candidates))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"candidates: expected positive integers, got {list(candidates)}")
    if memory_budget_bytes is not None and memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes: expected > 0 or None, got {memory_budget_bytes}")
    p = jax.tree_util.tree_map(placeholder, params)
    per_example: dict[int, float] = {}
    for m in sizes:
        batch = jax.tree_util.tree_map(lambda x, m=m: placeholder(x, m), example)
        padding = np.zeros((m,), np.bool_)
        run = jax.jit(lambda p, b, pad, m=m: sum_fn(p, b, pad, jax.random.key(0), microbatch_size=m))
        compiled = run.lower(p, batch, padding).compile()
        if memory_budget_bytes is not None and peak_bytes(compiled) > memory_budget_bytes:
            break
        per_example[m] = best_seconds(lambda c=compiled, b=batch, pad=padding: c(p, b, pad), repeats) / m
    if not per_example:
        raise ValueError(
            f"memory_budget_bytes={memory_budget_bytes}: a micro-batch of {sizes[0]} does not fit; raise the budget"
        )
    return min(per_example, key=per_example.get), per_example


def time_clipping_methods(
    loss: GhostLoss, params: Any, batch: Any, *, clip_norm: float, microbatch_size: int, repeats: int = 3
) -> dict[str, float]:
    """Seconds per micro-batch of each clipping method, measured on placeholder inputs with the
    shapes of `params` and of one micro-batch of `batch` (never on private data; arrays or
    ShapeDtypeStructs are accepted). Best of `repeats` runs after one warm-up."""
    # Concrete evaluation even when called while an outer step is being traced.
    with jax.ensure_compile_time_eval():
        p = jax.tree_util.tree_map(placeholder, params)
        b = jax.tree_util.tree_map(
            lambda x: placeholder(jax.ShapeDtypeStruct(x.shape[1:], x.dtype), microbatch_size), batch
        )
        pad = np.zeros((microbatch_size,), np.bool_)
        key = jax.random.key(0)
        seconds = {}
        for name, impl in {"vmap": clipped_grad_sum, "ghost": ghost_clipped_grad_sum}.items():
            fn = (
                jax.jit(
                    lambda p, b, impl=impl: impl(
                        loss, p, b, pad, key, clip_norm=clip_norm, microbatch_size=microbatch_size
                    )
                )
                .lower(p, b)
                .compile()
            )
            seconds[name] = best_seconds(lambda fn=fn: fn(p, b), repeats)
    return seconds
