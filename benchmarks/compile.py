"""Compile seconds and peak compile memory of dpbert's steps (issue 30, items 1 and 3).

Every figure is measured in a FRESH subprocess (no jit cache, its own peak resident memory),
by ahead-of-time lowering and compilation from abstract arrays (`jax.ShapeDtypeStruct`s: no
weight is ever materialized, so BERT-Large costs nothing to build):

- `presets`: for the bench presets tiny (2 x 128), mini (4 x 256), base (12 x 768) and large
  (24 x 1024 x 16 heads, vocabulary 30,522), at sequence length 128 with 20 decoded positions,
  batch 16 in micro-batches of 4: seconds to lower (trace) and to compile
  - the non-private step (`make_train_step`, one batched pass),
  - the ghost-clipped DP step (`make_dp_train_step(clipping_method="ghost")`: clipped sum,
    noise, optimizer update),
  - the ghost-clipped sum alone (the part the scan over layers changes), and
  - the noise draw alone (`privatize`: one Gaussian per parameter);
- `microbatch`: the tiny recipe (`recipes/tiny.yaml` of the dpbert measured, with one stage at an
  expected batch of 4,096 and the 30,522-token vocabulary: 4.4M parameters), compiled
  as `dpbert pretrain recipes/tiny.yaml --compile-only` does (`dpbert.train.compile.compile_step`:
  full DP step and the separate update), at micro-batch 16, 64, 256 and 1,024, and its
  non-private twin; seconds and peak resident memory (`ru_maxrss`) of the process. A child
  that grows past `--rss-cap-gb` is killed (reported as such) so that a blow-up cannot take
  a shared machine down.

Run: `python benchmarks/compile.py presets [--models tiny mini base large]`,
`python benchmarks/compile.py microbatch [--sizes 16 64 256 1024]`; add `--json` for JSON
lines and `--repeat N` to keep the fastest of N fresh processes. Wall seconds on a shared machine
carry its load (reported beside each figure); the compile's CPU seconds (`compile_cpu_s`,
`cpu_s`) much less so. It uses only APIs that existed before the scanned encoder, so the same script measures
an older checkout (`PYTHONPATH=/path/to/old/checkout python benchmarks/compile.py ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, PREDICTIONS = 128, 20
PRESETS = {  # layers, hidden, heads, vocabulary (as dpbert.bench)
    "tiny": (2, 128, 2, 8192),
    "mini": (4, 256, 4, 8192),
    "base": (12, 768, 12, 8192),
    "large": (24, 1024, 16, 30522),
}
BATCH, MICROBATCH = 16, 4
RECIPE_VOCAB = 30522


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _timed(fn) -> tuple[float, float, float, object]:
    """(lowering seconds, compile seconds, compile CPU seconds of this process, compiled)."""
    started = time.perf_counter()
    lowered = fn()
    lowered_at = time.perf_counter()
    cpu = time.process_time()
    compiled = lowered.compile()
    return lowered_at - started, time.perf_counter() - lowered_at, time.process_time() - cpu, compiled


def child_preset(model: str, what: str) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from transformers import BertConfig

    from dpbert.model import functional
    from dpbert.model.bert import BertForMaskedLM
    from dpbert.model.ghost import MLMGhostLoss
    from dpbert.privacy.dp_step import make_dp_train_step, make_train_step
    from dpbert.privacy.ghost_clipping import ghost_clipped_grad_sum
    from dpbert.privacy.noise import privatize

    layers, hidden, heads, vocab = PRESETS[model]
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    graphdef, params = functional.split_params(nnx.eval_shape(lambda: BertForMaskedLM(config, rngs=nnx.Rngs(0))))
    loss = MLMGhostLoss(graphdef=graphdef)
    optimizer = optax.sgd(1e-4)
    opt_state = jax.eval_shape(optimizer.init, params)
    i32, f32 = jnp.int32, jnp.float32
    batch = {
        "input_ids": jax.ShapeDtypeStruct((BATCH, SEQ), i32),
        "attention_mask": jax.ShapeDtypeStruct((BATCH, SEQ), i32),
        "masked_positions": jax.ShapeDtypeStruct((BATCH, PREDICTIONS), i32),
        "labels": jax.ShapeDtypeStruct((BATCH, PREDICTIONS), i32),
        "label_weights": jax.ShapeDtypeStruct((BATCH, PREDICTIONS), f32),
    }
    padding = jax.ShapeDtypeStruct((BATCH,), jnp.bool_)
    key = jax.eval_shape(lambda: jax.random.key(0))
    base_rss = _rss_gb()
    if what == "nonprivate":
        step = make_train_step(loss, optimizer, microbatch_size=BATCH, donate=False)
        lower = lambda: step.lower(params, opt_state, batch, padding, key)  # noqa: E731
    elif what == "dp":
        step = make_dp_train_step(
            loss,
            optimizer,
            clip_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=BATCH,
            microbatch_size=MICROBATCH,
            donate=False,
            clipping_method="ghost",
        )
        lower = lambda: step.lower(params, opt_state, batch, padding, key)  # noqa: E731
    elif what == "ghost_sum":
        fn = jax.jit(
            lambda p, b, pad, k: ghost_clipped_grad_sum(loss, p, b, pad, k, clip_norm=1.0, microbatch_size=MICROBATCH)
        )
        lower = lambda: fn.lower(params, batch, padding, key)  # noqa: E731
    elif what == "noise":
        fn = jax.jit(lambda p, k: privatize(p, k, clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=BATCH))
        lower = lambda: fn.lower(params, key)  # noqa: E731
    else:
        raise ValueError(what)
    lower_s, compile_s, compile_cpu_s, _ = _timed(lower)
    return {
        "kind": "preset",
        "model": model,
        "what": what,
        "lower_s": round(lower_s, 2),
        "compile_s": round(compile_s, 2),
        "compile_cpu_s": round(compile_cpu_s, 2),
        "total_s": round(lower_s + compile_s, 2),
        "rss_before_gb": round(base_rss, 2),
        "peak_rss_gb": round(_rss_gb(), 2),
    }


def child_microbatch(size: int, private: bool, expected: int) -> dict:
    import dpbert
    from dpbert.config.recipe import NONPRIVATE_OVERRIDES, load_recipe
    from dpbert.train.compile import compile_step
    from dpbert.train.mesh import make_mesh

    # The recipe file of the dpbert being measured, at the shape: one stage at `expected`,
    # the full bert-base-uncased vocabulary (4.4M parameters), whatever the file's schedule says.
    overrides = [
        f"train.microbatch_size={size}",
        f"schedule=[{{steps: 300, expected_batch_size: {expected}}}]",
        f"model.vocab_size={RECIPE_VOCAB}",
    ]
    if not private:
        overrides.extend(NONPRIVATE_OVERRIDES)
    recipe = load_recipe(Path(dpbert.__file__).resolve().parents[1] / "recipes" / "tiny.yaml", overrides)
    started, cpu = time.perf_counter(), time.process_time()
    report = compile_step(recipe, make_mesh())
    return {
        "kind": "microbatch",
        "cpu_s": round(time.process_time() - cpu, 2),
        "private": private,
        "microbatch": size,
        "expected_batch": expected,
        "physical_batch": report.physical_batch_size,
        "params": report.num_params,
        "compile_s": round(report.compile_seconds, 2),
        "wall_s": round(time.perf_counter() - started, 2),
        "peak_rss_gb": round(_rss_gb(), 2),
        "temp_gib": round(report.temp_bytes / 2**30, 3),
    }


def run_child(args: list[str], rss_cap_gb: float, timeout_s: float) -> dict:
    """Run this script as a child; kill it past `rss_cap_gb` resident or `timeout_s` seconds."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, __file__, "_child", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    killed: list[str] = []

    def watch() -> None:
        started = time.time()
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20
            except (OSError, StopIteration):
                rss = 0.0
            if rss > rss_cap_gb:
                killed.append(f"killed at {rss:.1f} GB resident (cap {rss_cap_gb} GB)")
            elif time.time() - started > timeout_s:
                killed.append(f"killed after {timeout_s:.0f} s")
            if killed:
                proc.kill()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    started = time.perf_counter()
    watcher.start()
    out, err = proc.communicate()
    watcher.join()
    if killed:
        return {"args": args, "error": killed[0], "wall_s": round(time.perf_counter() - started, 1)}
    if proc.returncode:
        return {"args": args, "error": (err.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        kind, *rest = argv[1:]
        if kind == "preset":
            result = child_preset(rest[0], rest[1])
        else:
            result = child_microbatch(int(rest[0]), rest[1] == "dp", int(rest[2]))
        print(json.dumps(result))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["presets", "microbatch"])
    p.add_argument("--models", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument(
        "--what",
        nargs="+",
        default=["nonprivate", "dp", "ghost_sum", "noise"],
        choices=["nonprivate", "dp", "ghost_sum", "noise"],
    )
    p.add_argument("--sizes", nargs="+", type=int, default=[16, 64, 256, 1024])
    p.add_argument("--expected-batch", type=int, default=4096)
    p.add_argument("--no-nonprivate", action="store_true", help="microbatch: skip the non-private twin")
    p.add_argument("--rss-cap-gb", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="fresh processes per figure; the fastest is kept (the machine's load only ever adds time)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    jobs: list[list[str]] = []
    if args.mode == "presets":
        jobs = [["preset", m, w] for m in args.models for w in args.what]
    else:
        for size in args.sizes:
            jobs.append(["microbatch", str(size), "dp", str(args.expected_batch)])
            if not args.no_nonprivate:
                jobs.append(["microbatch", str(size), "nonprivate", str(args.expected_batch)])
    for job in jobs:
        runs = []
        for _ in range(args.repeat):
            runs.append(run_child(job, args.rss_cap_gb, args.timeout) | {"load_avg_1m": round(os.getloadavg()[0], 1)})
            if "error" in runs[-1]:
                break
        ok = [r for r in runs if "error" not in r]
        key = "total_s" if job[0] == "preset" else "compile_s"
        result = min(ok, key=lambda r: r[key]) if ok else runs[-1]
        if len(ok) > 1:
            result[f"{key}_all"] = [r[key] for r in ok]
        print(json.dumps(result) if args.json else " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
