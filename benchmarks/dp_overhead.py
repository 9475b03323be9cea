"""Benchmark of the DP-SGD step against the non-private step, its memory, and sampling.

Prints, for a tiny (2 layers x 128) and a mini (4 x 256) BERT at sequence length 128 and
vocabulary 8192, with the same physical batch and micro-batch:
- examples/s of the DP step (ghost clipping, mixed per-layer mode) and of the best non-private
  step (the plain mean-loss gradient, in one batched pass or accumulated over micro-batches of
  the DP size, whichever is faster here), and their ratio;
- compiled memory of the DP step at expected batch 1,024 vs 65,536 with the micro-batch fixed
  (XLA's memory analysis of the compiled step: working memory, and working memory plus the
  batch itself, which is O(B) by nature), and their ratios;
- seconds per Poisson sample call at N = 500,000,000, B = 2,097,152.

Run: `python benchmarks/dp_overhead.py [--steps 3] [--batch 64] [--microbatch 4]` (defaults as `dpbert bench`).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import BertConfig

from dpbert.bench import DEFAULT_BATCH, DEFAULT_MICROBATCH
from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM
from dpbert.model.ghost import MLMGhostLoss
from dpbert.privacy import (
    default_optimizer,
    make_dp_train_step,
    make_train_step,
    physical_batch_size,
    poisson_sample,
    step_key,
)

SEQ, VOCAB, MASKED = 128, 8192, 20  # 20 of 128 positions ~ 15% masking
CONFIGS = {"tiny (2x128)": (2, 128), "mini (4x256)": (4, 256)}


def build(layers: int, hidden: int):
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 2),
        intermediate_size=4 * hidden,
        max_position_embeddings=SEQ,
    )
    graphdef, params = functional.split_params(BertForMaskedLM(config, rngs=nnx.Rngs(0)))
    return MLMGhostLoss(graphdef=graphdef), params


def batch_of(n: int):
    rng = np.random.default_rng(0)
    return {
        "input_ids": jnp.asarray(rng.integers(5, VOCAB, size=(n, SEQ)), jnp.int32),
        "attention_mask": jnp.ones((n, SEQ), jnp.int32),
        "masked_positions": jnp.asarray(np.sort(rng.choice(SEQ, size=(n, MASKED)), axis=1), jnp.int32),
        "labels": jnp.asarray(rng.integers(5, VOCAB, size=(n, MASKED)), jnp.int32),
        "label_weights": jnp.ones((n, MASKED), jnp.float32),
    }


def examples_per_second(steps_fns: dict, params, opt, batch, pad, steps: int) -> dict[str, float]:
    """Examples/s of each step (best of `steps` after a warm-up); the steps take turns, so a
    change of machine load hits all of them alike."""
    key = jax.random.key(0)
    state = {}
    for name, step in steps_fns.items():
        p = jax.tree.map(jnp.copy, params)  # the step donates its inputs
        p, s, m = step(p, opt.init(p), batch, pad, step_key(key, 0))  # compile + warm up
        jax.block_until_ready(m)
        state[name] = (p, s)
    best = dict.fromkeys(steps_fns, float("inf"))
    for t in range(1, steps + 1):
        for name, step in steps_fns.items():
            start = time.perf_counter()
            p, s, m = step(*state[name], batch, pad, step_key(key, t))
            jax.block_until_ready((p, m))
            best[name] = min(best[name], time.perf_counter() - start)
            state[name] = (p, s)
    return {name: pad.shape[0] / sec for name, sec in best.items()}


def compiled_memory(loss_fn, params, opt, expected: int, microbatch: int) -> tuple[int, int]:
    """(working bytes, working + argument bytes) of the compiled DP step at this expected batch."""
    physical = physical_batch_size(expected, 10 * expected, multiple=microbatch)
    step = make_dp_train_step(
        loss_fn,
        opt,
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=expected,
        microbatch_size=microbatch,
        clipping_method="ghost",
    )
    shapes = jax.eval_shape(lambda: batch_of(1))
    batch = {k: jax.ShapeDtypeStruct((physical,) + v.shape[1:], v.dtype) for k, v in shapes.items()}
    pad = jax.ShapeDtypeStruct((physical,), jnp.bool_)
    opt_state = jax.eval_shape(opt.init, params)
    key = jax.eval_shape(lambda: jax.random.key(0))
    mem = step.lower(params, opt_state, batch, pad, key).compile().memory_analysis()
    work = mem.temp_size_in_bytes
    return work, work + mem.argument_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH["mini"], help="physical batch for throughput")
    parser.add_argument("--microbatch", type=int, default=DEFAULT_MICROBATCH)
    args = parser.parse_args()
    print(f"devices: {jax.devices()}")
    pad = jnp.zeros(args.batch, bool)
    batch = batch_of(args.batch)
    for name, (layers, hidden) in CONFIGS.items():
        loss_fn, params = build(layers, hidden)
        opt = default_optimizer(1e-4)
        dp = make_dp_train_step(
            loss_fn,
            opt,
            clip_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=args.batch,
            microbatch_size=args.microbatch,
            clipping_method="ghost",
        )
        rates = examples_per_second(
            {
                "dp": dp,
                "one pass": make_train_step(loss_fn, opt, microbatch_size=args.batch),
                "micro-batches": make_train_step(loss_fn, opt, microbatch_size=args.microbatch),
            },
            params,
            opt,
            batch,
            pad,
            args.steps,
        )
        dp_rate = rates.pop("dp")
        best = max(rates, key=rates.get)
        print(
            f"{name}: DP step (ghost) {dp_rate:8.1f} ex/s | non-private one pass {rates['one pass']:8.1f}, "
            f"micro-batches {rates['micro-batches']:8.1f} ex/s | DP/best non-private ({best}) = "
            f"{dp_rate / rates[best]:.2f}  (batch {args.batch}, micro-batch {args.microbatch}, seq {SEQ})"
        )
        small = compiled_memory(loss_fn, params, opt, 1024, args.microbatch)
        large = compiled_memory(loss_fn, params, opt, 65_536, args.microbatch)
        print(
            f"{name}: DP step memory, expected batch 1,024 vs 65,536 (micro-batch {args.microbatch}): "
            f"working {small[0] / 2**20:.1f} MiB vs {large[0] / 2**20:.1f} MiB (ratio {large[0] / small[0]:.3f}); "
            f"with the batch itself {small[1] / 2**20:.1f} vs {large[1] / 2**20:.1f} MiB (ratio {large[1] / small[1]:.2f})"
        )
    n, b = 500_000_000, 2_097_152
    physical = physical_batch_size(b, n)
    key = jax.random.key(0)
    poisson_sample(key, 0, n, b, physical)
    start = time.perf_counter()
    for t in range(1, 4):
        sample = poisson_sample(key, t, n, b, physical)
    per_call = (time.perf_counter() - start) / 3
    print(
        f"sampling: N={n:,} B={b:,} physical {physical:,} (+{(physical - b) / b:.2%}): {per_call:.3f} s per call, "
        f"{sample.indices.nbytes / 2**20:.0f} MiB of indices"
    )


if __name__ == "__main__":
    main()
