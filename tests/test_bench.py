"""dpbert bench: the table and the JSON object report DP over the best non-private step."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
from pathlib import Path

import pytest

from dpbert.bench import NONPRIVATE_ROWS, TORCH_BF16_ROW, TORCH_ROW, _peer_rows_in_processes, format_table
from dpbert.cli import build_parser, main
from dpbert.config.plan import make_plan
from dpbert.config.recipe import load_recipe


@pytest.mark.parametrize("microbatch", ["1", "auto"])
def test_bench_ratio_is_over_the_best_nonprivate_row(capsys, tmp_path, microbatch):
    assert (
        main(
            [
                "bench",
                "--batch",
                "4",
                "--microbatch",
                microbatch,
                "--steps",
                "1",
                "--no-peers",
                "--no-memory",
                "--no-vmap",
                "--json",
                "--layer-mode",
                "ghost",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    result = json.loads(out)
    sizes = result["microbatch_by_row"]
    assert set(sizes) == {NONPRIVATE_ROWS[1], "dpbert DP (ghost)"}
    # "auto" picks each row's fastest proper divisor of the batch (1 or 2 here, never the whole batch).
    assert set(sizes.values()) <= ({1} if microbatch == "1" else {1, 2})
    rows = result["examples_per_s"]
    best = max(rows[k] for k in NONPRIVATE_ROWS)
    assert result["best_nonprivate"] in NONPRIVATE_ROWS and result["layer_mode"] == "ghost"
    assert abs(result["dp_over_nonprivate"] - rows["dpbert DP (ghost)"] / best) < 1e-9
    assert rows["dpbert DP (vmap)"].startswith("skipped")
    assert result["over_opacus"] is None and result["memory_65536_over_1024"] is None
    # The noise draw is timed on its own: its share of the DP step is the ratio of two timings (one
    # step each here, so a loaded machine can push it past 1; the bench reports, it does not bound).
    assert result["noise_ms_per_step"] > 0 and result["noise_fraction_of_dp_step"] > 0
    table = format_table(result)
    assert "best DP / best non-private" in table and "dpbert DP (ghost)" in table and "noise draw" in table
    assert ("fastest micro-batch" in table) == (microbatch == "auto")
    # benchmarks/gpu.sh's table reads this JSON as it is.
    (tmp_path / "bench-base-bfloat16-256.out").write_text(out)
    gpu_table = _gpu_table().table(tmp_path)
    assert f"DP / non-private:        {result['dp_over_nonprivate']:.2f} (" in gpu_table
    assert "DP / best Opacus:        n/a" in gpu_table and "large bfloat16 256: not measured" in gpu_table


def _gpu_table():
    spec = importlib.util.spec_from_file_location(
        "gpu_table", Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_refuses_a_bad_microbatch(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--microbatch", "four"])
    assert "expected a positive integer or 'auto', got 'four'" in capsys.readouterr().err
    assert main(["bench", "--batch", "6", "--microbatch", "4", "--no-peers"]) != 0
    assert "batch: expected a positive multiple of microbatch (4), got 6" in capsys.readouterr().err


def test_cpu_peers_run_here_and_name_their_device(capsys):
    """Without CUDA, the PyTorch and Opacus rows (bf16 autocast included) run in this process, in
    the round robin, each row naming its device; an Opacus mode that cannot run says why."""
    assert (
        main(
            [
                "bench",
                "--batch",
                "2",
                "--microbatch",
                "1",
                "--steps",
                "1",
                "--no-memory",
                "--no-vmap",
                "--json",
                "--layer-mode",
                "ghost",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    rows, devices = result["examples_per_s"], result["device_by_row"]
    assert result["peer_device"] == "cpu" and result["torch_reference"] == TORCH_ROW
    for row in (TORCH_ROW, TORCH_BF16_ROW, "opacus DP (hooks)", "dpbert DP (ghost)"):
        assert rows[row] > 0, row
    assert devices[TORCH_BF16_ROW].startswith("cpu:") and devices["dpbert DP (ghost)"] == "cpu:cpu"
    assert rows["opacus DP (ghost)"].startswith("failed:") and devices["opacus DP (ghost)"] is None
    assert abs(result["nonprivate_over_torch"] - rows[result["best_nonprivate"]] / rows[TORCH_ROW]) < 1e-9
    assert "   cpu:" in format_table(result)


def test_peer_rows_in_their_own_processes():
    """The CUDA path's protocol, run on the CPU: one child process per row reports its rate and
    device; a child that overruns its time is reported, not waited for."""
    rates, notes, devices = _peer_rows_in_processes("tiny", 2, 1, 300, device="cpu", rows=[TORCH_BF16_ROW])
    assert rates[TORCH_BF16_ROW] > 0 and devices[TORCH_BF16_ROW].startswith("cpu:") and notes == {}
    rates, notes, _ = _peer_rows_in_processes("tiny", 2, 1, 0.05, device="cpu", rows=[TORCH_ROW])
    assert rates == {} and notes == {TORCH_ROW: "failed: no result within 0.05 s"}


GPU_SH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.sh"
GPU_STEPS = {
    "bench-base-float32-64",
    "bench-base-bfloat16-64",
    "bench-base-float32-256",
    "bench-base-bfloat16-256",
    "bench-large-bfloat16-256",
    "pretrain-dp",
    "pretrain-nonprivate",
}


def test_gpu_script_parses_and_every_step_is_valid():
    """benchmarks/gpu.sh: valid bash; within 8 minutes by construction (its budget, plus timeout's
    kill grace); every dpbert command line it runs parses, with a recipe and overrides the
    pretraining accepts and a privacy plan within the recipe's target epsilon."""
    subprocess.run(["bash", "-n", str(GPU_SH)], check=True)
    lines = subprocess.run(
        ["bash", str(GPU_SH), "--dry-run"], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    budget = int(lines[0].removeprefix("budget "))
    assert budget + 5 <= 8 * 60
    steps = {}
    for line in lines[1:]:
        name, cap, *argv = shlex.split(line)
        assert 30 <= int(cap) <= budget and argv[1:3] == ["-m", "dpbert.cli"], line
        steps[name] = build_parser().parse_args(argv[3:])
    assert set(steps) == GPU_STEPS
    for name, args in steps.items():
        if args.command == "bench":
            model, dtype, batch = name.split("-")[1:]
            assert (args.model, "bfloat16" if args.bfloat16 else "float32", args.batch) == (model, dtype, int(batch))
            assert args.batch % args.microbatch == 0 and args.json
            continue
        recipe = load_recipe(Path(GPU_SH.parents[1], args.recipe), args.set)
        assert (recipe.schedule[0].expected_batch_size, recipe.total_steps) == (4096, 300)
        assert recipe.privacy.enabled == (name == "pretrain-dp")
        plan = make_plan(recipe, recipe.privacy.dataset_size or 94000)
        assert plan.ledger is None or plan.ledger.epsilon() <= recipe.privacy.target_epsilon


def test_gpu_table_ratios_borrowed_peers_and_pretraining(tmp_path):
    def bench(dtype: str, peers: bool) -> dict:
        rows = {"dpbert non-private (one pass)": 3200.0, "dpbert DP (ghost)": 2880.0}
        rows |= (
            {
                TORCH_ROW: 2000.0,
                TORCH_BF16_ROW: 2800.0,
                "opacus DP (hooks)": 600.0,
                "opacus DP (ghost)": "failed: ValueError: Parameter tying is not supported",
            }
            if peers
            else {}
        )
        return {
            "dtype": dtype,
            "examples_per_s": rows,
            "device_by_row": dict.fromkeys(rows, "gpu:H200"),
            "compile_seconds": {"dpbert DP (ghost)": 12.5, "dpbert non-private (one pass)": 4.0},
            "best_dp": "dpbert DP (ghost)",
            "best_nonprivate": "dpbert non-private (one pass)",
            "dp_over_nonprivate": 0.9,
        }

    (tmp_path / "bench-base-bfloat16-256.out").write_text("log line\n" + json.dumps(bench("bfloat16", True)))
    (tmp_path / "bench-base-float32-256.out").write_text(json.dumps(bench("float32", False)))
    for name, rate, accuracy in (("dp", 90000.0, 0.12), ("nonprivate", 100000.0, 0.15)):
        records = [
            {
                "kind": "train",
                "step": s,
                "step_time_s": 20.0 if s == 1 else 0.05,
                "examples_per_s": 1.0 if s <= 5 else rate,
                "epsilon": 8.0 if name == "dp" else None,
            }
            for s in range(1, 301)
        ] + [{"kind": "eval", "step": 300, "eval_mlm_accuracy": accuracy}]
        (tmp_path / f"pretrain-{name}.metrics.jsonl").write_text("\n".join(map(json.dumps, records)))
    (tmp_path / "notes.txt").write_text("bench-base-float32-64: skipped, out of time\n")
    text = _gpu_table().table(tmp_path)
    # 2,880 / 3,200 = 0.90; 2,880 / 600 = 4.80; 3,200 / 2,800 = 1.14; 90,000 / 100,000 = 0.90.
    assert "base bf16 256 DP / non-private:        0.90 (meets >= 0.9)" in text
    assert "base bf16 256 DP / best Opacus:        4.80 (meets >= 3)" in text
    assert "base bf16 256 non-private / torch bf16: 1.14 (meets >= 1)" in text
    assert "gpu:H200 (from the bfloat16 run)" in text and "Parameter tying" in text
    assert "DP / non-private:   0.90 examples/s; held-out accuracy 0.1200 vs 0.1500" in text
    assert "      20.0     90000.0   held-out MLM accuracy 0.1200, epsilon 8.00" in text
    assert "skipped, out of time" in text and "large bfloat16 256: not measured" in text
