"""dpbert bench: the table and the JSON object report DP over the best non-private step."""

from __future__ import annotations

import json

import pytest

from dpbert.bench import NONPRIVATE_ROWS, TORCH_BF16_ROW, TORCH_ROW, _peer_rows_in_processes, format_table
from dpbert.cli import main


@pytest.mark.parametrize("microbatch", ["1", "auto"])
def test_bench_ratio_is_over_the_best_nonprivate_row(capsys, microbatch):
    assert main(["bench", "--batch", "4", "--microbatch", microbatch, "--steps", "1", "--no-peers", "--no-memory",
                 "--no-vmap", "--json", "--layer-mode", "ghost"]) == 0
    result = json.loads(capsys.readouterr().out)
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
    # The noise draw is timed on its own, and is a part of the DP step.
    assert result["noise_ms_per_step"] > 0 and 0 < result["noise_fraction_of_dp_step"] < 1
    table = format_table(result)
    assert "best DP / best non-private" in table and "dpbert DP (ghost)" in table and "noise draw" in table
    assert ("fastest micro-batch" in table) == (microbatch == "auto")


def test_bench_refuses_a_bad_microbatch(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--microbatch", "four"])
    assert "expected a positive integer or 'auto', got 'four'" in capsys.readouterr().err
    assert main(["bench", "--batch", "6", "--microbatch", "4", "--no-peers"]) != 0
    assert "batch: expected a positive multiple of microbatch (4), got 6" in capsys.readouterr().err


def test_cpu_peers_run_here_and_name_their_device(capsys):
    """Without CUDA, the PyTorch and Opacus rows (bf16 autocast included) run in this process, in
    the round robin, each row naming its device; an Opacus mode that cannot run says why."""
    assert main(["bench", "--batch", "2", "--microbatch", "1", "--steps", "1", "--no-memory", "--no-vmap", "--json",
                 "--layer-mode", "ghost"]) == 0
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
