"""dpbert bench: the table and the JSON object report DP over the best non-private step."""

from __future__ import annotations

import json

from dpbert.bench import NONPRIVATE_ROWS, format_table
from dpbert.cli import main


def test_bench_ratio_is_over_the_best_nonprivate_row(capsys):
    assert main(["bench", "--batch", "2", "--microbatch", "1", "--steps", "1", "--no-peers", "--no-memory",
                 "--no-vmap", "--json", "--layer-mode", "ghost"]) == 0
    result = json.loads(capsys.readouterr().out)
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
