"""dpbert bench: the table and the JSON object report DP over the best non-private step."""

from __future__ import annotations

import json

import pytest

from dpbert.bench import NONPRIVATE_ROWS, format_table
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
