"""Run metrics: one JSON object per line in RUN_DIR/metrics.jsonl, and PNG curves of them.

Record kinds (field `kind`):
- "train": `step` (1-based, completed steps), `expected_batch_size`, `realized_batch_size`,
  `epsilon` (spent after this step; null for non-private runs), `examples_per_s`,
  `learning_rate`, and `nonprivate_diagnostics` ({"loss", "clip_fraction", ...}): these
  are computed on the private batch without noise, so they are NOT covered by the
  privacy guarantee; they are labelled so, and a release must not publish them.
- "eval": `step`, `eval_mlm_accuracy`, `eval_mlm_loss`, `eval_masked_tokens` on the
  held-out split (never trained on, so outside the guarantee's scope by construction).

Guarantees: each record is one complete line (written whole, then flushed); on resume,
`truncate_after(step)` rewrites the file atomically without records past the restored
step, so a resumed run's file equals an uninterrupted run's (timings aside).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpbert.atomic import write_text


class MetricsLog:
    """Appends records to a JSONL file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a metrics file (a torn last line from a kill is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_after(path: str | Path, step: int, match: Mapping[str, Any] | None = None) -> None:
    """Drop records with `step` > `step` (they belong to steps a resume will redo); with `match`,
    only records carrying all of its fields (e.g. one run of a sweep)."""
    path = Path(path)
    if not path.exists():
        return
    match = match or {}

    def redone(r: dict[str, Any]) -> bool:
        return r.get("step", 0) > step and all(r.get(k) == v for k, v in match.items())

    kept = [r for r in read_metrics(path) if not redone(r)]
    write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write RUN_DIR/curves.png (or `out`): held-out MLM accuracy and epsilon against step."""
    import matplotlib  # deferred: 0.56 s at import (measured), only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: as matplotlib above

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file in run folder: {path}")
    records = read_metrics(path)
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind") == "train"]
    if not train and not evals:
        raise ValueError(f"metrics file {path}: no train or eval records to plot")
    fig, (ax_acc, ax_eps) = plt.subplots(1, 2, figsize=(10, 4))
    ax_acc.plot([r["step"] for r in evals], [100 * r["eval_mlm_accuracy"] for r in evals], marker="o")
    ax_acc.set(xlabel="step", ylabel="held-out MLM accuracy (%)", title="Held-out masked-LM accuracy")
    private = [r for r in train if r.get("epsilon") is not None]
    if private:
        ax_eps.plot([r["step"] for r in private], [r["epsilon"] for r in private])
        ax_eps.set(title="Privacy spent")
    else:
        ax_eps.text(0.5, 0.5, "non-private run", ha="center", va="center", transform=ax_eps.transAxes)
        ax_eps.set(title="Privacy spent: none (not private)")
    ax_eps.set(xlabel="step", ylabel="epsilon")
    for ax in (ax_acc, ax_eps):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "curves.png"
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out
