"""The one table of benchmarks/gpu.sh, from the files its steps leave in OUT.

Usage: python benchmarks/gpu_table.py OUT

Reads `bench-<model>-<dtype>-<batch>.out` (`dpbert bench --json`) and
`pretrain-<dp|nonprivate>.metrics.jsonl`, and prints every row (compile seconds, examples/s, the
device it ran on), the ratios against issue 30's targets, and `notes.txt` (steps that failed, timed
out or were skipped). PyTorch and Opacus rows do not depend on dpbert's dtype: a run without peers
borrows them from the run of the same model and batch that has them, and says so.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

BENCH_RUNS = (
    ("base", "float32", 64),
    ("base", "bfloat16", 64),
    ("base", "float32", 256),
    ("base", "bfloat16", 256),
    ("large", "bfloat16", 256),
)
PEERS = (
    "torch non-private",
    "torch non-private (bf16 autocast)",
    "opacus DP",
    "opacus DP (hooks)",
    "opacus DP (ghost)",
)
TORCH_BF16 = "torch non-private (bf16 autocast)"
LARGE_DP_TARGET = 1265.0  # PyTorch BERT-Large with bf16 autocast, batch 256, on the H200 (examples/s)
MAX_COMPILE_S = 60.0
# Steps of a pretraining run left out of its examples/s: the first includes the compilation.
WARMUP_STEPS = 5


def load_bench(out: Path) -> dict[tuple[str, str, int], dict[str, Any]]:
    """The bench results found in `out`, by (model, dtype, batch); peers borrowed where missing."""
    found = {}
    for model, dtype, batch in BENCH_RUNS:
        path = out / f"bench-{model}-{dtype}-{batch}.out"
        text = path.read_text().strip() if path.is_file() else ""
        if text:
            found[model, dtype, batch] = json.loads(text.splitlines()[-1])
    for (model, _, batch), result in found.items():
        if any(p in result["examples_per_s"] for p in PEERS):
            continue
        donors = [
            r
            for (m, _, b), r in found.items()
            if (m, b) == (model, batch) and any(p in r["examples_per_s"] for p in PEERS)
        ]
        if donors:
            for p in PEERS:
                if p in donors[0]["examples_per_s"]:
                    result["examples_per_s"][p] = donors[0]["examples_per_s"][p]
                    result["device_by_row"][p] = (
                        f"{donors[0]['device_by_row'].get(p)} (from the {donors[0]['dtype']} run)"
                    )
    return found


def pretrain_summary(path: Path) -> dict[str, Any] | None:
    """Compile (first step) seconds, median examples/s after WARMUP_STEPS, last held-out MLM
    accuracy and epsilon of a `metrics.jsonl`; None when the file is absent."""
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    rates = [r["examples_per_s"] for r in train if r["step"] > WARMUP_STEPS]
    return {
        "steps": train[-1]["step"] if train else 0,
        "first_step_s": train[0]["step_time_s"] if train else None,
        "examples_per_s": statistics.median(rates) if rates else None,
        "accuracy": evals[-1]["eval_mlm_accuracy"] if evals else None,
        "epsilon": train[-1].get("epsilon") if train else None,
    }


def _num(value: Any, fmt: str = ".1f") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, float) and isinstance(b, float) and b else None


def _check(value: float | None, target: float, at_least: bool = True) -> str:
    if value is None:
        return "n/a"
    ok = value >= target if at_least else value <= target
    return f"{value:.2f} ({'meets' if ok else 'misses'} {'>=' if at_least else '<='} {target:g})"


def table(out: Path) -> str:
    """The whole report of one gpu.sh run in `out`, as text."""
    lines = [f"{'run':<22}{'row':<36}{'compile s':>10}{'examples/s':>12}   device / note"]
    found = load_bench(out)
    for (model, dtype, batch), r in found.items():
        for row, value in r["examples_per_s"].items():
            device = r["device_by_row"].get(row) or ""
            compile_s = r["compile_seconds"].get(row)
            rate = _num(value) if isinstance(value, float) else ""
            note = device if isinstance(value, float) else value
            lines.append(f"{f'{model} {dtype} {batch}':<22}{row:<36}{_num(compile_s):>10}{rate:>12}   {note}")
    runs = {name: pretrain_summary(out / f"pretrain-{name}.metrics.jsonl") for name in ("dp", "nonprivate")}
    for name, s in runs.items():
        if s is not None:
            label = f"{name} ({s['steps']} steps)"
            lines.append(
                f"{'tiny B=4096 pretrain':<22}{label:<36}{_num(s['first_step_s']):>10}"
                f"{_num(s['examples_per_s']):>12}   held-out MLM accuracy {_num(s['accuracy'], '.4f')}, "
                f"epsilon {_num(s['epsilon'], '.2f')} (compile s: the first step)"
            )
    lines.append("")
    lines.append("targets (issue 30, one H200):")
    for model in ("base", "large"):
        r = found.get((model, "bfloat16", 256))
        if r is None:
            lines.append(f"  {model} bfloat16 256: not measured")
            continue
        rows = r["examples_per_s"]
        dp = rows.get(r["best_dp"])
        opacus = [v for k, v in rows.items() if k.startswith("opacus") and isinstance(v, float)]
        lines.append(f"  {model} bf16 256 DP / non-private:        {_check(r['dp_over_nonprivate'], 0.90)}")
        lines.append(
            f"  {model} bf16 256 DP / best Opacus:        {_check(_ratio(dp, max(opacus)) if opacus else None, 3.0)}"
        )
        lines.append(
            f"  {model} bf16 256 non-private / torch bf16: "
            f"{_check(_ratio(rows.get(r['best_nonprivate']), rows.get(TORCH_BF16)), 1.0)}"
        )
        if model == "large":
            lines.append(f"  large bf16 256 DP examples/s:            {_check(dp, LARGE_DP_TARGET)}")
            longest = max((v for v in r["compile_seconds"].values() if v is not None), default=None)
            lines.append(f"  large longest compile, s:                {_check(longest, MAX_COMPILE_S, at_least=False)}")
    dp, np_ = runs["dp"], runs["nonprivate"]
    if dp and np_:
        lines.append(
            f"  tiny B=4096 pretrain DP / non-private:   "
            f"{_num(_ratio(dp['examples_per_s'], np_['examples_per_s']), '.2f')} examples/s; held-out "
            f"accuracy {_num(dp['accuracy'], '.4f')} vs {_num(np_['accuracy'], '.4f')}"
        )
    notes = out / "notes.txt"
    if notes.is_file():
        lines += ["", "notes:", *(f"  {line}" for line in notes.read_text().splitlines())]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
